"""What the handlers get injected (STYLE.md 10): the collector's state, a session, the ingest-token check.

`CollectorState` is built by the app's lifespan and set on `app.state.kvpilot`; handlers never reach for
it otherwise, so a test can build an app on its own engine and metrics registry.
"""

from __future__ import annotations

import hmac
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CollectorRegistry, Counter, Histogram
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from collector.db import session_scope
from collector.scraper import Scraper
from collector.server.errors import Rejected
from collector.settings import CollectorSettings


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
    scraper: Scraper | None = None
    ingest_lock: threading.Lock = field(default_factory=threading.Lock)


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
    """The ingest token, when one is set: 401 without a bearer token, 403 with a wrong one."""
    expected = state.settings.ingest_token
    if expected is None:
        return
    if credentials is None:
        raise Rejected(401, "unauthorized", "missing bearer token", headers={"WWW-Authenticate": "Bearer"})
    if not hmac.compare_digest(credentials.credentials.encode(), expected.encode()):
        raise Rejected(403, "forbidden", "wrong bearer token")
