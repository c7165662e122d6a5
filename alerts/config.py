"""Notifier configuration: an Alertmanager-style route tree (one level of child routes) and receivers.

Defaults are Alertmanager's: group_wait 30s, group_interval 5m, repeat_interval 4h, no group_by (one
group per route), send_resolved true. `group_by: ['...']` groups by every label, as in Alertmanager.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator

from alerts.durations import parse_duration
from alerts.matchers import Matcher

DurationS = Annotated[float, Field(ge=0)]


def _duration(value: object) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return parse_duration(value)


class Receiver(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, Field(min_length=1, max_length=200)]
    url: Annotated[str, Field(pattern=r"^https?://")]
    kind: Literal["webhook", "alertmanager"] = "webhook"
    send_resolved: bool = True
    max_alerts: Annotated[int, Field(ge=0)] = 0
    secret: str | None = None
    timeout_s: Annotated[float, Field(gt=0)] = 10.0


class Route(BaseModel):
    model_config = ConfigDict(extra="forbid")

    receiver: str | None = None
    group_by: list[str] | None = None
    group_wait_s: DurationS | None = None
    group_interval_s: DurationS | None = None
    repeat_interval_s: DurationS | None = None
    matchers: list[Matcher] = Field(default_factory=list)
    routes: list[Route] = Field(default_factory=list)
    continue_: bool = Field(False, alias="continue")

    @field_validator("group_wait_s", "group_interval_s", "repeat_interval_s", mode="before")
    @classmethod
    def _durations(cls, value: object) -> object:
        return None if value is None else _duration(value)


class NotifierConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    receivers: list[Receiver] = Field(default_factory=list)
    route: Route = Field(default_factory=Route)
    external_url: str = "http://localhost:9093"
    alertmanager_resend_s: DurationS = 60.0


class ResolvedRoute(BaseModel):
    """A route with its parent's settings filled in, and Alertmanager's route key."""

    key: str
    receiver: str
    group_by: list[str]
    group_wait_s: float
    group_interval_s: float
    repeat_interval_s: float
    matchers: list[Matcher]
    continue_: bool = False


def resolve_routes(config: NotifierConfig) -> tuple[ResolvedRoute, list[ResolvedRoute]]:
    """The root and its children, each inheriting unset fields, validated against the receivers."""
    names = {r.name for r in config.receivers}
    root = config.route
    root_receiver = root.receiver or (config.receivers[0].name if config.receivers else "")
    base = ResolvedRoute(
        key="{}",
        receiver=root_receiver,
        group_by=list(root.group_by or []),
        group_wait_s=30.0 if root.group_wait_s is None else root.group_wait_s,
        group_interval_s=300.0 if root.group_interval_s is None else root.group_interval_s,
        repeat_interval_s=4 * 3600.0 if root.repeat_interval_s is None else root.repeat_interval_s,
        matchers=[],
    )
    children = []
    for child in root.routes:
        ordered = sorted(child.matchers, key=lambda m: (m.name, m.value, m.match_type))  # as Alertmanager's Route
        key = "{}/{" + ",".join(m.text() for m in ordered) + "}"
        children.append(
            ResolvedRoute(
                key=key,
                receiver=child.receiver or base.receiver,
                group_by=list(child.group_by if child.group_by is not None else base.group_by),
                group_wait_s=base.group_wait_s if child.group_wait_s is None else child.group_wait_s,
                group_interval_s=base.group_interval_s if child.group_interval_s is None else child.group_interval_s,
                repeat_interval_s=base.repeat_interval_s
                if child.repeat_interval_s is None
                else child.repeat_interval_s,
                matchers=child.matchers,
                continue_=child.continue_,
            )
        )
    for route in [base, *children]:
        if config.receivers and route.receiver not in names:
            raise ValueError(
                f"route {route.key}: receiver {route.receiver!r} is not defined (receivers: {sorted(names)})"
            )
    return base, children


def routes_for(labels: dict[str, str], root: ResolvedRoute, children: list[ResolvedRoute]) -> list[ResolvedRoute]:
    matched: list[ResolvedRoute] = []
    for child in children:
        if all(m.matches(labels) for m in child.matchers):
            matched.append(child)
            if not child.continue_:
                break
    return matched or [root]


def webhook_config(
    urls: list[str],
    *,
    secret: str | None = None,
    group_wait_s: float = 30.0,
    group_interval_s: float = 300.0,
    repeat_interval_s: float = 4 * 3600.0,
    group_by: list[str] | None = None,
    alertmanager_urls: list[str] | None = None,
    external_url: str = "http://localhost:9093",
) -> NotifierConfig:
    """The common case in code: one webhook receiver per URL (plus Alertmanager forwards), one route."""
    receivers = [
        Receiver(name=f"webhook-{i}" if len(urls) > 1 else "webhook", url=u, secret=secret) for i, u in enumerate(urls)
    ]
    receivers += [
        Receiver(name=f"alertmanager-{i}", url=u.rstrip("/") + "/api/v2/alerts", kind="alertmanager")
        for i, u in enumerate(alertmanager_urls or [])
    ]
    route = Route(
        receiver=receivers[0].name if receivers else None,
        group_by=group_by or ["alertname"],
        group_wait_s=group_wait_s,
        group_interval_s=group_interval_s,
        repeat_interval_s=repeat_interval_s,
    )
    return NotifierConfig(receivers=receivers, route=route, external_url=external_url)


def load_notifier_config(path: str | Path) -> NotifierConfig:
    """Read a YAML file shaped like NotifierConfig (durations as '30s' or seconds)."""
    data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    return NotifierConfig.model_validate(data)
