"""The newest Home Assistant release with GPU Handoff, beside the pinned one.

The test tool chain pins the Home Assistant that pytest-homeassistant-custom-
component pins; users update monthly. This installs the newest release that
pip finds (or ``--version``) into a cached directory of its own, with the
packages its own manifests pin for what the demo loads (the frontend,
Assist), and runs the scripted demo on it: Home Assistant starts with the
integration, each tower is added through the config flow, a card is handed
off and given back, and the demo fails on any error, traceback, blocking
call or deprecation warning naming gpu_handoff in Home Assistant's log.

Run: scripts/newest-home-assistant [--version X.Y.Z]
"""

from __future__ import annotations

import argparse
from importlib import metadata
import json
import os
from pathlib import Path
import re
import shutil
import subprocess
import sys

from homeassistant import const

from .gpu_handoff_demo.home_assistant import OTHER_RELEASE
from .gpu_handoff_demo.packages import REQUIREMENTS_DEMO
from .gpu_handoff_demo.places import cache_dir

PINNED = const.__version__
PIP = [sys.executable, "-m", "pip"]
MANIFEST = (
    Path(__file__).resolve().parent.parent
    / "custom_components"
    / "gpu_handoff"
    / "manifest.json"
)
QUIET = ["--quiet", "--disable-pip-version-check"]


def log(text: str) -> None:
    print(f"newest-home-assistant: {text}", flush=True)


def newest_release() -> str:
    """The newest homeassistant release on the package index."""
    out = subprocess.run(
        [*PIP, "index", "versions", "homeassistant", "--disable-pip-version-check"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    found = re.match(r"homeassistant \(([^)]+)\)", out)
    if found is None:
        raise SystemExit(f"cannot read pip's answer: {out[:200]!r}")
    return found[1]


def _name(requirement: str) -> str:
    return (
        re.split(r"[=<>!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")
    )


def demo_pins(release_dir: Path) -> list[str]:
    """requirements_demo.txt, each package at the version the release's own
    manifests pin (the file's pin where none does); and every package the
    release's manifests pin that the tool chain has at another version (an
    integration the demo loads would import the tool chain's otherwise)."""
    pinned: dict[str, str] = {}
    components = release_dir / "homeassistant" / "components"
    for manifest in sorted(components.glob("*/manifest.json")):
        for requirement in json.loads(manifest.read_text("utf-8")).get(
            "requirements", []
        ):
            pinned.setdefault(_name(requirement), requirement)
    lines = (
        raw.split("#", 1)[0].strip()
        for raw in REQUIREMENTS_DEMO.read_text("utf-8").splitlines()
    )
    wanted = [pinned.get(_name(line), line) for line in lines if line]
    installed_here = {
        _name(dist.name) for dist in metadata.distributions(path=[str(release_dir)])
    }
    # (GPU Handoff's own requirements are what Home Assistant installs for it.)
    ours = json.loads(MANIFEST.read_text("utf-8"))["requirements"]
    installed_here |= {_name(requirement) for requirement in ours}
    for name, requirement in sorted(pinned.items()):
        if name in installed_here or "==" not in requirement:
            continue
        try:
            here = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        if here != requirement.split("==", 1)[1].split(";", 1)[0].strip():
            wanted.append(requirement)
    return list(dict.fromkeys(wanted))


def install(version: str) -> Path:
    """The release and its pins in a cached directory (once per version)."""
    target = cache_dir() / f"home-assistant-{version}"
    if (target / ".complete").exists():
        return target
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    log(f"installing Home Assistant {version} into {target} (once)")
    subprocess.run(
        [
            *PIP,
            "install",
            *QUIET,
            "--target",
            str(partial),
            f"homeassistant=={version}",
        ],
        check=True,
    )
    pins = demo_pins(partial)
    subprocess.run(
        [*PIP, "install", *QUIET, "--no-deps", "--target", str(partial), *pins],
        check=True,
    )
    (partial / ".complete").write_text(" ".join(pins), encoding="utf-8")
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    return target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", help="this release instead of the newest")
    args = parser.parse_args()
    version = args.version or newest_release()
    if version == PINNED:
        log(
            f"the newest release, {version}, is the one the tests pin: "
            "the whole suite runs on it"
        )
        return 0
    target = install(version)
    log(f"the scripted demo on Home Assistant {version} (the tests pin {PINNED})")
    env = dict(os.environ, **{OTHER_RELEASE: str(target)})
    demo = subprocess.run(
        [sys.executable, "-m", "scripts.gpu_handoff_demo", "--scripted", "--fast"],
        env=env,
        check=False,
        capture_output=True,
        text=True,
    )
    sys.stdout.write(demo.stdout)
    sys.stderr.write(demo.stderr)
    if f"(Home Assistant {version})" not in demo.stdout + demo.stderr:
        log(f"the demo did not run Home Assistant {version}")
        return 1
    log(f"Home Assistant {version}: {'ok' if demo.returncode == 0 else 'FAILED'}")
    return demo.returncode


if __name__ == "__main__":
    sys.exit(main())
