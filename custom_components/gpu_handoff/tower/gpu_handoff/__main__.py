"""Run the agent from its sources: ``python3 .../tower/gpu_handoff VERB ...``.

A checkout (the tests, a developer) runs the package as it is, as the built
file runs its archive (build.py's entry, which leaves this module out).
"""

import importlib
import os
import sys

# Run as a directory, this directory is sys.path[0]: import the package from
# its parent instead, as itself.
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.exit(importlib.import_module("gpu_handoff.cli").main())
