"""The docs stay in the repository: code cites only files that exist here, and the docs' links resolve."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = (
    "alerts",
    "benchmarks",
    "collector",
    "dashboard",
    "engine",
    "integrations",
    "kvpilot",
    "migrations",
    "plumbing",
    "tests",
    "tuner",
)
LINK = re.compile(r"\]\(([^)#\s]*)(?:#([^)]*))?\)")


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


def _anchors(page: Path) -> set[str]:
    """The heading anchors of a markdown page, slugged as GitHub does (lower case, punctuation dropped)."""
    out, fence = set(), False
    for line in page.read_text(encoding="utf-8").splitlines():
        fence ^= line.startswith("```")
        if not fence and (m := re.match(r"#+ (.*)", line)):
            out.add(re.sub(r"[^\w\- ]", "", m[1].strip().lower()).replace(" ", "-"))
    return out


def test_every_relative_link_of_the_readme_and_docs_resolves() -> None:
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    assert {"architecture.md", "operations.md", "benchmarks.md"} <= {p.name for p in pages}
    broken = []
    for page in pages:
        for target, anchor in LINK.findall(page.read_text(encoding="utf-8")):
            if "://" in target or (not target and not anchor):
                continue
            path = (page.parent / target).resolve() if target else page
            if not path.exists() or (anchor and path.suffix == ".md" and anchor not in _anchors(path)):
                broken.append(f"{page.relative_to(REPO)} -> {target}#{anchor}")
    assert broken == []


def test_the_readme_reads_in_five_minutes() -> None:
    assert len((REPO / "README.md").read_text(encoding="utf-8").splitlines()) <= 250


def test_the_paging_route_in_operations_is_a_notifier_config_kvpilot_loads(tmp_path: Path) -> None:
    """The example of a route that pages at once (docs/operations.md, "Paging within a second") loads, and its
    page route has no group_wait."""
    from alerts.config import load_notifier_config, resolve_routes

    text = (REPO / "docs" / "operations.md").read_text(encoding="utf-8")
    section = text[text.index("### Paging within a second") :]
    path = tmp_path / "notifier.yml"
    path.write_text(section.split("```yaml\n", 1)[1].split("```", 1)[0])
    root, children = resolve_routes(load_notifier_config(path))
    assert root.group_wait_s == 30.0
    assert [(c.receiver, c.group_wait_s) for c in children] == [("pager", 0.0)]
