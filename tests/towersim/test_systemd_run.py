"""The ``systemd-run`` stand-in: detached units, names, --collect, failures."""

from __future__ import annotations

from pathlib import Path
import subprocess

from tests.towersim import Tower
from tests.towersim.helpers import run

ALREADY_LOADED = (
    "Failed to start transient service unit: Unit {} was already loaded or has a "
    "fragment file.\n"
)


def _ended(tower: Tower, unit: str, runs: int = 1) -> bool:
    return len([u for u in tower.unit_runs() if u.name == unit]) >= runs


def test_collected_unit_is_gone_after_it_fails(tower: Tower) -> None:
    got = run(
        [
            str(tower.systemd_run),
            "--collect",
            "--quiet",
            "--unit=job-a",
            "--",
            "/bin/sh",
            "-c",
            "exit 3",
        ]
    )
    assert (got.rc, got.out, got.err) == (0, "", "")
    tower.wait_until(
        lambda: _ended(tower, "job-a.service"), timeout=20, what="the unit"
    )
    (finished,) = tower.unit_runs()
    assert (finished.state, finished.exit_code, finished.loaded) == ("failed", 3, False)
    assert tower.loaded_units() == []
    again = run(
        [str(tower.systemd_run), "--collect", "--quiet", "--unit=job-a", "/bin/true"]
    )
    assert again.rc == 0


def test_failed_unit_without_collect_stays_loaded(tower: Tower) -> None:
    argv = [str(tower.systemd_run), "--unit=job-b", "/bin/false"]
    first = run(argv)
    assert first.rc == 0
    assert first.err.startswith("Running as unit: job-b.service; invocation ID: ")
    tower.wait_until(
        lambda: _ended(tower, "job-b.service"), timeout=20, what="the unit"
    )
    assert [u.name for u in tower.loaded_units()] == ["job-b.service"]
    second = run(argv)
    assert (second.rc, second.err) == (1, ALREADY_LOADED.format("job-b.service"))


def test_successful_unit_is_unloaded_and_a_running_one_blocks_its_name(
    tower: Tower, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    argv = [
        str(tower.systemd_run),
        "--quiet",
        "--unit=job-c.service",
        "--",
        "/bin/sh",
        "-c",
        f"while [ ! -e {gate} ]; do sleep 0.01; done",
    ]
    assert run(argv).rc == 0
    assert run(argv).err == ALREADY_LOADED.format("job-c.service")
    gate.touch()
    tower.wait_until(
        lambda: _ended(tower, "job-c.service"), timeout=20, what="the unit"
    )
    assert tower.loaded_units() == []
    assert tower.unit_runs()[0].state == "inactive"


def test_generated_names_and_service_environment(tower: Tower, tmp_path: Path) -> None:
    out = tmp_path / "env"
    got = run(
        [
            str(tower.systemd_run),
            "--user",
            "--collect",
            "--setenv=GH_TEST=yes",
            "/bin/sh",
            "-c",
            f"env > {out}",
        ]
    )
    assert got.err.startswith("Running as unit: run-u1.service;")
    tower.wait_until(
        lambda: _ended(tower, "run-u1.service"), timeout=20, what="the unit"
    )
    env = dict(line.split("=", 1) for line in out.read_text().splitlines())
    assert env["GH_TEST"] == "yes"
    assert "INVOCATION_ID" in env
    assert "PYTEST_CURRENT_TEST" not in env  # the caller's environment is not passed


def test_unit_survives_its_caller(tower: Tower, tmp_path: Path) -> None:
    """The caller (and its whole session) ends; the unit runs on."""
    gate, done = tmp_path / "gate", tmp_path / "done"
    script = f"while [ ! -e {gate} ]; do sleep 0.01; done; touch {done}"
    caller = subprocess.Popen(
        [
            "/bin/sh",
            "-c",
            f"'{tower.systemd_run}' --quiet --collect -- /bin/sh -c '{script}'; exit 0",
        ],
        start_new_session=True,
    )
    assert caller.wait(timeout=20) == 0
    gate.touch()
    tower.wait_until(done.exists, timeout=20, what="the unit to finish")
    tower.wait_until(
        lambda: _ended(tower, "run-u1.service"), timeout=20, what="the record"
    )
    assert tower.unit_runs()[0].exit_code == 0


def test_usage_errors(tower: Tower) -> None:
    assert run([str(tower.systemd_run), "--frob", "/bin/true"]).err == (
        "systemd-run: unrecognized option '--frob'\n"
    )
    assert run([str(tower.systemd_run), "--quiet"]).rc == 1


def test_close_stops_running_units(tmp_path: Path) -> None:
    tower = Tower.create(tmp_path / "tower")
    assert (
        run(
            [str(tower.systemd_run), "--quiet", "--unit=sleeper", "/bin/sleep", "600"]
        ).rc
        == 0
    )
    tower.wait_until(
        lambda: any(u.state == "active" for u in tower.units()),
        timeout=20,
        what="start",
    )
    assert tower.close() == ["sleeper.service"]
    assert [u.state for u in tower.units()] == ["failed"]
