"""Pure reshaping for the pages: config diffs, alert history from notification bodies, matcher parsing.

No Streamlit and no database here, so each piece is tested on plain values.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import yaml

MISSING = object()


UNIT_SUFFIXES = (("_tok_s", " (tok/s)"), ("_tps", " (tok/s)"), ("_rps", " (req/s)"), ("_s", " (s)"))


def human(name: str) -> str:
    """A snake_case metric name as a header: `ttft_p99_s` -> `ttft p99 (s)`."""
    for suffix, unit in UNIT_SUFFIXES:
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)].replace("_", " ") + unit
    return name.replace("_", " ")


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'cache': {'block_size': 16}} -> {'cache.block_size': 16}; lists and scalars are leaves."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def config_changes(running: dict[str, Any], proposed: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per setting the proposal sets to a value other than the running one.

    Only keys the proposal names are compared: a proposal file may omit settings it leaves as they are.
    """
    ran = flatten(running)
    rows = []
    for key, value in flatten(proposed).items():
        current = ran.get(key, MISSING)
        if current is MISSING or current != value:
            rows.append(
                {
                    "setting": key,
                    "running": "(not set)" if current is MISSING else _show(current),
                    "proposed": _show(value),
                }
            )
    return rows


def _show(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (dict, list, bool)) or value is None else str(value)


def unified_diff(running: dict[str, Any], proposed: dict[str, Any], *, running_label: str) -> str:
    """A unified diff of the proposal's settings against the same settings of the running config."""
    ran = flatten(running)
    subset: dict[str, Any] = {}
    for key in flatten(proposed):
        if key in ran:
            _set_path(subset, key.split("."), ran[key])
    before = yaml.safe_dump(subset, sort_keys=True).splitlines(keepends=True)
    after = yaml.safe_dump(proposed, sort_keys=True).splitlines(keepends=True)
    return "".join(difflib.unified_diff(before, after, fromfile=running_label, tofile="proposal"))


def _set_path(target: dict[str, Any], path: list[str], value: Any) -> None:
    for part in path[:-1]:
        target = target.setdefault(part, {})
    target[path[-1]] = value


def metric_comparison(before: dict[str, Any] | None, after: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Baseline vs. proposal metrics side by side, with the change; non-numeric values shown as they are."""
    before, after = before or {}, after or {}
    rows = []
    for key in sorted(set(before) | set(after)):
        b, a = before.get(key), after.get(key)
        row: dict[str, Any] = {"metric": key, "before": _num_or_text(b), "after": _num_or_text(a)}
        if _is_num(b) and _is_num(a):
            row["change"] = float(a) - float(b)
            row["change %"] = (float(a) - float(b)) / abs(float(b)) * 100.0 if float(b) else None
        else:
            row["change"], row["change %"] = None, None
        rows.append(row)
    return rows


def proposal_measurements(before: dict[str, Any] | None, after: dict[str, Any] | None) -> list[tuple[str, list]]:
    """(title, rows) sections comparing a proposal's baseline and best measurements.

    The tuner records the study's trial metrics (`trial`), the parameters (`params`) and the confirmation on
    fresh seeds: each side's mean capacity over the comparison's pairs (`heldout_capacity_rps`), or in proposals
    written before the capacity comparison, re-runs (`confirmation`: a list of runs for the baseline,
    `{runs: [...], gain, ...}` for the best). Plain flat metric dicts are compared as they are.
    """
    before, after = before or {}, after or {}
    sections: list[tuple[str, list]] = []
    cap_before, cap_after = before.get("heldout_capacity_rps"), after.get("heldout_capacity_rps")
    if _is_num(cap_before) and _is_num(cap_after):
        sections.append(
            (
                "SLO capacity on held-out seeds (requests/s; mean over the comparison's ABBA pairs)",
                metric_comparison({"capacity_rps": cap_before}, {"capacity_rps": cap_after}),
            )
        )
    runs_before, conf_after = before.get("confirmation"), after.get("confirmation")
    runs_after = conf_after.get("runs") if isinstance(conf_after, dict) else None
    if isinstance(runs_before, list) and isinstance(runs_after, list):
        sections.append(
            (
                f"Confirmation re-runs (mean of {len(runs_before)} baseline and {len(runs_after)} "
                "proposal runs on fresh seeds)",
                metric_comparison(_mean_runs(runs_before), _mean_runs(runs_after)),
            )
        )
    for key, title in (("trial", "In the study (the trial's measurement)"), ("params", "Parameters")):
        if isinstance(before.get(key), dict) or isinstance(after.get(key), dict):
            sections.append((title, metric_comparison(before.get(key), after.get(key))))
    if not sections:
        flat_before = {k: v for k, v in before.items() if not isinstance(v, (dict, list))}
        flat_after = {k: v for k, v in after.items() if not isinstance(v, (dict, list))}
        if flat_before or flat_after:
            sections.append(("Measured", metric_comparison(flat_before, flat_after)))
    return sections


def confirmation_verdict(after: dict[str, Any] | None) -> str | None:
    """'Confirmation holds: serves +12.0% traffic at the same SLOs (90% interval ...)' from the tuner's capacity
    comparison (every engine's), 'Confirmation holds: +12.0% goodput (needed +5.0%)' from a proposal written
    before it; None without one."""
    conf = (after or {}).get("confirmation")
    if not isinstance(conf, dict) or not _is_num(conf.get("gain")):
        return None
    holds = conf.get("holds")
    if holds is None and _is_num(conf.get("gain_low")):  # a vLLM proposal of the first capacity comparisons
        holds = conf["gain_low"] > 0
    verdict = "holds" if holds else "does not hold"
    if conf.get("objective") == "slo_capacity" and isinstance(conf.get("sentence"), str):
        return f"Confirmation {verdict}: {conf['sentence']}."
    if _is_num(conf.get("gain_low")):
        return f"Confirmation {verdict}: {conf['gain']:+.1%} capacity (lower bound {conf['gain_low']:+.1%})."
    needed = f" (needed {conf['min_gain']:+.1%})" if _is_num(conf.get("min_gain")) else ""
    return f"Confirmation {verdict}: {conf['gain']:+.1%} goodput{needed}."


def running_capacity_line(before: dict[str, Any] | None) -> str | None:
    """'The running config served 40.1 req/s within the SLOs: 2.59x the traffic's 15.5 req/s (159% headroom).'
    from the baseline phase's capacity (`baseline_metrics.capacity`, every engine since the one tuning
    pipeline); None for a proposal that did not record it."""
    cap = (before or {}).get("capacity")
    if not isinstance(cap, dict) or not all(_is_num(cap.get(k)) for k in ("capacity_rps", "multiplier", "rate_rps")):
        return None
    m = float(cap["multiplier"])
    room = f"{m - 1:.0%} headroom" if m > 1 else "the traffic is past it"
    return (
        f"The running config served {cap['capacity_rps']:.3g} req/s within the SLOs: {m:.3g}x the traffic's "
        f"{cap['rate_rps']:.3g} req/s ({room})."
    )


def _mean_runs(runs: list[Any]) -> dict[str, float]:
    values: dict[str, list[float]] = {}
    for run in runs:
        if isinstance(run, dict):
            for k, v in run.items():
                if _is_num(v):
                    values.setdefault(k, []).append(float(v))
    return {k: sum(vs) / len(vs) for k, vs in values.items()}


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _num_or_text(v: Any) -> Any:
    return float(v) if _is_num(v) else (None if v is None else str(v))


def parse_time(value: str | None) -> float | None:
    """RFC 3339 (what Alertmanager bodies carry) to epoch seconds; Go's zero time means 'not set'."""
    if not value or value.startswith("0001-01-01"):
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def alerts_in_notification(notification: dict[str, Any], body: str) -> list[dict[str, Any]]:
    """The alerts one outbox row notified about: webhook bodies list them, Alertmanager bodies are a list."""
    try:
        payload = json.loads(body)
    except (TypeError, ValueError):
        return []
    if isinstance(payload, dict):
        alerts = payload.get("alerts") or []
    elif isinstance(payload, list):
        alerts = payload
    else:
        return []
    out = []
    for alert in alerts:
        if not isinstance(alert, dict):
            continue
        labels = alert.get("labels") or {}
        annotations = alert.get("annotations") or {}
        ends = parse_time(alert.get("endsAt"))
        status = alert.get("status") or (
            "resolved" if ends is not None and ends <= notification["created_at"] else "firing"
        )
        out.append(
            {
                "notified_at": notification["created_at"],
                "alertname": labels.get("alertname", ""),
                "status": status,
                "severity": labels.get("severity", ""),
                "instance": labels.get("instance", ""),
                "summary": annotations.get("summary", ""),
                "starts_at": parse_time(alert.get("startsAt")),
                "ends_at": ends,
                "receiver": notification["receiver"],
                "delivery": notification["status"],
                "notification_id": notification["id"],
            }
        )
    return out


def matcher_text(matchers: list[dict[str, Any]]) -> str:
    """Matchers as amtool writes them: alertname="X", instance=~"gpu.*"."""
    parts = []
    for m in matchers:
        op = ("=~" if m.get("isRegex") else "=") if m.get("isEqual", True) else ("!~" if m.get("isRegex") else "!=")
        parts.append(f'{m.get("name")}{op}"{m.get("value")}"')
    return ", ".join(parts)


def matches(matchers: list[dict[str, Any]], labels: dict[str, str]) -> bool:
    """Whether a silence's matchers (stored dicts) all match these labels (Alertmanager's rules)."""
    from alerts.matchers import Matcher

    return all(Matcher.model_validate(m).matches(labels) for m in matchers)


@dataclass(frozen=True)
class Threshold:
    """`series op level` in a rule: the line a chart of that series draws. `alone`: the comparison fires
    the rule by itself (reached through `or` only); otherwise it is one condition of an `and`."""

    series: str
    op: str
    level: float
    rule: str
    alone: bool = True

    @property
    def condition(self) -> str:
        shown = f"{self.level:.0%}" if self.series in PERCENT_SERIES else f"{self.level:g}"
        return f"{self.series} {self.op} {shown}" + ("" if self.alone else " and …")

    @property
    def text(self) -> str:
        return f"{self.rule} fires at {self.condition}"


# Canonical series that are fractions (0..1): thresholds on them read as percentages.
PERCENT_SERIES = frozenset(
    {"kv_usage", "kv_cold_usage", "memory_usage", "utilization", "kv_fragmentation", "prefix_hit_rate"}
)


FLIPPED = {">": "<", "<": ">", ">=": "<=", "<=": ">="}


def thresholds(rule: str, expr: Any) -> list[Threshold]:
    """Each `selector OP number` of an alert expression (alerts.expr_ast), as a chart draws it."""
    from alerts.expr_ast import Binary, NumberLiteral, Paren, VectorSelector

    def bare(node: Any) -> Any:
        while isinstance(node, Paren):
            node = node.expr
        return node

    out: list[Threshold] = []
    stack = [(expr, True)]
    while stack:
        node, alone = stack.pop()
        node = bare(node)
        if not isinstance(node, Binary):
            continue
        if node.op == "or":
            stack += [(node.rhs, alone), (node.lhs, alone)]
        elif node.op in ("and", "unless"):
            stack.append((node.lhs, False))
        elif node.op in FLIPPED and not node.return_bool:
            lhs, rhs, op = bare(node.lhs), bare(node.rhs), node.op
            if isinstance(lhs, NumberLiteral) and isinstance(rhs, VectorSelector):
                lhs, rhs, op = rhs, lhs, FLIPPED[op]
            if isinstance(lhs, VectorSelector) and isinstance(rhs, NumberLiteral):
                out.append(Threshold(lhs.name, op, rhs.value, rule, alone))
    return out
