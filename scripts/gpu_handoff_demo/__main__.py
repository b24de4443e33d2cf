"""``python -m scripts.gpu_handoff_demo``: what ``scripts/demo`` runs."""

from __future__ import annotations

import asyncio
import sys

from . import __doc__ as overview
from .demo import check, main_async, parser


def main() -> int:
    """Entry point."""
    description = (overview or "").split("\n\n")[0]
    arguments = parser(description)
    args = arguments.parse_args()
    check(arguments, args)
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
