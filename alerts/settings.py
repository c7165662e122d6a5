"""The alerts service's settings: environment variables with the `KVPILOT_ALERTS_` prefix.

`KVPILOT_ALERTS_API_TOKEN`: the bearer token of the alerts API (`kvpilot alerts run --api-port`). Without
one the API serves loopback only; with one, every route but /-/healthy and /-/ready needs
`Authorization: Bearer TOKEN` (reads and silence writes alike), and the API's docs are not served unless
`KVPILOT_ALERTS_PUBLIC_DOCS=true`. The rest bound what the API accepts.
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from alerts.silences import DEFAULT_MAX_DURATION_S, DEFAULT_MAX_SILENCES


class AlertsSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVPILOT_ALERTS_", extra="ignore")

    api_host: str = "127.0.0.1"
    api_token: str | None = Field(None, description="required when the API listens on anything but loopback")
    max_silence_duration_s: float = Field(DEFAULT_MAX_DURATION_S, gt=0, description="from now to endsAt")
    max_silences: int = Field(DEFAULT_MAX_SILENCES, ge=1, description="unexpired silences; 429 past it")
    max_body_bytes: int = Field(64 * 1024, ge=1024, description="request body; 413 past it, before parsing")
    max_filters: int = Field(32, ge=1, description="`filter` query parameters per request")
    public_docs: bool | None = Field(
        None, description="/docs, /redoc and /openapi.json; default: served only when no token is set"
    )
