"""Run the emulator as a process: ``python -m tests.k8semu --port 6443 --seed demo``.

Writes a kubeconfig for itself, prints one line ``k8semu ready URL KUBECONFIG``
and serves until SIGINT or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
import signal
import sys
import tempfile

from .auth import ALL_RULES, PRODUCT_RULES
from .emulator import DEFAULT_TOKEN, K8sEmulator
from .seed import SEEDS


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tests.k8semu", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=6443, help="0 picks a free port")
    parser.add_argument("--seed", choices=sorted(SEEDS), default="demo")
    parser.add_argument(
        "--kubeconfig",
        type=Path,
        default=Path(tempfile.gettempdir()) / "k8semu.kubeconfig",
    )
    parser.add_argument("--token", default=DEFAULT_TOKEN)
    parser.add_argument("--admin-token", help="also accept this token with every right")
    parser.add_argument(
        "--allow-all", action="store_true", help="grant --token every right"
    )
    parser.add_argument("--plain-http", action="store_true")
    parser.add_argument("--lease-interval", type=float, default=10.0)
    parser.add_argument("--deletion-grace", type=float, default=0.0)
    parser.add_argument("--node-monitor-grace-period", type=float, default=50.0)
    return parser


async def _serve(args: argparse.Namespace) -> None:
    emu = K8sEmulator(
        host=args.host,
        port=args.port,
        tls=not args.plain_http,
        token=args.token,
        rules=ALL_RULES if args.allow_all else PRODUCT_RULES,
        lease_interval=args.lease_interval,
        deletion_grace=args.deletion_grace,
        node_monitor_grace_period=args.node_monitor_grace_period,
    )
    if args.admin_token:
        emu.add_token(args.admin_token, ALL_RULES)
    SEEDS[args.seed](emu)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await emu.start()
    try:
        path = emu.write_kubeconfig(args.kubeconfig)
        print(f"k8semu ready {emu.url} {path.resolve()}", flush=True)
        await stop.wait()
    finally:
        await emu.stop()
    print("k8semu stopped", flush=True)


def main() -> int:
    """Entry point."""
    asyncio.run(_serve(_parser().parse_args()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
