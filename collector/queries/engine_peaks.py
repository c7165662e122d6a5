"""The peaks of an engine's load — KV usage, requests running, requests waiting — and where each comes from.

A peak is only a peak when every step was seen: a gauge scraped every few seconds misses the moment the
batch was fullest (a vLLM whose iteration log showed 43 of 64 blocks in use read 0.24 from 5-s scrapes).
So each figure comes from the step rows when the instance has them (vLLM's iteration log through
`integrations.vllm.iteration_log`, or kvpilot's engine's step events), and from sampled gauges only otherwise; the
source says which, and a sampled figure says that it is a sample, not a peak.

vLLM's iteration line carries no queue length (its step rows hold `queue_depth` 0), so for a vLLM the
waiting figure comes from its request rows (its `llm_request` spans): each request waited `queue_s` up to
the moment it was scheduled, which is its end minus its decode and prefill times, and the most requests
waiting at once is the most of those intervals that overlap (a preempted request's second wait is not in
its span). Without request rows it is the sampled `vllm:num_requests_waiting`. A step row's instance is a
kvpilot engine when that instance also pushes sample events (kvpilot's engine samples its gauges; the
vLLM adapter does not).

A window longer than a few hours reads the whole minutes the per-minute step rollup holds instead of every
step (`collector.queries.step_rollup`): the peaks are the same, and the step source says so.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence, Set
from dataclasses import dataclass

from sqlalchemy import Integer, Subquery, case, cast, func, null, select
from sqlalchemy.sql import ColumnElement

from collector.queries._base import Db, _bound, _dialect, _f, bucket_expr
from collector.queries.engine_stats import rollup_filter, sample_filter
from collector.queries.step_rollup import ROLLUP_AFTER_S, ROLLUP_NOTE, load_rows
from collector.queries.timeseries import series_instances, series_points
from collector.schema import RequestRow, SampleRollup, SampleRow

VLLM_STEPS = "vLLM iteration log (every step)"
VLLM_SPANS = "vLLM spans (every request's time in the queue)"
KVPILOT_STEPS = "kvpilot engine steps (every step)"
NO_DATA = "no data in the window"
# Past this many instances with steps a load chart draws the fleet's envelope and the TOP_LINES instances of the
# highest peaks of each series instead of a line each: 1,000 lines are a 60,000-row read an hour that shows
# nobody anything.
MAX_LINES = 12
TOP_LINES = 5


def sampled_source(interval_s: float | None, *, scraped: bool) -> str:
    """The label of a figure read from sampled gauges: how often they were sampled, and that it is no peak."""
    what = "scrape samples" if scraped else "kvpilot engine samples"
    every = f"every {interval_s:.3g} s" if interval_s is not None else "(a single sample)"
    return f"{what} {every} — sampled, not a peak"


@dataclass(frozen=True)
class EnginePeaks:
    """The highest load in the window over the selected instances, each figure with its source.

    `source` is where the step-derived figures come from (a step source, or the sampled source when no
    instance has steps); `kv_usage_source` and `waiting_source` can differ from it (a vLLM's waiting count
    comes from its spans, or from samples without them). Each source is that of the instance holding the
    highest value (joined with " + " when instances of different sources tie).
    """

    kv_usage_peak: float | None
    kv_usage_source: str
    running_peak: int | None
    waiting_peak: int | None
    waiting_source: str
    source: str
    steps: int  # step rows the step-derived figures were read from


@dataclass(frozen=True)
class StepPeaks:
    """One instance's highest step figures over a window, and how many steps they were read from."""

    kv: float | None
    running: int
    waiting: int
    steps: int


@dataclass(frozen=True)
class StepFacts:
    """What the peaks and the load chart of one window both start from: every instance's step peaks (`peaks`,
    from the rollup when `rolled`) and the instances that push sample events (`pushing`: kvpilot's engines).

    A page that shows both reads them once (`step_facts`) and passes them to `engine_peaks` and
    `step_load_lines`: on a fleet each is a scan of the window's steps or rollup rows and of its samples.
    `window` is what they were read for; passed with another window they are refused.
    """

    window: tuple[float, float, tuple[str, ...] | None, str | None]
    peaks: dict[str, StepPeaks]
    rolled: bool
    pushing: frozenset[str]


def _window(
    start: float, end: float, instances: Sequence[str] | None, run_id: str | None
) -> tuple[float, float, tuple[str, ...] | None, str | None]:
    return (start, end, None if instances is None else tuple(instances), run_id)


def step_facts(
    db: Db,
    *,
    start: float,
    end: float,
    instances: Sequence[str] | None = None,
    run_id: str | None = None,
) -> StepFacts:
    """The window's step peaks per instance and its sampling instances (see `StepFacts`)."""
    peaks, rolled = _step_peaks(db, start=start, end=end, instances=instances, run_id=run_id)
    pushing = _sampling_instances(db, start=start, end=end, instances=instances, run_id=run_id)
    return StepFacts(_window(start, end, instances, run_id), peaks, rolled, frozenset(pushing))


def _facts(
    db: Db,
    facts: StepFacts | None,
    *,
    start: float,
    end: float,
    instances: Sequence[str] | None,
    run_id: str | None,
) -> StepFacts:
    if facts is None:
        return step_facts(db, start=start, end=end, instances=instances, run_id=run_id)
    if facts.window != _window(start, end, instances, run_id):
        raise ValueError("step facts read for another window (start, end, instances or run_id differ)")
    return facts


def engine_peaks(
    db: Db,
    *,
    start: float,
    end: float,
    instances: Sequence[str] | None = None,
    run_id: str | None = None,
    facts: StepFacts | None = None,
) -> EnginePeaks:
    """KV usage, running and waiting peaks over `start <= ts < end` (warm-up steps left out).

    With `run_id`, steps and engine samples are those of that run; scraped series carry no run and are
    read over the window. `facts`, read by `step_facts` for the same window, saves reading them again.
    """
    known = _facts(db, facts, start=start, end=end, instances=instances, run_id=run_id)
    step_peaks, rolled, pushing = known.peaks, known.rolled, known.pushing
    kv: list[tuple[float, str]] = []
    running: list[tuple[float, str]] = []
    waiting: list[tuple[float, str]] = []
    queued = _queue_peaks(
        db, start=start, end=end, instances=[n for n in step_peaks if n not in pushing], run_id=run_id
    )
    for name, peaks in step_peaks.items():
        label = KVPILOT_STEPS if name in pushing else VLLM_STEPS
        if rolled:
            label = f"{label}; {ROLLUP_NOTE}"
        if peaks.kv is not None:
            kv.append((peaks.kv, label))
        running.append((peaks.running, label))
        if name in pushing:
            waiting.append((peaks.waiting, label))
        elif name in queued:
            waiting.append((queued[name], VLLM_SPANS))
    sampled_names = None if instances is None else [n for n in instances if n not in step_peaks]
    if sampled_names is None or sampled_names:
        kv += _sampled(db, "kv_usage", start, end, sampled_names, skip=set(step_peaks), pushing=pushing)
        running += _sampled(db, "running", start, end, sampled_names, skip=set(step_peaks), pushing=pushing)
    counted = {n for n in step_peaks if n in pushing} | set(queued)
    waiting_names = None if instances is None else [n for n in instances if n not in counted]
    if waiting_names is None or waiting_names:
        waiting += _sampled(db, "queue_depth", start, end, waiting_names, skip=counted, pushing=pushing)
    kv_peak, kv_source = _highest(kv)
    running_peak, running_source = _highest(running)
    waiting_peak, waiting_source = _highest(waiting)
    return EnginePeaks(
        kv_usage_peak=kv_peak,
        kv_usage_source=kv_source,
        running_peak=None if running_peak is None else round(running_peak),
        waiting_peak=None if waiting_peak is None else round(waiting_peak),
        waiting_source=waiting_source,
        source=running_source,
        steps=sum(p.steps for p in step_peaks.values()),
    )


@dataclass(frozen=True)
class StepLoadBucket:
    """The fullest step of a bucket: KV usage, requests in the batch, requests waiting (kvpilot's engine)."""

    ts: float
    kv_usage: float | None
    running: int
    waiting: int
    steps: int
    rollup: bool = False  # whole minutes of it were read from the step rollup


def step_load_over_time(
    db: Db,
    *,
    start: float,
    end: float,
    bucket_s: float,
    instances: Sequence[str] | None = None,
    run_id: str | None = None,
) -> dict[str, list[StepLoadBucket]]:
    """instance -> per-bucket peaks over every step (warm-up left out): what a chart of peaks draws.

    `waiting` is the step's queue depth, which only kvpilot's engine reports (0 for vLLM's steps). A long
    window reads whole minutes from the step rollup (`step_rollup`), with the same peaks; a bucket's `rollup`
    says it holds some.
    """
    if bucket_s <= 0:
        raise ValueError("bucket_s must be positive")
    out: dict[str, list[StepLoadBucket]] = {}
    with _bound(db) as conn:
        rows, _ = load_rows(start=start, end=end, instances=instances, run_id=run_id, bucket_s=bucket_s)
        b = bucket_expr(rows.c.ts, bucket_s, _dialect(conn)).label("bucket")
        stmt = (
            select(rows.c.instance, b, *_peak_columns(rows), func.max(rows.c.rolled))
            .group_by(rows.c.instance, b)
            .order_by(rows.c.instance, b)
        )
        for row in conn.execute(stmt).all():  # fetched at once: 60,000 rows for an hour of 1,000 instances
            name, bucket, kv, running, waiting, n, rolled = tuple(row)
            kv_usage = None if kv is None else float(kv)
            out.setdefault(name, []).append(
                StepLoadBucket(float(bucket), kv_usage, int(running), int(waiting), int(n), bool(rolled))
            )
    return out


@dataclass(frozen=True)
class FleetLoadBucket:
    """One bucket of many instances' load: the highest of their peaks in it, and the mean of those peaks over the
    instances with steps in it. `waiting_*` is over the instances whose steps carry their queue (kvpilot's
    engines; None when there is none)."""

    ts: float
    kv_usage_max: float | None
    kv_usage_mean: float | None
    running_max: int
    running_mean: float
    waiting_max: int | None
    waiting_mean: float | None
    instances: int
    rollup: bool = False


@dataclass(frozen=True)
class LoadLines:
    """What a load chart draws for the instances with steps in the window.

    Up to `max_lines` instances, each has its own line (`lines`, every instance) and `fleet` is empty. Past
    that, a chart of every instance is a thousand tangled lines and a 60,000-row read: `fleet` holds the
    envelope per bucket, and `lines` only the instances of the highest window peaks (`top[series]`, highest
    first, for kv_usage, running and waiting), so the instance that breaks away is still drawn by name.
    `sources` is every instance's step source (`VLLM_STEPS` or `KVPILOT_STEPS`), lines or not.
    """

    lines: dict[str, list[StepLoadBucket]]
    sources: dict[str, str]
    fleet: list[FleetLoadBucket]
    top: dict[str, list[str]]

    @property
    def instances(self) -> int:
        return len(self.sources)

    def fleet_source(self) -> str:
        """Where the envelope's figures come from (with the rollup's note when it was read)."""
        found = " + ".join(sorted(set(self.sources.values())))
        return f"{found}; {ROLLUP_NOTE}" if any(b.rollup for b in self.fleet) else found


def step_load_lines(
    db: Db,
    *,
    start: float,
    end: float,
    bucket_s: float,
    instances: Sequence[str] | None = None,
    run_id: str | None = None,
    max_lines: int = MAX_LINES,
    top: int = TOP_LINES,
    facts: StepFacts | None = None,
) -> LoadLines:
    """The lines of a load chart over `start <= ts < end` (see `LoadLines`): every instance's buckets
    (`step_load_over_time`) when there are at most `max_lines` instances with steps, else the fleet's
    envelope and the `top` instances of each series. Three to four reads whose results are bounded by the
    instances and the buckets, never by their product; one or two fewer with `facts` (`step_facts`, the same
    window)."""
    if bucket_s <= 0:
        raise ValueError("bucket_s must be positive")
    if max_lines < 1 or top < 1:
        raise ValueError("max_lines and top must be at least 1")
    known = _facts(db, facts, start=start, end=end, instances=instances, run_id=run_id)
    peaks, pushing = known.peaks, known.pushing
    sources = {name: KVPILOT_STEPS if name in pushing else VLLM_STEPS for name in sorted(peaks)}
    if len(peaks) <= max_lines:
        lines = step_load_over_time(db, start=start, end=end, bucket_s=bucket_s, instances=instances, run_id=run_id)
        return LoadLines(lines=lines, sources=sources, fleet=[], top={})
    queued = sorted(name for name in peaks if name in pushing)
    tops = {
        "kv_usage": _highest_names({n: p.kv for n, p in peaks.items()}, top),
        "running": _highest_names({n: p.running for n, p in peaks.items()}, top),
        "waiting": _highest_names({n: peaks[n].waiting for n in queued}, top),
    }
    drawn = sorted({name for names in tops.values() for name in names})
    lines = step_load_over_time(db, start=start, end=end, bucket_s=bucket_s, instances=drawn, run_id=run_id)
    fleet = _envelope(
        db,
        start=start,
        end=end,
        bucket_s=bucket_s,
        instances=instances,
        run_id=run_id,
        queued=queued,
        names=list(peaks),
    )
    return LoadLines(lines=lines, sources=sources, fleet=fleet, top=tops)


def _highest_names(values: dict[str, float | int | None], n: int) -> list[str]:
    """The `n` names of the highest values (None left out), highest first, ties by name."""
    ranked = sorted(((v, name) for name, v in values.items() if v is not None), key=lambda p: (-p[0], p[1]))
    return [name for _, name in ranked[:n]]


def _envelope(
    db: Db,
    *,
    start: float,
    end: float,
    bucket_s: float,
    instances: Sequence[str] | None,
    run_id: str | None,
    queued: list[str],
    names: list[str],
) -> list[FleetLoadBucket]:
    """Per bucket, the highest and the mean of the instances' peaks in it; waiting over `queued` only (the
    instances of `names` whose steps carry their queue), named by whichever list is shorter."""
    rows, _ = load_rows(start=start, end=end, instances=instances, run_id=run_id, bucket_s=bucket_s)
    if not queued:
        waiting: ColumnElement = cast(null(), Integer)
    elif len(queued) == len(names):
        waiting = rows.c.waiting_max
    elif len(queued) <= len(names) - len(queued):
        waiting = case((rows.c.instance.in_(queued), rows.c.waiting_max))
    else:
        waiting = case((rows.c.instance.not_in(sorted(set(names) - set(queued))), rows.c.waiting_max))
    with _bound(db) as conn:
        b = bucket_expr(rows.c.ts, bucket_s, _dialect(conn)).label("bucket")
        per = (
            select(
                b,
                func.max(rows.c.kv_usage_max).label("kv"),
                func.max(rows.c.running_max).label("running"),
                func.max(waiting).label("waiting"),
                func.max(rows.c.rolled).label("rolled"),
            )
            .group_by(rows.c.instance, b)
            .subquery("per_instance")
        )
        stmt = (
            select(
                per.c.bucket,
                func.max(per.c.kv),
                func.avg(per.c.kv),
                func.max(per.c.running),
                func.avg(per.c.running),
                func.max(per.c.waiting),
                func.avg(per.c.waiting),
                func.count(),
                func.max(per.c.rolled),
            )
            .group_by(per.c.bucket)
            .order_by(per.c.bucket)
        )
        return [
            FleetLoadBucket(
                ts=float(bucket),
                kv_usage_max=_f(kv_max),
                kv_usage_mean=_f(kv_mean),
                running_max=int(run_max),
                running_mean=float(run_mean),
                waiting_max=None if wait_max is None else int(wait_max),
                waiting_mean=_f(wait_mean),
                instances=int(n),
                rollup=bool(rolled),
            )
            for bucket, kv_max, kv_mean, run_max, run_mean, wait_max, wait_mean, n, rolled in conn.execute(stmt)
        ]


def _peak_columns(rows: Subquery) -> list[ColumnElement]:
    return [
        func.max(rows.c.kv_usage_max),
        func.max(rows.c.running_max),
        func.max(rows.c.waiting_max),
        func.sum(rows.c.steps),
    ]


def _highest(found: list[tuple[float, str]]) -> tuple[float | None, str]:
    """The highest value and the source of the instance(s) holding it."""
    if not found:
        return None, NO_DATA
    top = max(v for v, _ in found)
    return top, " + ".join(sorted({s for v, s in found if v == top}))


def _step_peaks(
    db: Db, *, start: float, end: float, instances: Sequence[str] | None, run_id: str | None
) -> tuple[dict[str, StepPeaks], bool]:
    """instance -> its step peaks, and whether they were read from the step rollup (`load_rows`)."""
    rows, rolled = load_rows(start=start, end=end, instances=instances, run_id=run_id)
    stmt = select(rows.c.instance, *_peak_columns(rows)).group_by(rows.c.instance)
    with _bound(db) as conn:
        peaks = {
            name: StepPeaks(None if kv is None else float(kv), int(running), int(waiting), int(n))
            for name, kv, running, waiting, n in conn.execute(stmt)
        }
    return peaks, rolled


def _queue_peaks(db: Db, *, start: float, end: float, instances: Sequence[str], run_id: str | None) -> dict[str, int]:
    """instance -> the most of its requests waiting at once, from each request's queue interval."""
    if not instances:
        return {}
    r = RequestRow.__table__.c
    conds: list[ColumnElement] = [r.ts >= start, r.ts < end, r.warmup.is_(False), r.instance.in_(instances)]
    if run_id is not None:
        conds.append(r.run_id == run_id)
    scheduled = r.ts - r.decode_s - r.prefill_s
    stmt = select(r.instance, scheduled - r.queue_s, scheduled).where(*conds, r.queue_s > 0)
    edges: dict[str, list[tuple[float, int]]] = {}
    with _bound(db) as conn:
        for name, queued_at, scheduled_at in conn.execute(stmt):
            edges.setdefault(name, []).extend(((float(queued_at), 1), (float(scheduled_at), -1)))
    out = {}
    for name, points in edges.items():
        depth = top = 0
        for _, step in sorted(points):  # at a tie the scheduling (-1) comes first: back to back is not both
            depth += step
            top = max(top, depth)
        out[name] = top
    return out


def _sampling_instances(
    db: Db, *, start: float, end: float, instances: Sequence[str] | None, run_id: str | None
) -> set[str]:
    """Instances that pushed sample events in the window: kvpilot engines. A window longer than `ROLLUP_AFTER_S`
    reads the sample rollup's minutes (whole, as the step peaks beside it read theirs), not every sample."""
    if end - start > ROLLUP_AFTER_S:
        rolled = SampleRollup.__table__
        stmt = select(rolled.c.instance).where(*rollup_filter(rolled, start, end, instances, run_id)).distinct()
    else:
        stmt = select(SampleRow.__table__.c.instance).where(*sample_filter(start, end, instances, run_id)).distinct()
    with _bound(db) as conn:
        return {row[0] for row in conn.execute(stmt)}


def _sampled(
    db: Db,
    name: str,
    start: float,
    end: float,
    instances: Sequence[str] | None,
    *,
    skip: set[str],
    pushing: Set[str],
) -> list[tuple[float, str]]:
    """(highest sample, its source) per instance not in `skip`, from every label set of the gauge. Only those
    instances' points are read: a fleet whose engines all have steps reads none (1,000 instances' samples of an
    hour were 140,000 rows fetched to be dropped)."""
    # an engine's own samples count only for an engine that pushes them (`pushing`) and has no steps
    engines = sorted(pushing - skip)
    wanted = series_instances(db, name=name, start=start, end=end, instances=instances, engines=engines) - skip
    if not wanted:
        return []
    by_instance: dict[str, list[tuple[float, float]]] = {}
    for sid, points in series_points(db, name=name, start=start, end=end, instances=sorted(wanted)).items():
        if sid.instance not in skip:
            by_instance.setdefault(sid.instance, []).extend(points)
    out = []
    for inst, points in by_instance.items():
        stamps = sorted({ts for ts, _ in points})
        gaps = [b - a for a, b in itertools.pairwise(stamps)]
        interval = statistics.median(gaps) if gaps else None
        out.append((max(v for _, v in points), sampled_source(interval, scraped=inst not in pushing)))
    return out
