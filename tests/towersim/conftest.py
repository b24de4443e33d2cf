"""Fixtures of the tower simulator's tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.libvirtd import libvirt_test_driver
from tests.towersim import Tower, realistic_tower

__all__ = ["libvirt_test_driver"]

# Fast simulated time: guest agent up 0.3 s after boot, shutdown in 0.1 s.
FAST = 0.01


@pytest.fixture
def tower(tmp_path: Path) -> Iterator[Tower]:
    """The realistic tower (GPU node running with every card), fast time.

    In this folder it stands in for the top-level ``tower`` fixture (an sshd in
    front of a test-driver tower): here the simulator itself is under test."""
    sim = realistic_tower(tmp_path / "tower", time_scale=FAST)
    yield sim
    sim.close()
