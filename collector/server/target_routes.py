"""/v1/targets: the Prometheus endpoints the scraper polls.

Listing (GET) takes any identity; creating and deleting take the admin role (`deps.require_admin`).
A URL may carry credentials for the scrape (userinfo, `?token=`): stored whole for the scraper, and
shown redacted in every answer (`collector.redact`).
A target's URL must not reach loopback, link-local, metadata, unspecified or multicast addresses unless
KVPILOT_SCRAPE_ALLOW_NETS allows them (`collector.netpolicy`; checked here and again before each scrape),
and its instance must not belong to someone else (`collector.claims`): 422 and 409, naming the field.
"""

from __future__ import annotations

import time
from typing import Annotated, Any
from urllib.parse import urlsplit

from fastapi import APIRouter, Depends, HTTPException, Path, Response
from pydantic import BaseModel, ConfigDict, Field, HttpUrl, UrlConstraints, field_validator
from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from collector.claims import claim_for_target, release_target
from collector.db import rowcount, translate_errors
from collector.identities import Identity
from collector.netpolicy import AddressRefusedError, ResolutionError
from collector.queries import parse_labels
from collector.redact import redact_url
from collector.schema import ScrapeTarget
from collector.scraper import (
    DEFAULT_SAMPLE_LIMIT,
    MAX_LABELS,
    MAX_SAMPLE_LIMIT,
    TargetLabelsError,
    validate_target_labels,
)
from collector.server.deps import (
    OPEN_PUSHER,
    AdminIdentity,
    CollectorState,
    SessionDep,
    StateDep,
    require_admin,
    require_reader,
)
from collector.server.errors import ERROR_RESPONSES, ErrorResponse, Rejected

router = APIRouter(prefix="/v1", dependencies=[Depends(require_reader)])
admin_router = APIRouter(prefix="/v1", dependencies=[Depends(require_admin)])

TargetId = Annotated[int, Path(ge=1, le=2**63 - 1)]
Url = Annotated[HttpUrl, UrlConstraints(max_length=2000)]
Label = Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[^\x00]+$")]
NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"model": ErrorResponse}}


class TargetIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: Url
    job: Label = "kvpilot"
    instance: Label | None = Field(None, description="the instance label of the points; default host:port")
    interval_s: float | None = Field(None, ge=1.0, le=86400.0)
    enabled: bool = True
    labels: dict[str, str] = Field(
        default_factory=dict,
        max_length=MAX_LABELS,
        description="static labels added to every point (Prometheus target labels), e.g. {'node': 'gpu-host-1'}",
    )
    sample_limit: int = Field(DEFAULT_SAMPLE_LIMIT, ge=1, le=MAX_SAMPLE_LIMIT, description="series kept per scrape")

    @field_validator("labels")
    @classmethod
    def _labels(cls, labels: dict[str, str]) -> dict[str, str]:
        try:
            validate_target_labels(labels)
        except TargetLabelsError as exc:
            raise ValueError(str(exc)) from exc
        return labels


class TargetOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    url: str
    job: str
    instance: str
    interval_s: float
    enabled: bool
    labels: dict[str, str]
    sample_limit: int
    up: bool | None
    last_error: str | None
    last_scrape_at: float | None
    scrape_duration_s: float | None
    created_at: float

    @field_validator("url")
    @classmethod
    def _redacted(cls, url: str) -> str:
        return redact_url(url)

    @field_validator("labels", mode="before")
    @classmethod
    def _stored_labels(cls, labels: object) -> object:
        return dict(parse_labels(labels)) if isinstance(labels, str) else labels


@admin_router.post("/targets", status_code=201, response_model=TargetOut, responses=ERROR_RESPONSES)
def create_target(body: TargetIn, state: StateDep, session: SessionDep, actor: AdminIdentity) -> ScrapeTarget:
    url = str(body.url)
    parts = urlsplit(url)
    try:
        state.policy.check_url(url, timeout_s=state.settings.scrape_timeout_s)
    except (AddressRefusedError, ResolutionError) as exc:
        kind = "address_refused" if isinstance(exc, AddressRefusedError) else "unresolved"
        raise Rejected(422, kind, f"url: {exc}", errors=[{"loc": "url", "msg": str(exc), "type": kind}]) from exc
    target = ScrapeTarget(
        url=url,
        job=body.job,
        instance=body.instance or (parts.netloc or url)[:200],
        interval_s=body.interval_s or state.settings.scrape_default_interval_s,
        enabled=body.enabled,
        labels=validate_target_labels(body.labels),
        sample_limit=body.sample_limit,
        created_at=time.time(),
    )
    session.add(target)
    try:
        session.flush()
    except IntegrityError as exc:
        message = f"a target with url {redact_url(url)} already exists"
        errors = [{"loc": "url", "msg": message, "type": "conflict"}]
        raise Rejected(409, "conflict", f"url: {message}", errors=errors) from exc
    claim_for_target(
        session.connection(),
        instance=target.instance,
        target_id=target.id,
        pushers=_pairable(state, actor),
        now=target.created_at,
    )
    _commit(session)
    return target


def _pairable(state: CollectorState, actor: Identity) -> set[str]:
    """Whose pushed instances a new target may pair with: an admin, any identity that may push; the pusher
    acting as admin in dev mode, only its own."""
    if "admin" not in actor.roles:
        return {actor.name}
    names = {name for name, ident in state.identities.identities().items() if "ingest" in ident.roles}
    if state.identities.pushes_open:
        names.add(OPEN_PUSHER.name)
    return names


@router.get("/targets", response_model=list[TargetOut], responses=ERROR_RESPONSES)
def list_targets(session: SessionDep) -> list[ScrapeTarget]:
    return list(session.scalars(select(ScrapeTarget).order_by(ScrapeTarget.id)))


@router.get("/targets/{target_id}", response_model=TargetOut, responses={**NOT_FOUND, **ERROR_RESPONSES})
def get_target(target_id: TargetId, session: SessionDep) -> ScrapeTarget:
    target = session.get(ScrapeTarget, target_id)
    if target is None:
        raise HTTPException(404, f"no target {target_id}")
    return target


@admin_router.delete("/targets/{target_id}", status_code=204, responses={**NOT_FOUND, **ERROR_RESPONSES})
def delete_target(target_id: TargetId, session: SessionDep) -> Response:
    """Delete a target; its instance is free to claim again (its stored points stay)."""
    deleted = rowcount(session.execute(delete(ScrapeTarget).where(ScrapeTarget.id == target_id)))
    if not deleted:
        raise HTTPException(404, f"no target {target_id}")
    release_target(session.connection(), target_id)
    _commit(session)
    return Response(status_code=204)


def _commit(session: Session) -> None:
    """Commit before answering: the session dependency's own commit runs after the response is sent, so a
    client listing targets right after a 201/204 could otherwise still see the old state."""
    with translate_errors():
        session.commit()
