"""The inner loop's choice of tests (scripts/fast_tests.py, ``scripts/test --fast``)."""

from __future__ import annotations

from pathlib import Path

from scripts.fast_tests import PACKAGE, imported_by, importers, select


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / PACKAGE / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_every_form_of_import_within_the_integration_is_followed(
    tmp_path: Path,
) -> None:
    _write(
        tmp_path,
        {
            "__init__.py": "from .controller import Controller\n",
            "controller.py": "from .progress import Progress\nimport json\n",
            "progress.py": "from . import const\n",
            "const.py": "DOMAIN = 'x'\n",
            "client/__init__.py": "from ..const import DOMAIN\n",
            "client/ssh.py": "from . import keys\nfrom .keys import load\n",
            "client/keys.py": "def load() -> None: ...\n",
            "report.py": "from custom_components.gpu_handoff.client.ssh import x\n",
            "tower/gpu_handoff/cli.py": "from .wire import VERSION\n",
        },
    )
    users = imported_by(tmp_path)
    assert users["progress"] == {"controller"}
    assert users["const"] == {"progress", "client"}
    assert users["client/keys"] == {"client/ssh"}
    assert users["client/ssh"] == {"report"}
    assert users["controller"] == {"__init__"}
    # the tower agent is not the integration: its own rule runs its tests
    assert not any(module.startswith("tower/") for module in users)
    assert importers("const", users) == {
        "const",
        "progress",
        "controller",
        "__init__",
        "client",
    }
    assert importers("report", users) == {"report"}


def test_a_module_imported_through_others_runs_their_tests() -> None:
    # progress is named by no test: controller imports it, the package
    # imports controller
    chosen, _, _ = select([f"{PACKAGE}/progress.py"])
    assert "tests/test_init.py" in chosen
    assert "tests/test_image.py" in chosen  # names the image platform, an importer


def test_the_test_file_named_after_a_module_runs() -> None:
    chosen, _, _ = select([f"{PACKAGE}/config_flow.py"])
    assert "tests/test_config_flow.py" in chosen
    chosen, _, _ = select([f"{PACKAGE}/__init__.py"])
    assert "tests/test_init.py" in chosen


def test_what_only_home_assistants_setup_runs_is_said_not_hidden() -> None:
    chosen, _, through_setup = select([f"{PACKAGE}/sensor.py"])
    assert "tests/test_handoff.py" not in chosen
    assert "tests/test_handoff.py" in through_setup
    assert not set(chosen) & set(through_setup)


def test_long_tests_run_only_when_their_own_files_change() -> None:
    chosen, left_out, _ = select([f"{PACKAGE}/drain.py"])
    assert "tests/chaos/test_harness.py" in left_out
    assert "tests/chaos/test_harness.py" not in chosen
    chosen, left_out, _ = select(["tests/chaos/test_harness.py"])
    assert chosen == ["tests/chaos/test_harness.py"]
    assert left_out == []


def test_docs_and_data_files_run_their_readers() -> None:
    assert select(["docs/development.md"]).tests == ["tests/test_docs.py"]
    assert "tests/test_hassfest.py" in select([f"{PACKAGE}/strings.json"]).tests
