"""The one read path for alerts, tuner and dashboard: windows, rates, percentiles, series over time.

Every function is keyword-only after its first argument, which may be a Session, a Connection or an
Engine. Times are epoch seconds; windows are half-open, `start <= ts < end`. Each figure has one
definition here; nobody else writes SQL over the telemetry tables (docs/architecture.md).

Downsampling groups in SQL by `floor(ts / bucket_s) * bucket_s`: the value of a bucket is the average of
the points in it.
"""

from collector.queries._base import DEFAULT_QUANTILES, Db, GroupBy, LatencyMetric, Points, bucket_expr
from collector.queries.catalog import (
    SIMULATED_INSTANCE_PREFIX,
    InstanceInfo,
    RunInfo,
    TargetHealth,
    is_simulated_instance,
    list_instances,
    list_runs,
    list_series_names,
    target_health,
)
from collector.queries.diagnosis import DETECTORS, diagnose, diagnosed_instances
from collector.queries.diagnosis_base import KNOBS, TRAPS, Finding, Knob, Trap, study_command
from collector.queries.diagnosis_kv import memory_wall, swap_thrashing
from collector.queries.diagnosis_requests import bursts, cold_start, mixed_lengths
from collector.queries.engine_info import ENGINES, EngineInfo, EngineName, engine_infos
from collector.queries.engine_peaks import (
    EnginePeaks,
    FleetLoadBucket,
    LoadLines,
    StepLoadBucket,
    engine_peaks,
    step_load_lines,
    step_load_over_time,
)
from collector.queries.engine_stats import (
    AllocOpBucket,
    AllocTrace,
    KvBucket,
    ThroughputBucket,
    alloc_ops_over_time,
    alloc_trace,
    kv_over_time,
    latest_samples,
    run_gauges_over_time,
    throughput_over_time,
)
from collector.queries.headline import HeadlineLatency, headline_latency
from collector.queries.histogram_stats import (
    HistogramQuantiles,
    histogram_bases,
    histogram_quantiles,
    histogram_quantiles_over_time,
)
from collector.queries.losses import LostEvents, lost_events
from collector.queries.request_rates import (
    Arrival,
    Goodput,
    RequestRates,
    StageBucket,
    goodput,
    request_arrivals,
    request_rates,
    slowest_requests,
    stage_breakdown_over_time,
)
from collector.queries.request_stats import (
    HistogramBin,
    LatencyStats,
    QuantileBucket,
    latency_histogram,
    latency_percentiles,
    latency_quantiles_over_time,
)
from collector.queries.run_audit import duplicate_steps, stored_event_counts, stored_requests
from collector.queries.steps import StoredStep, stored_steps
from collector.queries.timeseries import (
    EVENT_COUNTERS,
    Labels,
    Series,
    SeriesId,
    bucketed,
    counter_increase,
    counter_rate,
    group_key,
    group_sum,
    increase_of,
    parse_labels,
    series_points,
)

__all__ = [
    "DEFAULT_QUANTILES",
    "DETECTORS",
    "ENGINES",
    "EVENT_COUNTERS",
    "KNOBS",
    "SIMULATED_INSTANCE_PREFIX",
    "TRAPS",
    "AllocOpBucket",
    "AllocTrace",
    "Arrival",
    "Db",
    "EngineInfo",
    "EngineName",
    "EnginePeaks",
    "Finding",
    "FleetLoadBucket",
    "Goodput",
    "GroupBy",
    "HeadlineLatency",
    "HistogramBin",
    "HistogramQuantiles",
    "InstanceInfo",
    "Knob",
    "KvBucket",
    "Labels",
    "LatencyMetric",
    "LatencyStats",
    "LoadLines",
    "LostEvents",
    "Points",
    "QuantileBucket",
    "RequestRates",
    "RunInfo",
    "Series",
    "SeriesId",
    "StageBucket",
    "StepLoadBucket",
    "StoredStep",
    "TargetHealth",
    "ThroughputBucket",
    "Trap",
    "alloc_ops_over_time",
    "alloc_trace",
    "bucket_expr",
    "bucketed",
    "bursts",
    "cold_start",
    "counter_increase",
    "counter_rate",
    "diagnose",
    "diagnosed_instances",
    "duplicate_steps",
    "engine_infos",
    "engine_peaks",
    "goodput",
    "group_key",
    "group_sum",
    "headline_latency",
    "histogram_bases",
    "histogram_quantiles",
    "histogram_quantiles_over_time",
    "increase_of",
    "is_simulated_instance",
    "kv_over_time",
    "latency_histogram",
    "latency_percentiles",
    "latency_quantiles_over_time",
    "latest_samples",
    "list_instances",
    "list_runs",
    "list_series_names",
    "lost_events",
    "memory_wall",
    "mixed_lengths",
    "parse_labels",
    "request_arrivals",
    "request_rates",
    "run_gauges_over_time",
    "series_points",
    "slowest_requests",
    "stage_breakdown_over_time",
    "step_load_lines",
    "step_load_over_time",
    "stored_event_counts",
    "stored_requests",
    "stored_steps",
    "study_command",
    "swap_thrashing",
    "target_health",
    "throughput_over_time",
]
