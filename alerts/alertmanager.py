"""Alertmanager's wire formats: label-set fingerprints, webhook payload version 4, the v2 postable alert.

Receivers written for Alertmanager must work unchanged, so these follow Alertmanager field for field:
the fingerprint is prometheus/common's LabelSet.Fingerprint (FNV-1a 64 over label names and values in
name order, each followed by the 0xff separator byte, printed as 16 hex digits); times are RFC 3339 with
nanoseconds trimmed like Go's time.Time JSON; a firing alert's endsAt is Go's zero time, as Alertmanager
hides an end time that has not been reached.
"""

from __future__ import annotations

import datetime as dt
import urllib.parse
from collections.abc import Iterable, Mapping
from typing import Any

FNV_OFFSET64 = 14695981039346656037
FNV_PRIME64 = 1099511628211
SEPARATOR_BYTE = 0xFF
_MASK64 = (1 << 64) - 1
GO_ZERO_TIME = "0001-01-01T00:00:00Z"


def _fnv_add(h: int, data: bytes) -> int:
    for byte in data:
        h = ((h ^ byte) * FNV_PRIME64) & _MASK64
    return h


def fingerprint_int(labels: Mapping[str, str]) -> int:
    h = FNV_OFFSET64
    for name in sorted(labels):
        h = _fnv_add(h, name.encode())
        h = _fnv_add(h, bytes((SEPARATOR_BYTE,)))
        h = _fnv_add(h, labels[name].encode())
        h = _fnv_add(h, bytes((SEPARATOR_BYTE,)))
    return h


def fingerprint(labels: Mapping[str, str]) -> str:
    """Alertmanager's `fingerprint` field: model.LabelSet.Fingerprint().String()."""
    return f"{fingerprint_int(labels):016x}"


def labelset_string(labels: Mapping[str, str]) -> str:
    """model.LabelSet.String(): `{a="1", b="2"}` sorted, values quoted as Go's %q does."""
    return "{" + ", ".join(f"{k}={go_quote(labels[k])}" for k in sorted(labels)) + "}"


def go_quote(value: str) -> str:
    out = ['"']
    for ch in value:
        if ch in ('"', "\\"):
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def rfc3339(ts: float | None) -> str:
    """Go's time.Time MarshalJSON (RFC3339Nano, UTC, trailing zeros of the fraction trimmed)."""
    if ts is None:
        return GO_ZERO_TIME
    micros = round(ts * 1_000_000)
    when = dt.datetime.fromtimestamp(micros // 1_000_000, tz=dt.UTC)
    base = when.strftime("%Y-%m-%dT%H:%M:%S")
    frac = micros % 1_000_000
    if frac:
        base += "." + f"{frac:06d}".rstrip("0")
    return base + "Z"


def group_key(route_key: str, group_labels: Mapping[str, str]) -> str:
    """Alertmanager's groupKey: the route's key, ':', the group labels (e.g. `{}:{alertname="X"}`)."""
    return f"{route_key}:{labelset_string(group_labels)}"


def generator_url(external_url: str, expr: str) -> str:
    """Prometheus's generatorURL: the graph page for the rule's expression."""
    query = urllib.parse.urlencode({"g0.expr": expr, "g0.tab": "1"})
    return f"{external_url.rstrip('/')}/graph?{query}"


def _common(maps: list[dict[str, str]]) -> dict[str, str]:
    if not maps:
        return {}
    common = dict(maps[0])
    for other in maps[1:]:
        for key in list(common):
            if other.get(key) != common[key]:
                del common[key]
    return common


def webhook_alert(
    *,
    status: str,
    labels: dict[str, str],
    annotations: dict[str, str],
    starts_at: float,
    ends_at: float | None,
    generator: str,
) -> dict[str, Any]:
    return {
        "status": status,
        "labels": dict(labels),
        "annotations": dict(annotations),
        "startsAt": rfc3339(starts_at),
        "endsAt": rfc3339(ends_at if status == "resolved" else None),
        "generatorURL": generator,
        "fingerprint": fingerprint(labels),
    }


def _alert_order(alert: dict[str, Any]) -> tuple:
    """types.AlertSlice order: by job, then instance (alerts carrying them first), then the label set."""
    labels = alert["labels"]
    return (
        ("job" not in labels, labels.get("job", "")),
        ("instance" not in labels, labels.get("instance", "")),
        sorted(labels.items()),
    )


def webhook_payload(
    *,
    receiver: str,
    alerts: Iterable[dict[str, Any]],
    group_labels: dict[str, str],
    group_key_text: str,
    external_url: str,
    max_alerts: int = 0,
) -> dict[str, Any]:
    """Alertmanager's webhook body, version 4 (notify/webhook: Message = template.Data + version, key, truncated)."""
    all_alerts = list(alerts)
    all_alerts.sort(key=_alert_order)
    kept = all_alerts[:max_alerts] if max_alerts > 0 else all_alerts
    status = "firing" if any(a["status"] == "firing" for a in all_alerts) else "resolved"
    return {
        "receiver": receiver,
        "status": status,
        "alerts": kept,
        "groupLabels": dict(group_labels),
        "commonLabels": _common([a["labels"] for a in all_alerts]),
        "commonAnnotations": _common([a["annotations"] for a in all_alerts]),
        "externalURL": external_url,
        "version": "4",
        "groupKey": group_key_text,
        "truncatedAlerts": len(all_alerts) - len(kept),
    }


def postable_alert(
    *, labels: dict[str, str], annotations: dict[str, str], starts_at: float, ends_at: float, generator: str
) -> dict[str, Any]:
    """One element of Alertmanager's POST /api/v2/alerts body (what Prometheus itself sends)."""
    return {
        "labels": dict(labels),
        "annotations": dict(annotations),
        "startsAt": rfc3339(starts_at),
        "endsAt": rfc3339(ends_at),
        "generatorURL": generator,
    }
