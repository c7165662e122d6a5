"""The collector's one settings class (STYLE.md 10): environment variables with the `KVPILOT_` prefix.

`KVPILOT_DB_URL` picks the database: SQLite by default, PostgreSQL (psycopg 3) by URL such as
`postgresql+psycopg://user@host/db`. The same class feeds `kvpilot collector serve`, `kvpilot db ...`
and Alembic's env.py, so all three agree on which database they mean.

`KVPILOT_OTLP_INSTANCE_MAP` (JSON, e.g. `{"vllm": "vllm-h200-0"}`) names the instance of OTLP spans by
their `service.name`; see `collector.otlp` for the whole rule.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_DB_URL = "sqlite:///./kvpilot-data/kvpilot.db"


class CollectorSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVPILOT_", extra="ignore")

    db_url: str = DEFAULT_DB_URL
    host: str = "127.0.0.1"
    port: int = Field(8100, ge=0, le=65535)
    ingest_token: str | None = Field(
        None, description="bearer token for /v1/*; required unless the collector listens on loopback only"
    )
    max_batch_bytes: int = Field(16 * 2**20, ge=1024, description="compressed (wire) body limit")
    max_decompressed_bytes: int = Field(64 * 2**20, ge=1024, description="limit after gunzip (zip bombs)")
    max_batch_events: int = Field(20_000, ge=1, le=100_000)
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
    raw_retention_days: float = Field(7.0, gt=0)
    downsample_retention_days: float = Field(90.0, gt=0)
    log_level: str = "info"

    @field_validator("otlp_instance_map")
    @classmethod
    def _instance_names(cls, value: dict[str, str]) -> dict[str, str]:
        """Instance names are stored as they are: refuse at startup what no instance column can hold."""
        for service, instance in value.items():
            if not 1 <= len(instance) <= 200 or "\x00" in instance:
                raise ValueError(f"instance for service {service!r} must be 1..200 characters without NUL")
        return value
