"""Silences as Alertmanager has them: label matchers and a time window; CRUD for the API, the CLI, the dashboard.

Bounded as Alertmanager's validation is and then some: matchers (alerts.matchers) are RE2, at least one must
not match the empty string (a silence of `alertname=~".*"` would mute everything), names are label names,
and names, values, comment, author and the matcher count have maximum sizes; strings hold no control
characters (NUL cannot even be stored on PostgreSQL; values and comments may hold tabs and newlines).
`create_silence` and `update_silence` also bound how far ahead a silence starts and how long it lasts
from now (`max_duration_s`, 30 days unless the caller's settings say otherwise) and how many unexpired
(active or pending) silences there are (`max_silences`), so the evaluator's silence matching per tick
stays bounded. Expiring a pending silence ends it before it starts, as in Alertmanager.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Iterable
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from alerts.matchers import Matcher, has_control_chars, text_without_controls
from collector.schema import AlertSilence

log = logging.getLogger(__name__)

MAX_MATCHERS = 32
MAX_CREATED_BY_CHARS = 200
MAX_COMMENT_CHARS = 4096
DEFAULT_MAX_DURATION_S = 30 * 86400.0
DEFAULT_MAX_SILENCES = 1000
EVERYTHING = "at least one matcher must not match the empty string (this silence would mute every alert)"


def _one_line(text: str) -> str:
    if has_control_chars(text):
        raise ValueError("control characters (such as NUL or a newline) are not allowed")
    return text


Author = Annotated[str, Field(min_length=1, max_length=MAX_CREATED_BY_CHARS), AfterValidator(_one_line)]
Comment = Annotated[str, Field(max_length=MAX_COMMENT_CHARS), AfterValidator(text_without_controls)]


class SilenceRejected(ValueError):
    """A silence refused by a bound; `field` names the input at fault (the API answers 422 naming it)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class TooManySilences(SilenceRejected):
    """`max_silences` unexpired silences exist already; `retry_after_s`: until the first of them ends."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__("matchers", message)
        self.retry_after_s = retry_after_s


def check_matchers(matchers: list[Matcher]) -> list[Matcher]:
    """Alertmanager's rule: a silence whose every matcher matches the empty string matches every alert."""
    if matchers and all(m.matches({}) for m in matchers):
        raise ValueError(EVERYTHING)
    return matchers


class SilenceIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    matchers: Annotated[list[Matcher], Field(min_length=1, max_length=MAX_MATCHERS)]
    startsAt: Annotated[float, Field(allow_inf_nan=False)]
    endsAt: Annotated[float, Field(allow_inf_nan=False)]
    createdBy: Author
    comment: Comment = ""

    select_some = field_validator("matchers")(check_matchers)

    @model_validator(mode="after")
    def _window(self) -> SilenceIn:
        if self.endsAt <= self.startsAt:
            raise ValueError("endsAt must be after startsAt")
        return self


_MATCHER = re.compile(r'^\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"?(.*?)"?\s*$')


def parse_matcher(text: str) -> Matcher:
    """`alertname=MemoryPressure`, `instance=~"gpu.*"`, `severity!=info` (amtool's syntax)."""
    match = _MATCHER.match(text)
    if not match:
        raise ValueError(f"bad matcher {text!r} (use name=value, name!=value, name=~regex, name!~regex)")
    name, op, value = match.groups()
    return Matcher(name=name, value=value, is_regex="~" in op, is_equal=not op.startswith("!"))


def _human(seconds: float) -> str:
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= size and seconds % size == 0:
            count = seconds / size
            return f"{count:g} {unit}" + ("s" if count != 1 else "")
    return f"{seconds:g} s"


def check_bounds(
    session: Session,
    silence: SilenceIn,
    *,
    now: float,
    max_duration_s: float,
    max_silences: int | None,
    replacing: str | None = None,
) -> None:
    """Raise SilenceRejected if `silence` starts too far ahead or lasts too long from now (a silence
    starting in 9999 would hold a place under `max_silences` forever), TooManySilences past that."""
    if silence.startsAt - now > max_duration_s:
        raise SilenceRejected("startsAt", f"a silence may start at most {_human(max_duration_s)} from now")
    if silence.endsAt - max(silence.startsAt, now) > max_duration_s:
        raise SilenceRejected(
            "endsAt", f"a silence may last at most {_human(max_duration_s)} from now; expire it and make a new one"
        )
    if max_silences is None:
        return
    unexpired = select(func.count(), func.min(AlertSilence.ends_at)).where(AlertSilence.ends_at > now)
    if replacing is not None:
        unexpired = unexpired.where(AlertSilence.id != replacing)
    count, first_end = session.execute(unexpired).one()
    if count >= max_silences:
        raise TooManySilences(
            f"{count} unexpired silences (the limit is {max_silences}); expire some first",
            retry_after_s=max(1.0, (first_end or now) - now),
        )


def create_silence(
    session: Session,
    silence: SilenceIn,
    *,
    now: float,
    max_duration_s: float = DEFAULT_MAX_DURATION_S,
    max_silences: int | None = DEFAULT_MAX_SILENCES,
) -> str:
    check_bounds(session, silence, now=now, max_duration_s=max_duration_s, max_silences=max_silences)
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
    """End a silence now; a pending one ends before it starts (Alertmanager sets both times to now),
    so it stops counting under `max_silences` at once. False if there is no such silence."""
    row = session.get(AlertSilence, silence_id)
    if row is None:
        return False
    if row.ends_at > now:
        row.starts_at = min(row.starts_at, now)
        row.ends_at = now
        row.updated_at = now
    return True


def update_silence(
    session: Session,
    silence_id: str,
    silence: SilenceIn,
    *,
    now: float,
    max_duration_s: float = DEFAULT_MAX_DURATION_S,
    max_silences: int | None = DEFAULT_MAX_SILENCES,
) -> bool:
    """Replace an existing silence's matchers, window and comment (Alertmanager: POST with an `id`)."""
    row = session.get(AlertSilence, silence_id)
    if row is None:
        return False
    check_bounds(
        session, silence, now=now, max_duration_s=max_duration_s, max_silences=max_silences, replacing=silence_id
    )
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


def _stored_matchers(row: AlertSilence) -> list[Matcher] | None:
    """A stored silence's matchers; None (the silence is ignored, and said so) if today's rules refuse them,
    e.g. a pattern stored before matchers were RE2."""
    try:
        return [Matcher.model_validate(m) for m in row.matchers]
    except ValidationError as exc:
        log.warning("silence %s ignored: its matchers are no longer valid: %s", row.id, exc.errors()[0]["msg"])
        return None


def active_silences_by_id(session: Session, now: float) -> dict[str, list[Matcher]]:
    rows = session.execute(
        select(AlertSilence).where(AlertSilence.starts_at <= now, AlertSilence.ends_at > now).order_by(AlertSilence.id)
    ).scalars()
    return {row.id: matchers for row in rows if (matchers := _stored_matchers(row)) is not None}


def active_silences(session: Session, now: float) -> list[list[Matcher]]:
    return list(active_silences_by_id(session, now).values())


def silenced_by(labels: dict[str, str], silences: dict[str, list[Matcher]]) -> list[str]:
    """Ids of the silences muting an alert with `labels` (Alertmanager's status.silencedBy)."""
    return [sid for sid, matchers in silences.items() if all(m.matches(labels) for m in matchers)]


def is_silenced(labels: dict[str, str], silences: list[list[Matcher]]) -> bool:
    return any(all(m.matches(labels) for m in matchers) for matchers in silences)


def silenced_fingerprints(session: Session, alerts: Iterable[tuple[str, dict[str, str]]], now: float) -> frozenset[str]:
    """Which of (fingerprint, labels) the active silences mute: run in a read-only session before the
    evaluator's write transaction, so matching never holds the lease row or SQLite's write lock."""
    silences = active_silences(session, now)
    if not silences:
        return frozenset()
    return frozenset(fp for fp, labels in alerts if is_silenced(labels, silences))
