"""What `kvpilot bench vllm` reads back from the collector, through its one read path (`collector.queries`).

A `Wired` vLLM is one whose telemetry reaches a collector: steps from its iteration lines, request rows from
its OTLP spans, scraped series from its /metrics. A `Snapshot` is taken once everything it produced so far has
arrived (stored steps = iteration lines in its raw log, a scrape newer than the last request); the figures
are differences between two snapshots, so a vLLM that served other requests before (a test session's)
is measured as well as a fresh one.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import Engine

from collector.queries import request_rates, series_points, slowest_requests, throughput_over_time

ITERATION = re.compile(rb"Iteration\(\d+\): ")
LABELLED_SERIES = ("running", "queue_depth", "kv_usage", "preemptions_total", "requests_total")
FAR = 3600.0


def _noop() -> None:
    return None


@dataclass
class Wired:
    """A vLLM wired to a collector: where load goes, where its telemetry is stored, where its raw log is."""

    url: str
    model: str
    db: Engine
    instance: str
    run_id: str
    log_path: Path  # vLLM's own output; its iteration lines are counted here, apart from the adapter
    pause: Callable[[], None] = _noop
    resume: Callable[[], None] = _noop


@dataclass(frozen=True)
class Snapshot:
    steps: int  # step rows stored for the instance and run
    lines: int  # iteration lines in vLLM's log
    vllm_count: float | None  # vLLM's requests_total (every finished_reason) at `scraped_at`
    scraped_at: float | None
    settled: bool


def iteration_lines(path: Path) -> int:
    if not path.exists():
        return 0
    with path.open("rb") as fh:
        return sum(1 for line in fh if ITERATION.search(line))


def stored_steps(w: Wired) -> int:
    buckets = throughput_over_time(
        w.db, start=0.0, end=time.time() + FAR, bucket_s=1e10, instances=[w.instance], run_id=w.run_id
    )
    return sum(b.steps for b in buckets.get(w.instance, []))


def vllm_count(w: Wired, *, since: float) -> tuple[float, float] | None:
    """(sum over label sets of the latest scraped requests_total, its scrape time), from scrapes after `since`."""
    series = series_points(w.db, name="requests_total", start=since, end=time.time() + FAR, instances=[w.instance])
    if not series:
        return None
    return sum(points[-1][1] for points in series.values()), min(points[-1][0] for points in series.values())


def stored_requests(w: Wired, *, since: float) -> int:
    rates = request_rates(w.db, start=since, end=time.time() + FAR, instances=[w.instance], run_id=w.run_id)
    return sum(r.requests for r in rates)


def snapshot(
    w: Wired, *, scraped_after: float, requests: int = 0, requests_since: float = 0.0, timeout_s: float = 90.0
) -> Snapshot:
    """Wait until stored steps = iteration lines (in two reads in a row), a scrape after `scraped_after` is stored
    and at least `requests` request rows end after `requests_since`; the snapshot then, or when time is up."""
    deadline = time.monotonic() + timeout_s
    previous = -1
    while True:
        lines, steps = iteration_lines(w.log_path), stored_steps(w)
        count = vllm_count(w, since=scraped_after)
        settled = (
            steps == lines == previous
            and count is not None
            and (requests == 0 or stored_requests(w, since=requests_since) >= requests)
        )
        if settled or time.monotonic() > deadline:
            value, at = count if count is not None else (None, None)
            return Snapshot(steps, lines, value, at, settled)
        previous = lines if steps == lines else -1
        time.sleep(0.5)


@dataclass(frozen=True)
class StageSums:
    """|queue + prefill + decode - e2e| of request rows: relative to e2e (sorted), and the largest in seconds."""

    rows: int = 0
    errors: tuple[float, ...] = ()
    max_gap_s: float | None = None

    def __add__(self, other: StageSums) -> StageSums:
        gaps = [g for g in (self.max_gap_s, other.max_gap_s) if g is not None]
        return StageSums(self.rows + other.rows, tuple(sorted(self.errors + other.errors)), max(gaps, default=None))

    @property
    def max_error(self) -> float | None:
        return self.errors[-1] if self.errors else None

    @property
    def median_error(self) -> float | None:
        return self.errors[len(self.errors) // 2] if self.errors else None


def stage_sums(w: Wired, *, since: float, limit: int) -> StageSums:
    """The stage sums of the request rows ending after `since`."""
    rows = slowest_requests(
        w.db, start=since, end=time.time() + FAR, limit=limit, instances=[w.instance], run_id=w.run_id
    )
    gaps = [
        (abs((r["queue_s"] or 0.0) + (r["prefill_s"] or 0.0) + (r["decode_s"] or 0.0) - r["e2e_s"]), r["e2e_s"])
        for r in rows
        if r["e2e_s"]
    ]
    errors = tuple(sorted(gap / e2e for gap, e2e in gaps))
    return StageSums(len(rows), errors, max((gap for gap, _ in gaps), default=None))


def series_labels(w: Wired, *, since: float) -> dict[str, list[dict[str, str]]]:
    """Canonical name -> the label sets stored for the instance's scraped series (what the scrape kept)."""
    out: dict[str, list[dict[str, str]]] = {}
    for name in LABELLED_SERIES:
        series = series_points(w.db, name=name, start=since, end=time.time() + FAR, instances=[w.instance])
        out[name] = sorted((sid.label_dict() for sid in series), key=lambda d: sorted(d.items()))
    return out
