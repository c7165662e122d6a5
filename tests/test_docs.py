"""The docs stay in the repository: code cites only files that exist here, and the docs' links resolve."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("alerts", "benchmarks", "collector", "dashboard", "engine", "kvpilot", "migrations", "tests", "tuner")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_no_code_cites_a_design_file_outside_the_repository() -> None:
    outside = re.compile(r"\b(DESIGN|STYLE)\.md\b")
    cited = [
        f"{path.relative_to(REPO)}:{n}"
        for package in PACKAGES
        for path in (REPO / package).rglob("*.py")
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
        if outside.search(line) and path != Path(__file__).resolve()
    ]
    assert cited == [], f"cite docs/ instead: {cited}"


def test_every_relative_link_of_the_readme_and_docs_resolves() -> None:
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    assert (REPO / "docs" / "architecture.md") in pages
    broken = [
        f"{page.relative_to(REPO)} -> {target}"
        for page in pages
        for target in LINK.findall(page.read_text(encoding="utf-8"))
        if "://" not in target and not (page.parent / target).exists()
    ]
    assert broken == []
