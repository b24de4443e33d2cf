# The tower agent as a package: bin/gpu-handoff, the one executable file that
# tower/build.py makes from the agent's sources with the python3 it will run
# on (standard library only); its `#!/usr/bin/env python3` line is pointed at
# that python3 by the fixup phase's patchShebangs. Deliberately no wrapper: a
# wrapper that set PATH would put its directories ahead of NixOS's setuid
# wrappers in /run/wrappers/bin, and the agent finds virsh and systemd-run on
# the PATH it inherits (then in its configuration's `path`, after it).
{
  lib,
  stdenvNoCC,
  python3,
}:

stdenvNoCC.mkDerivation {
  pname = "gpu-handoff";
  # The integration's version, which is the agent's (tests/test_manifest.py).
  version = (lib.importJSON ../custom_components/gpu_handoff/manifest.json).version;

  # The agent's sources and their build (the same sources give the same file).
  src = ../custom_components/gpu_handoff/tower;
  dontUnpack = true;

  nativeBuildInputs = [ python3 ];
  buildInputs = [ python3 ];

  buildPhase = ''
    runHook preBuild
    python3 "$src/build.py" gpu-handoff
    runHook postBuild
  '';

  # Beside it, its module compiled for that python3 (bin/__pycache__): a
  # start then skips compiling the agent (tower/build.py, cache_path).
  installPhase = ''
    runHook preInstall
    install -D -m 0755 gpu-handoff "$out/bin/gpu-handoff"
    python3 "$src/build.py" --cache "$out/bin/gpu-handoff"
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
