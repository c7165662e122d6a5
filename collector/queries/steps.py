"""The stored step rows themselves, one per engine iteration: what a cost-model fit reads (each step's shape and
duration), where the dashboard and the rules read bucketed aggregates (`engine_stats`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

from sqlalchemy import select

from collector.queries._base import Db, _bound
from collector.schema import StepRow


@dataclass(frozen=True, slots=True)
class StoredStep:
    run_id: str | None
    instance: str
    ts: float  # when the step's iteration line was read (vLLM) or the step ended (kvpilot)
    step: int
    duration_s: float
    num_seqs: int
    prefill_tokens: int
    decode_tokens: int
    kv_blocks_used: int
    kv_blocks_total: int


def stored_steps(
    db: Db,
    *,
    start: float,
    end: float,
    instances: Sequence[str] | None = None,
    run_ids: Sequence[str] | None = None,
    limit: int = 500_000,
) -> list[StoredStep]:
    """Steps with `start <= ts < end` (warm-up steps left out), by instance and run, then in step order; at most
    `limit` of them."""
    s = StepRow.__table__.c
    conds = [s.ts >= start, s.ts < end, s.warmup.is_(False)]
    if instances is not None:
        conds.append(s.instance.in_(list(instances)))
    if run_ids is not None:
        conds.append(s.run_id.in_(list(run_ids)))
    stmt = (
        select(*(s[f.name] for f in fields(StoredStep)))  # StoredStep's fields, in its order
        .where(*conds)
        .order_by(s.instance, s.run_id, s.step, s.id)
        .limit(limit)
    )
    with _bound(db) as conn:
        return [StoredStep(*row) for row in conn.execute(stmt)]
