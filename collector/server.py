"""`kvpilot collector serve`: the ingest API, target CRUD, /health and /metrics.

Handlers stay thin (STYLE.md 10): they read and bound the body, then hand it to `collector.ingest`
in a worker thread. A 202 is sent only after the batch's transaction committed: acknowledged means
durable. Every refusal increments `kvpilot_collector_ingest_rejected_total{reason}` and logs a line.

Programmatic use (demo, tests): `handle = run_in_thread(settings)` ... `handle.stop()`, or
`start_subprocess(settings)` for a separate process that can be killed.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Annotated, Any
from urllib.parse import urlsplit

import httpx
import uvicorn
from fastapi import Depends, FastAPI, Header, HTTPException, Path, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field, HttpUrl, UrlConstraints
from sqlalchemy import Engine, delete, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker
from starlette.exceptions import HTTPException as StarletteHTTPException

from collector.db import check_schema_current, make_engine, redact, session_factory, session_scope
from collector.errors import (
    CollectorError,
    IdempotencyConflictError,
    SchemaOutdatedError,
    StorageError,
    StorageUnavailableError,
)
from collector.events import EventBatch
from collector.ingest import BatchTooLargeError, BatchValidationError, IngestResult, parse_batch, store_batch
from collector.schema import ScrapeTarget
from collector.scraper import ScrapeMetrics, Scraper
from collector.settings import CollectorSettings

log = logging.getLogger("kvpilot.collector")

LOOPBACK = {"127.0.0.1", "::1", "localhost"}


class IngestMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.batches = Counter(
            "kvpilot_collector_ingest_batches", "batches answered 2xx", ["result"], registry=registry
        )
        self.events = Counter("kvpilot_collector_ingest_events", "events stored", ["type"], registry=registry)
        self.rejected = Counter(
            "kvpilot_collector_ingest_rejected", "requests refused, by reason", ["reason"], registry=registry
        )
        self.bytes = Counter("kvpilot_collector_ingest_bytes", "request body bytes received", registry=registry)
        self.latency = Histogram(
            "kvpilot_collector_ingest_batch_seconds",
            "time from body received to commit",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
            registry=registry,
        )


@dataclass
class CollectorState:
    settings: CollectorSettings
    engine: Engine
    sessions: sessionmaker[Session]
    registry: CollectorRegistry
    metrics: IngestMetrics
    scraper: Scraper | None = None
    ingest_lock: threading.Lock = field(default_factory=threading.Lock)


class Rejected(Exception):
    """A refusal with its HTTP status and metric reason; handled in one place below."""

    def __init__(
        self, status_code: int, reason: str, detail: str, errors: list | None = None, headers: dict | None = None
    ) -> None:
        super().__init__(detail)
        self.status_code = status_code
        self.reason = reason
        self.detail = detail
        self.errors = errors
        self.headers = headers


# --- dependencies ----------------------------------------------------------------------------------


def get_state(request: Request) -> CollectorState:
    return request.app.state.kvpilot


StateDep = Annotated[CollectorState, Depends(get_state)]


def get_session(state: StateDep) -> Iterator[Session]:
    with session_scope(state.sessions) as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]

_bearer = HTTPBearer(auto_error=False, description="the collector's ingest token (KVPILOT_INGEST_TOKEN)")


def require_token(
    state: StateDep, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> None:
    expected = state.settings.ingest_token
    if expected is None:
        return
    if credentials is None:
        raise Rejected(401, "unauthorized", "missing bearer token", headers={"WWW-Authenticate": "Bearer"})
    if not hmac.compare_digest(credentials.credentials.encode(), expected.encode()):
        raise Rejected(403, "forbidden", "wrong bearer token")


AuthDep = Annotated[None, Depends(require_token)]


# --- request/response models -----------------------------------------------------------------------


class IngestResponse(BaseModel):
    batch_id: int
    idempotency_key: str
    events: int
    duplicate: bool


class ErrorResponse(BaseModel):
    detail: str
    errors: list[dict[str, Any]] | None = None


TargetId = Annotated[int, Path(ge=1, le=2**63 - 1)]
Url = Annotated[HttpUrl, UrlConstraints(max_length=2000)]
Label = Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[^\x00]+$")]


class TargetIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: Url
    job: Label = "kvpilot"
    instance: Label | None = Field(None, description="the instance label of the points; default host:port")
    interval_s: float | None = Field(None, ge=1.0, le=86400.0)
    enabled: bool = True


class TargetOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    url: str
    job: str
    instance: str
    interval_s: float
    enabled: bool
    up: bool | None
    last_error: str | None
    last_scrape_at: float | None
    scrape_duration_s: float | None
    created_at: float


_ERRORS = {
    400: {"model": ErrorResponse},
    401: {"model": ErrorResponse},
    403: {"model": ErrorResponse},
    409: {"model": ErrorResponse},
    413: {"model": ErrorResponse},
    415: {"model": ErrorResponse},
    422: {"model": ErrorResponse},
    503: {"model": ErrorResponse},
}


# --- body handling ---------------------------------------------------------------------------------


async def read_limited(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise Rejected(413, "too_large", f"body of {declared} bytes exceeds the limit of {limit}")
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > limit:
            raise Rejected(413, "too_large", f"body exceeds the limit of {limit} bytes")
    return bytes(buf)


def gunzip_limited(data: bytes, limit: int) -> bytes:
    """Decompress one gzip member, refusing output past `limit` (zip bombs) and trailing junk."""
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        out = inflater.decompress(data, limit + 1)
    except zlib.error as exc:
        raise Rejected(400, "bad_gzip", f"body is not valid gzip: {exc}") from exc
    if len(out) > limit or inflater.unconsumed_tail:
        raise Rejected(413, "too_large", f"decompressed body exceeds the limit of {limit} bytes")
    if not inflater.eof:
        raise Rejected(400, "bad_gzip", "gzip body is truncated")
    if inflater.unused_data:
        raise Rejected(400, "bad_gzip", "data after the end of the gzip stream")
    return out


def decode_body(request: Request, raw: bytes, settings: CollectorSettings) -> bytes:
    ctype = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if ctype != "application/json":
        raise Rejected(415, "unsupported_media", f"content-type must be application/json, got {ctype!r}")
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding == "gzip":
        return gunzip_limited(raw, settings.max_decompressed_bytes)
    if encoding in ("identity", ""):
        return raw
    raise Rejected(415, "unsupported_encoding", f"content-encoding must be gzip or identity, got {encoding!r}")


def ingest_sync(state: CollectorState, body: bytes, key: str | None) -> IngestResult:
    """Validate and store one batch in a worker thread, one batch at a time.

    Validation and the inserts both need the GIL. Overlapping them across threads buys nothing: the
    drivers release the GIL around every row they step, then wait for a validator that holds it for
    a whole batch (a lock convoy). Overlapping only the COMMIT's fsync with the next validation was
    tried and measured no faster on 2 cores, so each batch simply runs under `ingest_lock`; the event
    loop keeps receiving the next bodies meanwhile.
    """
    with state.ingest_lock:
        batch = parse_batch(body, max_events=state.settings.max_batch_events)
        return store_batch(state.engine, batch, idempotency_key=key, content=body)


# --- app -------------------------------------------------------------------------------------------


def _openapi_with_batch(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema plus EventBatch, which the ingest route reads itself (to handle gzip)."""
    if app.openapi_schema:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    schema = get_openapi(title=app.title, version=app.version, routes=app.routes, description=app.description)
    batch_schema = EventBatch.model_json_schema(ref_template="#/components/schemas/{model}")
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.update(batch_schema.pop("$defs", {}))
    components["EventBatch"] = batch_schema
    app.openapi_schema = schema
    return schema


def create_app(
    settings: CollectorSettings | None = None,
    *,
    engine: Engine | None = None,
    registry: CollectorRegistry | None = None,
    start_scraper: bool | None = None,
) -> FastAPI:
    settings = settings or CollectorSettings()
    registry = registry or CollectorRegistry()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        db = engine or make_engine(settings.db_url, sqlite_synchronous=settings.sqlite_synchronous)
        check_schema_current(db)
        state = CollectorState(
            settings=settings,
            engine=db,
            sessions=session_factory(db),
            registry=registry,
            metrics=IngestMetrics(registry),
        )
        scrape = settings.scrape_enabled if start_scraper is None else start_scraper
        if scrape:
            state.scraper = Scraper(db, timeout_s=settings.scrape_timeout_s, metrics=ScrapeMetrics(registry))
            state.scraper.start()
        app.state.kvpilot = state
        log.info("collector ready on %s", redact(settings.db_url))
        try:
            yield
        finally:
            if state.scraper:
                state.scraper.stop()
            if engine is None:
                db.dispose()

    app = FastAPI(
        title="kvpilot collector",
        version="1",
        description="Ingest of engine telemetry events and Prometheus scrape targets.",
        lifespan=lifespan,
    )
    app.openapi = lambda: _openapi_with_batch(app)  # type: ignore[method-assign]

    @app.exception_handler(Rejected)
    async def _rejected(request: Request, exc: Rejected) -> JSONResponse:
        state: CollectorState = request.app.state.kvpilot
        state.metrics.rejected.labels(exc.reason).inc()
        log.info("%s %s -> %d %s: %s", request.method, request.url.path, exc.status_code, exc.reason, exc.detail)
        body = {"detail": exc.detail} if exc.errors is None else {"detail": exc.detail, "errors": exc.errors}
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(CollectorError)
    async def _collector_error(request: Request, exc: CollectorError) -> JSONResponse:
        return await _rejected(request, _as_rejected(exc))

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [
            {
                "loc": ".".join(str(p) for p in err.get("loc", ())),
                "msg": err.get("msg", ""),
                "type": err.get("type", ""),
            }
            for err in exc.errors()[:20]
        ]
        detail = f"{errors[0]['loc']}: {errors[0]['msg']}" if errors else "invalid request"
        return await _rejected(request, Rejected(422, "invalid_request", detail, errors=errors))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return await _rejected(
            request, Rejected(exc.status_code, f"http_{exc.status_code}", str(exc.detail), headers=exc.headers)
        )

    @app.get("/health")
    def health(state: StateDep) -> dict[str, str]:
        """Liveness plus a database round trip (503 when the database is unreachable)."""
        try:
            check_schema_current(state.engine)
        except SchemaOutdatedError as exc:
            raise Rejected(503, "schema_outdated", str(exc)) from exc
        return {"status": "ok"}

    @app.get("/metrics", response_class=Response)
    def metrics(state: StateDep) -> Response:
        return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post(
        "/v1/ingest",
        status_code=202,
        response_model=IngestResponse,
        responses={200: {"model": IngestResponse, "description": "duplicate of a stored batch"}, **_ERRORS},
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/EventBatch"}}},
            }
        },
    )
    async def ingest(
        request: Request,
        state: StateDep,
        _auth: AuthDep,
        idempotency_key: Annotated[
            str | None, Header(alias="Idempotency-Key", min_length=1, max_length=200, pattern=r"^[!-~]+$")
        ] = None,
    ) -> JSONResponse:
        """Store one batch atomically. 202: committed. 200 with duplicate=true: stored before."""
        raw = await read_limited(request, state.settings.max_batch_bytes)
        state.metrics.bytes.inc(len(raw))
        body = decode_body(request, raw, state.settings)
        started = time.perf_counter()
        result = await run_in_threadpool(ingest_sync, state, body, idempotency_key)
        state.metrics.latency.observe(time.perf_counter() - started)
        if result.duplicate:
            state.metrics.batches.labels("duplicate").inc()
            log.info("duplicate batch %s (key %s) not stored again", result.batch_id, result.idempotency_key)
        else:
            state.metrics.batches.labels("accepted").inc()
            for kind, n in result.counts.items():
                state.metrics.events.labels(kind).inc(n)
        payload = IngestResponse(
            batch_id=result.batch_id,
            idempotency_key=result.idempotency_key,
            events=result.events,
            duplicate=result.duplicate,
        )
        return JSONResponse(payload.model_dump(), status_code=200 if result.duplicate else 202)

    @app.post("/v1/targets", status_code=201, response_model=TargetOut, responses=_ERRORS)
    def create_target(body: TargetIn, state: StateDep, session: SessionDep, _auth: AuthDep) -> ScrapeTarget:
        url = str(body.url)
        parts = urlsplit(url)
        target = ScrapeTarget(
            url=url,
            job=body.job,
            instance=body.instance or (parts.netloc or url)[:200],
            interval_s=body.interval_s or state.settings.scrape_default_interval_s,
            enabled=body.enabled,
            created_at=time.time(),
        )
        session.add(target)
        try:
            session.flush()
        except IntegrityError as exc:
            raise Rejected(409, "conflict", f"a target with url {url} already exists") from exc
        return target

    @app.get("/v1/targets", response_model=list[TargetOut], responses=_ERRORS)
    def list_targets(session: SessionDep, _auth: AuthDep) -> list[ScrapeTarget]:
        return list(session.scalars(select(ScrapeTarget).order_by(ScrapeTarget.id)))

    @app.get("/v1/targets/{target_id}", response_model=TargetOut, responses={404: {"model": ErrorResponse}, **_ERRORS})
    def get_target(target_id: TargetId, session: SessionDep, _auth: AuthDep) -> ScrapeTarget:
        target = session.get(ScrapeTarget, target_id)
        if target is None:
            raise HTTPException(404, f"no target {target_id}")
        return target

    @app.delete("/v1/targets/{target_id}", status_code=204, responses={404: {"model": ErrorResponse}, **_ERRORS})
    def delete_target(target_id: TargetId, session: SessionDep, _auth: AuthDep) -> Response:
        deleted = session.execute(delete(ScrapeTarget).where(ScrapeTarget.id == target_id)).rowcount
        if not deleted:
            raise HTTPException(404, f"no target {target_id}")
        return Response(status_code=204)

    return app


def _as_rejected(exc: CollectorError) -> Rejected:
    if isinstance(exc, BatchValidationError):
        return Rejected(422, "invalid", f"batch rejected, nothing stored: {exc}", errors=exc.errors)
    if isinstance(exc, BatchTooLargeError):
        return Rejected(413, "too_many_events", str(exc))
    if isinstance(exc, IdempotencyConflictError):
        return Rejected(409, "idempotency_conflict", str(exc))
    if isinstance(exc, StorageUnavailableError | StorageError):
        log.error("storage failure: %s", exc)
        return Rejected(503, "storage", "database unavailable; retry later", headers={"Retry-After": "1"})
    return Rejected(400, "error", str(exc))


# --- running it ------------------------------------------------------------------------------------


def check_bind_safety(settings: CollectorSettings) -> None:
    if settings.ingest_token is None and settings.host not in LOOPBACK:
        raise CollectorError(
            f"refusing to listen on {settings.host} without KVPILOT_INGEST_TOKEN; set a token or bind to 127.0.0.1"
        )


def serve(settings: CollectorSettings) -> None:
    """Blocking: what `kvpilot collector serve` runs. Refuses an unmigrated database up front."""
    check_bind_safety(settings)
    engine = make_engine(settings.db_url, sqlite_synchronous=settings.sqlite_synchronous)
    try:
        check_schema_current(engine)
    finally:
        engine.dispose()
    if settings.ingest_token is None:
        log.warning("no KVPILOT_INGEST_TOKEN: /v1/* accepts unauthenticated requests on %s", settings.host)
    app = create_app(settings)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level, access_log=False)


@dataclass
class CollectorHandle:
    """A collector serving in a background thread of this process."""

    url: str
    port: int
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=timeout_s)

    def __enter__(self) -> CollectorHandle:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()


def run_in_thread(settings: CollectorSettings, *, timeout_s: float = 30.0) -> CollectorHandle:
    """Start a collector on `settings.host:settings.port` (port 0 picks a free one); returns when it serves.

    Raises SchemaOutdatedError before starting if the database is not at head.
    """
    check_bind_safety(settings)
    engine = make_engine(settings.db_url, sqlite_synchronous=settings.sqlite_synchronous)
    try:
        check_schema_current(engine)
    finally:
        engine.dispose()
    sock = socket.socket(socket.AF_INET6 if ":" in settings.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((settings.host, settings.port))
    port = sock.getsockname()[1]
    config = uvicorn.Config(create_app(settings), log_level=settings.log_level, access_log=False, lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="kvpilot-collector", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise CollectorError("collector did not start (see its log)")
        time.sleep(0.02)
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    return CollectorHandle(url=f"http://{host}:{port}", port=port, server=server, thread=thread)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def stop_process(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if the child has not exited within `timeout_s`; reaps it either way."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class CollectorProcess:
    """A collector in a child process (`python -m collector serve`); kill() is a real SIGKILL."""

    url: str
    port: int
    proc: subprocess.Popen

    def stop(self, timeout_s: float = 10.0) -> None:
        stop_process(self.proc, timeout_s)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def start_subprocess(
    settings: CollectorSettings, *, timeout_s: float = 30.0, log_path: str | os.PathLike | None = None
) -> CollectorProcess:
    """Run a collector in a child process on settings.port (0: a free port); returns once /health answers."""
    port = settings.port or free_port(settings.host)
    env = {**os.environ}
    for name, value in settings.model_dump().items():
        key = f"KVPILOT_{name.upper()}"
        if value is None:
            env.pop(key, None)
        else:
            env[key] = str(value)
    env["KVPILOT_PORT"] = str(port)
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "collector", "serve"], env=env, stdout=out, stderr=out)
    url = f"http://{settings.host}:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise CollectorError(f"collector exited with {proc.returncode} before serving")
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return CollectorProcess(url=url, port=port, proc=proc)
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise CollectorError(f"collector did not answer on {url} within {timeout_s}s")
        time.sleep(0.05)
