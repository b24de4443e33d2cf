"""What the generated ``bin/virsh`` and ``bin/systemd-run`` scripts run."""

from __future__ import annotations

import sys


def run(state_dir: str, tool: str, argv: list[str], boot: list[str]) -> int:
    if tool == "virsh":
        from .virsh import main as virsh_main

        return virsh_main(state_dir, argv)
    from .systemd_run import main as systemd_run_main, supervise

    if tool == "supervise":
        return supervise(state_dir, argv[1] if argv[:1] == ["supervise"] else argv[0])
    return systemd_run_main(state_dir, argv, boot)


if __name__ == "__main__":  # pragma: no cover - used through the wrappers
    sys.exit(run(sys.argv[1], sys.argv[2], sys.argv[3:], []))
