"""Request counts and rates, goodput against SLOs, the slowest requests, arrivals as they came and the stage
breakdown over time."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import and_, case, func, literal, select, union_all
from sqlalchemy.sql import ColumnElement

from collector.queries import latency_sketch as sketch
from collector.queries._base import Db, GroupBy, LatencyMetric, _bound, _dialect, bucket_expr
from collector.queries.catalog import SIMULATED_INSTANCE_PREFIX
from collector.queries.request_stats import _group_column, _request_filter, metric_column, user_e2e, user_ttft
from collector.schema import RequestRow, RequestStageMinute


@dataclass(frozen=True)
class RequestRates:
    group: str
    requests: int
    finished: int
    failed: int
    rejected: int
    aborted: int
    window_s: float
    requests_per_s: float
    prompt_tokens_per_s: float
    output_tokens_per_s: float
    preemptions: int = 0


def request_rates(
    db: Db,
    *,
    start: float,
    end: float,
    group_by: GroupBy = "instance",
    instances: Sequence[str] | None = None,
    run_id: str | None = None,
    include_warmup: bool = False,
) -> list[RequestRates]:
    """Requests by status and token throughput (finished requests' tokens / window length) per group."""
    if end <= start:
        raise ValueError("end must be after start")
    r = RequestRow.__table__.c
    group = _group_column(group_by).label("g")
    conds = _request_filter(start, end, instances, run_id, None, include_warmup)

    def count_status(status: str) -> ColumnElement:
        return func.sum(case((r.status == status, 1), else_=0))

    def finished_sum(col: ColumnElement) -> ColumnElement:
        return func.sum(case((r.status == "finished", col), else_=0))

    stmt = (
        select(
            group,
            func.count(),
            count_status("finished"),
            count_status("failed"),
            count_status("rejected"),
            count_status("aborted"),
            finished_sum(r.prompt_tokens),
            finished_sum(r.output_tokens),
            func.sum(r.preemptions),
        )
        .where(*conds)
        .group_by(group)
        .order_by(group)
    )
    window = end - start
    with _bound(db) as conn:
        rows = conn.execute(stmt).all()
    return [
        RequestRates(
            group=str(g),
            requests=int(n),
            finished=int(fin or 0),
            failed=int(fail or 0),
            rejected=int(rej or 0),
            aborted=int(ab or 0),
            window_s=window,
            requests_per_s=int(n) / window,
            prompt_tokens_per_s=float(pt or 0) / window,
            output_tokens_per_s=float(ot or 0) / window,
            preemptions=int(pre or 0),
        )
        for g, n, fin, fail, rej, ab, pt, ot, pre in rows
    ]


@dataclass(frozen=True)
class Goodput:
    group: str
    requests: int
    good: int
    fraction: float
    good_per_s: float
    good_output_tokens: int = 0  # output tokens of the good requests: the tuner's goodput in tokens/s


def goodput(
    db: Db,
    *,
    start: float,
    end: float,
    ttft_slo_s: float | None = None,
    tpot_slo_s: float | None = None,
    e2e_slo_s: float | None = None,
    group_by: GroupBy = "instance",
    instances: Sequence[str] | None = None,
    run_id: str | None = None,
    include_warmup: bool = False,
) -> list[Goodput]:
    """Requests that finished within every given SLO, over all requests that left the engine.

    A failed, rejected or aborted request is never good; a missing TTFT fails a TTFT SLO.
    TPOT is decode time per output token after the first (requests with one token meet any TPOT SLO).
    """
    if end <= start:
        raise ValueError("end must be after start")
    r = RequestRow.__table__.c
    good_conds: list[ColumnElement] = [r.status == "finished"]
    if ttft_slo_s is not None:
        good_conds.append(and_(r.ttft_s.is_not(None), user_ttft() <= ttft_slo_s))
    if tpot_slo_s is not None:
        good_conds.append(case((r.output_tokens > 1, r.decode_s <= tpot_slo_s * (r.output_tokens - 1)), else_=True))
    if e2e_slo_s is not None:
        good_conds.append(user_e2e() <= e2e_slo_s)
    group = _group_column(group_by).label("g")
    stmt = (
        select(
            group,
            func.count(),
            func.sum(case((and_(*good_conds), 1), else_=0)),
            func.sum(case((and_(*good_conds), r.output_tokens), else_=0)),
        )
        .where(*_request_filter(start, end, instances, run_id, None, include_warmup))
        .group_by(group)
        .order_by(group)
    )
    with _bound(db) as conn:
        rows = conn.execute(stmt).all()
    window = end - start
    return [
        Goodput(
            group=str(g),
            requests=int(n),
            good=int(good or 0),
            fraction=(int(good or 0) / int(n)) if n else 0.0,
            good_per_s=int(good or 0) / window,
            good_output_tokens=int(tokens or 0),
        )
        for g, n, good, tokens in rows
    ]


def slowest_requests(
    db: Db,
    *,
    start: float,
    end: float,
    metric: LatencyMetric = "e2e",
    limit: int = 20,
    instances: Sequence[str] | None = None,
    run_id: str | None = None,
    include_warmup: bool = False,
) -> list[dict[str, Any]]:
    """The `limit` requests with the largest `metric`, as plain dicts (all request columns)."""
    t = RequestRow.__table__
    value = metric_column(metric)
    stmt = (
        select(t, value.label("metric_value"))
        .where(*_request_filter(start, end, instances, run_id, None, include_warmup), value.is_not(None))
        .order_by(value.desc(), t.c.id)
        .limit(max(0, int(limit)))
    )
    with _bound(db) as conn:
        return [dict(row._mapping) for row in conn.execute(stmt)]


@dataclass(frozen=True)
class Arrival:
    """One stored request as its user sent it: when it arrived and what it asked for."""

    arrival: float  # epoch seconds: the HTTP arrival where `frontend_s` was measured, else the engine's
    instance: str
    status: str
    priority: int
    prompt_tokens: int
    output_tokens: int
    user_facing: bool  # the row measured the stage before the engine: `arrival` is the HTTP arrival


def user_arrival() -> ColumnElement:
    """When the user's request arrived: the row's end minus the user-facing end to end (`user_e2e`)."""
    r = RequestRow.__table__.c
    return r.ts - user_e2e()


def request_arrivals(
    db: Db,
    *,
    start: float,
    end: float,
    limit: int,
    instances: Sequence[str] | None = None,
    run_id: str | None = None,
) -> list[Arrival]:
    """The latest `limit` requests stored in `start`..`end` (every status, warm-up excluded), oldest first.

    Without `instances`, the tuner's own replays (instances named `SIMULATED_INSTANCE_PREFIX`...) are left out:
    they are traffic no user sent. Arrival ties keep the order the rows were stored in.
    """
    r = RequestRow.__table__.c
    arrival = user_arrival().label("arrival")
    conds = _request_filter(start, end, instances, run_id, None, False)
    if instances is None:
        conds.append(r.instance.not_like(f"{SIMULATED_INSTANCE_PREFIX}%"))
    stmt = (
        select(arrival, r.instance, r.status, r.priority, r.prompt_tokens, r.output_tokens, r.frontend_s, r.id)
        .where(*conds)
        .order_by(arrival.desc(), r.id.desc())
        .limit(max(0, int(limit)))
    )
    with _bound(db) as conn:
        rows = conn.execute(stmt).all()
    return [
        Arrival(float(a), inst, status, int(prio), int(p), int(o), front is not None)
        for a, inst, status, prio, p, o, front, _id in rows[::-1]
    ]


@dataclass(frozen=True)
class StageBucket:
    """Mean seconds per request stage in one bucket; the stacked stages add up to the mean end-to-end latency.

    The stacked stages are before the engine (`frontend_s`: HTTP arrival to the engine's arrival stamp, 0
    where not measured), queue, prefill, first-token gap, decode excluding swap and swap; `e2e_s` is the
    user-facing end to end (from the HTTP arrival). The engine
    counts time swapped out to the host tier inside the stage it interrupted, so `decode_excl_swap_s`
    is the mean of decode - swap per request (clamped at 0), `swap_s` the mean swap time, and
    `first_token_gap_s` what is left of e2e: e2e - queue - prefill - decode, prefill done to first
    token, except that a request swapped out longer than it decoded (swapped during prefill) gives the
    excess back there, so the five still add up (unless the excess is longer than the gap, rare: the
    gap is clamped at 0). `decode_s` is the whole decode stage, swap included.
    """

    ts: float
    requests: int
    queue_s: float
    prefill_s: float
    first_token_gap_s: float
    decode_excl_swap_s: float
    swap_s: float
    decode_s: float
    e2e_s: float
    swaps: int
    preemptions: int
    frontend_s: float = 0.0


def stage_breakdown_over_time(
    db: Db,
    *,
    start: float,
    end: float,
    bucket_s: float,
    instances: Sequence[str] | None = None,
    run_id: str | None = None,
    include_warmup: bool = False,
) -> list[StageBucket]:
    """Per bucket: mean queue, prefill, first-token gap, decode and swap seconds of finished requests, and counts.

    A fleet-wide window the latency sketch would serve (`latency_sketch.sketch_window`: no instance or run
    filter, longer than `ROLLUP_AFTER_S`, buckets of whole minutes) reads the per-minute stage sums
    (`request_stage_minutes`) before their watermark, whole minutes as the sketch does, and the raw rows after
    it: sums add, so its means are the means of those requests.
    """
    if bucket_s <= 0:
        raise ValueError("bucket_s must be positive")
    r = RequestRow.__table__.c
    conds = _request_filter(start, end, instances, run_id, ("finished",), include_warmup)
    with _bound(db) as conn:
        bucket = bucket_expr(r.ts, bucket_s, _dialect(conn)).label("b")
        raw = select(bucket, func.count().label("requests"), *stage_sums(r)).where(*conds).group_by(bucket)
        window = sketch.sketch_window(
            conn,
            start=start,
            end=end,
            instances=instances,
            run_id=run_id,
            statuses=("finished",),
            include_warmup=include_warmup,
            bucket_s=bucket_s,
            watermark=STAGES,
        )
        if window is not None:
            m = RequestStageMinute.__table__.c
            rolled = select(
                bucket_expr(m.bucket_ts, bucket_s, _dialect(conn)).label("b"), *(m[c] for c in STAGE_COLUMNS)
            )
            rolled = rolled.where(m.bucket_ts >= window.lo, m.bucket_ts < min(window.through, window.end))
            both = union_all(rolled, raw.where(r.ts >= window.through)).subquery("stages")
            sums = [func.sum(both.c[c]) for c in STAGE_COLUMNS]
            stmt = select(both.c.b, *sums).group_by(both.c.b).order_by(both.c.b)
        else:
            stmt = raw.order_by(bucket)
        rows = conn.execute(stmt).all()
    out = []
    for b, count, *sums in rows:
        n = int(count)  # a sum of counts is a NUMERIC on PostgreSQL
        queue, prefill, decode, decode_excl, swap, e2e, frontend = (float(x) / n for x in sums[:7])
        out.append(
            StageBucket(
                ts=float(b),
                requests=int(n),
                queue_s=queue,
                prefill_s=prefill,
                first_token_gap_s=max(0.0, e2e - queue - prefill - decode_excl - swap),
                decode_excl_swap_s=decode_excl,
                swap_s=swap,
                decode_s=decode,
                e2e_s=e2e + frontend,
                swaps=int(sums[7] or 0),
                preemptions=int(sums[8] or 0),
                frontend_s=frontend,
            )
        )
    return out


STAGES = "stages"  # the stage sums' row in rollup_watermarks (`collector.latency_rollup` rolls them)
# a stage minute's columns after its minute (`request_stage_minutes`): how many requests, then `stage_sums`
STAGE_COLUMNS = (
    "requests", "queue_s", "prefill_s", "decode_s", "decode_excl_swap_s", "swap_s", "e2e_s", "frontend_s", "swaps",
    "preemptions",
)  # fmt: skip


def stage_sums(r: Any) -> list[ColumnElement]:
    """The sums of a set of request rows (`r`: a table's columns) that a stage minute keeps, in `STAGE_COLUMNS`'
    order after `requests`, labelled as those columns."""
    decode_excl_swap = case((r.decode_s > r.swap_s, r.decode_s - r.swap_s), else_=literal(0.0))
    return [
        func.sum(r.queue_s).label("queue_s"),
        func.sum(r.prefill_s).label("prefill_s"),
        func.sum(r.decode_s).label("decode_s"),
        func.sum(decode_excl_swap).label("decode_excl_swap_s"),
        func.sum(r.swap_s).label("swap_s"),
        func.sum(r.e2e_s).label("e2e_s"),
        func.sum(func.coalesce(r.frontend_s, 0.0)).label("frontend_s"),
        func.sum(r.swaps).label("swaps"),
        func.sum(r.preemptions).label("preemptions"),
    ]
