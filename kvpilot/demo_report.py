"""The demo's summary: what the load got, what the collector stored (warm-up apart), what the alert did,
what the engine's weights are, and where the dashboard is — or that it is not running."""

from __future__ import annotations

import time
from dataclasses import dataclass

import typer


@dataclass(frozen=True)
class StoredCounts:
    requests: int  # the demo's own requests (what the load sent and the engine finished or refused)
    warmup_requests: int  # the engine's warm-up before it served: stored too, flagged `warmup`
    steps: int


def stored_counts(db_url: str, *, run_id: str, start: float, end: float) -> StoredCounts:
    """Counts of one run through the collector's read path (warm-up requests counted apart)."""
    from collector.db import make_engine
    from collector.queries import request_rates, throughput_over_time

    engine = make_engine(db_url)
    try:
        served = sum(r.requests for r in request_rates(engine, start=start, end=end, group_by="run", run_id=run_id))
        everything = request_rates(engine, start=start, end=end, group_by="run", run_id=run_id, include_warmup=True)
        steps = throughput_over_time(engine, start=start, end=end, bucket_s=end - start, run_id=run_id)
    finally:
        engine.dispose()
    return StoredCounts(
        requests=served,
        warmup_requests=sum(r.requests for r in everything) - served,
        steps=sum(b.steps for buckets in steps.values() for b in buckets),
    )


def wait_for_stored(db_url: str, *, run_id: str, since: float, expect: int, timeout_s: float = 10.0) -> StoredCounts:
    """The run's counts once the engine's last batches are stored (they trail the answers by a flush)."""
    deadline = time.monotonic() + timeout_s
    while True:
        counts = stored_counts(db_url, run_id=run_id, start=since - 600, end=time.time() + 1)
        if counts.requests >= expect or time.monotonic() >= deadline:
            return counts
        time.sleep(0.25)


def weights_line(weights: str | None) -> str:
    if weights == "random":
        return (
            "  model: random weights, so the text it generates is noise (the serving, memory and telemetry are "
            "real); set model.checkpoint: DIR in an engine config to load a Hugging Face Llama checkpoint"
        )
    return f"  model: {weights or 'unknown (no request was answered)'}"


def dashboard_line(url: str | None, *, keep_running: bool, db_url: str) -> str:
    """Never a URL that is about to stop answering: with --exit the dashboard is not started at all."""
    if not keep_running:
        return f"  dashboard: not started (--exit); browse this run with `kvpilot dashboard --db-url {db_url}`"
    return f"  dashboard: {url or 'did not start (see kvpilot-data/dashboard.log)'}"


def print_summary(report: dict, counts: StoredCounts, run_id: str, alert_lines: list[str]) -> None:
    echo = typer.echo
    echo("")
    echo("kvpilot demo summary")
    echo(f"  requests sent / answered / refused (429): {report['sent']} / {report['answered']} / {report['refused']}")
    if report.get("errors"):
        echo(f"  requests failed (no answer): {report['errors']}")
    echo(f"  output tokens: {report['output_tokens']}  throughput: {report['tokens_per_s']:.0f} tokens/s")
    echo(f"  e2e p50 / p99: {report['p50_s']:.3f} s / {report['p99_s']:.3f} s")
    echo(f"  ttft p50: {report['ttft_p50_s']:.3f} s")
    burst = report.get("burst_s")
    burst_text = f"{burst:.1f} s" if burst is not None else "cut short"
    echo(f"  burst (+500%): from t={report['burst_start_s']:.0f} s for {burst_text}: {report['burst_outcome']}")
    echo(
        f"  stored in SQL (run {run_id}): {counts.requests} requests "
        f"+ {counts.warmup_requests} warm-up requests the engine ran before serving, {counts.steps} steps"
    )
    for line in alert_lines:
        echo(f"  {line}")
    echo(weights_line(report.get("weights")))
