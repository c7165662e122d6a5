"""Label regular expressions as Prometheus and Alertmanager have them: RE2 syntax, fully anchored, linear time.

Go's regexp (RE2) is what both accept, so a pattern either means the same here or is refused: no
backreferences, no lookarounds, repetition counts up to 1000. Matching is linear in the label value
whatever the pattern, so `(.*.*.*)*\\d` cannot pin the evaluator (Python's backtracking `re` needs seconds
for 11 characters). Compiled patterns are cached (bounded: silence and filter patterns come from API users).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import re2

MAX_PROGRAM_BYTES = 1 << 20  # RE2's memory budget per pattern: a pattern needing more is refused


class RegexError(ValueError):
    """A pattern RE2 cannot compile (invalid, or a backtracking-only feature such as \\1 or (?=...))."""


def _options() -> Any:
    options = re2.Options()
    options.log_errors = False  # the error comes back as RegexError; RE2 would also print it to stderr
    options.max_mem = MAX_PROGRAM_BYTES
    return options


_OPTIONS = _options()


@lru_cache(maxsize=2048)
def compile_anchored(pattern: str) -> Any:
    """The pattern for `fullmatch`: anchored at both ends as Alertmanager's `^(?:pattern)$` and Prometheus's
    selectors, but compiled on its own, so `a)|(b` is refused instead of escaping the anchors."""
    try:
        return re2.compile(pattern, _OPTIONS)
    except re2.error as exc:
        reason = exc.args[0].decode(errors="replace") if exc.args and isinstance(exc.args[0], bytes) else str(exc)
        raise RegexError(f"bad regular expression: {reason[:200]} (RE2 syntax)") from None


def full_match(pattern: str, value: str) -> bool:
    return compile_anchored(pattern).fullmatch(value) is not None


def check(pattern: str) -> None:
    """Raise RegexError unless RE2 accepts `pattern`."""
    compile_anchored(pattern)
