"""What was stored for one run, row by row: the load tester's and the demo's end-to-end checks."""

from __future__ import annotations

from sqlalchemy import func, select

from collector.queries._base import Db, _bound
from collector.schema import AllocRow, RequestRow, SampleRow, StepRow

_EVENT_TABLES = (("request", RequestRow), ("step", StepRow), ("alloc", AllocRow), ("sample", SampleRow))


def stored_event_counts(db: Db, *, run_id: str) -> dict[str, int]:
    """Rows stored for the run, per event kind (request, step, alloc, sample), warm-up included."""
    with _bound(db) as conn:
        return {
            kind: int(conn.execute(select(func.count()).select_from(t).where(t.run_id == run_id)).scalar_one())
            for kind, t in _EVENT_TABLES
        }


def stored_requests(db: Db, *, run_id: str, include_warmup: bool = False) -> list[tuple[str, str]]:
    """(request_id, status) of every request row of the run, duplicates included (a check counts them)."""
    stmt = select(RequestRow.request_id, RequestRow.status).where(RequestRow.run_id == run_id)
    if not include_warmup:
        stmt = stmt.where(RequestRow.warmup.is_(False))
    with _bound(db) as conn:
        return [(rid, status) for rid, status in conn.execute(stmt)]


def duplicate_steps(db: Db, *, run_id: str) -> int:
    """How many step numbers of the run were stored more than once (a retried batch stored twice)."""
    stmt = select(StepRow.step).where(StepRow.run_id == run_id).group_by(StepRow.step).having(func.count() > 1)
    with _bound(db) as conn:
        return len(conn.execute(stmt).all())
