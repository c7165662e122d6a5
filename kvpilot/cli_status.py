"""`kvpilot status`: the Overview in a terminal, through the dashboard's own read functions.

Every figure comes from the collector's read package (`headline_latency`, `engine_peaks`, `diagnose`) and the
alert store, the functions the Overview page calls, so what the terminal says and what the page shows cannot
drift apart: a test of one is a test of the other.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import typer

from alerts.durations import DurationError, parse_duration

DbOpt = typer.Option(None, "--db-url", help="database URL (default: KVPILOT_DB_URL or ./kvpilot-data/kvpilot.db)")
# A status over more than a month of raw rows is a history question, not a glance: the dashboard's job.
MAX_SINCE_S = 31 * 86400.0
TRAP_WORDS = {"present": "present", "absent": "not seen", "no_data": "not enough data"}
TRAP_RANK = tuple(TRAP_WORDS)  # the order in which one instance's status outweighs another's


@dataclass(frozen=True)
class Window:
    start: float
    end: float
    run_id: str | None
    text: str


@dataclass
class Status:
    """What `--json` prints; the human form is rendered from the same object."""

    window: dict[str, Any]
    instance: str | None
    requests: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    ttft_source: str
    e2e_p50_s: float | None
    e2e_p99_s: float | None
    kv_usage_peak: float | None
    kv_usage_source: str
    running_peak: float | None
    waiting_peak: float | None
    alerts_firing: list[dict[str, Any]] = field(default_factory=list)
    traps: dict[str, str] = field(default_factory=dict)


def _fail(message: str) -> typer.Exit:
    typer.echo(f"kvpilot status: {message}", err=True)
    return typer.Exit(2)


def _window(db: Any, *, since: str | None, run_id: str | None, instance: str | None, now: float) -> Window:
    from collector import queries

    if since is not None and run_id is not None:
        raise _fail("--since and --run pick the window two ways; give one")
    if run_id is not None:
        runs = [r for r in queries.list_runs(db, instance=instance) if r.run_id == run_id]
        if not runs:
            where = f" of instance {instance!r}" if instance else ""
            raise _fail(f"--run: no run {run_id!r}{where} in this database")
        start = min(r.first_seen_ts for r in runs)
        end = max(r.last_seen_ts for r in runs) + 1.0
        return Window(start, end, run_id, f"run {run_id}")
    text = since or "1h"
    try:
        seconds = parse_duration(text)
    except DurationError as exc:
        raise _fail(f"--since: {exc}") from None
    if not 0 < seconds <= MAX_SINCE_S:
        raise _fail(f"--since: {text!r} is outside (0, 31d]")
    return Window(now - seconds, now, None, f"last {text}")


def _firing(engine: Any, instance: str | None) -> list[dict[str, Any]]:
    from alerts.store import current_alerts
    from collector.db import session_factory, session_scope

    with session_scope(session_factory(engine)) as session:
        stored = current_alerts(session, include_pending=False)
    return [
        {
            "alertname": a.rule,
            "instance": a.labels.get("instance", ""),
            "severity": a.labels.get("severity", ""),
            "summary": a.annotations.get("summary", ""),
            "since": a.fired_at,
            "labels": dict(a.labels),
        }
        for a in stored
        if instance is None or a.labels.get("instance", "") in ("", instance)
    ]


def collect(db_url: str, *, instance: str | None, since: str | None, run_id: str | None, now: float) -> Status:
    """Everything the Overview's headline shows, for one window; raises typer.Exit(2) on bad input."""
    from sqlalchemy.engine import make_url

    from collector.db import check_schema_current, make_engine
    from collector.errors import CollectorError

    try:
        url = make_url(db_url)
    except Exception:  # sqlalchemy's ArgumentError: not a URL at all
        raise _fail("--db-url: not a database URL (e.g. sqlite:///kvpilot.db, postgresql+psycopg://...)") from None
    database = url.database or ""
    local_file = url.get_backend_name() == "sqlite" and database not in ("", ":memory:")
    if local_file and not database.startswith("file:") and not Path(database).expanduser().exists():
        raise _fail(f"--db-url: no database at {database} (start the collector or run `kvpilot demo`)")
    engine = None
    try:  # a library call as well as the CLI's: its connections are closed here, not left to the GC
        try:
            engine = make_engine(db_url)
            check_schema_current(engine)
        except CollectorError as exc:
            raise _fail(f"--db-url: {exc}") from None
        except Exception as exc:  # a malformed URL, a missing driver, no database there: say which option
            shown = url.render_as_string(hide_password=True)
            raise _fail(f"--db-url: cannot open {shown}: {type(exc).__name__}") from None
        return _collect(engine, instance=instance, since=since, run_id=run_id, now=now)
    finally:
        if engine is not None:
            engine.dispose()


def _collect(engine: Any, *, instance: str | None, since: str | None, run_id: str | None, now: float) -> Status:
    from collector import queries

    win = _window(engine, since=since, run_id=run_id, instance=instance, now=now)
    instances = [instance] if instance else None
    lat = queries.headline_latency(engine, start=win.start, end=win.end, instances=instances, run_id=win.run_id)
    peaks = queries.engine_peaks(engine, start=win.start, end=win.end, instances=instances, run_id=win.run_id)
    findings = queries.diagnose(engine, start=win.start, end=win.end, instances=instances, run_id=win.run_id, now=now)
    traps: dict[str, str] = {}
    for f in findings:  # over several instances: present anywhere wins, then not seen, then not enough data
        old = traps.get(f.trap)
        if old is None or TRAP_RANK.index(f.status) < TRAP_RANK.index(old):
            traps[f.trap] = f.status
    return Status(
        window={"start": win.start, "end": win.end, "run_id": win.run_id, "text": win.text},
        instance=instance,
        requests=lat.requests,
        ttft_p50_s=lat.ttft_p50_s,
        ttft_p99_s=lat.ttft_p99_s,
        ttft_source=lat.source,
        e2e_p50_s=lat.e2e_p50_s,
        e2e_p99_s=lat.e2e_p99_s,
        kv_usage_peak=peaks.kv_usage_peak,
        kv_usage_source=peaks.kv_usage_source,
        running_peak=peaks.running_peak,
        waiting_peak=peaks.waiting_peak,
        alerts_firing=_firing(engine, instance),
        traps={trap: TRAP_WORDS[s] for trap, s in traps.items()},
    )


def _s(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1e3:.0f} ms" if value < 1 else f"{value:.2f} s"


def render(st: Status) -> str:
    """The human form: headline, sources, alerts, traps."""
    who = st.instance or "all instances"
    lines = [
        f"kvpilot status: {who}, {st.window['text']}",
        f"  requests        {st.requests:,}",
        f"  TTFT            p50 {_s(st.ttft_p50_s)}  p99 {_s(st.ttft_p99_s)}   ({st.ttft_source})",
        f"  e2e             p50 {_s(st.e2e_p50_s)}  p99 {_s(st.e2e_p99_s)}",
    ]
    kv = "-" if st.kv_usage_peak is None else f"{st.kv_usage_peak:.0%}"
    running = "-" if st.running_peak is None else f"{st.running_peak:g}"
    waiting = "-" if st.waiting_peak is None else f"{st.waiting_peak:g}"
    lines.append(f"  KV usage peak   {kv}   ({st.kv_usage_source})")
    lines.append(f"  running peak    {running}, waiting peak {waiting}")
    if st.alerts_firing:
        lines.append(f"  alerts firing   {len(st.alerts_firing)}")
        for a in st.alerts_firing:
            where = f" on {a['instance']}" if a["instance"] else ""
            lines.append(f"    {a['alertname']}{where} ({a['severity'] or 'no severity'}): {a['summary']}")
    else:
        lines.append("  alerts firing   none")
    if st.traps:
        lines.append("  traps           " + ", ".join(f"{t}: {w}" for t, w in st.traps.items()))
    return "\n".join(lines)


def status_cmd(
    instance: str | None = typer.Option(None, "--instance", help="one instance (default: all of them)"),
    since: str | None = typer.Option(None, "--since", help="window ending now, e.g. 15m, 1h, 1d (default 1h)"),
    run_id: str | None = typer.Option(None, "--run", help="the window of one run instead of --since"),
    db_url: str | None = DbOpt,
    as_json: bool = typer.Option(False, "--json", help="print the figures as JSON"),
) -> None:
    """What the dashboard's Overview shows, in a terminal: user-facing latency, true KV peaks, alerts, traps."""
    if db_url is None:
        from collector.settings import CollectorSettings

        db_url = CollectorSettings().db_url
    st = collect(db_url, instance=instance, since=since, run_id=run_id, now=time.time())
    if as_json:
        typer.echo(json.dumps(st.__dict__, indent=2, sort_keys=True))
    else:
        typer.echo(render(st))
