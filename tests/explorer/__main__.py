"""scripts/explore [--depth N] [--lend]: explore, print JSON, and each
violation as a ready-to-run test; exit 1 if any invariant broke."""

from __future__ import annotations

import argparse
from dataclasses import replace
import json
import sys

from .model import BASE, Model
from .search import as_test, explore


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/explore")
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--lend", action="store_true", help="lending the free cards")
    args = parser.parse_args(argv)
    model = Model(replace(BASE, lend_free=True) if args.lend else BASE)
    result = explore(model, args.depth)
    for found in result.found.values():
        print(as_test(found, lend=args.lend), file=sys.stderr)
    print(json.dumps({"lend": args.lend, **result.as_json()}, indent=2))
    return 1 if result.found else 0


if __name__ == "__main__":
    sys.exit(main())
