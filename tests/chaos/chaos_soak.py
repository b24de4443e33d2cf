"""The chaos soak, on demand: ``scripts/chaos --cycles N --seed S``.

Collected only when asked (``-o python_files='chaos_*.py'``, as scripts/chaos
does), like the benchmark. It runs cycles 1..N of seed S through the harness
(tests/chaos/harness.py), prints one JSON summary at the end (also written to
``$GPU_HANDOFF_CHAOS_JSON`` if set) and fails on any invariant violation;
each violation names the seed and cycle that replay it.

Options come from the environment: ``GPU_HANDOFF_CHAOS_CYCLES`` (default 20),
``GPU_HANDOFF_CHAOS_SEED`` (default 1), ``GPU_HANDOFF_CHAOS_JSON``,
``GPU_HANDOFF_CHAOS_LAG_LIMIT`` (seconds, default 0.5), ``GPU_HANDOFF_CHAOS_LEND``
(1: the tower lends its free cards while someone plays).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path
import sys

from homeassistant.core import HomeAssistant
import pytest

from tests.chaos.harness import run_soak
from tests.k8semu import K8sEmulator

CYCLES = int(os.environ.get("GPU_HANDOFF_CHAOS_CYCLES", "20"))
SEED = int(os.environ.get("GPU_HANDOFF_CHAOS_SEED", "1"))
LEND = os.environ.get("GPU_HANDOFF_CHAOS_LEND") == "1"


@pytest.fixture(autouse=True)
async def enable_event_loop_debug() -> None:
    """Overrides the harness's fixture of that name: Home Assistant runs its
    loop without asyncio's debug mode, and so does the soak."""
    asyncio.get_running_loop().set_debug(False)


@pytest.fixture(autouse=True)
def quiet_logs() -> None:
    """Only warnings reach the console (the soak's progress lines are its own)."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(
            handler, logging.FileHandler
        ):
            handler.setLevel(logging.WARNING)


def _progress(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


async def test_chaos_soak(
    hass: HomeAssistant, k8s_emulator: K8sEmulator, tmp_path: Path
) -> None:
    """Cycles 1..CYCLES of SEED: no invariant may break."""
    summary = await run_soak(
        hass,
        k8s_emulator,
        tmp_path / "chaos",
        seed=SEED,
        cycles=CYCLES,
        log=_progress,
        lend=LEND,
    )
    text = json.dumps(summary, indent=2)
    sys.stdout.write("\n" + text + "\n")
    sys.stdout.flush()
    target = os.environ.get("GPU_HANDOFF_CHAOS_JSON")
    if target:
        await asyncio.to_thread(Path(target).write_text, text + "\n", "utf-8")
    assert summary["violations"] == [], "invariants broke: see the summary"
