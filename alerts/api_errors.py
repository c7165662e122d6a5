"""The alerts API's error answers: what a client sees when its input or the database fails.

Two leaks are closed here, at the app's one boundary. FastAPI's 422 echoes each refused `input`: a NaN or
an infinity cannot be written as JSON, so a refused `endsAt: NaN` became a 500 with a traceback, and any
refused value went back as sent. And a database error's text (SQLAlchemy's message carries the SQL
statement and its parameters) went back in a 503. Now a 422 names the field and says why, never the
value; a database error is translated by `collector.db.translate_errors` (the project's one translation)
and answered 503 with Retry-After when the database is unavailable, 500 otherwise, with the details in
the log line only.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import SQLAlchemyError

from collector.db import translate_errors
from collector.errors import StorageError, StorageUnavailableError

log = logging.getLogger("kvpilot.alerts.api")

RETRY_AFTER_S = 5


async def invalid_request(_request: Request, exc: RequestValidationError) -> JSONResponse:
    """FastAPI's 422 shape (`detail`: a list of loc/msg/type), without the refused input."""
    errors = [
        {"loc": list(err.get("loc", ())), "msg": err.get("msg", ""), "type": err.get("type", "")}
        for err in exc.errors()[:20]
    ]
    return JSONResponse({"detail": errors}, status_code=422)


def _translated(exc: Exception) -> StorageError:
    if isinstance(exc, StorageError):
        return exc
    try:
        with translate_errors():
            raise exc
    except StorageError as translated:
        return translated
    return StorageError(type(exc).__name__)  # pragma: no cover - translate_errors maps every SQLAlchemyError


async def storage_error(request: Request, exc: Exception) -> JSONResponse:
    translated = _translated(exc)
    log.error("alerts API %s %s: %s", request.method, request.url.path, translated)
    if isinstance(translated, StorageUnavailableError):
        return JSONResponse(
            {"detail": "database unavailable; retry later"},
            status_code=503,
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    return JSONResponse({"detail": "database error (logged by the server)"}, status_code=500)


def install(app: FastAPI) -> None:
    """Answer refused input and database errors as above."""
    app.add_exception_handler(RequestValidationError, invalid_request)  # type: ignore[arg-type]  # Starlette's handler type takes any Exception
    app.add_exception_handler(StorageError, storage_error)
    app.add_exception_handler(SQLAlchemyError, storage_error)
