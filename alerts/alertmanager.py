"""Alertmanager's wire formats: label-set fingerprints, webhook payload version 4, the v2 postable alert.

Receivers written for Alertmanager must work unchanged, so the webhook body is the one Alertmanager
0.25 posts for the same alerts, byte for byte (alerts/gowire.py has Go's text forms): the fingerprint is
prometheus/common's LabelSet.Fingerprint (FNV-1a 64 over label names and values in name order, each
followed by the 0xff separator byte, printed as 16 hex digits); times are Go's time.Time JSON; a firing
alert's endsAt is Go's zero time, as Alertmanager hides an end time that has not been reached; the
groupKey is the route key, ':', and the group labels as model.LabelSet.String() prints them.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterable, Mapping
from functools import cmp_to_key
from typing import Any

from alerts.gowire import go_json, go_map, go_quote, quote_meta, rfc3339

FNV_OFFSET64 = 14695981039346656037
FNV_PRIME64 = 1099511628211
SEPARATOR_BYTE = 0xFF
_MASK64 = (1 << 64) - 1


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
    """model.LabelSet.String() as Alertmanager 0.25-0.27 prints it: `{a="1", b="2"}`, values quoted with %q.

    prometheus/common before v0.49 sorts the whole `name="value"` strings, not the names: `a1="x"` sorts
    before `a="y"` ('1' < '='). Alertmanager 0.28 and later (common v0.61+) sort by name instead; the two
    differ only when one label name is another followed by a digit.
    """
    return "{" + ", ".join(sorted(f"{k}={go_quote(v)}" for k, v in labels.items())) + "}"


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
    """template.Alert: fields in the Go struct's order, label and annotation maps sorted as Go writes maps."""
    return {
        "status": status,
        "labels": go_map(labels),
        "annotations": go_map(annotations),
        "startsAt": rfc3339(starts_at),
        "endsAt": rfc3339(ends_at if status == "resolved" else None),
        "generatorURL": generator,
        "fingerprint": fingerprint(labels),
    }


def _labelset_before(ours: Mapping[str, str], other: Mapping[str, str]) -> bool:
    """model.LabelSet.Before: the smaller set first, else the first differing name or value in name order."""
    if len(ours) != len(other):
        return len(ours) < len(other)
    for name in sorted([*ours, *other]):
        if name not in ours:
            return True
        if name not in other:
            return False
        if ours[name] != other[name]:
            return ours[name] < other[name]
    return False


def _alert_less(ours: Mapping[str, str], other: Mapping[str, str]) -> bool:
    """types.AlertSlice.Less: by job, then instance (alerts carrying them first), then LabelSet.Before."""
    for name in ("job", "instance"):
        if name not in ours and name not in other:
            continue
        if name not in ours:
            return False
        if name not in other:
            return True
        if ours[name] != other[name]:
            return ours[name] < other[name]
    return _labelset_before(ours, other)


def _alert_cmp(a: dict[str, Any], b: dict[str, Any]) -> int:
    if _alert_less(a["labels"], b["labels"]):
        return -1
    return 1 if _alert_less(b["labels"], a["labels"]) else 0


def webhook_payload(
    *,
    receiver: str,
    alerts: Iterable[dict[str, Any]],
    group_labels: dict[str, str],
    group_key_text: str,
    external_url: str,
    max_alerts: int = 0,
) -> dict[str, Any]:
    """Alertmanager's webhook Message, version 4: template.Data's fields, then version, groupKey, truncatedAlerts.

    As Alertmanager does: the group's alerts sorted (AlertSlice), cut to max_alerts, and only then the
    status and the common labels and annotations computed, over the alerts kept; the receiver name goes
    through regexp.QuoteMeta (template.Data does it for use in templates, and the webhook sends Data).
    """
    ordered = sorted(alerts, key=cmp_to_key(_alert_cmp))
    kept = ordered[:max_alerts] if max_alerts > 0 else ordered
    return {
        "receiver": quote_meta(receiver),
        "status": "firing" if any(a["status"] == "firing" for a in kept) else "resolved",
        "alerts": kept,
        "groupLabels": go_map(group_labels),
        "commonLabels": go_map(_common([a["labels"] for a in kept])),
        "commonAnnotations": go_map(_common([a["annotations"] for a in kept])),
        "externalURL": external_url,
        "version": "4",
        "groupKey": group_key_text,
        "truncatedAlerts": len(ordered) - len(kept),
    }


def webhook_body(payload: Mapping[str, Any]) -> str:
    """The bytes Alertmanager posts: json.NewEncoder(buf).Encode(msg), Go's JSON and a trailing newline."""
    return go_json(payload) + "\n"


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
