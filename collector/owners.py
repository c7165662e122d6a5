"""Changing who owns instances: adopting the fingerprints older versions stored, and the admin's reassignment.

Before identities had names, a push owned its instances as `token:<16 hex digits of the token's SHA-256>`.
`adopt` gives them to the identity a known secret belongs to (the collector runs it at startup, for the
environment tokens and every secret in the tokens file); instances of a token nobody holds any more stay
with its fingerprint until `reassign` (`kvpilot collector tokens reassign`) moves them.
"""

from __future__ import annotations

import re

from sqlalchemy import Engine, func, select, update

from collector.claims import TARGET_PREFIX
from collector.db import translate_errors
from collector.errors import CollectorError
from collector.schema import InstanceOwner
from collector.tokens import NAME_PATTERN

_OWNERS = InstanceOwner.__table__


class ReassignError(CollectorError):
    """A reassignment that cannot be done; the message names the option."""


def adopt(engine: Engine, legacy: dict[str, str]) -> dict[str, int]:
    """Move instances owned by each `token:<fingerprint>` to its identity name; returns moved counts by name."""
    moved: dict[str, int] = {}
    if not legacy:
        return moved
    held = select(func.count()).where(_OWNERS.c.owner.in_(sorted(legacy)))
    with translate_errors(), engine.connect() as conn:
        if not conn.execute(held).scalar_one():
            return moved  # nothing to move: no write (the database may be read-only; /health says so)
    with translate_errors(), engine.begin() as conn:
        for fingerprint, name in sorted(legacy.items()):
            n = conn.execute(update(_OWNERS).where(_OWNERS.c.owner == fingerprint).values(owner=name)).rowcount
            if n:
                moved[name] = moved.get(name, 0) + n
    return moved


def owner_counts(engine: Engine) -> list[tuple[str, int]]:
    """Every owner with its number of instances, most first."""
    stmt = select(_OWNERS.c.owner, func.count()).group_by(_OWNERS.c.owner)
    with translate_errors(), engine.connect() as conn:
        rows = [(owner, int(n)) for owner, n in conn.execute(stmt)]
    return sorted(rows, key=lambda r: (-r[1], r[0]))


def reassign(engine: Engine, *, from_owner: str, to_name: str, instances: list[str] | None = None) -> int:
    """Give `from_owner`'s instances (all, or only `instances`) to identity `to_name`; returns how many."""
    if not re.fullmatch(NAME_PATTERN, to_name):
        raise ReassignError(f"--to: {to_name!r} is not an identity name")
    if from_owner.startswith(TARGET_PREFIX):
        raise ReassignError(f"--from: {from_owner} is a scrape target; delete the target to free its instance")
    if from_owner == to_name:
        raise ReassignError("--from and --to name the same owner")
    stmt = update(_OWNERS).where(_OWNERS.c.owner == from_owner).values(owner=to_name)
    if instances:
        stmt = stmt.where(_OWNERS.c.instance.in_(instances))
    with translate_errors(), engine.begin() as conn:
        moved = conn.execute(stmt).rowcount
    if not moved:
        what = f" among {', '.join(instances)}" if instances else ""
        raise ReassignError(f"--from: {from_owner!r} owns no instance{what} (see `kvpilot collector tokens owners`)")
    return moved
