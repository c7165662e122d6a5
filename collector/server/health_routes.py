"""/health and /metrics: unauthenticated, so load balancers and Prometheus need no token."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from collector.db import check_schema_current
from collector.errors import SchemaOutdatedError
from collector.server.deps import StateDep
from collector.server.errors import Rejected

router = APIRouter()


@router.get("/health")
def health(state: StateDep) -> dict[str, str]:
    """Liveness plus a database round trip (503 when the database is unreachable)."""
    try:
        check_schema_current(state.engine)
    except SchemaOutdatedError as exc:
        raise Rejected(503, "schema_outdated", str(exc)) from exc
    return {"status": "ok"}


@router.get("/metrics", response_class=Response)
def metrics(state: StateDep) -> Response:
    return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)
