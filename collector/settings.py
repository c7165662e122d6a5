"""The collector's one settings class: environment variables with the `KVPILOT_` prefix.

`KVPILOT_DB_URL` picks the database: SQLite by default, PostgreSQL (psycopg 3) by URL such as
`postgresql+psycopg://user@host/db`. The same class feeds `kvpilot collector serve`, `kvpilot db ...`
and Alembic's env.py, so all three agree on which database they mean.

`KVPILOT_OTLP_INSTANCE_MAP` (JSON, e.g. `{"vllm": "vllm-h200-0"}`) names the instance of OTLP spans by
their `service.name`; see `collector.otlp` for the whole rule.

Trust (docs/architecture.md, "Trust boundaries"): engines hold `KVPILOT_INGEST_TOKEN` and may push (/v1/ingest,
/v1/traces) and list targets, nothing else. Target administration (POST/DELETE /v1/targets) needs
`KVPILOT_ADMIN_TOKEN`; without one it is refused, unless `KVPILOT_DEV_MODE=true` on a loopback-only
collector. A non-loopback bind without an ingest token (or tokens file), or in dev mode, is refused at
startup. `KVPILOT_TOKENS_FILE` names the file of named identities (`collector.tokens`: roles, hashed
secrets, rotation); the two tokens above act as the identities `ingest` and `admin` (`collector.identities`).
Scrape targets may not resolve to loopback, link-local, unspecified or multicast addresses unless
`KVPILOT_SCRAPE_ALLOW_NETS` (comma-separated networks, e.g. `127.0.0.0/8,::1/128`) names them; cloud
metadata addresses are refused always (`collector.netpolicy`).

Overload (`collector.server.admission`): past `max_inflight_requests` pushes in flight, or
`max_inflight_bytes` of bodies (wire plus inflated) held, a push is answered 429; one that waited
`storage_wait_s` for the database 503; both with `Retry-After`. Cardinality (`collector.claims`):
an ingest identity owns at most `max_instances_per_identity` instances, creates at most
`max_new_instances_per_minute` of them and `max_new_runs_per_minute_per_identity` runs, and an instance
at most `max_new_runs_per_minute` runs.
Time: a pushed event's `ts` lies within `raw_retention_days` back and `max_clock_skew_s` ahead
(`collector.validation.TimeWindow`).
Maintenance (`collector.maintenance`): every `maintenance_interval_s` it makes day partitions
`partitions_ahead_days` ahead (PostgreSQL) and rolls up steps older than the rollup (recounting the last
`rollup_lookback_s` when set).
"""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from plumbing.bind import is_loopback

DEFAULT_DB_URL = "sqlite:///./kvpilot-data/kvpilot.db"
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class CollectorSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVPILOT_", extra="ignore")

    db_url: str = DEFAULT_DB_URL
    host: str = "127.0.0.1"
    port: int = Field(8100, ge=0, le=65535)
    ingest_token: str | None = Field(
        None, description="bearer token for pushes (/v1/ingest, /v1/traces); required unless bound to loopback"
    )
    admin_token: str | None = Field(
        None, description="bearer token for target administration (POST/DELETE /v1/targets); without it, refused"
    )
    tokens_file: Path | None = Field(
        None, description="named identities (kvpilot collector tokens): roles and hashed secrets, re-read on change"
    )
    dev_mode: bool = Field(
        False, description="loopback only: target administration without an admin token (the ingest token, if set)"
    )
    public_metrics: bool = Field(True, description="/metrics without a token (Prometheus scrapes it)")
    public_docs: bool | None = Field(
        None, description="/docs and /openapi.json; default: served only when no token is set"
    )
    max_batch_bytes: int = Field(16 * 2**20, ge=1024, description="compressed (wire) body limit")
    max_decompressed_bytes: int = Field(
        32 * 2**20, ge=1024, description="limit after gunzip (zip bombs); a 20,000-event batch is about 6 MB"
    )
    max_batch_events: int = Field(20_000, ge=1, le=100_000)
    max_inflight_requests: int = Field(
        256, ge=1, description="pushes admitted at once; 429 beyond (those queued for storage: the next round's group)"
    )
    max_inflight_bytes: int = Field(
        256 * 2**20, ge=64 * 1024, description="body bytes (wire plus inflated) held by admitted pushes; 429 beyond"
    )
    storage_wait_s: float = Field(
        3.0,
        gt=0,
        description="an admitted push waits this long for the database, then 503 (under a sink's 5 s timeout)",
    )
    ingest_group_max_batches: int = Field(
        256, ge=1, le=1024, description="pushes stored in one transaction at most (group commit); 1 stores each alone"
    )
    retry_after_s: int = Field(1, ge=1, le=3600, description="Retry-After of a 429/503 for overload")
    gc_young_threshold: int = Field(
        50_000,
        ge=0,
        description="a served collector's young-generation GC threshold, its start-up heap frozen out of collections"
        " (collector.server.run.tune_gc); 0 keeps Python's own settings",
    )
    body_timeout_s: float = Field(10.0, gt=0, description="an admitted push's body must arrive within this (408)")
    max_instances_per_identity: int = Field(1000, ge=1, description="instances one ingest identity may own")
    max_new_instances_per_minute: int = Field(200, ge=1, description="new instances per ingest identity per minute")
    max_new_runs_per_minute: int = Field(100, ge=1, description="new runs per instance per minute")
    max_new_runs_per_minute_per_identity: int = Field(
        1000, ge=1, description="new runs per ingest identity per minute, all its instances together"
    )
    scrape_allow_nets: Annotated[tuple[Network, ...], NoDecode] = Field(
        (), description="networks scrape targets may resolve to although blocked (loopback, link-local...)"
    )
    health_probe_interval_s: float = Field(5.0, gt=0, description="how often /health's database check runs")
    storage_min_free_bytes: int = Field(
        64 * 2**20, ge=0, description="SQLite: /health is 503 with less room than this for the database to grow"
    )
    sqlite_synchronous: Literal["FULL", "NORMAL", "EXTRA"] = Field(
        "FULL", description="FULL: an acknowledged batch survives power loss, not only a crash"
    )
    otlp_max_spans: int = Field(10_000, ge=1, le=100_000, description="spans per POST /v1/traces (413 past it)")
    otlp_instance_map: dict[str, str] = Field(
        default_factory=dict, description="OTLP service.name -> instance, ahead of the resource attributes"
    )
    scrape_enabled: bool = True
    scrape_default_interval_s: float = Field(15.0, gt=0)
    scrape_timeout_s: float = Field(5.0, gt=0)
    raw_retention_days: float = Field(7.0, gt=0, description="also how old a pushed event may be")
    max_clock_skew_s: float = Field(
        300.0, ge=0, le=86_400, description="how far ahead of the collector's clock a pushed event may be"
    )
    downsample_retention_days: float = Field(90.0, gt=0)
    maintenance_interval_s: float = Field(
        60.0,
        gt=0,
        le=86_400,
        description="how often maintenance makes partitions ahead, summarizes BRIN ranges and rolls up steps (the "
        "last hour's reads scan what it has not reached yet)",
    )
    partitions_ahead_days: int = Field(3, ge=1, le=60, description="PostgreSQL: day partitions made ahead of today")
    rollup_lookback_s: float = Field(
        0.0,
        ge=0,
        le=86_400,
        description="each maintenance round also recomputes this much of the step rollup before its watermark from "
        "the raw steps, to repair rows written around ingest (ingest keeps the rollup itself; 0: no recompute)",
    )
    log_level: str = "info"

    @field_validator("otlp_instance_map")
    @classmethod
    def _instance_names(cls, value: dict[str, str]) -> dict[str, str]:
        """Instance names are stored as they are: refuse at startup what no instance column can hold."""
        for service, instance in value.items():
            if not 1 <= len(instance) <= 200 or "\x00" in instance:
                raise ValueError(f"instance for service {service!r} must be 1..200 characters without NUL")
        return value

    @field_validator("scrape_allow_nets", mode="before")
    @classmethod
    def _networks(cls, value: object) -> object:
        """`127.0.0.0/8,10.0.0.0/8` (the environment's form) or a JSON list or a sequence; a bare address is a /32."""
        if isinstance(value, str):
            text = value.strip()
            items = json.loads(text) if text.startswith("[") else [p for p in text.split(",") if p.strip()]
        else:
            items = list(value)  # type: ignore[call-overload]  # any other sequence; list() refuses the rest
        return tuple(ipaddress.ip_network(str(item).strip(), strict=False) for item in items)

    @field_validator("admin_token")
    @classmethod
    def _distinct_tokens(cls, value: str | None, info) -> str | None:
        if value is not None and value == info.data.get("ingest_token"):
            raise ValueError("KVPILOT_ADMIN_TOKEN must differ from KVPILOT_INGEST_TOKEN (every engine holds that one)")
        return value

    @model_validator(mode="after")
    def _budget_holds_one_push(self) -> CollectorSettings:
        """A push at both body limits must fit the byte budget, or it would be refused 429 forever (the
        inflated body counts twice: its parts and their joined copy exist together for a moment)."""
        need = self.max_batch_bytes + 2 * self.max_decompressed_bytes
        if self.max_inflight_bytes < need:
            raise ValueError(
                f"max_inflight_bytes must be at least max_batch_bytes + 2 * max_decompressed_bytes ({need})"
            )
        return self

    @property
    def loopback_only(self) -> bool:
        """Whether the collector listens on a loopback address only (nobody else can reach it)."""
        return is_loopback(self.host)

    @property
    def docs_enabled(self) -> bool:
        """/docs and /openapi.json: as set, else only on a collector without tokens (loopback, development)."""
        if self.public_docs is not None:
            return self.public_docs
        return self.ingest_token is None and self.admin_token is None and self.tokens_file is None
