"""What the handlers get injected (STYLE.md 10): the collector's state, a session, and the three scopes.

`CollectorState` is built by the app's lifespan and set on `app.state.kvpilot`; handlers never reach for
it otherwise, so a test can build an app on its own engine and metrics registry.

Scopes (DESIGN.md, Trust boundaries): `require_token` is the ingest token (pushes; it returns the
pusher's identity), `require_admin` the admin token (target administration), `require_reader` either
of them (listing targets, and /metrics when it is not public).
"""

from __future__ import annotations

import hmac
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CollectorRegistry, Counter, Histogram
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from collector.claims import ClaimWindows, token_identity
from collector.db import session_scope
from collector.netpolicy import AddressPolicy
from collector.scraper import Scraper
from collector.server.errors import RefusalLog, Rejected
from collector.settings import CollectorSettings

if TYPE_CHECKING:
    from collector.server.admission import Admission
    from collector.server.health_routes import HealthProbe


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
        self.otlp_spans = Counter(
            "kvpilot_collector_otlp_spans",
            "OTLP spans received: stored (as request rows), duplicate (stored before), ignored (not llm_request),"
            " rejected (an llm_request span that cannot be a request row)",
            ["result"],
            registry=registry,
        )
        for result in ("stored", "duplicate", "ignored", "rejected"):
            self.otlp_spans.labels(result)
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
    admission: Admission
    windows: ClaimWindows
    policy: AddressPolicy
    health: HealthProbe
    scraper: Scraper | None = None
    refusal_log: RefusalLog = field(default_factory=RefusalLog)
    ingest_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def ingest_identity(self) -> str:
        """Who pushes with the collector's ingest token (a fingerprint, never the token)."""
        return token_identity(self.settings.ingest_token)


async def get_state(request: Request) -> CollectorState:
    """`async`, as every dependency of /health and the push routes: a sync one would wait for a worker thread."""
    return request.app.state.kvpilot


StateDep = Annotated[CollectorState, Depends(get_state)]


def get_session(state: StateDep) -> Iterator[Session]:
    with session_scope(state.sessions) as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]

_bearer = HTTPBearer(auto_error=False, description="KVPILOT_INGEST_TOKEN (pushes) or KVPILOT_ADMIN_TOKEN (targets)")
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]

ADMIN_DISABLED = (
    "target administration needs an admin token: set KVPILOT_ADMIN_TOKEN on the collector and send it as"
    " 'Authorization: Bearer <token>' (a loopback-only development collector may set KVPILOT_DEV_MODE=true"
    " instead)"
)


def _check(credentials: HTTPAuthorizationCredentials | None, *accepted: str, scope: str) -> None:
    if credentials is None:
        raise Rejected(401, "unauthorized", "missing bearer token", headers={"WWW-Authenticate": "Bearer"})
    presented = credentials.credentials.encode()
    if not any(hmac.compare_digest(presented, token.encode()) for token in accepted):
        raise Rejected(403, "forbidden", f"wrong bearer token for {scope}")


async def require_token(state: StateDep, credentials: Credentials) -> str:
    """The ingest token, when one is set: 401 without a bearer token, 403 with a wrong one. Returns the
    pusher's identity (`collector.claims.token_identity`)."""
    expected = state.settings.ingest_token
    if expected is not None:
        _check(credentials, expected, scope="pushes")
    return state.ingest_identity


IngestIdentity = Annotated[str, Depends(require_token)]


async def require_reader(state: StateDep, credentials: Credentials) -> None:
    """Either token, when any is set (listing targets; /metrics when not public)."""
    accepted = [t for t in (state.settings.ingest_token, state.settings.admin_token) if t is not None]
    if accepted:
        _check(credentials, *accepted, scope="reading")


async def require_admin(state: StateDep, credentials: Credentials) -> None:
    """The admin token. Without one configured, administration is refused (403 saying how to enable it),
    except in dev mode on a loopback-only collector, where the ingest token (if any) is enough."""
    settings = state.settings
    if settings.admin_token is not None:
        _check(credentials, settings.admin_token, scope="target administration (KVPILOT_ADMIN_TOKEN)")
        return
    if settings.dev_mode and settings.loopback_only:
        await require_token(state, credentials)
        return
    raise Rejected(403, "admin_disabled", ADMIN_DISABLED)
