"""Refusals: one exception (`Rejected`) carrying the HTTP status and the metric reason, and their documented shape.

Every refusal, whoever raises it (a handler, the auth dependency, FastAPI's validation, the storage layer),
becomes a `Rejected` answered and counted in one place (`collector.server.app`).
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel

from collector.errors import CollectorError, IdempotencyConflictError, StorageError, StorageUnavailableError
from collector.ingest import BatchTooLargeError, BatchValidationError
from collector.otlp import OtlpDecodeError, TooManySpansError

log = logging.getLogger("kvpilot.collector")


class Rejected(Exception):
    """A refusal with its HTTP status and metric reason; answered by the app's exception handler."""

    def __init__(
        self, status_code: int, reason: str, detail: str, errors: list | None = None, headers: dict | None = None
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
    403: {"model": ErrorResponse},
    409: {"model": ErrorResponse},
    413: {"model": ErrorResponse},
    415: {"model": ErrorResponse},
    422: {"model": ErrorResponse},
    503: {"model": ErrorResponse},
}


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
    if isinstance(exc, IdempotencyConflictError):
        return Rejected(409, "idempotency_conflict", str(exc))
    if isinstance(exc, StorageUnavailableError | StorageError):
        log.error("storage failure: %s", exc)
        return Rejected(503, "storage", "database unavailable; retry later", headers={"Retry-After": "1"})
    return Rejected(400, "error", str(exc))
