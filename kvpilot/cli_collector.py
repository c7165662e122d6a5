"""`kvpilot collector ...` and `kvpilot db ...`: the collector service and its database."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import typer

from collector.db import (
    check_schema_current,
    current_revision,
    head_revision,
    make_engine,
    redact,
    upgrade,
)
from collector.errors import CollectorError
from collector.settings import CollectorSettings
from kvpilot.cli_tokens import tokens_app

collector_app = typer.Typer(no_args_is_help=True, add_completion=False)
db_app = typer.Typer(no_args_is_help=True, add_completion=False)
collector_app.add_typer(
    tokens_app, name="tokens", help="Named identities (add, rotate, revoke, list) and instance owners."
)


def _settings(db_url: str | None) -> CollectorSettings:
    settings = CollectorSettings()
    return settings.model_copy(update={"db_url": db_url}) if db_url else settings


def _fail(exc: Exception) -> typer.Exit:
    typer.echo(f"kvpilot: {' '.join(str(exc).split())}", err=True)  # one line, whatever the driver wrote
    return typer.Exit(1)


DbUrl = typer.Option(None, "--db-url", help="database URL (default: KVPILOT_DB_URL or ./kvpilot-data/kvpilot.db)")


@collector_app.command("serve")
def serve_cmd(
    host: str = typer.Option(None, help="listen address (KVPILOT_HOST, default 127.0.0.1)"),
    port: int = typer.Option(None, help="listen port (KVPILOT_PORT, default 8100)"),
    db_url: str = DbUrl,
    no_scrape: bool = typer.Option(False, "--no-scrape", help="do not run the scraper in this collector"),
) -> None:
    """Serve POST /v1/ingest, scrape targets, /health and /metrics. Refuses an unmigrated database."""
    from collector.server import serve

    update: dict = {}
    if host:
        update["host"] = host
    if port is not None:
        update["port"] = port
    if no_scrape:
        update["scrape_enabled"] = False
    settings = _settings(db_url).model_copy(update=update)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per scrape; its failures are logged by us
    try:
        serve(settings)
    except CollectorError as exc:
        raise _fail(exc) from exc


@collector_app.command("relay")
def relay_cmd(
    upstream: str = typer.Option(..., "--upstream", help="the collector's URL (or its load balancer's)"),
    host: str = typer.Option("127.0.0.1", help="listen address: the node's engines push here"),
    port: int = typer.Option(8101, help="listen port"),
    token_file: Path = typer.Option(
        None, "--token-file", help="the ingest token, read from this file (default: KVPILOT_INGEST_TOKEN)"
    ),
    flush_interval_s: float = typer.Option(0.2, "--flush-interval-s", min=0.01, max=10.0),
    gzip_level: int = typer.Option(1, "--gzip-level", min=0, max=9, help="0: bundles go uncompressed"),
) -> None:
    """Forward this node's engines' pushes to the collector as bundles (one request a flush for the node).
    Point each engine's sink at this relay; it answers each push with the collector's own answer."""
    import uvicorn

    from collector.relay import RelayConfig, create_app
    from plumbing.bind import UnsafeBindError, check_bind

    try:
        token = token_file.read_text().strip() if token_file is not None else os.environ.get("KVPILOT_INGEST_TOKEN")
        check_bind(host, has_credential=bool(token), service="the relay", missing="an ingest token")
        config = RelayConfig(upstream, token or None, flush_interval_s=flush_interval_s, gzip_level=gzip_level)
    except (UnsafeBindError, ValueError, OSError) as exc:
        raise _fail(exc) from exc
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    uvicorn.run(create_app(config), host=host, port=port, log_level="warning", access_log=False)


@collector_app.command("import")
def import_cmd(
    path: Path = typer.Argument(..., exists=True, dir_okay=False, help="JSONL of events (JsonlSink output)"),
    db_url: str = DbUrl,
    batch_events: int = typer.Option(5000, min=1, max=100_000),
) -> None:
    """Store a JSONL event file; re-importing the same file stores nothing twice (per-chunk keys)."""
    from collector.ingest import BatchValidationError, parse_batch, store_batch

    settings = _settings(db_url)
    engine = make_engine(settings.db_url, sqlite_synchronous=settings.sqlite_synchronous)
    try:
        check_schema_current(engine)
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:24]
        stored = duplicates = 0
        lines: list[str] = []
        chunk = 0
        first_line = 1

        def flush() -> None:
            nonlocal stored, duplicates, chunk, lines, first_line
            if not lines:
                return
            body = ('{"events":[' + ",".join(lines) + "]}").encode()
            try:
                batch = parse_batch(body, max_events=batch_events)
            except BatchValidationError as exc:
                for err in exc.errors:
                    err["loc"] = _line_loc(err["loc"], first_line)
                raise CollectorError(f"{path}: {exc.errors[0]['loc']}: {exc.errors[0]['msg']}") from exc
            result = store_batch(engine, batch, idempotency_key=f"import-{digest}-{chunk}", content=body)
            if result.duplicate:
                duplicates += result.events
            else:
                stored += result.events
            chunk += 1
            first_line += len(lines)
            lines = []

        with path.open(encoding="utf-8") as fh:
            for raw in fh:
                line = raw.strip()
                if not line:
                    continue
                json.loads(line)  # a clear error for a broken line before batching
                lines.append(line)
                if len(lines) >= batch_events:
                    flush()
        flush()
    except (CollectorError, json.JSONDecodeError) as exc:
        raise _fail(exc) from exc
    finally:
        engine.dispose()
    typer.echo(f"stored {stored} events, {duplicates} already present")


def _line_loc(loc: str, first_line: int) -> str:
    """`events[3].ttft_s` of a chunk -> `line 42: ttft_s` (blank lines aside)."""
    if loc.startswith("events["):
        index, _, rest = loc[len("events[") :].partition("]")
        if index.isdigit():
            return f"event {first_line + int(index)}{rest}"
    return loc


SUPPORTED_URLS = "sqlite:///PATH or postgresql+psycopg://USER@HOST/DB"


def check_db_url(url: str) -> str | None:
    """Why kvpilot cannot use `url` (one line naming it), or None. A SQLite file's directory is made
    as the collector makes it; one that cannot be made is named with the reason."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        parsed = make_url(url)
    except ArgumentError:
        return f"not a database URL: {url!r} (expected {SUPPORTED_URLS})"
    shown = redact(url)
    if parsed.get_backend_name() not in ("sqlite", "postgresql"):
        return f"unsupported database URL {shown}: kvpilot stores to {SUPPORTED_URLS}"
    try:
        parsed.get_dialect().import_dbapi()
    except (ImportError, NoSuchModuleError) as exc:
        missing = getattr(exc, "name", None) or parsed.drivername
        return f"unsupported database URL {shown}: its driver ({missing}) is not installed; use {SUPPORTED_URLS}"
    database = parsed.database
    if parsed.get_backend_name() == "sqlite" and database and database != ":memory:":
        if database.startswith("file:"):
            return None
        parent = Path(database).expanduser().parent
        if not parent.is_dir():
            try:
                parent.mkdir(parents=True)
            except OSError as exc:
                return f"the directory {parent} for {shown} does not exist and cannot be made: {exc.strerror or exc}"
            typer.echo(f"kvpilot: made the directory {parent} for {shown}", err=True)
        if not os.access(parent, os.W_OK | os.X_OK):
            return f"the directory {parent} for {shown} is not writable"
    return None


@db_app.command("upgrade")
def upgrade_cmd(db_url: str = DbUrl, revision: str = typer.Option("head")) -> None:
    """Migrate the database to the code's schema (creates it if needed)."""
    settings = _settings(db_url)
    problem = check_db_url(settings.db_url)
    if problem:
        typer.echo(f"kvpilot: {problem}", err=True)
        raise typer.Exit(2)
    try:
        upgrade(settings.db_url, revision)
    except CollectorError as exc:
        raise _fail(exc) from exc
    typer.echo(f"{redact(settings.db_url)} is at {revision if revision != 'head' else head_revision()}")


@db_app.command("current")
def current_cmd(db_url: str = DbUrl) -> None:
    """Print the database's revision and the code's head; exit 1 if they differ."""
    settings = _settings(db_url)
    engine = make_engine(settings.db_url)
    try:
        current = current_revision(engine)
        head = head_revision()
    except CollectorError as exc:
        raise _fail(exc) from exc
    finally:
        engine.dispose()
    typer.echo(f"database: {current or '(not migrated)'}\nhead:     {head}")
    if current != head:
        raise typer.Exit(1)


@db_app.command("prune")
def prune_cmd(
    db_url: str = DbUrl,
    raw_days: float = typer.Option(None, help="keep raw events this many days (KVPILOT_RAW_RETENTION_DAYS)"),
    downsample_days: float = typer.Option(
        None, help="keep 1-minute aggregates this many days (KVPILOT_DOWNSAMPLE_RETENTION_DAYS)"
    ),
) -> None:
    """Downsample then delete raw rows older than --raw-days; drop aggregates older than --downsample-days."""
    from collector.retention import prune

    settings = _settings(db_url)
    engine = make_engine(settings.db_url, sqlite_synchronous=settings.sqlite_synchronous)
    try:
        check_schema_current(engine)
        result = prune(
            engine,
            raw_days=raw_days if raw_days is not None else settings.raw_retention_days,
            downsample_days=downsample_days if downsample_days is not None else settings.downsample_retention_days,
        )
    except (CollectorError, ValueError) as exc:
        raise _fail(exc) from exc
    finally:
        engine.dispose()
    deleted = ", ".join(f"{k} {v}" for k, v in result.deleted.items())
    typer.echo(f"downsampled {result.downsampled_rows} buckets; deleted: {deleted}")


@db_app.command("partitions")
def partitions_cmd(
    db_url: str = DbUrl,
    create: bool = typer.Option(
        False, "--create", help="run a maintenance round now: day partitions ahead, strays re-homed, steps rolled up"
    ),
) -> None:
    """List the day partitions of the raw tables (PostgreSQL) and the rows in their DEFAULT partitions."""
    import time

    from collector import partitions
    from collector.db import translate_errors
    from collector.maintenance import run_round

    settings = _settings(db_url)
    engine = make_engine(settings.db_url, sqlite_synchronous=settings.sqlite_synchronous)
    try:
        check_schema_current(engine)
        if engine.dialect.name != "postgresql":
            typer.echo(f"{redact(settings.db_url)}: SQLite has no partitions; `kvpilot db prune` deletes old rows")
            return
        if create:
            made = run_round(engine, settings, now=time.time())
            typer.echo("another collector holds the maintenance lock; nothing done" if made.skipped
                       else f"made {len(made.created)} partitions")  # fmt: skip
        with translate_errors(), engine.connect() as conn:
            strays = partitions.default_rows(conn)
            for table in partitions.PARTITIONED:
                days = [p for p in partitions.list_partitions(conn, table) if p.start is not None]
                span = f"{_day(days[0].start)} .. {_day(days[-1].start)}" if days else "none"
                typer.echo(f"{table}: {len(days)} day partitions ({span}); {strays[table]} rows in {table}_default")
    except CollectorError as exc:
        raise _fail(exc) from exc
    finally:
        engine.dispose()


def _day(ts: float | None) -> str:
    import datetime as dt

    return f"{dt.datetime.fromtimestamp(ts or 0.0, dt.UTC):%Y-%m-%d}"


@collector_app.command("tail")
def tail_cmd(
    file: Path = typer.Option(..., "--file", exists=True, dir_okay=False, help="vLLM's log (its stdout/stderr)"),
    instance: str = typer.Option(..., "--instance", min=1, help="instance name of its step rows"),
    follow: bool = typer.Option(False, "--follow", "-f", help="keep reading as the file grows (Ctrl-C stops)"),
    collector: str = typer.Option(
        "http://127.0.0.1:8100", "--collector", envvar="KVPILOT_COLLECTOR_URL", help="collector base URL"
    ),
    ingest_token: str | None = typer.Option(None, "--ingest-token", envvar="KVPILOT_INGEST_TOKEN"),
    run_id: str | None = typer.Option(None, "--run-id", help="run id of the steps (default: kept from last time)"),
    block_size: int | None = typer.Option(
        None, "--block-size", min=1, max=1 << 20, help="vLLM's KV block size, to count KV in blocks, not tokens"
    ),
    spool_dir: Path = typer.Option(Path("kvpilot-data/spool"), "--spool-dir", help="spool and read offset live here"),
) -> None:
    """Ship a vLLM log's iteration lines (--enable-logging-iteration-details) as step rows; resumes where it left."""
    import signal
    import threading

    from engine.http_sink import HttpSink, SpoolLockedError, spool_dir_for
    from integrations.vllm.iteration_log import VllmLogError
    from integrations.vllm.tail import tail_file
    from kvpilot.cli_vllm import check_collector_url

    url = check_collector_url(collector)
    logging.basicConfig(level=logging.INFO, format="kvpilot: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    stop = threading.Event()
    handlers = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        stats, sink = tail_file(
            file,
            instance=instance,
            sink_factory=lambda d: HttpSink(url, token=ingest_token or None, spool_dir=d),
            state_dir=spool_dir_for(spool_dir, instance),
            follow=follow,
            run_id=run_id,
            block_size=block_size,
            stop=stop,
        )
    except (VllmLogError, SpoolLockedError, OSError) as exc:
        raise _fail(exc) from exc
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert isinstance(sink, HttpSink)
    typer.echo(
        f"read {stats.lines} lines: {stats.iteration_lines} iteration lines, {stats.steps} steps, "
        f"{stats.unparsable} unparsable; {sink.sent} acknowledged, {len(sink.spool)} batch(es) waiting in the spool"
    )
