"""scripts/explore [--depth N] [--lend] [--jobs J [--keep PATH]
[--stop-after SECONDS]]: explore, print JSON, and each violation as a
ready-to-run test; exit 1 if any invariant broke, 2 if a kept run stopped
before its end. With --jobs, the search of deep.py (a compact table shared
by J processes: depth 6 fits this machine); --keep keeps a run that
--stop-after stopped, and the same command goes on with it (a run killed
instead goes on from its last stop)."""

from __future__ import annotations

import argparse
from dataclasses import replace
import json
import os
import sys

from .deep import deep
from .model import BASE, Model
from .search import as_test, explore


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/explore")
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--lend", action="store_true", help="lending the free cards")
    parser.add_argument(
        "--jobs", type=int, help="processes sharing one compact table (deep.py)"
    )
    parser.add_argument(
        "--keep", metavar="PATH", help="with --jobs: keep a stopped run, go on with it"
    )
    parser.add_argument(
        "--stop-after", type=float, metavar="SECONDS", help="with --jobs: stop then"
    )
    args = parser.parse_args(argv)
    if args.keep and os.environ.get("PYTHONHASHSEED") != "0":
        # A kept table holds hashes: every run of it must hash alike.
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        command = [sys.executable, "-m", "tests.explorer", *(argv or sys.argv[1:])]
        os.execve(sys.executable, command, env)  # noqa: S606 - this command again
    model = Model(replace(BASE, lend_free=True) if args.lend else BASE)
    if args.jobs:
        result = deep(
            model,
            args.depth,
            jobs=args.jobs,
            keep=args.keep,
            stop_after=args.stop_after,
        )
    else:
        result = explore(model, args.depth)
    for found in result.found.values():
        print(as_test(found, lend=args.lend), file=sys.stderr)
    print(json.dumps({"lend": args.lend, **result.as_json()}, indent=2))
    return 1 if result.found else 0 if result.complete else 2


if __name__ == "__main__":
    sys.exit(main())
