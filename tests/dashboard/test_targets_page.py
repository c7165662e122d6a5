"""The targets table: a target never scraped next to scraped ones reads "never" (a float column holds the missing
time as NaN), and the figures a reader scans for come before the URL."""

from __future__ import annotations

import time

from collector.db import make_engine, session_factory, session_scope
from collector.schema import ScrapeTarget
from tests.dashboard.conftest import metrics, no_exception, table_with
from tests.dashboard.seed import Seed


def test_a_target_never_scraped_reads_never(seeded: Seed, open_page) -> None:
    engine = make_engine(seeded.url)
    with session_scope(session_factory(engine)) as session:
        session.add(
            ScrapeTarget(
                url="http://127.0.0.1:8000/metrics",
                job="vllm",
                instance="vllm-new",
                interval_s=15.0,
                enabled=True,
                labels="{}",
                created_at=time.time(),
            )
        )
    engine.dispose()
    at = open_page(seeded.url, "targets")
    no_exception(at)
    shown = table_with(at, "health", "last scrape")
    table = shown.set_index("instance")
    assert tuple(table.loc["vllm-new", ["health", "last scrape"]]) == ("never scraped", "never")
    assert table.loc["vllm-a", "last scrape"].endswith("ago")
    # (the seeded targets turn stale a minute after the session's seed was made: not counted here)
    assert int(metrics(at)["Stale / never scraped"]) >= 1
    assert list(shown.columns[:7]) == [
        "health",
        "job",
        "instance",
        "last scrape",
        "scrape_duration_s",
        "interval_s",
        "last_error",
    ]
