"""Silences as Alertmanager has them: label matchers and a time window; CRUD for the API and the CLI."""

from __future__ import annotations

import re
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from sqlalchemy import select
from sqlalchemy.orm import Session

from collector.schema import AlertSilence


class SilenceMatcher(BaseModel):
    """Alertmanager API v2's matcher fields (name, value, isRegex, isEqual)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(min_length=1)
    value: str
    isRegex: bool = False
    isEqual: bool = True

    @model_validator(mode="after")
    def _regex_compiles(self) -> SilenceMatcher:
        if self.isRegex:
            try:
                re.compile(self.value)
            except re.error as exc:
                raise ValueError(f"matcher {self.name}: bad regular expression: {exc}") from exc
        return self

    def matches(self, labels: dict[str, str]) -> bool:
        actual = labels.get(self.name, "")
        hit = re.fullmatch(self.value, actual) is not None if self.isRegex else actual == self.value
        return hit if self.isEqual else not hit


class SilenceIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    matchers: list[SilenceMatcher] = Field(min_length=1)
    startsAt: float
    endsAt: float
    createdBy: str = Field(min_length=1, max_length=200)
    comment: str = ""

    @model_validator(mode="after")
    def _window(self) -> SilenceIn:
        if self.endsAt <= self.startsAt:
            raise ValueError("endsAt must be after startsAt")
        return self


_MATCHER = re.compile(r'^\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"?(.*?)"?\s*$')


def parse_matcher(text: str) -> SilenceMatcher:
    """`alertname=MemoryPressure`, `instance=~"gpu.*"`, `severity!=info` (amtool's syntax)."""
    match = _MATCHER.match(text)
    if not match:
        raise ValueError(f"bad matcher {text!r} (use name=value, name!=value, name=~regex, name!~regex)")
    name, op, value = match.groups()
    return SilenceMatcher(name=name, value=value, isRegex="~" in op, isEqual=not op.startswith("!"))


def create_silence(session: Session, silence: SilenceIn, *, now: float) -> str:
    silence_id = str(uuid.uuid4())
    session.add(
        AlertSilence(
            id=silence_id,
            matchers=[m.model_dump() for m in silence.matchers],
            starts_at=silence.startsAt,
            ends_at=silence.endsAt,
            created_by=silence.createdBy,
            comment=silence.comment,
            created_at=now,
            updated_at=now,
        )
    )
    return silence_id


def expire_silence(session: Session, silence_id: str, *, now: float) -> bool:
    row = session.get(AlertSilence, silence_id)
    if row is None:
        return False
    if row.ends_at > now:
        row.ends_at = max(now, row.starts_at)
        row.updated_at = now
    return True


def update_silence(session: Session, silence_id: str, silence: SilenceIn, *, now: float) -> bool:
    """Replace an existing silence's matchers, window and comment (Alertmanager: POST with an `id`)."""
    row = session.get(AlertSilence, silence_id)
    if row is None:
        return False
    row.matchers = [m.model_dump() for m in silence.matchers]
    row.starts_at, row.ends_at = silence.startsAt, silence.endsAt
    row.created_by, row.comment, row.updated_at = silence.createdBy, silence.comment, now
    return True


def silence_state(row: AlertSilence, now: float) -> str:
    return "expired" if row.ends_at <= now else ("pending" if row.starts_at > now else "active")


def silence_dict(row: AlertSilence, now: float) -> dict[str, Any]:
    return {
        "id": row.id,
        "matchers": row.matchers,
        "startsAt": row.starts_at,
        "endsAt": row.ends_at,
        "createdBy": row.created_by,
        "comment": row.comment,
        "updatedAt": row.updated_at,
        "status": {"state": silence_state(row, now)},
    }


def get_silence(session: Session, silence_id: str, *, now: float) -> dict[str, Any] | None:
    row = session.get(AlertSilence, silence_id)
    return None if row is None else silence_dict(row, now)


def list_silences(
    session: Session, *, now: float, include_expired: bool = False, expired_since: float | None = None
) -> list[dict[str, Any]]:
    """Silences by creation; expired ones only with `include_expired` (and ended after `expired_since`)."""
    stmt = select(AlertSilence).order_by(AlertSilence.created_at, AlertSilence.id)
    if include_expired and expired_since is not None:
        stmt = stmt.where(AlertSilence.ends_at > expired_since)
    out = []
    for row in session.execute(stmt).scalars():
        if silence_state(row, now) == "expired" and not include_expired:
            continue
        out.append(silence_dict(row, now))
    return out


def active_silences_by_id(session: Session, now: float) -> dict[str, list[SilenceMatcher]]:
    rows = session.execute(
        select(AlertSilence).where(AlertSilence.starts_at <= now, AlertSilence.ends_at > now).order_by(AlertSilence.id)
    ).scalars()
    return {row.id: [SilenceMatcher.model_validate(m) for m in row.matchers] for row in rows}


def active_silences(session: Session, now: float) -> list[list[SilenceMatcher]]:
    return list(active_silences_by_id(session, now).values())


def silenced_by(labels: dict[str, str], silences: dict[str, list[SilenceMatcher]]) -> list[str]:
    """Ids of the silences muting an alert with `labels` (Alertmanager's status.silencedBy)."""
    return [sid for sid, matchers in silences.items() if all(m.matches(labels) for m in matchers)]


def is_silenced(labels: dict[str, str], silences: list[list[SilenceMatcher]]) -> bool:
    return any(all(m.matches(labels) for m in matchers) for matchers in silences)
