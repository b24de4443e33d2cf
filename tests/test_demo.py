"""The demo's scripted mode, end to end: Home Assistant as its own process,
onboarded and set up through its REST API, hands the cards to Gaming station 1
and back (guests 100x faster)."""

from __future__ import annotations

import os
from pathlib import Path
import re
import subprocess
import sys

import pytest

from tests.support.sshd import sshd_available

DEMO = Path(__file__).resolve().parent.parent / "scripts" / "demo.py"
SUMMARY = re.compile(r"^demo: handoff \d+\.\d s, return \d+\.\d s: ok$", re.MULTILINE)


def test_scripted_demo() -> None:
    """``scripts/demo.py --scripted --fast`` exits 0 with its summary line."""
    if not sshd_available():
        if os.environ.get("GPU_HANDOFF_REQUIRE_SYSTEM"):
            pytest.fail("sshd is required here")
        pytest.skip("needs OpenSSH's sshd")
    result = subprocess.run(
        [sys.executable, str(DEMO), "--scripted", "--fast"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert SUMMARY.search(result.stdout), output
    assert "demo: stopped" in result.stdout, output
