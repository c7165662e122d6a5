"""`kvpilot alerts ...`: rule tests and checks, PromQL export, the evaluator loop, silences, deliveries."""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import sys
import threading
import time
from pathlib import Path

import typer

alerts_app = typer.Typer(no_args_is_help=True)

RulesOpt = typer.Option(None, "--rules", help="rule files (default: the built-in rules)")
DbOpt = typer.Option(None, "--db-url", help="database URL (default: KVPILOT_DB_URL or ./kvpilot-data/kvpilot.db)")
# `--db` was this option's name before every command took `--db-url`; still accepted, not shown.
DbAliasOpt = typer.Option(None, "--db", hidden=True)


def _db_url(db_url: str | None, db: str | None = None) -> str:
    given = db_url or db
    if given:
        return given
    from collector.settings import CollectorSettings

    return CollectorSettings().db_url


def _load(paths: list[Path] | None):
    from alerts.rules import BUILTIN_RULES, RuleFileError, load_rule_files

    try:
        return load_rule_files(list(paths) if paths else [BUILTIN_RULES])
    except RuleFileError as exc:
        for problem in exc.problems:
            typer.echo(problem, err=True)
        raise typer.Exit(1) from None


@alerts_app.command("test")
def test_cmd(files: list[Path] = typer.Argument(..., help="promtool-format rule test files")) -> None:
    """Run rule unit tests (promtool's format); exit 1 on any failure."""
    from alerts.promtest import run_test_file

    ok = True
    for path in files:
        report = run_test_file(path)
        typer.echo(report.render())
        ok = ok and report.ok
    raise typer.Exit(0 if ok else 1)


@alerts_app.command("check")
def check_cmd(
    files: list[Path] = typer.Argument(None, help="rule files (default: built-in)"),
    list_series: bool = typer.Option(False, "--list-series", help="print the series rules may use"),
) -> None:
    """Validate rule files: syntax, series names, durations, templates."""
    if list_series:
        from alerts.series_catalog import known_series

        typer.echo("\n".join(sorted(known_series())))
        raise typer.Exit(0)
    groups = _load(files)
    typer.echo(f"SUCCESS: {sum(len(g.rules) for g in groups)} rules in {len(groups)} groups")


@alerts_app.command("export-prometheus")
def export_cmd(
    files: list[Path] = typer.Argument(None, help="rule files (default: built-in)"),
    out: Path | None = typer.Option(None, "--out", help="write here instead of stdout"),
) -> None:
    """The rules as PromQL over the engine's /metrics names (for a stock Prometheus)."""
    from alerts.promql_export import ExportError, export_yaml, write_export

    groups = _load(files)
    try:
        if out is None:
            typer.echo(export_yaml(groups), nl=False)
        else:
            write_export(groups, out)
            typer.echo(f"wrote {out}", err=True)
    except ExportError as exc:
        typer.echo(f"export failed: {exc}", err=True)
        raise typer.Exit(1) from None


@alerts_app.command("run")
def run_cmd(
    rules: list[Path] = RulesOpt,
    db_url: str | None = DbOpt,
    db: str | None = DbAliasOpt,
    webhook: list[str] = typer.Option(None, "--webhook", help="webhook receiver URL (repeatable)"),
    alertmanager: list[str] = typer.Option(None, "--alertmanager", help="also forward to this Alertmanager"),
    config: Path | None = typer.Option(None, "--config", help="notifier YAML (receivers, route)"),
    sink_port: int | None = typer.Option(None, "--sink-port", help="also run a local logging webhook sink"),
    secret: str | None = typer.Option(None, "--secret", envvar="KVPILOT_ALERTS_SECRET", help="HMAC secret"),
    group_wait: str = typer.Option("30s", help="Alertmanager group_wait"),
    group_interval: str = typer.Option("5m", help="Alertmanager group_interval"),
    repeat_interval: str = typer.Option("4h", help="Alertmanager repeat_interval"),
    duration_s: float | None = typer.Option(None, help="stop after this long (default: until Ctrl-C)"),
    api_port: int | None = typer.Option(
        None,
        "--api-port",
        help="serve the Alertmanager API v2 subset "
        "(silences, alerts, /metrics) on this port, e.g. 9093; 0: any free port",
    ),
    api_host: str = typer.Option(
        "127.0.0.1", "--api-host", help="address the API binds to; anything but loopback needs a token"
    ),
    api_token: str | None = typer.Option(
        None,
        "--api-token",
        envvar="KVPILOT_ALERTS_API_TOKEN",
        help="require Authorization: Bearer TOKEN on the API (prefer the environment variable: argv is visible)",
    ),
) -> None:
    """Evaluate rules against the database and deliver notifications (one active evaluator per DB)."""
    from alerts.config import load_notifier_config
    from alerts.durations import DurationError, parse_duration
    from alerts.runner import start_evaluator
    from alerts.sink import run_webhook_sink
    from collector.errors import StorageError
    from plumbing.bind import UnsafeBindError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    groups = _load(rules)
    del groups  # validated up front; start_evaluator loads them again
    sink = run_webhook_sink(port=sink_port, secret=secret) if sink_port is not None else None
    urls = list(webhook or []) + ([sink.url] if sink else [])
    try:
        waits = [parse_duration(v) for v in (group_wait, group_interval, repeat_interval)]
        notifier = load_notifier_config(config) if config else None
    except (DurationError, ValueError, OSError) as exc:
        typer.echo(f"bad notifier settings: {exc}", err=True)
        raise typer.Exit(2) from None
    if not urls and notifier is None and not alertmanager and api_port is None:
        typer.echo(
            "no receivers: pass --webhook URL, --sink-port PORT, --alertmanager URL, --config "
            "(or --api-port to only serve alert state)",
            err=True,
        )
        raise typer.Exit(2)
    try:
        handle = start_evaluator(
            _db_url(db_url, db),
            rule_files=list(rules or []) or None,
            webhook_urls=urls,
            alertmanager_urls=list(alertmanager or []),
            notifier=notifier,
            secret=secret,
            group_wait_s=waits[0],
            group_interval_s=waits[1],
            repeat_interval_s=waits[2],
            api_port=api_port,
            api_host=api_host,
            api_token=api_token,
        )
    except (StorageError, RuntimeError, UnsafeBindError) as exc:
        typer.echo(f"database error: {exc}" if isinstance(exc, StorageError) else str(exc), err=True)
        if sink:
            sink.stop()
        raise typer.Exit(1) from None
    if sink:
        typer.echo(f"webhook sink listening on {sink.url}", err=True)
    if handle.api_url:
        typer.echo(f"alerts API (Alertmanager v2 subset) on {handle.api_url}/api/v2/", err=True)
    stop = threading.Event()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with contextlib.suppress(KeyboardInterrupt):
        stop.wait(duration_s) if duration_s else stop.wait()
    handle.stop()
    if sink:
        sink.stop()


silence_app = typer.Typer(no_args_is_help=True, help="Alertmanager-style silences.")
alerts_app.add_typer(silence_app, name="silence")


def _factory(db_url: str | None, db: str | None):
    from collector.db import make_engine, session_factory

    return session_factory(make_engine(_db_url(db_url, db)))


@silence_app.command("add")
def silence_add(
    matchers: list[str] = typer.Argument(..., help="e.g. alertname=MemoryPressure instance=~'gpu.*'"),
    duration: str = typer.Option("2h", help="how long (e.g. 30m, 2h)"),
    comment: str = typer.Option("", help="why (shown with the silence)"),
    author: str = typer.Option("cli", "--author", help="who silenced it"),
    db_url: str | None = DbOpt,
    db: str | None = DbAliasOpt,
) -> None:
    """Silence alerts matching every matcher (`name=value`, `!=`, `=~`, `!~`) for a while; prints its id."""
    from pydantic import ValidationError

    from alerts.durations import DurationError, parse_duration
    from alerts.settings import AlertsSettings
    from alerts.silences import SilenceIn, create_silence, parse_matcher
    from collector.db import session_scope

    settings = AlertsSettings()
    now = time.time()
    try:
        silence = SilenceIn(
            matchers=[parse_matcher(m) for m in matchers],
            startsAt=now,
            endsAt=now + parse_duration(duration),
            createdBy=author,
            comment=comment,
        )
        with session_scope(_factory(db_url, db)) as session:
            silence_id = create_silence(
                session,
                silence,
                now=now,
                max_duration_s=settings.max_silence_duration_s,
                max_silences=settings.max_silences,
            )
    except (ValueError, DurationError, ValidationError) as exc:
        typer.echo(f"bad silence: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(silence_id)


@silence_app.command("list")
def silence_list(
    expired: bool = typer.Option(False, "--expired", help="also list expired silences"),
    db_url: str | None = DbOpt,
    db: str | None = DbAliasOpt,
) -> None:
    """The silences in force (JSON, as Alertmanager's API lists them)."""
    from alerts.silences import list_silences
    from collector.db import session_scope

    with session_scope(_factory(db_url, db)) as session:
        typer.echo(json.dumps(list_silences(session, now=time.time(), include_expired=expired), indent=2))


@silence_app.command("expire")
def silence_expire(
    silence_id: str = typer.Argument(..., help="the id `silence add` printed"),
    db_url: str | None = DbOpt,
    db: str | None = DbAliasOpt,
) -> None:
    """End a silence now; its alerts notify again from the next evaluation."""
    from alerts.silences import expire_silence
    from collector.db import session_scope

    with session_scope(_factory(db_url, db)) as session:
        if not expire_silence(session, silence_id, now=time.time()):
            typer.echo(f"no silence {silence_id}", err=True)
            raise typer.Exit(1)
    typer.echo(f"expired {silence_id}")


@alerts_app.command("deliveries")
def deliveries_cmd(
    limit: int = typer.Option(20, help="how many"),
    status: str | None = typer.Option(None, help="only this delivery status"),
    db_url: str | None = DbOpt,
    db: str | None = DbAliasOpt,
) -> None:
    """Outbox notifications with their attempts (newest first)."""
    from alerts.delivery import list_notifications
    from collector.db import session_scope

    with session_scope(_factory(db_url, db)) as session:
        json.dump(list_notifications(session, limit=limit, status=status), sys.stdout, indent=2)
    typer.echo("")
