"""The README and the pages under docs/: the README stays short, every
relative link (markdown links and images) reaches an existing file, every
``#anchor`` in a link to a page is a heading of that page, and no line names
a path of the machine the docs were written on. Pure file reading."""

from __future__ import annotations

from pathlib import Path
import re

import pytest
import yaml

from tests.k8semu.auth import PRODUCT_RULES

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PAGES = (README, *sorted((REPO / "docs").glob("*.md")))

# Paths that only exist on one machine: pytest's
# temporary directories, home directories (root's included).
MACHINE_PATHS = ("/tmp/pytest", "/home/", "/Users/", "/root/")

# [text](target) and ![alt](target), with an optional "title".
LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: its text without markup, lowercased,
    every character but letters, digits, ``_``, ``-`` and spaces dropped,
    spaces made hyphens."""
    text = INLINE_CODE.sub(lambda m: m.group(2), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor in a page, repeated headings numbered as
    GitHub numbers them (``name``, ``name-1``, ...)."""
    seen: dict[str, int] = {}
    found = set()
    for line in prose_lines(page.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if not match:
            continue
        base = anchor(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(page: Path) -> list[str]:
    """The targets of the page's markdown links and images, outside code."""
    targets = []
    for line in prose_lines(page.read_text(encoding="utf-8")):
        targets.extend(LINK.findall(INLINE_CODE.sub("", line)))
    return targets


def relative(target: str) -> bool:
    return not re.match(r"[a-z][a-z0-9+.-]*:", target, flags=re.IGNORECASE)


def test_pages_found() -> None:
    assert len(PAGES) > 5, PAGES


def test_readme_is_short() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) < 200


def broken_links(page: Path) -> list[str]:
    """The page's relative links whose file or heading does not exist."""
    broken = []
    for target in links(page):
        if not relative(target):
            continue
        path, _, fragment = target.partition("#")
        destination = (page.parent / path).resolve() if path else page
        if not destination.exists():
            broken.append(f"{target}: no such file")
        elif (
            fragment
            and destination.suffix == ".md"
            and fragment not in anchors(destination)
        ):
            broken.append(f"{target}: no heading #{fragment}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_relative_links_reach_files_and_headings(page: Path) -> None:
    assert not broken_links(page)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_no_machine_paths(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    found = [
        f"{number}: {line}"
        for number, line in enumerate(text.splitlines(), start=1)
        if any(path in line for path in MACHINE_PATHS)
    ]
    assert not found, found


def test_the_rules_notice_breakage(tmp_path: Path) -> None:
    """The checks can fail: a missing file, a missing heading, and GitHub's
    anchors for headings with markup and repeats."""
    (tmp_path / "a.md").write_text(
        "# A `code` heading, with: punctuation!\n\n## Twice\n\n## Twice\n\n"
        "```\n# not a heading\n[x](inside-code.md)\n```\n"
        "[ok](a.md#a-code-heading-with-punctuation) [gone](b.md) "
        "[twice](#twice-1) [none](a.md#not-a-heading) "
        "![pic](pic.png) `[code](c.md)` [web](https://example.com/x)\n",
        encoding="utf-8",
    )
    page = tmp_path / "a.md"
    assert anchors(page) == {"a-code-heading-with-punctuation", "twice", "twice-1"}
    assert links(page) == [
        "a.md#a-code-heading-with-punctuation",
        "b.md",
        "#twice-1",
        "a.md#not-a-heading",
        "pic.png",
        "https://example.com/x",
    ]
    assert broken_links(page) == [
        "b.md: no such file",
        "a.md#not-a-heading: no heading #not-a-heading",
        "pic.png: no such file",
    ]


def test_the_cluster_role_is_what_the_emulator_grants() -> None:
    """docs/cluster-setup.md's ClusterRole grants exactly what the tests'
    emulator gives the product's token (PRODUCT_RULES): a rule the product
    needs and the docs forget would pass every test and fail on a cluster."""
    text = (REPO / "docs" / "cluster-setup.md").read_text(encoding="utf-8")
    block = re.search(r"```yaml\n(.*?)```", text, re.DOTALL)
    assert block is not None
    role = next(
        doc
        for doc in yaml.safe_load_all(block.group(1))
        if doc["kind"] == "ClusterRole"
    )
    granted = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    expected = {
        (group, resource, verb)
        for rule in PRODUCT_RULES
        for group in rule.api_groups
        for resource in rule.resources
        for verb in rule.verbs
    }
    assert granted == expected
    assert ("events.k8s.io", "events", "create") in granted
