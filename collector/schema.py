"""The SQL schema (SQLAlchemy 2 typed ORM). Alembic migrations in migrations/ target this metadata.

Times are epoch seconds (UTC) as floats, exactly as they arrive on the wire: one representation on
SQLite and PostgreSQL alike, cheap to bucket in SQL, and never ambiguous about time zones.

Raw event tables (`requests`, `steps`, `alloc_events`, `samples`, `gaps`, `series_points`) are written only by
the ingest fast path and the scraper with Core `insert()`; the ORM classes exist for typed reads and for
the small tables (targets, proposals). On PostgreSQL the high-volume ones are partitioned by day on `ts`
(`collector.partitions`, revision a7c3e9f1b2d4): there their primary key is (id, ts), not the (id) declared
here, which is what SQLite has.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# SQLite only auto-increments an INTEGER PRIMARY KEY; PostgreSQL gets a 64-bit identity.
BigId = BigInteger().with_variant(Integer(), "sqlite")
Name = String(200)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    if TYPE_CHECKING:
        __table__: ClassVar[Table]  # every model here maps one Table (DeclarativeBase says any FromClause)


class Instance(Base):
    """One engine (or scraped server) by its `instance` label; upserted by every batch that names it."""

    __tablename__ = "instances"

    name: Mapped[str] = mapped_column(Name, primary_key=True)
    first_seen_ts: Mapped[float] = mapped_column(Float)
    last_seen_ts: Mapped[float] = mapped_column(Float)


class InstanceOwner(Base):
    """Who first claimed an instance name (`collector.claims`): a push identity's name (`collector.identities`;
    `token:<fingerprint>` from before names, until adopted or reassigned) or a scrape target (`target:<id>`).
    Nobody else may take it over; an admin may move it (`collector.owners.reassign`)."""

    __tablename__ = "instance_owners"

    instance: Mapped[str] = mapped_column(Name, primary_key=True)
    owner: Mapped[str] = mapped_column(String(64), index=True)
    claimed_at: Mapped[float] = mapped_column(Float)


class Run(Base):
    __tablename__ = "runs"
    __table_args__ = (UniqueConstraint("instance", "run_id"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    instance: Mapped[str] = mapped_column(Name)
    run_id: Mapped[str] = mapped_column(Name)
    first_seen_ts: Mapped[float] = mapped_column(Float)
    last_seen_ts: Mapped[float] = mapped_column(Float)


class IngestBatch(Base):
    """The dedup record of one accepted batch, written in the same transaction as its events."""

    __tablename__ = "ingest_batches"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    idempotency_key: Mapped[str] = mapped_column(Name, unique=True)
    content_sha256: Mapped[str] = mapped_column(String(64))
    event_count: Mapped[int] = mapped_column(Integer)
    received_at: Mapped[float] = mapped_column(Float, index=True)


class OtlpSpan(Base):
    """The identity of each OTLP span stored as a request row, claimed in that batch's transaction.

    A span re-sent inside a different export (another batch, so another idempotency key) finds its
    claim and is not stored twice. Pruned with the raw rows (by `received_at`).
    """

    __tablename__ = "otlp_spans"

    trace_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    span_id: Mapped[str] = mapped_column(String(16), primary_key=True)
    received_at: Mapped[float] = mapped_column(Float, index=True)


class _EventColumns:
    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True, sort_order=-5)
    batch_id: Mapped[int | None] = mapped_column(BigInteger, sort_order=-4)
    instance: Mapped[str] = mapped_column(Name, sort_order=-3)
    run_id: Mapped[str] = mapped_column(Name, sort_order=-2)
    ts: Mapped[float] = mapped_column(Float, sort_order=-1)


class RequestRow(_EventColumns, Base):
    __tablename__ = "requests"
    __table_args__ = (
        Index("ix_requests_instance_ts", "instance", "ts"),
        Index("ix_requests_run_id_ts", "run_id", "ts"),
    )

    request_id: Mapped[str] = mapped_column(Name)
    status: Mapped[str] = mapped_column(String(16))
    priority: Mapped[int] = mapped_column(Integer)
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    output_tokens: Mapped[int] = mapped_column(Integer)
    # Seconds from the HTTP arrival to the engine's arrival stamp (the stage before the engine); NULL when
    # the source does not measure it apart (engine.events.RequestEvent says where it comes from).
    frontend_s: Mapped[float | None] = mapped_column(Float)
    queue_s: Mapped[float] = mapped_column(Float)
    prefill_s: Mapped[float] = mapped_column(Float)
    ttft_s: Mapped[float | None] = mapped_column(Float)
    decode_s: Mapped[float] = mapped_column(Float)
    e2e_s: Mapped[float] = mapped_column(Float)
    preemptions: Mapped[int] = mapped_column(Integer)
    swaps: Mapped[int] = mapped_column(Integer)
    # Seconds swapped out to the host tier, counted inside prefill_s/decode_s. The server default gives
    # rows stored before the column existed 0, as the wire default does for batches without the field.
    swap_s: Mapped[float] = mapped_column(Float, server_default=text("0"))
    cached_tokens: Mapped[int] = mapped_column(Integer)
    finish_reason: Mapped[str | None] = mapped_column(String(64))
    warmup: Mapped[bool] = mapped_column(Boolean)


class StepRow(_EventColumns, Base):
    __tablename__ = "steps"
    __table_args__ = (
        Index("ix_steps_instance_ts", "instance", "ts"),
        Index("ix_steps_run_id_ts", "run_id", "ts"),
    )

    step: Mapped[int] = mapped_column(BigInteger)
    duration_s: Mapped[float] = mapped_column(Float)
    forward_s: Mapped[float] = mapped_column(Float)
    num_seqs: Mapped[int] = mapped_column(Integer)
    prefill_tokens: Mapped[int] = mapped_column(Integer)
    decode_tokens: Mapped[int] = mapped_column(Integer)
    kv_blocks_used: Mapped[int] = mapped_column(BigInteger)
    kv_blocks_total: Mapped[int] = mapped_column(BigInteger)
    queue_depth: Mapped[int] = mapped_column(Integer)
    busy_s: Mapped[float] = mapped_column(Float)
    preemptions: Mapped[int] = mapped_column(Integer)
    swapped_seqs: Mapped[int] = mapped_column(Integer)
    warmup: Mapped[bool] = mapped_column(Boolean)


class AllocRow(_EventColumns, Base):
    __tablename__ = "alloc_events"
    __table_args__ = (Index("ix_alloc_events_instance_ts", "instance", "ts"),)

    op: Mapped[str] = mapped_column(String(16))
    request_id: Mapped[str | None] = mapped_column(Name)
    blocks: Mapped[int] = mapped_column(BigInteger)
    block_size: Mapped[int] = mapped_column(Integer)
    bytes: Mapped[int] = mapped_column(BigInteger)
    tier: Mapped[str] = mapped_column(String(8))
    usage_after: Mapped[float] = mapped_column(Float)


class SampleRow(_EventColumns, Base):
    """Wide gauges, one column per SampleEvent field; NULL where the engine had no value."""

    __tablename__ = "samples"
    __table_args__ = (
        Index("ix_samples_instance_ts", "instance", "ts"),
        Index("ix_samples_run_id_ts", "run_id", "ts"),
    )

    utilization: Mapped[float | None] = mapped_column(Float)
    memory_used_bytes: Mapped[int | None] = mapped_column(BigInteger)
    memory_total_bytes: Mapped[int | None] = mapped_column(BigInteger)
    kv_usage: Mapped[float | None] = mapped_column(Float)
    cold_usage: Mapped[float | None] = mapped_column(Float)
    fragmentation: Mapped[float | None] = mapped_column(Float)
    internal_waste: Mapped[float | None] = mapped_column(Float)
    queue_depth: Mapped[int | None] = mapped_column(Integer)
    running: Mapped[int | None] = mapped_column(Integer)
    swap_rate: Mapped[float | None] = mapped_column(Float)
    prefix_hit_rate: Mapped[float | None] = mapped_column(Float)
    source: Mapped[str] = mapped_column(String(64))


class GapRow(_EventColumns, Base):
    """Events a sink lost (a `gap` wire record): what type, why, how many, and the time span they covered.

    Read as the canonical counter `events_lost_total{kind, reason}` and by the dashboard's loss notice.
    """

    __tablename__ = "gaps"
    __table_args__ = (Index("ix_gaps_instance_ts", "instance", "ts"),)

    kind: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str] = mapped_column(String(16))
    events: Mapped[int] = mapped_column(BigInteger)
    first_ts: Mapped[float] = mapped_column(Float)
    last_ts: Mapped[float] = mapped_column(Float)


class ScrapeTarget(Base):
    """A Prometheus text endpoint the scraper polls, with its current health."""

    __tablename__ = "scrape_targets"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    url: Mapped[str] = mapped_column(String(2000), unique=True)
    job: Mapped[str] = mapped_column(Name)
    instance: Mapped[str] = mapped_column(Name)
    interval_s: Mapped[float] = mapped_column(Float)
    enabled: Mapped[bool] = mapped_column(Boolean)
    # Static labels added to every point of the target, as Prometheus target labels (e.g. `node`), so an
    # engine and the GPU exporter on the same host can be joined; sorted compact JSON like SeriesPoint.labels.
    labels: Mapped[str] = mapped_column(Text, server_default=text("'{}'"))
    # At most this many series per scrape; the rest are dropped, counted and logged (cardinality bound).
    sample_limit: Mapped[int] = mapped_column(Integer, server_default=text("10000"))
    up: Mapped[bool | None] = mapped_column(Boolean)
    last_error: Mapped[str | None] = mapped_column(Text)
    last_scrape_at: Mapped[float | None] = mapped_column(Float)
    scrape_duration_s: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[float] = mapped_column(Float)


class SeriesPoint(Base):
    """Long-format canonical series from scrapes: `labels` is sorted compact JSON of the kept labels."""

    __tablename__ = "series_points"
    __table_args__ = (
        Index("ix_series_points_name_instance_ts", "name", "instance", "ts"),
        Index("ix_series_points_ts", "ts"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    instance: Mapped[str] = mapped_column(Name)
    name: Mapped[str] = mapped_column(Name)
    labels: Mapped[str] = mapped_column(Text)
    ts: Mapped[float] = mapped_column(Float)
    value: Mapped[float] = mapped_column(Float)
    target_id: Mapped[int | None] = mapped_column(BigInteger)


class DownsampledPoint(Base):
    """1-minute aggregates of canonical series per label set, written by `kvpilot db prune` before raw rows go."""

    __tablename__ = "samples_downsampled"
    __table_args__ = (Index("ix_samples_downsampled_name_instance_bucket", "name", "instance", "bucket_ts"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    instance: Mapped[str] = mapped_column(Name)
    name: Mapped[str] = mapped_column(Name)
    labels: Mapped[str] = mapped_column(Text, server_default=text("'{}'"))
    bucket_ts: Mapped[float] = mapped_column(Float)
    bucket_s: Mapped[float] = mapped_column(Float)
    count: Mapped[int] = mapped_column(Integer)
    sum: Mapped[float] = mapped_column(Float)
    min: Mapped[float] = mapped_column(Float)
    max: Mapped[float] = mapped_column(Float)


class StepRollup(Base):
    """Per-minute aggregates of one instance's and run's steps (warm-up left out), kept by the collector's
    maintenance (`collector.rollup`) for history views over long ranges; as long as `samples_downsampled`."""

    __tablename__ = "step_rollups"
    __table_args__ = (Index("ix_step_rollups_bucket_ts", "bucket_ts"),)

    instance: Mapped[str] = mapped_column(Name, primary_key=True)
    run_id: Mapped[str] = mapped_column(Name, primary_key=True)
    bucket_ts: Mapped[float] = mapped_column(Float, primary_key=True)
    steps: Mapped[int] = mapped_column(Integer)
    duration_sum: Mapped[float] = mapped_column(Float)
    kv_usage_max: Mapped[float | None] = mapped_column(Float)  # kv_blocks_used / kv_blocks_total
    running_max: Mapped[int] = mapped_column(Integer)  # num_seqs
    waiting_max: Mapped[int] = mapped_column(Integer)  # queue_depth


class AllocRollup(Base):
    """Per-minute totals of one instance's and run's KV allocation records by op and tier: records, blocks and
    bytes (`collector.rollup`, kept current by ingest like `step_rollups`), for the KV page's long windows; as
    long as `samples_downsampled`."""

    __tablename__ = "alloc_rollups"
    __table_args__ = (Index("ix_alloc_rollups_bucket_ts", "bucket_ts"),)

    instance: Mapped[str] = mapped_column(Name, primary_key=True)
    run_id: Mapped[str] = mapped_column(Name, primary_key=True)
    bucket_ts: Mapped[float] = mapped_column(Float, primary_key=True)
    op: Mapped[str] = mapped_column(String(16), primary_key=True)
    tier: Mapped[str] = mapped_column(String(8), primary_key=True)
    events: Mapped[int] = mapped_column(BigInteger)
    blocks: Mapped[int] = mapped_column(BigInteger)
    bytes: Mapped[int] = mapped_column(BigInteger)


class SampleRollup(Base):
    """Per-minute KV gauges of one instance's and run's engine samples: how many samples, and for each of KV
    usage, cold usage, fragmentation and internal waste the sum and the count of samples that had it (NULL where
    an engine had no value), so a long window's per-minute means are exact (`collector.rollup`, kept current by
    ingest like `step_rollups`), for the KV page's usage chart and the Overview's sampling engines; as long as
    `samples_downsampled`."""

    __tablename__ = "sample_rollups"
    __table_args__ = (Index("ix_sample_rollups_bucket_ts", "bucket_ts"),)

    instance: Mapped[str] = mapped_column(Name, primary_key=True)
    run_id: Mapped[str] = mapped_column(Name, primary_key=True)
    bucket_ts: Mapped[float] = mapped_column(Float, primary_key=True)
    samples: Mapped[int] = mapped_column(BigInteger)
    kv_usage_sum: Mapped[float] = mapped_column(Float)
    kv_usage_n: Mapped[int] = mapped_column(BigInteger)
    cold_usage_sum: Mapped[float] = mapped_column(Float)
    cold_usage_n: Mapped[int] = mapped_column(BigInteger)
    fragmentation_sum: Mapped[float] = mapped_column(Float)
    fragmentation_n: Mapped[int] = mapped_column(BigInteger)
    internal_waste_sum: Mapped[float] = mapped_column(Float)
    internal_waste_n: Mapped[int] = mapped_column(BigInteger)


class LatencySketch(Base):
    """Per minute and request stage, a fleet's finished requests (warm-up left out) in logarithmic bins, with
    each bin's count, sum and largest value (`collector.latency_rollup`, read by `collector.queries.latency_sketch`):
    a long window's percentiles without sorting every request of it. Kept as long as `samples_downsampled`."""

    __tablename__ = "latency_sketches"

    metric: Mapped[str] = mapped_column(String(16), primary_key=True)
    bucket_ts: Mapped[float] = mapped_column(Float, primary_key=True)
    bin: Mapped[int] = mapped_column(Integer, primary_key=True)
    count: Mapped[int] = mapped_column(BigInteger)
    total: Mapped[float] = mapped_column(Float)
    peak: Mapped[float] = mapped_column(Float)


class RequestStageMinute(Base):
    """Per minute, a fleet's finished requests (warm-up left out): how many, and the sums of their stages'
    seconds and of their swaps and preemptions (`collector.latency_rollup`, beside the sketch, under its own
    watermark), so the Latency page's stage breakdown over a long window reads a row a minute instead of every
    request. Sums add, so any set of minutes has exact means. Kept as long as the sketch."""

    __tablename__ = "request_stage_minutes"

    bucket_ts: Mapped[float] = mapped_column(Float, primary_key=True)
    requests: Mapped[int] = mapped_column(BigInteger)
    queue_s: Mapped[float] = mapped_column(Float)
    prefill_s: Mapped[float] = mapped_column(Float)
    decode_s: Mapped[float] = mapped_column(Float)
    decode_excl_swap_s: Mapped[float] = mapped_column(Float)  # max(decode - swap, 0) per request, summed
    swap_s: Mapped[float] = mapped_column(Float)
    e2e_s: Mapped[float] = mapped_column(Float)
    frontend_s: Mapped[float] = mapped_column(Float)  # a request that did not measure it counts 0
    swaps: Mapped[int] = mapped_column(BigInteger)
    preemptions: Mapped[int] = mapped_column(BigInteger)


class RollupWatermark(Base):
    """How far a rollup is complete: buckets before `through_ts` are rolled up, later ones read raw."""

    __tablename__ = "rollup_watermarks"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    through_ts: Mapped[float] = mapped_column(Float)


PROPOSAL_STATUSES = ("pending", "accepted", "rejected", "applied")


class Proposal(Base):
    """A tuning proposal: `config_yaml` is an EngineConfig file, so applying it is `engine serve --config`."""

    __tablename__ = "proposals"
    __table_args__ = (
        CheckConstraint("status IN ('pending', 'accepted', 'rejected', 'applied')", name="status"),
        Index("ix_proposals_status_created_at", "status", "created_at"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)
    status: Mapped[str] = mapped_column(String(16))
    study_name: Mapped[str | None] = mapped_column(Name)
    instance: Mapped[str | None] = mapped_column(Name)
    config_yaml: Mapped[str] = mapped_column(Text)
    report_md: Mapped[str] = mapped_column(Text)
    baseline_metrics: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    best_metrics: Mapped[dict[str, Any] | None] = mapped_column(JSON)


EVENT_TABLES = {
    "request": RequestRow.__table__,
    "step": StepRow.__table__,
    "alloc": AllocRow.__table__,
    "sample": SampleRow.__table__,
    "gap": GapRow.__table__,
}
RAW_TABLES = (RequestRow, StepRow, AllocRow, SampleRow, GapRow, SeriesPoint)


# --- alerts (owned by the alerts package; revision d4a1e7c2b9f0) -----------------------------------------
# Alert state, the single-evaluator lease, groups (Alertmanager's notification log), silences and the
# notification outbox with its delivery attempts. Written only by alerts.store, always under the lease.


class AlertState(Base):
    """One active alert (pending, firing, or resolved within retention) of one rule, by label fingerprint."""

    __tablename__ = "alert_states"
    __table_args__ = (UniqueConstraint("rule", "fingerprint", name="rule_fingerprint"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    rule: Mapped[str] = mapped_column(Name)
    fingerprint: Mapped[str] = mapped_column(String(16))
    labels: Mapped[dict[str, Any]] = mapped_column(JSON)
    annotations: Mapped[dict[str, Any]] = mapped_column(JSON)
    state: Mapped[str] = mapped_column(String(16))
    active_at: Mapped[float] = mapped_column(Float)
    fired_at: Mapped[float | None] = mapped_column(Float)
    resolved_at: Mapped[float | None] = mapped_column(Float)
    keep_firing_since: Mapped[float | None] = mapped_column(Float)
    last_value: Mapped[float] = mapped_column(Float)
    last_eval_at: Mapped[float] = mapped_column(Float)
    generator_url: Mapped[str] = mapped_column(Text)


class AlertEvaluatorLease(Base):
    """One row (id=1): who may evaluate and notify, until when, and the fencing token of that tenure."""

    __tablename__ = "alert_evaluator_lease"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    holder: Mapped[str] = mapped_column(Name)
    token: Mapped[int] = mapped_column(BigInteger)
    expires_at: Mapped[float] = mapped_column(Float)
    acquired_at: Mapped[float] = mapped_column(Float)
    renewed_at: Mapped[float] = mapped_column(Float)


class AlertGroup(Base):
    """Alertmanager's aggregation group plus its notification-log entry, per receiver and group key."""

    __tablename__ = "alert_groups"
    __table_args__ = (UniqueConstraint("receiver", "group_key", name="receiver_group_key"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    receiver: Mapped[str] = mapped_column(Name)
    group_key: Mapped[str] = mapped_column(String(1000))
    group_labels: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[float] = mapped_column(Float)
    next_flush_at: Mapped[float] = mapped_column(Float)
    last_notified_at: Mapped[float | None] = mapped_column(Float)
    last_firing: Mapped[list[Any]] = mapped_column(JSON)
    last_resolved: Mapped[list[Any]] = mapped_column(JSON)
    flushed_resolved: Mapped[list[Any]] = mapped_column(JSON)
    seq: Mapped[int] = mapped_column(Integer)


class AlertSilence(Base):
    """An Alertmanager-style silence: alerts matching every matcher are not notified between the times."""

    __tablename__ = "alert_silences"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    matchers: Mapped[list[Any]] = mapped_column(JSON)
    starts_at: Mapped[float] = mapped_column(Float)
    ends_at: Mapped[float] = mapped_column(Float, index=True)
    created_by: Mapped[str] = mapped_column(Name)
    comment: Mapped[str] = mapped_column(Text)
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)


class AlertNotification(Base):
    """The outbox: one notification to one receiver, written in the transaction that decided to send it."""

    __tablename__ = "alert_notifications"
    __table_args__ = (
        CheckConstraint("status IN ('pending', 'delivered', 'failed', 'expired')", name="status"),
        Index("ix_alert_notifications_status_next_attempt_at", "status", "next_attempt_at"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    idempotency_key: Mapped[str] = mapped_column(Name, unique=True)
    receiver: Mapped[str] = mapped_column(Name)
    kind: Mapped[str] = mapped_column(String(16))
    url: Mapped[str] = mapped_column(String(2000))
    group_key: Mapped[str] = mapped_column(String(1000))
    body: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16))
    attempts: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[float] = mapped_column(Float)
    next_attempt_at: Mapped[float] = mapped_column(Float)
    claim_token: Mapped[int | None] = mapped_column(BigInteger)
    claim_expires_at: Mapped[float | None] = mapped_column(Float)
    delivered_at: Mapped[float | None] = mapped_column(Float)
    last_error: Mapped[str | None] = mapped_column(Text)
    fencing_token: Mapped[int] = mapped_column(BigInteger)
    due_at: Mapped[float] = mapped_column(Float)


class AlertNotificationAttempt(Base):
    """One HTTP attempt at delivering a notification, successful or not."""

    __tablename__ = "alert_notification_attempts"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    notification_id: Mapped[int] = mapped_column(BigInteger, index=True)
    attempt: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[float] = mapped_column(Float)
    duration_s: Mapped[float] = mapped_column(Float)
    http_status: Mapped[int | None] = mapped_column(Integer)
    outcome: Mapped[str] = mapped_column(String(16))
    error: Mapped[str | None] = mapped_column(Text)
