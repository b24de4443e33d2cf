"""Fixtures of the real-VM tests: one guest build and one private libvirtd per
session (the guest is cached across sessions in $GPU_HANDOFF_CACHE_DIR)."""

from __future__ import annotations

from collections.abc import Iterator
import os
import time

import pytest

from tests.realvm.build_guest import BuildError, Guest, build_guest, cache_dir
from tests.realvm.qemu_libvirtd import (
    LibvirtdError,
    QemuLibvirtd,
    missing_tools,
)
from tests.support.agentbuild import AGENT


def system_missing(reason: str) -> None:
    """Skip, or fail when the environment promises the system tools."""
    if os.environ.get("GPU_HANDOFF_REQUIRE_SYSTEM") == "1":
        pytest.fail(f"GPU_HANDOFF_REQUIRE_SYSTEM=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def realvm_timings() -> Iterator[dict[str, float]]:
    """Measurements of this session, printed at its end (pytest -s)."""
    timings: dict[str, float] = {}
    yield timings
    for key, value in timings.items():
        print(f"realvm timing: {key}: {value:.1f} s")


@pytest.fixture(scope="session")
def guest(realvm_timings: dict[str, float]) -> Guest:
    missing = missing_tools()
    if missing:
        system_missing(f"missing {', '.join(missing)}")
    started = time.monotonic()
    try:
        built = build_guest()
    except BuildError as err:
        system_missing(f"cannot build the test guest: {err}")
        raise
    realvm_timings["guest build (cached or not)"] = time.monotonic() - started
    return built


@pytest.fixture(scope="session")
def qemu_libvirtd(
    guest: Guest, realvm_timings: dict[str, float]
) -> Iterator[QemuLibvirtd]:
    started = time.monotonic()
    # The tower agent is the daemon's live qemu hook, as on a tower: it runs
    # on every start and stop (with the configuration a test names).
    daemon = QemuLibvirtd(cache_dir=cache_dir() / "libvirt-cache", hook_agent=AGENT)
    try:
        daemon.start()
    except LibvirtdError as err:
        daemon.stop()
        daemon.cleanup()
        system_missing(f"cannot run a private libvirtd: {err}")
    realvm_timings["libvirtd start"] = time.monotonic() - started
    yield daemon
    leftovers = daemon.stop()
    daemon.cleanup()
    assert not leftovers, f"QEMU processes outlived libvirtd: {leftovers}"
