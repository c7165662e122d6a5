"""plumbing/ imports none of the project's packages, so any of them may import it without a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

PROJECT = {"engine", "collector", "alerts", "tuner", "dashboard", "kvpilot", "benchmarks", "migrations"}
PLUMBING = Path(__file__).resolve().parents[2] / "plumbing"


def _imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_plumbing_imports_no_project_package() -> None:
    modules = sorted(PLUMBING.glob("*.py"))
    assert len(modules) >= 7
    for path in modules:
        assert not _imported(path) & PROJECT, path.name
