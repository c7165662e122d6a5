"""Serving the collector in this process: `serve` (blocking, what `kvpilot collector serve` runs) and
`run_in_thread` (demo, tests). Both refuse an unmigrated database, and a non-loopback bind without an
ingest token or in dev mode (`check_bind_safety`)."""

from __future__ import annotations

import gc
import logging

import uvicorn

from collector import tokens
from collector.db import check_schema_current, make_engine
from collector.errors import CollectorError
from collector.server.app import create_app
from collector.settings import CollectorSettings
from plumbing.serving import ServeError, ThreadServer, serve_in_thread

log = logging.getLogger("kvpilot.collector")


def check_bind_safety(settings: CollectorSettings) -> None:
    """A tokens file must parse. Off loopback, pushes need the ingest token or a tokens file, and dev mode
    (admin without a token) is not allowed. Without an admin identity target administration is refused
    anyway, so one is not required to start."""
    if settings.tokens_file is not None:
        tokens.load(settings.tokens_file)  # TokensFileError names the file and the field
    if settings.loopback_only:
        return
    if settings.ingest_token is None and settings.tokens_file is None:
        raise CollectorError(
            f"refusing to listen on {settings.host} without KVPILOT_INGEST_TOKEN or KVPILOT_TOKENS_FILE;"
            " set one or bind to 127.0.0.1"
        )
    if settings.dev_mode:
        raise CollectorError(
            f"refusing to listen on {settings.host} with KVPILOT_DEV_MODE=true; dev mode is for loopback only"
        )


def _check_database(settings: CollectorSettings) -> None:
    engine = make_engine(settings.db_url, sqlite_synchronous=settings.sqlite_synchronous)
    try:
        check_schema_current(engine)
    finally:
        engine.dispose()


def serve(settings: CollectorSettings) -> None:
    """Blocking: what `kvpilot collector serve` runs. Refuses an unmigrated database up front."""
    check_bind_safety(settings)
    _check_database(settings)
    if settings.ingest_token is None and settings.tokens_file is None:
        log.warning("no KVPILOT_INGEST_TOKEN: pushes are accepted unauthenticated on %s", settings.host)
    if settings.admin_token is None and settings.tokens_file is None and not settings.dev_mode:
        log.warning("no KVPILOT_ADMIN_TOKEN: target administration (POST/DELETE /v1/targets) is refused")
    app = create_app(settings)
    tune_gc(settings.gc_young_threshold)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level, access_log=False)


def tune_gc(young_threshold: int) -> None:
    """A serving collector's garbage collector, set for a process that allocates a row tuple per event: what
    start-up built (the app, its models, SQLAlchemy's metadata, the libraries) frozen out of every later
    collection (`gc.freeze`), and the young generation collected every `young_threshold` allocations instead of
    Python's 700. In the fleet bench with Python's settings a collector spent 4.5-5.3 s of its 31-40 s of CPU in
    collections, 19-28 of them full ones (about 0.2 s each, walking that start-up heap), and their pauses, the
    GIL held, added up to 10-16 s of the run; with these, 1.3-2.5 s, 3 full ones, and it stored half as many
    pushes again (docs/benchmarks.md). 0: Python's settings. Only for the process `serve` runs: a collector in
    a thread (tests, the demo) leaves its host's GC alone."""
    if young_threshold <= 0:
        return
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(young_threshold, middle, old)
    log.info(
        "GC: %d start-up objects frozen, young generation collected every %d allocations",
        gc.get_freeze_count(),
        young_threshold,
    )


def run_in_thread(settings: CollectorSettings, *, timeout_s: float = 30.0) -> ThreadServer:
    """Start a collector on `settings.host:settings.port` (port 0 picks a free one); returns when it serves.

    Raises SchemaOutdatedError before starting if the database is not at head, CollectorError if it cannot
    listen or does not start.
    """
    check_bind_safety(settings)
    _check_database(settings)
    try:
        return serve_in_thread(
            create_app(settings),
            host=settings.host,
            port=settings.port,
            name="kvpilot-collector",
            log_level=settings.log_level,
            timeout_s=timeout_s,
        )
    except ServeError as exc:
        raise CollectorError(f"collector: {exc}") from None
