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
Optional bearer token (`token`): every route but /-/healthy and /-/ready needs `Authorization: Bearer`
(alerts.api_server refuses to serve beyond loopback without one). Bounded input (alerts.settings): a body
over `max_body_bytes` is 413 before parsing; matchers, comment and author have maximum sizes, a silence a
maximum duration and at least one matcher that does not match the empty string (422 naming the field);
past `max_silences` unexpired silences a new one is 429. Regexes are RE2 (alerts.regex). A refused body
value is never echoed, nor a database error's SQL (alerts.api_errors). /docs, /redoc and
/openapi.json are served only without a token unless `public_docs` says otherwise (the collector's rule).
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
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from alerts import api_errors
from alerts.alertmanager import rfc3339
from alerts.config import NotifierConfig, resolve_routes, routes_for
from alerts.matchers import MAX_NAME_CHARS, MAX_VALUE_CHARS, Matcher, has_control_chars
from alerts.metrics import AlertMetrics
from alerts.settings import AlertsSettings
from alerts.silences import (
    MAX_MATCHERS,
    Author,
    Comment,
    SilenceIn,
    SilenceRejected,
    TooManySilences,
    active_silences_by_id,
    check_matchers,
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
from plumbing.body_limit import BodyLimitMiddleware

SILENCE_RETENTION_S = 120 * 3600.0  # Alertmanager's --data.retention default
MAX_ID_CHARS = 64  # ids are UUIDs (36)
MAX_FILTER_CHARS = MAX_NAME_CHARS + MAX_VALUE_CHARS + 8


def _epoch(value: dt.datetime) -> float:
    return (value if value.tzinfo else value.replace(tzinfo=dt.UTC)).timestamp()


class PostableSilence(BaseModel):
    """Alertmanager's postableSilence; times are RFC 3339 (or epoch seconds), naive ones taken as UTC."""

    model_config = ConfigDict(extra="ignore")

    id: Annotated[str, Field(max_length=MAX_ID_CHARS, pattern=r"^[!-~]*$")] | None = None
    matchers: Annotated[list[Matcher], Field(min_length=1, max_length=MAX_MATCHERS)]
    startsAt: dt.datetime
    endsAt: dt.datetime
    createdBy: Author
    comment: Comment = ""

    select_some = field_validator("matchers")(check_matchers)

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
        settings: AlertsSettings | None = None,
    ) -> None:
        self.settings = settings or AlertsSettings()
        self.factory = factory
        self.metrics = metrics
        self.clock = clock
        self.token = token or None  # an empty token would accept "Bearer "
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


def _known_id(silence_id: str) -> bool:
    """Whether `silence_id` could name a stored silence (a UUID): anything else is 404 before any SQL."""
    return len(silence_id) <= MAX_ID_CHARS and not has_control_chars(silence_id)


def _unprocessable(loc: list[str], message: str) -> HTTPException:
    return HTTPException(422, [{"loc": loc, "msg": message, "type": "value_error"}])


def _filters(state: StateDep, filter: Annotated[list[str] | None, Query()] = None) -> list[Matcher]:
    """Alertmanager's `filter` parameters: label matchers such as alertname="X" or instance=~"gpu.*"."""
    texts = filter or []
    if len(texts) > state.settings.max_filters:
        raise _unprocessable(["query", "filter"], f"at most {state.settings.max_filters} filters")
    if any(len(text) > MAX_FILTER_CHARS for text in texts):
        raise _unprocessable(["query", "filter"], f"a filter has at most {MAX_FILTER_CHARS} characters")
    try:
        return [parse_matcher(text) for text in texts]
    except ValidationError as exc:  # the reason, not pydantic's text with the input in it
        raise _unprocessable(["query", "filter"], exc.errors(include_url=False)[0]["msg"]) from None
    except ValueError as exc:
        raise _unprocessable(["query", "filter"], str(exc)) from None


SessionDep = Annotated[Session, Depends(_session)]
NowDep = Annotated[float, Depends(_now)]
FiltersDep = Annotated[list[Matcher], Depends(_filters)]
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


def _matches_filters(matchers: list[dict[str, Any]], filters: list[Matcher]) -> bool:
    """A silence passes a filter when it has an equal matcher (Alertmanager's silence filtering)."""
    wanted = [f.model_dump() for f in filters]
    stored = [{"isRegex": False, "isEqual": True, **m} for m in matchers]
    return all(f in stored for f in wanted)


@api.get("/silences")
def get_silences(session: SessionDep, now: NowDep, filters: FiltersDep) -> list[dict[str, Any]]:
    rows = list_silences(session, now=now, include_expired=True, expired_since=now - SILENCE_RETENTION_S)
    rows = [s for s in rows if _matches_filters(s["matchers"], filters)]
    return [_gettable_silence(s) for s in sorted(rows, key=_silence_order)]


@api.post("/silences")
def post_silence(body: PostableSilence, session: SessionDep, now: NowDep, state: StateDep) -> SilenceCreated:
    bounds: dict[str, Any] = {
        "max_duration_s": state.settings.max_silence_duration_s,
        "max_silences": state.settings.max_silences,
    }
    try:
        if body.id:
            if not update_silence(session, body.id, body.to_silence(), now=now, **bounds):
                raise HTTPException(404, f"silence {body.id} not found")
            silence_id = body.id
        else:
            silence_id = create_silence(session, body.to_silence(), now=now, **bounds)
    except TooManySilences as exc:
        raise HTTPException(429, str(exc), headers={"Retry-After": str(round(exc.retry_after_s))}) from None
    except SilenceRejected as exc:
        raise _unprocessable(["body", exc.field], str(exc)) from None
    session.commit()
    return SilenceCreated(silenceID=silence_id)


@api.get("/silence/{silence_id}")
def get_one_silence(silence_id: str, session: SessionDep, now: NowDep) -> dict[str, Any]:
    silence = get_silence(session, silence_id, now=now) if _known_id(silence_id) else None
    if silence is None:
        raise HTTPException(404, f"silence {silence_id} not found")
    return _gettable_silence(silence)


@api.delete("/silence/{silence_id}")
def delete_silence(silence_id: str, session: SessionDep, now: NowDep) -> Response:
    if not _known_id(silence_id) or not expire_silence(session, silence_id, now=now):
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
    settings: AlertsSettings | None = None,
) -> FastAPI:
    """The API over the database at `db_url` (or an existing `engine`, which the caller keeps and disposes).

    `metrics`: the evaluator's, served at /metrics. `notifier`: to list each alert's receivers.
    `settings`: the limits (default: AlertsSettings() from the environment).
    """
    settings = settings or AlertsSettings()
    token = token if token is not None else settings.api_token
    if (db_url is None) == (engine is None):
        raise ValueError("pass exactly one of db_url or engine")
    owned = make_engine(db_url) if db_url is not None else None
    bound = engine if engine is not None else owned
    assert bound is not None

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        if owned is not None:
            owned.dispose()

    docs = settings.public_docs if settings.public_docs is not None else not token
    app = FastAPI(
        title="kvpilot alerts (Alertmanager API v2 subset)",
        lifespan=lifespan,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
    )
    app.state.alerts = ApiState(
        session_factory(bound),
        metrics=metrics or AlertMetrics(),
        clock=clock,
        token=token,
        notifier=notifier,
        resend_s=notifier.alertmanager_resend_s if notifier is not None else 60.0,
        settings=settings,
    )
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.include_router(api)
    api_errors.install(app)

    @app.get("/-/healthy", response_class=PlainTextResponse)
    @app.get("/-/ready", response_class=PlainTextResponse)
    def healthy() -> str:
        return "OK"

    @app.get("/metrics", dependencies=[Depends(_authorized)])
    def metrics_page(state: StateDep) -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
