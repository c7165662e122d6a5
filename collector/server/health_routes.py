"""/health and /metrics. /health is public (load balancers); /metrics too unless KVPILOT_PUBLIC_METRICS=false.

/health must answer fast under any load, so it never touches the database itself: `HealthProbe` checks
the database (reachable, at the code's schema head, taking writes with room to grow:
`collector.storage_check`) in a thread of its own every few seconds on a connection of its own, and
/health reports the last result: 503 when it failed or is overdue, so a load balancer stops sending
pushes that could not be stored.
Both handlers are `async` so that neither waits for a worker thread behind ingest.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from fastapi import APIRouter, Depends, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import Engine

from collector.db import current_revision, head_revision
from collector.errors import CollectorError
from collector.server.deps import Credentials, StateDep, require_reader
from collector.server.errors import Rejected
from collector.storage_check import storage_problem

log = logging.getLogger("kvpilot.collector")

router = APIRouter()


class HealthProbe:
    """The database check behind /health, run off the request path; `status()` is a read of its result."""

    def __init__(
        self,
        engine: Engine,
        *,
        interval_s: float,
        min_free_bytes: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.interval_s = interval_s
        self.min_free_bytes = min_free_bytes
        self.clock = clock
        self.overdue_s = max(3 * interval_s, 15.0)
        self.head = head_revision()
        self._ok_at = clock()  # the lifespan checked the schema before serving
        self._failure: tuple[str, str] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check_once(self) -> None:
        try:
            current = current_revision(self.engine)
        except CollectorError as exc:
            log.warning("health check: %s", exc)
            self._failure = ("database_unavailable", "database unreachable")
            return
        if current != self.head:
            self._failure = ("schema_outdated", f"database at revision {current}, not head {self.head}")
            return
        self._failure = storage_problem(
            self.engine, min_free_bytes=self.min_free_bytes, lock_wait_s=self.interval_s / 2
        )
        if self._failure is not None:
            return
        self._ok_at = self.clock()

    def status(self) -> tuple[str, str] | None:
        """None when healthy, else (reason, detail)."""
        if self._failure is not None:
            return self._failure
        age = self.clock() - self._ok_at
        if age > self.overdue_s:
            return ("health_check_overdue", f"the database check has not completed for {age:.0f}s")
        return None

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.check_once()

    def start(self) -> None:
        self.check_once()  # the lifespan checked the schema; a read-only or full database is refused from the start
        self._thread = threading.Thread(target=self._loop, name="kvpilot-health", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)


@router.get("/health")
async def health(state: StateDep) -> dict[str, str]:
    """Liveness plus the last database check (503 when the database is unreachable, not at head, refuses
    writes or has no room left)."""
    failure = state.health.status()
    if failure is not None:
        raise Rejected(503, *failure)
    return {"status": "ok"}


async def metrics_access(state: StateDep, credentials: Credentials) -> None:
    """Prometheus scrapes /metrics without a token by default; KVPILOT_PUBLIC_METRICS=false asks for one."""
    if not state.settings.public_metrics:
        await require_reader(state, credentials)


@router.get("/metrics", response_class=Response, dependencies=[Depends(metrics_access)])
async def metrics(state: StateDep) -> Response:
    return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)
