"""The headline latency: TTFT and e2e p50/p99 as users waited them, with where the figures come from.

Every page, the built-in user-TTFT rule, the tuner's SLO reading and `kvpilot status` show these figures,
so they are computed once, here. They are the user-facing request stages (`request_stats.user_ttft`,
`user_e2e`: from the HTTP arrival), exact nearest rank over the stored request rows; a fleet's window longer
than a quarter of an hour reads its whole minutes from the latency sketch (`latency_sketch`: each quantile at
most 2% above the exact, never below), and `source` says so. `source` names what
they stand on, and says so when some rows lack the stage before the engine (a vLLM whose spans carry no
arrival stamp: not started by `kvpilot vllm serve`). vLLM's own frontend histograms
(`vllm:time_to_first_token_seconds`) start at the same `arrival_time` as its spans, so they cannot fill
that gap; they stay on the Latency page as the engine's own view, at bucket precision.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select

from collector.queries import latency_sketch as sketch
from collector.queries._base import Db, _bound
from collector.queries.request_stats import _request_filter, latency_percentiles, sketched_stats
from collector.schema import RequestRow

FROM_HTTP = "request rows, from the HTTP arrival (exact)"
ENGINE_ONLY = (
    "request rows from the engine's arrival stamp: the time before the engine is not measured "
    "(start vLLM with `kvpilot vllm serve` for it)"
)


@dataclass(frozen=True)
class HeadlineLatency:
    requests: int  # finished requests in the window
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    e2e_p50_s: float | None
    e2e_p99_s: float | None
    source: str
    unmeasured: int = 0  # of `requests`, those whose stage before the engine was not measured


def headline_latency(
    db: Db,
    *,
    start: float,
    end: float,
    instances: Sequence[str] | None = None,
    run_id: str | None = None,
    include_warmup: bool = False,
) -> HeadlineLatency:
    """User-facing TTFT and e2e p50/p99 of the finished requests in [start, end), and their source."""
    common: dict[str, Any] = {
        "start": start,
        "end": end,
        "quantiles": (0.5, 0.99),
        "group_by": "all",
        "instances": instances,
        "run_id": run_id,
        "include_warmup": include_warmup,
    }
    r = RequestRow.__table__.c
    conds = _request_filter(start, end, instances, run_id, ("finished",), include_warmup)
    with _bound(db) as conn:
        window = sketch.sketch_window(
            conn,
            start=start,
            end=end,
            instances=instances,
            run_id=run_id,
            statuses=("finished",),
            include_warmup=include_warmup,
        )
        if window is not None:  # a fleet's long window: per-minute bins, `unmeasured` from the stages' counts
            ttft, e2e = (sketched_stats(conn, window, m, conds, common["quantiles"]) for m in ("ttft", "e2e"))
            unmeasured = e2e.count - sketch.value_count(conn, window, "frontend", r.frontend_s, conds)
            t, e, n = ttft.quantiles, e2e.quantiles, e2e.count
        else:
            ttfts = latency_percentiles(conn, metric="ttft", **common)
            e2es = latency_percentiles(conn, metric="e2e", **common)
            unmeasured = int(conn.execute(select(func.count()).where(*conds, r.frontend_s.is_(None))).scalar_one())
            t = ttfts[0].quantiles if ttfts else {}
            e = e2es[0].quantiles if e2es else {}
            n = e2es[0].count if e2es else 0
    if n == 0:
        source = "no finished requests in the window"
    elif unmeasured == 0:
        source = FROM_HTTP
    elif unmeasured == n:
        source = ENGINE_ONLY
    else:
        source = f"{FROM_HTTP}; {unmeasured} of {n} from the engine's arrival stamp (time before it not measured)"
    if n and window is not None:
        source = f"{source}; {sketch.SKETCH_NOTE}"
    return HeadlineLatency(
        requests=n,
        ttft_p50_s=t.get(0.5),
        ttft_p99_s=t.get(0.99),
        e2e_p50_s=e.get(0.5),
        e2e_p99_s=e.get(0.99),
        source=source,
        unmeasured=unmeasured,
    )
