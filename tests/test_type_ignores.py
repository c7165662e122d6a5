"""Every `# type: ignore` names the error it silences and says why, so a reader knows what the checker saw and
whether the reason still holds (mypy's `warn_unused_ignores` removes the ones that no longer silence anything)."""

from __future__ import annotations

import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = (
    "engine",
    "collector",
    "alerts",
    "integrations",
    "tuner",
    "dashboard",
    "kvpilot",
    "benchmarks",
    "plumbing",
    "tests",
)
IGNORE = re.compile(r"type:\s*ignore")
EXPLAINED = re.compile(r"type: ignore\[[a-z-]+(, *[a-z-]+)*\]  # \S")


def _comments(path: Path) -> list[tuple[int, str]]:
    with path.open("rb") as fh:
        return [(t.start[0], t.string) for t in tokenize.tokenize(fh.readline) if t.type == tokenize.COMMENT]


def test_every_type_ignore_has_a_code_and_a_reason() -> None:
    bare = [
        f"{path.relative_to(ROOT)}:{line}: {text}"
        for package in PACKAGES
        if (ROOT / package).is_dir()
        for path in sorted((ROOT / package).rglob("*.py"))
        for line, text in _comments(path)
        if IGNORE.search(text) and not EXPLAINED.search(text)
    ]
    assert not bare, "type: ignore without [code]  # reason:\n" + "\n".join(bare)
