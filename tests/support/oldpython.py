"""The oldest Python the tower agent claims (3.9, Debian 11's), where the
machine has one: scripts/_common.sh mounts the host's oldest Python >= 3.9
into the test root and names it in GPU_HANDOFF_OLD_PYTHON (its shared
library's directory in GPU_HANDOFF_OLD_PYTHON_LIB). Without it a test that
needs it is skipped, or fails under GPU_HANDOFF_REQUIRE_SYSTEM=1."""

from __future__ import annotations

import os

import pytest


def oldest_python() -> tuple[str, dict[str, str]]:
    """The interpreter, and what its environment must add to run it."""
    python = os.environ.get("GPU_HANDOFF_OLD_PYTHON")
    if not python:
        if os.environ.get("GPU_HANDOFF_REQUIRE_SYSTEM") == "1":
            pytest.fail(
                "GPU_HANDOFF_OLD_PYTHON is unset (GPU_HANDOFF_REQUIRE_SYSTEM=1)"
            )
        pytest.skip("GPU_HANDOFF_OLD_PYTHON is unset")
    lib = os.environ.get("GPU_HANDOFF_OLD_PYTHON_LIB")
    return python, ({"LD_LIBRARY_PATH": lib} if lib else {})
