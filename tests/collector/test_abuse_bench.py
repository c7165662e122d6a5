"""`kvpilot bench ingest --abuse`'s plumbing on two of its cases: a push and a hostile scrape target, each
against a fresh collector process, with its figures and its verdict."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.ingest_abuse import _cases, _met, _run_case


@pytest.mark.parametrize("name", ["ingest_missing_fields", "scrape_stacked_gzip"])
def test_abuse_case_is_refused_and_measured(tmp_path: Path, name: str) -> None:
    (case,) = [c for c in _cases(quick=True) if c.name == name]
    figures = _run_case(tmp_path, case)
    assert figures["answer"] in (
        "413: batch has more than 20000 events; the limit is 20000",
        "up=0: more than one content coding",
    )
    assert figures["wire_bytes"] < 10_000 < figures["inflated_bytes"]
    assert figures["peak_rss_mb"] > 0 and figures["health_max_s"] > 0
    assert figures["honest_acked"] > 0 and figures["lost"] == 0
    assert _met(figures)
