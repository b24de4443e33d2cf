"""The named mutants in the normal suite: every one still applies to the code as
it is, and the CI handful (fast killers) is killed. scripts/mutants runs them
all on demand."""

from __future__ import annotations

import pytest

from tests.mutants.catalog import MUTANTS, Mutant, Patch
from tests.mutants.run import REPO, run, stale_patches

CI_MUTANTS = [mutant for mutant in MUTANTS if mutant.ci]


def _id(mutant: Mutant) -> str:
    return mutant.name


def test_the_catalog() -> None:
    """Unique names; at least the promises issue 12 lists; a handful in CI."""
    names = [mutant.name for mutant in MUTANTS]
    assert len(names) == len(set(names))
    assert {
        "no_uncordon_after_return",
        "stop_before_guest_agent",
        "throttling_429_taken_as_success",
        "no_domain_check_in_serve",
        "noop_job_lock",
        "no_resume_of_the_stored_job",
        "host_key_repinned_on_reconfigure",
        "operator_cordon_lifted",
        "unmanaged_pod_evicted",
        "destroy_sent",
    } <= set(names)
    assert 3 <= len(CI_MUTANTS) <= 8


@pytest.mark.parametrize("mutant", MUTANTS, ids=_id)
def test_every_mutant_still_applies(mutant: Mutant) -> None:
    """Each patch's text is in its file exactly once, and each test it names
    exists (else the code moved on: update the mutant)."""
    assert stale_patches(mutant) == []
    for test in mutant.tests:
        path, _, name = test.partition("::")
        assert (REPO / path).is_file(), test
        if name:
            assert f"def {name}(" in (REPO / path).read_text(encoding="utf-8"), test


@pytest.mark.parametrize("mutant", CI_MUTANTS, ids=_id)
def test_the_ci_mutants_are_killed(mutant: Mutant) -> None:
    """Applied to a scratch copy, the mutant makes its tests fail there."""
    result = run(mutant, timeout=300)
    assert result.verdict == "killed", result.line()


def test_the_runner_tells_survivors_and_stale_mutants() -> None:
    """A patch its tests cannot notice (a docstring) survives; a patch whose
    text is gone is stale."""
    const = "custom_components/gpu_handoff/const.py"
    harmless = Mutant(
        "harmless",
        "nothing",
        (Patch(const, "Constants for the GPU Handoff", "Mutated constants for the"),),
        ("tests/test_manifest.py",),
    )
    assert run(harmless, timeout=300).verdict == "survived"
    gone = Mutant(
        "gone", "nothing", (Patch(const, "text no file has", "x"),), ("tests",)
    )
    assert stale_patches(gone) != []
    assert run(gone, timeout=300).verdict == "stale"
