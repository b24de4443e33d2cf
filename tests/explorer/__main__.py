"""scripts/explore [--depth N] [--lend] [--jobs J]: explore, print JSON,
and each violation as a ready-to-run test; exit 1 if any invariant broke.
With --jobs, the search of deep.py (a compact table shared by J processes:
depth 6 fits this machine)."""

from __future__ import annotations

import argparse
from dataclasses import replace
import json
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
    args = parser.parse_args(argv)
    model = Model(replace(BASE, lend_free=True) if args.lend else BASE)
    if args.jobs:
        result = deep(model, args.depth, jobs=args.jobs)
    else:
        result = explore(model, args.depth)
    for found in result.found.values():
        print(as_test(found, lend=args.lend), file=sys.stderr)
    print(json.dumps({"lend": args.lend, **result.as_json()}, indent=2))
    return 1 if result.found else 0


if __name__ == "__main__":
    sys.exit(main())
