"""Regexes in linear time (RE2 semantics)."""

from __future__ import annotations

import time

import pytest

from alerts.rules import load_rules_text
from alerts.silences import SilenceMatcher

CATASTROPHIC = r"(.*.*.*)*\d"  # Python's backtracking `re` needs seconds for 11 characters, minutes for 14


def test_silence_matcher_is_linear_time():
    matcher = SilenceMatcher(name="instance", value=CATASTROPHIC, isRegex=True)
    started = time.perf_counter()
    assert not matcher.matches({"instance": "a" * 11})
    assert matcher.matches({"instance": "a" * 10_000 + "7"})
    assert time.perf_counter() - started < 0.5


def test_rule_selector_regex_is_linear_time():
    from alerts.expr_select import matches

    started = time.perf_counter()
    assert matches("!~", CATASTROPHIC, "a" * 11)
    assert matches("=~", CATASTROPHIC, "a" * 10_000 + "7")
    assert time.perf_counter() - started < 0.5


def test_matchers_stay_fully_anchored():
    from alerts.expr_select import matches

    assert matches("=~", "gpu|cpu", "gpu") and not matches("=~", "gpu|cpu", "gpu0")
    assert not matches("=~", "pu", "gpu") and matches("!~", "pu", "gpu")
    assert SilenceMatcher(name="i", value="a|b", isRegex=True).matches({"i": "b"})
    assert not SilenceMatcher(name="i", value="a|b", isRegex=True).matches({"i": "ab"})


@pytest.mark.parametrize("pattern", [r"(a)\\1", "(?=a)b", "(?<!a)b"])
def test_rule_with_an_re2_unsupported_pattern_is_refused(pattern):
    from alerts.rules import RuleFileError

    rules = f"""
groups:
  - name: g
    rules:
      - alert: A
        expr: queue_depth{{instance=~"{pattern}"}} > 1
"""
    with pytest.raises((RuleFileError, ValueError)):
        load_rules_text(rules)
