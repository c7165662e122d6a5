"""What the handlers get injected: the collector's state, a session, and the three scopes.

`CollectorState` is built by the app's lifespan and set on `app.state.kvpilot`; handlers never reach for
it otherwise, so a test can build an app on its own engine and metrics registry.

Scopes: `require_token` needs an identity with the ingest role (pushes; it returns the pusher's
identity name), `require_admin` one with the admin role (target administration), `require_reader` any
identity (listing targets, and /metrics when it is not public). Identities come from the tokens file
and the two environment tokens (`collector.identities`). The scheme is matched case-insensitively
(`bearer` is as good as `Bearer`: RFC 7235 section 2.1).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CollectorRegistry, Counter, Histogram
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from collector.claims import ClaimWindows
from collector.db import session_scope
from collector.identities import Identity, IdentityStore
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
    identities: IdentityStore
    scraper: Scraper | None = None
    refusal_log: RefusalLog = field(default_factory=RefusalLog)
    ingest_lock: threading.Lock = field(default_factory=threading.Lock)


async def get_state(request: Request) -> CollectorState:
    """`async`, as every dependency of /health and the push routes: a sync one would wait for a worker thread."""
    return request.app.state.kvpilot


StateDep = Annotated[CollectorState, Depends(get_state)]


def get_session(state: StateDep) -> Iterator[Session]:
    with session_scope(state.sessions) as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]

_bearer = HTTPBearer(
    auto_error=False, description="a secret of the tokens file, KVPILOT_INGEST_TOKEN (pushes) or KVPILOT_ADMIN_TOKEN"
)
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]

ADMIN_DISABLED = (
    "target administration needs an admin token: set KVPILOT_ADMIN_TOKEN on the collector, or add an identity"
    " with `kvpilot collector tokens add NAME --role admin`, and send it as 'Authorization: Bearer <token>'"
    " (a loopback-only development collector may set KVPILOT_DEV_MODE=true instead)"
)
OPEN_PUSHER = Identity("ingest", frozenset({"ingest"}))  # who pushes to a collector without any ingest credential


def _identify(
    state: CollectorState, credentials: HTTPAuthorizationCredentials | None, role: str, scope: str
) -> Identity:
    if credentials is None:
        raise Rejected(401, "unauthorized", "missing bearer token", headers={"WWW-Authenticate": "Bearer"})
    identity = state.identities.authenticate(credentials.credentials)
    if identity is None:
        raise Rejected(403, "forbidden", f"wrong bearer token for {scope}")
    if not identity.may(role):
        roles = ", ".join(sorted(identity.roles))
        raise Rejected(403, "forbidden", f"identity {identity.name!r} (roles: {roles}) may not do {scope}")
    return identity


async def push_identity(state: StateDep, credentials: Credentials) -> Identity:
    """An identity with the ingest role: 401 without a bearer token, 403 with a wrong one. A collector
    without any ingest credential (loopback only) takes pushes as `ingest`."""
    if state.identities.pushes_open:
        return OPEN_PUSHER
    return _identify(state, credentials, "ingest", "pushes")


async def require_token(state: StateDep, credentials: Credentials) -> str:
    """The pusher's identity name: what its instances are owned by."""
    return (await push_identity(state, credentials)).name


IngestIdentity = Annotated[str, Depends(require_token)]


async def require_reader(state: StateDep, credentials: Credentials) -> None:
    """Any identity, when any credential is configured (listing targets; /metrics when not public)."""
    if not state.identities.reads_open:
        _identify(state, credentials, "read", "reading")


async def require_admin(state: StateDep, credentials: Credentials) -> Identity:
    """An identity with the admin role. Without any, administration is refused (403 saying how to enable
    it), except in dev mode on a loopback-only collector, where the ingest credential (if any) is enough."""
    settings = state.settings
    if state.identities.has_admin():
        return _identify(state, credentials, "admin", "target administration (KVPILOT_ADMIN_TOKEN)")
    if settings.dev_mode and settings.loopback_only:
        return await push_identity(state, credentials)
    raise Rejected(403, "admin_disabled", ADMIN_DISABLED)


AdminIdentity = Annotated[Identity, Depends(require_admin)]
