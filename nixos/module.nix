# NixOS module of the GPU Handoff tower agent: what the agent's `install`
# does on other systems (README, Tower setup), declared instead of written.
# Needs NixOS 23.11 or newer: users.users.<name>.linger came with it (nixpkgs
# pull request 260248, October 2023).
# Import it by path or from a flake input (README, Tower setup, NixOS), then:
#
#   services.gpu-handoff = {
#     enable = true;
#     user = "hass";
#     gpuNode = "gpu-node";
#     gaming = [ "win-1" "win-2" ];
#     authorizedKeys = [ "ssh-ed25519 AAAA… home-assistant" ];
#   };
#
# The agent's configuration, hook and authorized_keys line come from
# config.nix, which the tests compare with the agent's own. Not one option
# here sets a PATH: the agent must inherit the PATH NixOS gives it, with
# /run/wrappers/bin first, and `path` (its configuration's) is searched only
# after that PATH, never ahead of it.
{
  config,
  lib,
  pkgs,
  ...
}:

let
  pure = import ./config.nix;
  inherit (pure) defaults;
  inherit (lib) mkIf mkOption types;

  cfg = config.services.gpu-handoff;
  defaultUser = "gpu-handoff";
  program = "${cfg.package}/bin/gpu-handoff";

  settings = pure.agentConfig {
    inherit (cfg)
      gpuNode
      gaming
      libvirtUri
      stateDir
      timeouts
      path
      detach
      ;
  };
  settingsFile = pkgs.writeText "gpu-handoff-settings.json" (builtins.toJSON settings);
  # The agent checks its configuration as it builds: one it would refuse (a
  # GPU node that is also a gaming VM, a bad name) fails the rebuild, not a
  # handoff.
  configFile = pkgs.runCommand "gpu-handoff-config.json" { inherit settingsFile; } ''
    ${program} --config "$settingsFile" check-config >&2 || exit 1
    cp "$settingsFile" "$out"
  '';
  hook = pkgs.writeScript "gpu-handoff-qemu-hook" (pure.hookScript { inherit program; });

  # One OpenSSH public key on one line: its type, its base64 blob, a comment.
  # A newline would start a second authorized_keys line without `restrict`
  # and the forced command; options before the type would be read as its.
  keyOk =
    key:
    builtins.match (
      "(ssh-ed25519|ssh-rsa|ecdsa-sha2-nistp(256|384|521)|sk-ssh-ed25519@openssh\\.com"
      + "|sk-ecdsa-sha2-nistp256@openssh\\.com) [A-Za-z0-9+/]+={0,3}( [^\r\n]*)?"
    ) key != null;
  badKeys = builtins.filter (key: !keyOk key) cfg.authorizedKeys;
  # The state directory: an absolute, plain path, not under a directory
  # other users may write to (the agent's trust rules want root's parents).
  userWritable = [
    "/tmp"
    "/var/tmp"
    "/dev/shm"
    "/home"
    "/run/user"
  ];
  under = parent: dir: builtins.substring 0 (builtins.stringLength parent + 1) dir == "${parent}/";
  # (No component starts with a dot: no "." or "..".)
  stateDirOk =
    builtins.match "(/[A-Za-z0-9_+-][A-Za-z0-9_.+-]*)+" cfg.stateDir != null
    && !(builtins.any (parent: under parent cfg.stateDir) userWritable);
in
{
  options.services.gpu-handoff = {
    enable = lib.mkEnableOption "the GPU Handoff tower agent, driven by Home Assistant over SSH";

    package = mkOption {
      type = types.package;
      default = pkgs.callPackage ./package.nix { };
      defaultText = lib.literalExpression "pkgs.callPackage ./package.nix { }";
      description = "The agent's package.";
    };

    user = mkOption {
      type = types.str;
      default = defaultUser;
      description = ''
        The account Home Assistant's SSH key logs in as. It owns the state
        directory and joins the libvirtd group; the agent needs no root and
        no sudo. Left at its default, the module creates it as a system
        user; any other name must be an account defined elsewhere.
      '';
    };

    authorizedKeys = mkOption {
      type = types.listOf types.str;
      default = [ ];
      example = [ "ssh-ed25519 AAAAC3Nza… home-assistant" ];
      description = ''
        Home Assistant's public keys (the setup dialog shows the key at the
        end of the authorized_keys line). Each may run the agent's `serve`
        and nothing else: no shell, no forwarding.
      '';
    };

    gpuNode = mkOption {
      type = types.str;
      example = "gpu-node";
      description = "The libvirt domain of the Kubernetes node that holds the cards while nobody plays.";
    };

    gaming = mkOption {
      type = types.nonEmptyListOf types.str;
      example = [
        "win-1"
        "win-2"
      ];
      description = "The libvirt domains of the gaming VMs.";
    };

    libvirtUri = mkOption {
      type = types.str;
      default = defaults.libvirtUri;
      description = "The libvirt connection the agent's virsh uses.";
    };

    stateDir = mkOption {
      type = types.str;
      default = defaults.stateDir;
      description = ''
        The agent's state directory (jobs, requests, card claims), owned by
        `user` with mode 0700; the directories above it must be root's.
      '';
    };

    timeouts = lib.mapAttrs (
      kind: seconds:
      mkOption {
        type = types.numbers.positive;
        default = seconds;
        description = "Seconds a job waits (${kind}) before it fails and leaves the VM alone.";
      }
    ) defaults.timeouts;

    path = mkOption {
      type = types.listOf types.str;
      # libvirtd runs the hook with its own service PATH, which has no virsh;
      # virtualisation.libvirtd puts libvirt in the system profile.
      default = [ "/run/current-system/sw/bin" ];
      description = ''
        Directories where the agent looks for virsh and systemd-run after the
        PATH it inherits (never before it, so nothing can shadow a setuid
        wrapper in /run/wrappers/bin).
      '';
    };

    detach = mkOption {
      type = types.nullOr (types.enum defaults.detachModes);
      default = null;
      description = ''
        How a job's runner leaves the SSH session: systemd-run units,
        plain detached processes, or (null, the agent's default: auto)
        systemd-run where the user's systemd manager runs, else processes.
      '';
    };
  };

  config = mkIf cfg.enable {
    assertions = [
      {
        assertion = config.virtualisation.libvirtd.enable;
        message = "services.gpu-handoff needs virtualisation.libvirtd.enable = true.";
      }
      {
        # The agent needs no privilege; Home Assistant's key must not be root's.
        assertion = cfg.user != "root" && (config.users.users.${cfg.user}.uid or null) != 0;
        message = "services.gpu-handoff.user must not be root (or any account of user id 0).";
      }
      {
        assertion = badKeys == [ ];
        message =
          "services.gpu-handoff.authorizedKeys: each must be one public key on one line "
          + "(type, key, comment), such as \"ssh-ed25519 AAAA... home-assistant\"; "
          + "not: ${builtins.toJSON badKeys}";
      }
      {
        assertion = stateDirOk;
        message =
          "services.gpu-handoff.stateDir must be an absolute plain path outside "
          + "${builtins.concatStringsSep ", " userWritable}: got ${builtins.toJSON cfg.stateDir}.";
      }
    ];

    environment.systemPackages = [ cfg.package ];

    # Where the agent reads it by default, so `gpu-handoff status` needs no
    # --config on the tower either.
    environment.etc."gpu-handoff/config.json".source = configFile;

    # nixos/modules/virtualisation/libvirtd.nix: each entry of
    # virtualisation.libvirtd.hooks.qemu (attribute set of paths) is linked
    # into /var/lib/libvirt/hooks/qemu.d/, which libvirt runs for every
    # qemu domain's begin and end events.
    virtualisation.libvirtd.hooks.qemu.gpu-handoff = hook;

    users.users = lib.mkMerge [
      {
        ${cfg.user} = {
          # NixOS names libvirt's socket group libvirtd.
          extraGroups = [ "libvirtd" ];
          # logind keeps the user's systemd manager (where the agent's job
          # units run) when no SSH session is open: a job outlives the
          # request that started it (nixos/modules/config/users-groups.nix).
          linger = true;
          # nixos/modules/services/networking/ssh/sshd.nix
          openssh.authorizedKeys.keys = map (
            key: pure.authorizedKeysLine { inherit program key; }
          ) cfg.authorizedKeys;
        };
      }
      (mkIf (cfg.user == defaultUser) {
        ${defaultUser} = {
          isSystemUser = true;
          group = defaultUser;
          description = "GPU Handoff agent";
          # sshd runs a forced command through the login shell.
          useDefaultShell = true;
        };
      })
    ];
    users.groups = mkIf (cfg.user == defaultUser) { ${defaultUser} = { }; };

    # The SSH user's alone, as the agent's trust model wants it.
    systemd.tmpfiles.settings.gpu-handoff.${cfg.stateDir}.d = {
      inherit (cfg) user;
      group = config.users.users.${cfg.user}.group;
      mode = "0700";
    };
  };
}
