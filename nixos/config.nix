# The pure half of the NixOS module (module.nix imports it): the agent's
# configuration, its libvirt hook and its authorized_keys line, from the
# module's options. Each is the twin of a function of the agent
# (custom_components/gpu_handoff/tower/gpu_handoff/install.py) that `install` uses on
# other systems: agentConfig of agent_config, hookScript of hook_script,
# authorizedKeysLine of authorized_keys_line, and the defaults are the
# agent's. It needs no nixpkgs, so tests/tower/test_nixos.py evaluates it with
# nix-instantiate alone and compares every part with the agent's own output.
let
  defaults = {
    libvirtUri = "qemu:///system"; # DEFAULT_LIBVIRT_URI
    stateDir = "/var/lib/gpu-handoff"; # DEFAULT_INSTALL_STATE_DIR
    configPath = "/etc/gpu-handoff/config.json"; # DEFAULT_CONFIG_PATH
    # Seconds (TIMEOUT_DEFAULTS): waiting for the guest agent, for a guest
    # to shut off, for a domain to start.
    timeouts = {
      agent = 180.0;
      shutdown = 180.0;
      start = 300.0;
    };
    detachModes = [
      "auto"
      "systemd"
      "process"
    ]; # DETACH_MODES
  };

  # Python's shlex.quote: a word of safe characters as it is, anything else
  # in single quotes.
  shellQuote =
    word:
    if builtins.match "[A-Za-z0-9_@%+=:,./-]+" word != null then
      word
    else
      "'" + builtins.replaceStrings [ "'" ] [ "'\"'\"'" ] word + "'";
in
{
  inherit defaults;

  # The agent's configuration (config.json) as an attribute set. Every
  # timeout is written, in floating point, as the agent's install writes it.
  agentConfig =
    {
      gpuNode,
      gaming,
      libvirtUri ? defaults.libvirtUri,
      stateDir ? defaults.stateDir,
      timeouts ? { },
      path ? [ ],
      detach ? null,
    }:
    {
      libvirt_uri = libvirtUri;
      gpu_node = gpuNode;
      inherit gaming;
      state_dir = stateDir;
      timeouts = builtins.mapAttrs (kind: seconds: seconds * 1.0) (defaults.timeouts // timeouts);
    }
    // (if path == [ ] then { } else { inherit path; })
    // (if detach == null then { } else { inherit detach; });

  # The libvirt qemu hook: libvirt's arguments, as they are, to the `hook`
  # verb, for "prepare begin" only (the one step it acts on). It sets no PATH
  # (see module.nix).
  hookScript =
    {
      program,
      configPath ? defaults.configPath,
    }:
    ''
      #!/bin/sh
      # libvirt qemu hook of gpu-handoff: records, never waits.
      [ "$2 $3" = "prepare begin" ] || exit 0
      exec ${shellQuote program} --config ${shellQuote configPath} hook "$@"
    '';

  # The authorized_keys line that lets `key` run `serve` and nothing else.
  authorizedKeysLine =
    {
      program,
      key,
      configPath ? defaults.configPath,
    }:
    ''restrict,command="${program} --config ${configPath} serve" ${key}'';
}
