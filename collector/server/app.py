"""The collector's FastAPI app: lifespan (database, schema check, health probe, scraper, maintenance), routers,
and one place for refusals.

Every refusal, wherever raised, is answered here as `{"detail": ..., "errors": ...}` (on /v1/traces as the
OTLP spec's google.rpc.Status), counted in `kvpilot_collector_ingest_rejected_total{reason}` and logged,
at most one line per reason every 10 s (`errors.RefusalLog`).

/docs and /openapi.json are served only when `settings.docs_enabled` (by default: no token set).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry
from sqlalchemy import Engine
from starlette.exceptions import HTTPException as StarletteHTTPException

from collector import bundle
from collector.claims import CardinalityLimits, ClaimWindows
from collector.db import check_schema_current, make_engine, redact, session_factory
from collector.errors import CollectorError, StorageError
from collector.identities import IdentityStore
from collector.maintenance import Maintenance, MaintenanceMetrics
from collector.netpolicy import AddressPolicy
from collector.owners import adopt
from collector.redact import redact_logger
from collector.scraper import ScrapeMetrics, Scraper
from collector.server import health_routes, ingest_routes, otlp_routes, target_routes
from collector.server.admission import Admission
from collector.server.deps import CollectorState, IngestMetrics
from collector.server.errors import Rejected, as_rejected
from collector.settings import CollectorSettings
from engine.events import EventBatch

log = logging.getLogger("kvpilot.collector")


def create_app(
    settings: CollectorSettings | None = None,
    *,
    engine: Engine | None = None,
    registry: CollectorRegistry | None = None,
    start_scraper: bool | None = None,
) -> FastAPI:
    """The app on `settings`; `engine` (kept and disposed by the caller) and `registry` are injected in tests.

    `start_scraper` overrides `settings.scrape_enabled`. The database is opened and checked at startup.
    """
    settings = settings or CollectorSettings()
    registry = registry or CollectorRegistry()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        db = engine or make_engine(settings.db_url, sqlite_synchronous=settings.sqlite_synchronous)
        check_schema_current(db)
        # /health's probe has a connection of its own: it must not queue behind ingest for the pool.
        probe_db = engine or make_engine(settings.db_url, sqlite_synchronous=settings.sqlite_synchronous, pool_size=1)
        policy = AddressPolicy(settings.scrape_allow_nets)
        limits = CardinalityLimits(
            max_instances=settings.max_instances_per_identity,
            new_instances_per_minute=settings.max_new_instances_per_minute,
            new_runs_per_minute=settings.max_new_runs_per_minute,
            new_runs_per_minute_per_identity=settings.max_new_runs_per_minute_per_identity,
        )
        identities = IdentityStore(
            ingest_token=settings.ingest_token,
            admin_token=settings.admin_token,
            tokens_file=settings.tokens_file,
            registry=registry,
        )
        try:
            adopted = adopt(db, identities.legacy_owners())
        except StorageError as exc:  # serve anyway: /health reports the storage, the next start adopts them
            log.warning("could not hand fingerprint-owned instances to their identities: %s", exc)
            adopted = {}
        for name, n in adopted.items():
            log.info("identity %s adopted %d instances owned by the fingerprint of one of its secrets", name, n)
        redact_logger("httpx")  # it logs every request's URL at INFO: a scrape URL may carry credentials
        state = CollectorState(
            settings=settings,
            engine=db,
            sessions=session_factory(db),
            registry=registry,
            metrics=IngestMetrics(registry),
            admission=Admission(settings, registry),
            windows=ClaimWindows(limits),
            policy=policy,
            health=health_routes.HealthProbe(
                probe_db, interval_s=settings.health_probe_interval_s, min_free_bytes=settings.storage_min_free_bytes
            ),
            identities=identities,
        )
        state.health.start()
        maintenance = Maintenance(db, settings, metrics=MaintenanceMetrics(registry))
        maintenance.start()
        scrape = settings.scrape_enabled if start_scraper is None else start_scraper
        if scrape:
            metrics = ScrapeMetrics(registry)
            state.scraper = Scraper(db, timeout_s=settings.scrape_timeout_s, metrics=metrics, policy=policy)
            state.scraper.start()
        app.state.kvpilot = state
        log.info("collector ready on %s", redact(settings.db_url))
        try:
            yield
        finally:
            state.health.stop()
            maintenance.stop()
            state.admission.close()
            if state.scraper:
                state.scraper.stop()
            if engine is None:
                db.dispose()
                probe_db.dispose()

    docs = settings.docs_enabled
    app = FastAPI(
        title="kvpilot collector",
        version="1",
        description="Ingest of engine events, OTLP/HTTP traces (vLLM's request spans) and Prometheus scrape targets.",
        lifespan=lifespan,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
        exception_handlers={
            Rejected: _rejected,
            CollectorError: _collector_error,
            RequestValidationError: _invalid_request,
            StarletteHTTPException: _http_error,
        },
    )
    app.openapi = lambda: _openapi_with_batch(app)  # type: ignore[method-assign]  # FastAPI's documented override
    app.include_router(health_routes.router)
    app.include_router(ingest_routes.router)
    app.include_router(otlp_routes.router)
    app.include_router(target_routes.router)
    app.include_router(target_routes.admin_router)
    app.add_middleware(FastPaths)
    return app


class FastPaths:
    """ASGI middleware for what must stay cheap under overload, ahead of routing, auth and dependencies
    (which cost about 1 ms of CPU a request): a push while the in-flight bound is reached, or while the storage
    stage is backlogged (`Admission.refusal`), is refused here
    (through the one refusal handler: counted, logged, OTLP-shaped on /v1/traces), and a healthy /health
    answered here. The route's own `admit` stays the authoritative check."""

    PUSHES = frozenset({"/v1/ingest", bundle.PATH, otlp_routes.TRACES_PATH})
    OK = b'{"status":"ok"}'

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        state: CollectorState | None = None
        if scope["type"] == "http":
            state = getattr(scope["app"].state, "kvpilot", None)
        if state is not None:
            path, method = scope["path"], scope["method"]
            if method == "POST" and path in self.PUSHES and (refused := state.admission.refusal()) is not None:
                response = await _rejected(Request(scope, receive), refused)
                await response(scope, receive, send)
                return
            if method == "GET" and path == "/health" and state.health.status() is None:
                await Response(self.OK, media_type="application/json")(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _openapi_with_batch(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema plus EventBatch, which the ingest route reads itself (to handle gzip)."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes, description=app.description)
    batch_schema = EventBatch.model_json_schema(ref_template="#/components/schemas/{model}")
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.update(batch_schema.pop("$defs", {}))
    components["EventBatch"] = batch_schema
    app.openapi_schema = schema
    return schema


# --- refusals: answered and counted here ------------------------------------------------------------


async def _rejected(request: Request, exc: Rejected) -> Response:
    state: CollectorState = request.app.state.kvpilot
    state.metrics.rejected.labels(exc.reason).inc()
    state.refusal_log(
        exc.reason, f"{request.method} {request.url.path} -> {exc.status_code} {exc.reason}: {exc.detail}"
    )
    if request.url.path == otlp_routes.TRACES_PATH:
        return otlp_routes.status_response(request, exc)
    body = {"detail": exc.detail} if exc.errors is None else {"detail": exc.detail, "errors": exc.errors}
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


async def _collector_error(request: Request, exc: CollectorError) -> Response:
    return await _rejected(request, as_rejected(exc))


async def _invalid_request(request: Request, exc: RequestValidationError) -> Response:
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


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    return await _rejected(
        request, Rejected(exc.status_code, f"http_{exc.status_code}", str(exc.detail), headers=exc.headers)
    )
