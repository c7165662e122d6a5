"""Refusals: one exception (`Rejected`) carrying the HTTP status and the metric reason, and their documented shape.

Every refusal, whoever raises it (a handler, the auth dependency, FastAPI's validation, the storage layer),
becomes a `Rejected` answered and counted in one place (`collector.server.app`).
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import BaseModel

from collector.claims import CardinalityError, InstanceOwnedError
from collector.errors import CollectorError, IdempotencyConflictError, StorageError, StorageUnavailableError
from collector.ingest import BatchTooLargeError, BatchValidationError
from collector.otlp import OtlpDecodeError, TooManySpansError

log = logging.getLogger("kvpilot.collector")


class Rejected(Exception):
    """A refusal with its HTTP status and metric reason; answered by the app's exception handler."""

    def __init__(
        self,
        status_code: int,
        reason: str,
        detail: str,
        errors: list | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(detail)
        self.status_code = status_code
        self.reason = reason
        self.detail = detail
        self.errors = errors
        self.headers = headers


class ErrorResponse(BaseModel):
    detail: str
    errors: list[dict[str, Any]] | None = None


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse},
    401: {"model": ErrorResponse},
    408: {"model": ErrorResponse, "description": "the body did not arrive in time"},
    403: {"model": ErrorResponse},
    409: {"model": ErrorResponse},
    413: {"model": ErrorResponse},
    415: {"model": ErrorResponse},
    422: {"model": ErrorResponse},
    429: {"model": ErrorResponse, "description": "overloaded or past a cardinality bound; see Retry-After"},
    503: {"model": ErrorResponse, "description": "the database is unavailable or the bottleneck; see Retry-After"},
}
# Refusals that say the collector or a pusher is past a bound: logged as warnings.
WARNING_REASONS = frozenset(
    {
        "overloaded",
        "overloaded_bytes",
        "storage_busy",
        "storage_backlog",
        "storage",
        "too_many_instances",
        "new_instances_rate",
        "new_runs_rate",
        "instance_owned",
    }
)


class RefusalLog:
    """One log line per refusal reason every `interval_s` at most, saying how many it stood for: under
    overload a line per refusal would cost more than the refusal itself."""

    def __init__(self, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self._last: dict[str, float] = {}
        self._suppressed: Counter[str] = Counter()

    def __call__(self, reason: str, message: str) -> None:
        now = self.clock()
        last = self._last.get(reason)
        if last is not None and now - last < self.interval_s:
            self._suppressed[reason] += 1
            return
        self._last[reason] = now
        more = self._suppressed.pop(reason, 0)
        level = logging.WARNING if reason in WARNING_REASONS else logging.INFO
        suffix = f" (and {more} more {reason!r} refusals since the last line)" if more else ""
        log.log(level, "%s%s", message, suffix)


def as_rejected(exc: CollectorError) -> Rejected:
    """The HTTP answer to an error of the data layer; storage failures become a retryable 503 that names no detail."""
    if isinstance(exc, BatchValidationError):
        return Rejected(422, "invalid", f"batch rejected, nothing stored: {exc}", errors=exc.errors)
    if isinstance(exc, OtlpDecodeError):
        return Rejected(400, "bad_otlp", str(exc))
    if isinstance(exc, TooManySpansError):
        return Rejected(413, "too_many_spans", str(exc))
    if isinstance(exc, BatchTooLargeError):
        return Rejected(413, "too_many_events", str(exc))
    if isinstance(exc, InstanceOwnedError):
        errors = [{"loc": exc.loc, "msg": str(exc), "type": "instance_owned"}]
        return Rejected(409, "instance_owned", f"{exc.loc}: {exc}", errors=errors)
    if isinstance(exc, CardinalityError):
        errors = [{"loc": exc.loc, "msg": str(exc), "type": exc.reason}]
        if exc.retry_after_s is None:
            return Rejected(422, exc.reason, f"batch rejected, nothing stored: {exc.loc}: {exc}", errors=errors)
        retry = str(max(1, math.ceil(exc.retry_after_s)))
        detail = f"batch rejected, nothing stored: {exc.loc}: {exc}; retry in {retry}s"
        return Rejected(429, exc.reason, detail, errors=errors, headers={"Retry-After": retry})
    if isinstance(exc, IdempotencyConflictError):
        return Rejected(409, "idempotency_conflict", str(exc))
    if isinstance(exc, StorageUnavailableError | StorageError):
        log.error("storage failure: %s", exc)
        return Rejected(503, "storage", "database unavailable; retry later", headers={"Retry-After": "1"})
    return Rejected(400, "error", str(exc))
