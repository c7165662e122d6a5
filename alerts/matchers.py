"""Label matchers as Alertmanager and Prometheus have them: `name` `=`, `!=`, `=~` or `!~` `value`.

One model serves notifier routes (YAML, snake_case: `is_regex`, `is_equal`) and silences (Alertmanager API
v2 JSON: `isRegex`, `isEqual`): either spelling is accepted, and it is written as the API writes it, which
is also how silences are stored. A missing label matches as the empty string; regular expressions are RE2,
fully anchored (alerts.regex). `label_matches` is the same rule for the PromQL selectors of alert rules.

Bounded as Alertmanager validates matchers, and then some: a name is a label name of at most
MAX_NAME_CHARS, a value at most MAX_VALUE_CHARS without control characters other than tab and newline.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from alerts.regex import RegexError, check, full_match

LABEL_NAME = r"^[a-zA-Z_][a-zA-Z0-9_]*$"
MAX_NAME_CHARS = 256
MAX_VALUE_CHARS = 1024
OPS = ("=", "!=", "=~", "!~")  # labels.MatchType's order

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_CONTROL_BUT_WHITESPACE = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def has_control_chars(text: str, *, multiline: bool = False) -> bool:
    """Whether `text` holds a control character (tab, LF and CR allowed when `multiline`)."""
    return (_CONTROL_BUT_WHITESPACE if multiline else _CONTROL).search(text) is not None


def text_without_controls(text: str) -> str:
    """A validator: tabs and newlines pass, other control characters (NUL cannot even be stored) do not."""
    if has_control_chars(text, multiline=True):
        raise ValueError("control characters (such as NUL) are not allowed; tabs and newlines are")
    return text


def label_matches(op: str, pattern: str, actual: str) -> bool:
    """Whether a label's value (`actual`, "" when absent) satisfies `op pattern`."""
    if op == "=":
        return actual == pattern
    if op == "!=":
        return actual != pattern
    hit = full_match(pattern, actual)
    return hit if op == "=~" else not hit


class Matcher(BaseModel):
    """One label matcher, for a route or a silence (either spelling of its flags; see the module docstring)."""

    model_config = ConfigDict(extra="forbid", validate_by_name=True, validate_by_alias=True, serialize_by_alias=True)

    name: Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS, pattern=LABEL_NAME)]
    value: Annotated[str, Field(max_length=MAX_VALUE_CHARS), AfterValidator(text_without_controls)]
    is_regex: bool = Field(False, alias="isRegex")
    is_equal: bool = Field(True, alias="isEqual")

    @model_validator(mode="after")
    def _regex_compiles(self) -> Matcher:
        if self.is_regex:
            try:
                check(self.value)
            except RegexError as exc:
                raise ValueError(f"matcher {self.name}: {exc}") from None
        return self

    @property
    def match_type(self) -> int:
        """labels.MatchType: =, !=, =~, !~ in that order (the last key when Alertmanager sorts matchers)."""
        return (0 if self.is_equal else 1) + (2 if self.is_regex else 0)

    def matches(self, labels: dict[str, str]) -> bool:
        return label_matches(OPS[self.match_type], self.value, labels.get(self.name, ""))

    def text(self) -> str:
        """labels.Matcher.String(): the value escaped as OpenMetrics does (backslash, newline, double quote)."""
        escaped = self.value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
        return f'{self.name}{OPS[self.match_type]}"{escaped}"'
