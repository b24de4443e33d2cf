# The tower agent as a package: its one stdlib-only file as bin/gpu-handoff,
# the shebang (`#!/usr/bin/env python3`) pointed at the python3 given by the
# fixup phase's patchShebangs. Deliberately no wrapper: a wrapper that set
# PATH would put its directories ahead of NixOS's setuid wrappers in
# /run/wrappers/bin, and the agent finds virsh and systemd-run on the PATH
# it inherits (then in its configuration's `path`, after it).
{
  lib,
  stdenvNoCC,
  python3,
}:

stdenvNoCC.mkDerivation {
  pname = "gpu-handoff";
  # The integration's version, which is the agent's (tests/test_manifest.py).
  version = (lib.importJSON ../custom_components/gpu_handoff/manifest.json).version;

  src = ../custom_components/gpu_handoff/tower/gpu_handoff.py;
  dontUnpack = true;

  buildInputs = [ python3 ];

  installPhase = ''
    runHook preInstall
    install -D -m 0755 "$src" "$out/bin/gpu-handoff"
    runHook postInstall
  '';

  meta = {
    description = "Tower agent of GPU Handoff: lends a libvirt tower's GPUs to Kubernetes";
    homepage = "https://github.com/gpu-handoff/gpu-handoff";
    license = lib.licenses.mit;
    mainProgram = "gpu-handoff";
    platforms = lib.platforms.linux;
  };
}
