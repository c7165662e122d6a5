"""The import rules of docs/architecture.md ("Who may import whom"), checked on the source.

Every module of the repository's packages is parsed with `ast`; every `import` and `from ... import`
counts, at module level or inside a function (a deferred import is still a dependency). Relative imports
are resolved against the importing module. Each rule failure names the offending import as
`path:line: source -> target`.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = (
    "engine",
    "collector",
    "alerts",
    "tuner",
    "dashboard",
    "kvpilot",
    "integrations",
    "plumbing",
    "benchmarks",
    "migrations",
)
RUNTIME = frozenset(PACKAGES) - {"benchmarks", "migrations"}
# packages that may import only these: the shared helpers are a leaf, the engine (with the wire schema) builds
# on them alone, and the engine integrations on the engine's wire schema and workload types
ONLY = {"plumbing": frozenset(), "engine": frozenset({"plumbing"}), "integrations": frozenset({"engine", "plumbing"})}


@dataclass(frozen=True)
class Import:
    source: str  # top-level package of the importing module
    target: str  # top-level package imported
    where: str  # path:line

    def __str__(self) -> str:
        return f"{self.where}: {self.source} -> {self.target}"


def _module_name(path: Path, root: Path) -> list[str]:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def _imported(node: ast.AST, path: Path, root: Path) -> list[str]:
    """Dotted names a node imports ('' when none)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level == 0:
        return [node.module or ""]
    package = _module_name(path, root)
    if path.name != "__init__.py":
        package = package[:-1]
    base = package[: len(package) - (node.level - 1)]
    return [".".join([*base, *([node.module] if node.module else [])])]


def project_imports(root: Path = ROOT) -> list[Import]:
    """Every import between two different top-level packages, in file order."""
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for node in ast.walk(tree):
                for name in _imported(node, path, root):
                    target = name.split(".")[0]
                    if target in PACKAGES and target != package:
                        found.append(Import(package, target, f"{path.relative_to(root)}:{node.lineno}"))
    return sorted(found, key=lambda i: (i.where.rsplit(":", 1)[0], int(i.where.rsplit(":", 1)[1])))


def _cycles(imports: list[Import]) -> list[list[str]]:
    """Strongly connected components of the package graph with more than one package (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        graph.setdefault(imp.source, set()).add(imp.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def violations(imports: list[Import]) -> list[str]:
    """What breaks the rules, one line per offending import."""
    out = []
    for component in _cycles(imports):
        members = set(component)
        edges: dict[tuple[str, str], list[Import]] = {}
        for imp in imports:
            if imp.source in members and imp.target in members:
                edges.setdefault((imp.source, imp.target), []).append(imp)
        lines = [
            f"{found[0]} (+{len(found) - 1} more)" if len(found) > 1 else str(found[0]) for found in edges.values()
        ]
        out.append(f"cycle between {', '.join(component)}:\n    " + "\n    ".join(lines))
    for imp in imports:
        if imp.source in RUNTIME and imp.target == "kvpilot":
            out.append(f"{imp} (runtime code must not import the CLI package)")
        elif imp.source in RUNTIME and imp.target == "benchmarks":
            out.append(f"{imp} (runtime code must not import benchmarks)")
        elif imp.source in ONLY and imp.target not in ONLY[imp.source]:
            allowed = " and ".join(sorted(ONLY[imp.source]))
            out.append(f"{imp} ({imp.source} may import " + (f"only {allowed})" if allowed else "no other package)"))
    return out


def test_package_imports_follow_the_architecture() -> None:
    found = violations(project_imports())
    assert not found, "import rules broken (docs/architecture.md):\n" + "\n".join(found)


def test_the_checker_sees_deferred_and_relative_imports(tmp_path: Path) -> None:
    (tmp_path / "tuner").mkdir()
    (tmp_path / "kvpilot").mkdir()
    (tmp_path / "tuner" / "__init__.py").write_text("")
    (tmp_path / "tuner" / "a.py").write_text("def f():\n    from kvpilot import cli\n")
    (tmp_path / "kvpilot" / "__init__.py").write_text("")
    (tmp_path / "kvpilot" / "b.py").write_text("from . import c\nimport tuner.a\n")
    imports = project_imports(tmp_path)
    assert [str(i) for i in imports] == ["kvpilot/b.py:2: kvpilot -> tuner", "tuner/a.py:2: tuner -> kvpilot"]
    found = violations(imports)
    assert found[0].startswith("cycle between kvpilot, tuner")
    assert "tuner/a.py:2: tuner -> kvpilot (runtime code must not import the CLI package)" in found


def test_integrations_may_import_only_the_engine_and_plumbing(tmp_path: Path) -> None:
    for package in ("integrations", "plumbing"):
        (tmp_path / package).mkdir()
    (tmp_path / "integrations" / "x.py").write_text("import engine.sinks\nimport plumbing\nfrom collector import db\n")
    (tmp_path / "plumbing" / "y.py").write_text("from engine import events\n")
    found = violations(project_imports(tmp_path))
    assert found == [
        "integrations/x.py:3: integrations -> collector (integrations may import only engine and plumbing)",
        "plumbing/y.py:1: plumbing -> engine (plumbing may import no other package)",
    ]
