"""An Alertmanager API v2 subset over the alerts' tables: silences (list, get, create/update, expire), alerts.

What amtool, Grafana's Alertmanager data source and scripts written for Alertmanager call, with
Alertmanager's field names and RFC 3339 times:

    GET    /api/v2/silences[?filter=alertname="X"]   gettableSilences (expired ones of the last 5 days too)
    POST   /api/v2/silences                          postableSilence -> {"silenceID": ...} (an `id` updates)
    GET    /api/v2/silence/{id}   DELETE /api/v2/silence/{id}   (404 if unknown)
    GET    /api/v2/alerts[?filter=...&active=&silenced=&pending=]   firing (and pending) alerts from alert_states
    GET    /-/healthy  /-/ready  /metrics

Differences from Alertmanager: bad input is 422 naming the field (FastAPI's shape) where Alertmanager
answers 400 with text; pending alerts (not yet firing, which Prometheus never sends to Alertmanager) are
listed too unless `pending=false`, each alert says which in `alertState` ("pending" | "firing").
Optional bearer token (`token`): every route but /-/healthy and /-/ready needs `Authorization: Bearer`.
Handlers are thin; data functions live in alerts.silences and alerts.store.
"""

from __future__ import annotations

import datetime as dt
import hmac
import time
from collections.abc import Callable, Iterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Header, HTTPException, Query, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from alerts.alertmanager import rfc3339
from alerts.config import NotifierConfig, resolve_routes, routes_for
from alerts.metrics import AlertMetrics
from alerts.silences import (
    SilenceIn,
    SilenceMatcher,
    active_silences_by_id,
    create_silence,
    expire_silence,
    get_silence,
    list_silences,
    parse_matcher,
    silenced_by,
    update_silence,
)
from alerts.store import current_alerts
from collector.db import make_engine, session_factory
from collector.errors import StorageError

SILENCE_RETENTION_S = 120 * 3600.0  # Alertmanager's --data.retention default


def _epoch(value: dt.datetime) -> float:
    return (value if value.tzinfo else value.replace(tzinfo=dt.UTC)).timestamp()


class PostableSilence(BaseModel):
    """Alertmanager's postableSilence; times are RFC 3339 (or epoch seconds), naive ones taken as UTC."""

    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    matchers: Annotated[list[SilenceMatcher], Field(min_length=1)]
    startsAt: dt.datetime
    endsAt: dt.datetime
    createdBy: Annotated[str, Field(min_length=1, max_length=200)]
    comment: str = ""

    @field_validator("endsAt")
    @classmethod
    def _after_start(cls, value: dt.datetime, info: ValidationInfo) -> dt.datetime:
        starts = info.data.get("startsAt")
        if starts is not None and _epoch(value) <= _epoch(starts):
            raise ValueError("endsAt must be after startsAt")
        return value

    def to_silence(self) -> SilenceIn:
        return SilenceIn(
            matchers=self.matchers,
            startsAt=_epoch(self.startsAt),
            endsAt=_epoch(self.endsAt),
            createdBy=self.createdBy,
            comment=self.comment,
        )


class SilenceCreated(BaseModel):
    silenceID: str


class ApiState:
    """What the handlers need, set on `app.state.alerts` (tests build their own)."""

    def __init__(
        self,
        factory: sessionmaker[Session],
        *,
        metrics: AlertMetrics,
        clock: Callable[[], float],
        token: str | None,
        notifier: NotifierConfig | None,
        resend_s: float,
    ) -> None:
        self.factory = factory
        self.metrics = metrics
        self.clock = clock
        self.token = token
        self.routes = resolve_routes(notifier) if notifier is not None else None
        self.resend_s = resend_s


def _state(request: Request) -> ApiState:
    return request.app.state.alerts


StateDep = Annotated[ApiState, Depends(_state)]


def _session(state: StateDep) -> Iterator[Session]:
    with state.factory() as session:
        yield session


def _now(state: StateDep) -> float:
    return state.clock()


def _authorized(state: StateDep, authorization: Annotated[str | None, Header()] = None) -> None:
    if state.token is None:
        return
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), state.token.encode()):
        raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})


def _filters(filter: Annotated[list[str] | None, Query()] = None) -> list[SilenceMatcher]:
    """Alertmanager's `filter` parameters: label matchers such as alertname="X" or instance=~"gpu.*"."""
    try:
        return [parse_matcher(text) for text in filter or []]
    except ValueError as exc:
        raise HTTPException(422, [{"loc": ["query", "filter"], "msg": str(exc), "type": "value_error"}]) from None


SessionDep = Annotated[Session, Depends(_session)]
NowDep = Annotated[float, Depends(_now)]
FiltersDep = Annotated[list[SilenceMatcher], Depends(_filters)]
api = APIRouter(prefix="/api/v2", dependencies=[Depends(_authorized)])


def _gettable_silence(silence: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": silence["id"],
        "status": silence["status"],
        "updatedAt": rfc3339(silence["updatedAt"]),
        "matchers": silence["matchers"],
        "startsAt": rfc3339(silence["startsAt"]),
        "endsAt": rfc3339(silence["endsAt"]),
        "createdBy": silence["createdBy"],
        "comment": silence["comment"],
    }


def _silence_order(silence: dict[str, Any]) -> tuple:
    """Alertmanager's order: active by end, then pending by start, then expired, most recently ended first."""
    state = silence["status"]["state"]
    if state == "active":
        return (0, silence["endsAt"])
    if state == "pending":
        return (1, silence["startsAt"])
    return (2, -silence["endsAt"])


def _matches_filters(matchers: list[SilenceMatcher], filters: list[SilenceMatcher]) -> bool:
    """A silence passes a filter when it has an equal matcher (Alertmanager's silence filtering)."""
    return all(
        any(
            m.name == f.name and m.value == f.value and m.isRegex == f.isRegex and m.isEqual == f.isEqual
            for m in matchers
        )
        for f in filters
    )


@api.get("/silences")
def get_silences(session: SessionDep, now: NowDep, filters: FiltersDep) -> list[dict[str, Any]]:
    rows = list_silences(session, now=now, include_expired=True, expired_since=now - SILENCE_RETENTION_S)
    rows = [s for s in rows if _matches_filters([SilenceMatcher.model_validate(m) for m in s["matchers"]], filters)]
    return [_gettable_silence(s) for s in sorted(rows, key=_silence_order)]


@api.post("/silences")
def post_silence(body: PostableSilence, session: SessionDep, now: NowDep) -> SilenceCreated:
    if body.id:
        if not update_silence(session, body.id, body.to_silence(), now=now):
            raise HTTPException(404, f"silence {body.id} not found")
        silence_id = body.id
    else:
        silence_id = create_silence(session, body.to_silence(), now=now)
    session.commit()
    return SilenceCreated(silenceID=silence_id)


@api.get("/silence/{silence_id}")
def get_one_silence(silence_id: str, session: SessionDep, now: NowDep) -> dict[str, Any]:
    silence = get_silence(session, silence_id, now=now)
    if silence is None:
        raise HTTPException(404, f"silence {silence_id} not found")
    return _gettable_silence(silence)


@api.delete("/silence/{silence_id}")
def delete_silence(silence_id: str, session: SessionDep, now: NowDep) -> Response:
    if not expire_silence(session, silence_id, now=now):
        raise HTTPException(404, f"silence {silence_id} not found")
    session.commit()
    return Response(status_code=200)


@api.get("/alerts")
def get_alerts(
    session: SessionDep,
    now: NowDep,
    filters: FiltersDep,
    state: StateDep,
    active: bool = True,
    silenced: bool = True,
    pending: bool = True,
) -> list[dict[str, Any]]:
    silences = active_silences_by_id(session, now)
    out = []
    for alert in current_alerts(session, include_pending=pending):
        if not all(f.matches(alert.labels) for f in filters):
            continue
        muted = silenced_by(alert.labels, silences)
        if (muted and not silenced) or (not muted and not active):
            continue
        receivers = (
            [] if state.routes is None else [{"name": r.receiver} for r in routes_for(alert.labels, *state.routes)]
        )
        out.append(
            {
                "labels": alert.labels,
                "annotations": alert.annotations,
                "startsAt": rfc3339(alert.fired_at or alert.active_at),
                "endsAt": rfc3339(alert.last_eval_at + 4 * state.resend_s),
                "updatedAt": rfc3339(alert.last_eval_at),
                "generatorURL": alert.generator_url,
                "fingerprint": alert.fingerprint,
                "receivers": receivers,
                "status": {"state": "suppressed" if muted else "active", "silencedBy": muted, "inhibitedBy": []},
                "alertState": alert.state,
            }
        )
    return out


def create_api_app(
    db_url: str | None = None,
    *,
    engine: Engine | None = None,
    metrics: AlertMetrics | None = None,
    token: str | None = None,
    notifier: NotifierConfig | None = None,
    clock: Callable[[], float] = time.time,
) -> FastAPI:
    """The API over the database at `db_url` (or an existing `engine`, which the caller keeps and disposes).

    `metrics`: the evaluator's, served at /metrics. `notifier`: to list each alert's receivers.
    """
    if (db_url is None) == (engine is None):
        raise ValueError("pass exactly one of db_url or engine")
    owned = make_engine(db_url) if engine is None else None
    bound = engine if engine is not None else owned
    assert bound is not None

    @asynccontextmanager
    async def lifespan(_app: FastAPI):  # type: ignore[no-untyped-def]
        yield
        if owned is not None:
            owned.dispose()

    app = FastAPI(title="kvpilot alerts (Alertmanager API v2 subset)", lifespan=lifespan)
    app.state.alerts = ApiState(
        session_factory(bound),
        metrics=metrics or AlertMetrics(),
        clock=clock,
        token=token,
        notifier=notifier,
        resend_s=notifier.alertmanager_resend_s if notifier is not None else 60.0,
    )
    app.include_router(api)

    async def _storage_error(_request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"detail": f"database error: {exc}"}, status_code=503)

    app.add_exception_handler(StorageError, _storage_error)
    app.add_exception_handler(SQLAlchemyError, _storage_error)

    @app.get("/-/healthy", response_class=PlainTextResponse)
    @app.get("/-/ready", response_class=PlainTextResponse)
    def healthy() -> str:
        return "OK"

    @app.get("/metrics", dependencies=[Depends(_authorized)])
    def metrics_page(state: StateDep) -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
