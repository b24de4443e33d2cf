"""``python -m tests.mutants [--list] [--ci] [--keep] [--no-baseline] [NAME...]``

Runs the named mutants (all by default; ``--ci``: the handful CI runs), each
on a scratch copy of the repository, and prints one line per mutant. Exits 1
if any survived, no longer applies, or could not be tested. scripts/mutants
runs this inside the provisioned environment.
"""

from __future__ import annotations

import argparse
import sys

from .catalog import MUTANTS, by_name
from .run import baseline, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/mutants", description=__doc__)
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list them and exit")
    parser.add_argument("--ci", action="store_true", help="only the CI handful")
    parser.add_argument("--keep", action="store_true", help="keep the scratch copies")
    parser.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip checking that their tests pass without a mutant",
    )
    args = parser.parse_args(argv)
    try:
        mutants = [by_name(name) for name in args.names] or list(MUTANTS)
    except KeyError as err:
        parser.error(f"no mutant named {err.args[0]!r}")
    if args.ci:
        mutants = [mutant for mutant in mutants if mutant.ci]
    if args.list:
        for mutant in mutants:
            flag = " (ci)" if mutant.ci else ""
            print(f"{mutant.name}{flag}: {mutant.promise}")
            for test in mutant.tests:
                print(f"    {test}")
        return 0
    if not args.no_baseline:
        ok, last = baseline(mutants)
        print(f"baseline: their tests without a mutant: {last}", flush=True)
        if not ok:
            print("the tests fail without any mutant: nothing can be judged")
            return 1
    failed = 0
    for mutant in mutants:
        result = run(mutant, keep=args.keep)
        print(result.line(), flush=True)
        failed += result.verdict != "killed"
    print(f"{len(mutants) - failed} of {len(mutants)} mutants killed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
