"""The dashboard's one settings class: what it may reach and who may change things.

Everything here comes from the operator's environment, never from a visitor: the engines whose running
config the Tuning page reads (`KVPILOT_DASHBOARD_ENGINES=name=url,...`, the admin token from
`KVPILOT_ADMIN_TOKEN`), the write credential (`KVPILOT_DASHBOARD_PASSWORD`, or a trusted reverse-proxy
header named by `KVPILOT_DASHBOARD_TRUST_PROXY_HEADER`), the header in which such a proxy passes the
client's address (`KVPILOT_DASHBOARD_CLIENT_ADDRESS_HEADER`, for sign-in lockouts) and the alert rule
files the Alerts page lists (`KVPILOT_DASHBOARD_RULE_FILES`, default: the built-in rules). See
dashboard/auth.py for how they are used.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlsplit

from pydantic import AliasChoices, Field, SecretStr, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

ENGINE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
HEADER_NAME = re.compile(r"^[A-Za-z0-9-]{1,64}$")
LEGACY_ENGINE = "engine"  # the name KVPILOT_ENGINE_URL's engine goes by


class SettingsError(ValueError):
    """A dashboard setting the operator has to fix; the message names the variable."""


def parse_engines(text: str) -> dict[str, str]:
    """`name=url,name=url` -> {name: url}. Only http(s) URLs without credentials, query or fragment."""
    engines: dict[str, str] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, sep, url = (s.strip() for s in item.partition("="))
        if not sep or not ENGINE_NAME.match(name):
            raise SettingsError(
                f"KVPILOT_DASHBOARD_ENGINES: {item!r} is not name=url (a name of letters, digits, '.', '_', '-')"
            )
        engines[name] = check_engine_url(url, f"KVPILOT_DASHBOARD_ENGINES ({name})")
    return engines


def check_engine_url(url: str, where: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise SettingsError(f"{where}: {url!r} is not an http(s) URL")
    if parts.username or parts.password or parts.query or parts.fragment:
        raise SettingsError(f"{where}: give the engine's base URL only (no credentials, query or fragment)")
    return url.rstrip("/")


class DashboardSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVPILOT_DASHBOARD_", extra="ignore")

    engines: str = Field("", description="name=url,... of engines whose /admin/config the Tuning page reads")
    engine_url: str = Field(
        "",
        validation_alias=AliasChoices("KVPILOT_DASHBOARD_ENGINE_URL", "KVPILOT_ENGINE_URL"),
        description="one engine, named 'engine' (what `kvpilot demo` sets)",
    )
    admin_token: SecretStr | None = Field(
        None,
        validation_alias=AliasChoices("KVPILOT_DASHBOARD_ADMIN_TOKEN", "KVPILOT_ADMIN_TOKEN"),
        description="bearer token for the engines' /admin/config; sent to the configured engines only",
    )
    password: SecretStr | None = Field(None, description="write password: silences and proposal decisions")
    trust_proxy_header: str | None = Field(
        None, description="header with the user a reverse proxy on this host authenticated (X-Forwarded-User)"
    )
    client_address_header: str | None = Field(
        None, description="header with the client's address a reverse proxy on this host sets (X-Forwarded-For)"
    )
    rule_files: str = Field("", description="alert rule files to list (comma-separated); default built-in")

    @field_validator("trust_proxy_header", "client_address_header")
    @classmethod
    def _header(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None or not value.strip():
            return None
        if not HEADER_NAME.match(value.strip()):
            raise ValueError(
                f"KVPILOT_DASHBOARD_{str(info.field_name).upper()} must be a header name such as X-Forwarded-User"
            )
        return value.strip()

    @field_validator("password")
    @classmethod
    def _password(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None or not value.get_secret_value():
            return None
        if len(value.get_secret_value()) < 12:
            raise ValueError("KVPILOT_DASHBOARD_PASSWORD must be at least 12 characters")
        return value

    def engine_map(self) -> dict[str, str]:
        """The engines a visitor may pick from (by name); SettingsError names a malformed entry."""
        engines = parse_engines(self.engines)
        if self.engine_url.strip() and LEGACY_ENGINE not in engines:
            engines[LEGACY_ENGINE] = check_engine_url(self.engine_url.strip(), "KVPILOT_ENGINE_URL")
        return engines

    def rule_paths(self) -> list[Path]:
        from alerts.rules import BUILTIN_RULES

        paths = [Path(p.strip()) for p in self.rule_files.split(",") if p.strip()]
        return paths or [BUILTIN_RULES]

    @property
    def write_auth(self) -> str | None:
        """How writers authenticate: 'proxy', 'password', or None (the dashboard is read-only)."""
        if self.trust_proxy_header:
            return "proxy"
        if self.password is not None:
            return "password"
        return None


def load() -> DashboardSettings:
    """The settings from the environment now (read on every run: cheap, and tests set the environment)."""
    return DashboardSettings()
