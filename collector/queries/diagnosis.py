"""The fleet's traps, checked from stored data: one `Finding` per (trap, instance) over a window.

The seed names five ways a serving fleet wastes its hardware: short and long requests mixed, bursts the
scheduler cannot absorb, swap thrashing, cold starts and the memory wall. Each has a detector (a read
function like every other here), in `diagnosis_requests` (request rows) and `diagnosis_kv` (KV memory);
their thresholds, the knob of each trap and the study command over that knob are in `diagnosis_base`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from sqlalchemy import select, union

from collector.queries._base import Db, _bound
from collector.queries.diagnosis_base import TRAPS, Finding, for_engine, study_hours
from collector.queries.diagnosis_kv import memory_wall, swap_thrashing
from collector.queries.diagnosis_requests import bursts, cold_start, mixed_lengths
from collector.queries.engine_info import engine_infos
from collector.schema import AllocRow, RequestRow, SampleRow, SeriesPoint, StepRow

Detector = Callable[..., Finding]
DETECTORS: dict[str, Detector] = {
    "mixed_lengths": mixed_lengths,
    "bursts": bursts,
    "swap_thrashing": swap_thrashing,
    "cold_start": cold_start,
    "memory_wall": memory_wall,
}


def diagnosed_instances(
    db: Db, *, start: float, end: float, instances: Sequence[str] | None = None, run_id: str | None = None
) -> list[str]:
    """The instances asked for, all of them, with data or not (their findings then say "not enough data");
    else every instance with an engine event (or, without a run filter, a scraped point) in the window."""
    if instances is not None:
        return sorted(set(instances))
    selects = []
    for table in (RequestRow.__table__, StepRow.__table__, SampleRow.__table__, AllocRow.__table__):
        conds = [table.c.ts >= start, table.c.ts < end]
        if run_id is not None:
            conds.append(table.c.run_id == run_id)
        selects.append(select(table.c.instance).where(*conds).distinct())
    if run_id is None:
        t = SeriesPoint.__table__
        selects.append(select(t.c.instance).where(t.c.ts >= start, t.c.ts < end).distinct())
    with _bound(db) as conn:
        return sorted(set(conn.execute(union(*selects)).scalars()))


def diagnose(
    db: Db,
    *,
    start: float,
    end: float,
    instances: Sequence[str] | None = None,
    run_id: str | None = None,
    traps: Sequence[str] | None = None,
    now: float | None = None,
) -> list[Finding]:
    """Every trap (or those named) on every instance with data in the window, in TRAPS order then instance.

    `now` dates the study commands (the tuner's collector workload reads the last hours before now); each
    finding carries its instance's engine, and its study command is that engine's (`for_engine`).
    """
    if end <= start:
        raise ValueError("end must be after start")
    unknown = [t for t in traps or () if t not in DETECTORS]
    if unknown:
        raise ValueError(f"unknown trap(s) {unknown}; one of {', '.join(TRAPS)}")
    now = time.time() if now is None else now
    names = diagnosed_instances(db, start=start, end=end, instances=instances, run_id=run_id)
    engines = engine_infos(db, instances=names)
    hours = study_hours(start, now)
    return [
        for_engine(
            DETECTORS[trap](db, instance=instance, start=start, end=end, run_id=run_id, now=now),
            engines[instance].engine,
            hours=hours,
        )
        for trap in (traps or TRAPS)
        for instance in names
    ]
