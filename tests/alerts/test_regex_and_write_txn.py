"""Regexes in linear time (RE2 semantics), and nothing slow inside the evaluator's write transaction."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import create_engine, text

from alerts.matchers import Matcher
from alerts.memory_source import MemorySource
from alerts.rules import load_rules_text
from alerts.silences import SilenceIn, create_silence, parse_matcher

CATASTROPHIC = r"(.*.*.*)*\d"  # Python's backtracking `re` needs seconds for 11 characters, minutes for 14


def test_silence_matcher_is_linear_time():
    matcher = Matcher(name="instance", value=CATASTROPHIC, isRegex=True)
    started = time.perf_counter()
    assert not matcher.matches({"instance": "a" * 11})
    assert matcher.matches({"instance": "a" * 10_000 + "7"})
    assert time.perf_counter() - started < 0.5


def test_rule_selector_regex_is_linear_time():
    from alerts.matchers import label_matches as matches

    started = time.perf_counter()
    assert matches("!~", CATASTROPHIC, "a" * 11)
    assert matches("=~", CATASTROPHIC, "a" * 10_000 + "7")
    assert time.perf_counter() - started < 0.5


def test_matchers_stay_fully_anchored():
    from alerts.matchers import label_matches as matches

    assert matches("=~", "gpu|cpu", "gpu") and not matches("=~", "gpu|cpu", "gpu0")
    assert not matches("=~", "pu", "gpu") and matches("!~", "pu", "gpu")
    assert Matcher(name="i", value="a|b", isRegex=True).matches({"i": "b"})
    assert not Matcher(name="i", value="a|b", isRegex=True).matches({"i": "ab"})


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


def _lease_row_writable(url: str) -> bool:
    """Can another connection write the lease row within 200 ms? (Not while a writer holds SQLite's lock or
    PostgreSQL's row lock on it: the collector's ingest would stall on SQLite the same way.)"""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            if engine.dialect.name == "sqlite":
                conn.exec_driver_sql("PRAGMA busy_timeout=200")
            else:
                conn.execute(text("SET lock_timeout = '200ms'"))
            try:
                conn.execute(text("UPDATE alert_evaluator_lease SET renewed_at = renewed_at WHERE id = 1"))
            except Exception:
                return False
            finally:
                conn.rollback()
        return True
    finally:
        engine.dispose()


class ProbingSource(MemorySource):
    def __init__(self, url: str) -> None:
        super().__init__()
        self.url = url
        self.probes: list[bool] = []

    def points(self, *args, **kwargs):
        self.probes.append(_lease_row_writable(self.url))
        return super().points(*args, **kwargs)


def test_rules_and_silences_run_outside_the_write_transaction(
    db_url, config_for, make_evaluator, groups, sink, clock, monkeypatch
):
    source = ProbingSource(db_url)
    ev = make_evaluator(source, groups, config_for(sink))
    with ev.factory() as s:
        silence = SilenceIn(
            matchers=[parse_matcher("instance=~b.*")], startsAt=clock.now, endsAt=clock.now + 3600, createdBy="t"
        )
        create_silence(s, silence, now=clock.now)
        s.commit()
    silence_probes: list[bool] = []
    original = Matcher.matches

    def probing_matches(self, labels):
        silence_probes.append(_lease_row_writable(db_url))
        return original(self, labels)

    monkeypatch.setattr(Matcher, "matches", probing_matches)
    for _ in range(5):
        source.add("queue_depth", "a", clock.now, 500.0)
        source.add("queue_depth", "b", clock.now, 500.0)
        assert ev.tick().error is None
        clock.advance(10)
    assert sink.wait_for(1, 5)
    assert [a["labels"]["instance"] for a in sink.received[0].payload["alerts"]] == ["a"]
    assert source.probes and all(source.probes), source.probes
    assert silence_probes and all(silence_probes), silence_probes
