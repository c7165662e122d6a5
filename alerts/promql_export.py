"""`kvpilot alerts export-prometheus`: the rules as real PromQL over the engine's /metrics names.

Plain canonical series are renamed through collector.series's kvpilot mappings (`queue_depth` ->
`kvpilot_queue_depth`); series that only exist derived in kvpilot get their PromQL definition
(`memory_usage` -> used / total); a range over a derived series becomes a subquery. External names a
rule was written with (`vllm:num_requests_waiting`, `DCGM_FI_DEV_FB_USED`) stay as written: the exporter
publishes them, in the unit the rule reads them in. Vector matching (`on`, `ignoring`, `group_left`,
`group_right`) is copied as is. The result is a rule file that `promtool check rules` accepts and a stock
Prometheus + Alertmanager can run.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from alerts.durations import format_duration
from alerts.expr_ast import (
    Aggregate,
    Binary,
    Call,
    Matcher,
    MatrixSelector,
    Node,
    NumberLiteral,
    Paren,
    Unary,
    VectorSelector,
)
from alerts.expr_parser import parse_expr
from alerts.rules import RuleGroup
from alerts.series_catalog import external_names, known_series
from alerts.templates import go_format
from collector.series import MAPPINGS

SUBQUERY_STEP = "1m"


class ExportError(ValueError):
    """A rule uses a series that has no Prometheus equivalent."""


def _renames() -> dict[str, str]:
    names: dict[str, str] = {"up": "up", "scrape_duration_seconds": "scrape_duration_seconds"}
    # The engine's own count of what its sink lost (per reason, summed over kinds). Not a scraper mapping:
    # the collector reads this series from the sinks' gap records, and a scraped copy would be a second
    # series of it.
    names["events_lost_total"] = "kvpilot_telemetry_events_dropped_total"
    for mapping in MAPPINGS:
        if mapping.source == "kvpilot" and mapping.scale == 1.0:
            names.setdefault(mapping.canonical, mapping.external)
            if mapping.canonical.endswith("_count") and mapping.external.endswith("_count"):
                names.setdefault(mapping.canonical[:-6] + "_bucket", mapping.external[:-6] + "_bucket")
    return names


RENAMES = _renames()
# Derived series: PromQL built from /metrics names; `{m}` receives the selector's label matchers.
DERIVED: dict[str, Callable[[str], str]] = {
    "memory_usage": lambda m: f"(kvpilot_memory_used_bytes{m} / kvpilot_memory_total_bytes{m})",
    "swap_rate": lambda m: f"sum without (direction) (rate(kvpilot_swaps_total{m}[1m]))",
    "ttft_p99_seconds": lambda m: (
        "histogram_quantile(0.99, sum by (instance, job, le) "
        f"(rate(kvpilot_time_to_first_token_seconds_bucket{m}[5m])))"
    ),
}


def is_plain_rename(name: str) -> bool:
    return name in RENAMES and name not in DERIVED


def is_external(name: str) -> bool:
    """An exporter's own name (vllm:..., DCGM_...): exported as written, a stock Prometheus scrapes it."""
    return name not in known_series() and name in external_names()


def _matchers(matchers: tuple[Matcher, ...]) -> str:
    if not matchers:
        return ""
    parts = []
    for m in matchers:
        escaped = m.value.replace("\\", "\\\\").replace('"', '\\"')
        parts.append(f'{m.label}{m.op}"{escaped}"')
    return "{" + ", ".join(parts) + "}"


def _offset(seconds: float) -> str:
    if not seconds:
        return ""
    return f" offset -{format_duration(-seconds)}" if seconds < 0 else f" offset {format_duration(seconds)}"


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Inf" if value > 0 else "-Inf"
    return go_format(value)


def to_promql(node: Node) -> str:
    if isinstance(node, NumberLiteral):
        return _number(node.value)
    if isinstance(node, VectorSelector):
        return _selector(node)
    if isinstance(node, MatrixSelector):
        sel = node.selector
        rng = format_duration(node.range_s)
        if sel.name in DERIVED:
            return f"({DERIVED[sel.name](_matchers(sel.matchers))})[{rng}:{SUBQUERY_STEP}]{_offset(sel.offset_s)}"
        return f"{_renamed(sel.name)}{_matchers(sel.matchers)}[{rng}]{_offset(sel.offset_s)}"
    if isinstance(node, Paren):
        return f"({to_promql(node.expr)})"
    if isinstance(node, Unary):
        return f"-{to_promql(node.expr)}"
    if isinstance(node, Call):
        return f"{node.func}({', '.join(to_promql(a) for a in node.args)})"
    if isinstance(node, Aggregate):
        grouping = ""
        if node.grouping or node.without:
            grouping = f" {'without' if node.without else 'by'} ({', '.join(node.grouping)})"
        args = to_promql(node.expr) if node.param is None else f"{to_promql(node.param)}, {to_promql(node.expr)}"
        return f"{node.op}{grouping} ({args})"
    if isinstance(node, Binary):
        modifiers = " bool" if node.return_bool else ""
        if node.on is not None:
            modifiers += f" on ({', '.join(node.on)})"
        elif node.ignoring is not None:
            modifiers += f" ignoring ({', '.join(node.ignoring)})"
        if node.group is not None:
            modifiers += f" group_{node.group}" + (f" ({', '.join(node.include)})" if node.include else "")
        return f"{to_promql(node.lhs)} {node.op}{modifiers} {to_promql(node.rhs)}"
    raise ExportError(f"cannot export {type(node).__name__}")


def _renamed(name: str) -> str:
    if is_external(name):
        return name
    if name not in RENAMES:
        raise ExportError(f"series {name!r} has no /metrics equivalent to export to PromQL")
    return RENAMES[name]


def _selector(sel: VectorSelector) -> str:
    if sel.name in DERIVED:
        text = DERIVED[sel.name](_matchers(sel.matchers))
        if sel.offset_s:
            raise ExportError(f"offset on derived series {sel.name!r} is not exportable; use a range function")
        return text if text.startswith("(") else f"({text})"
    return f"{_renamed(sel.name)}{_matchers(sel.matchers)}{_offset(sel.offset_s)}"


def export_groups(groups: list[RuleGroup]) -> dict[str, Any]:
    out_groups = []
    for group in groups:
        rules = []
        for rule in group.rules:
            item: dict[str, Any] = {"alert": rule.name, "expr": to_promql(rule.expr)}
            if rule.for_s:
                item["for"] = format_duration(rule.for_s)
            if rule.keep_firing_for_s:
                item["keep_firing_for"] = format_duration(rule.keep_firing_for_s)
            if rule.labels:
                item["labels"] = dict(rule.labels)
            if rule.annotations:
                item["annotations"] = dict(rule.annotations)
            rules.append(item)
        out_groups.append({"name": group.name, "interval": format_duration(group.interval_s), "rules": rules})
    return {"groups": out_groups}


def export_yaml(groups: list[RuleGroup]) -> str:
    header = "# Generated by `kvpilot alerts export-prometheus` from kvpilot rule files; PromQL over /metrics names.\n"
    return header + yaml.safe_dump(export_groups(groups), sort_keys=False, allow_unicode=True, width=1000)


def write_export(groups: list[RuleGroup], path: str | Path) -> None:
    """Write atomically: a failed export never leaves a truncated rules file for Prometheus to load."""
    target = Path(path)
    text = export_yaml(groups)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(target)


def promtool_test_inputs(series: str, values: str) -> list[tuple[str, str]] | None:
    """The /metrics-named input series equivalent to one canonical input series, for `promtool test rules`.

    Returns None where the semantics differ (a gauge exported as a rate of a counter, histograms).
    """
    from alerts.promtest import expand_values

    if is_external(series):
        return [(series, values)]
    if is_plain_rename(series):
        return [(RENAMES[series], values)]
    if series == "memory_usage":
        tokens = ["_" if v is None else ("stale" if v != v else "1") for v in expand_values(values)]
        return [("kvpilot_memory_used_bytes", values), ("kvpilot_memory_total_bytes", " ".join(tokens))]
    return None


def promtool_test_file(test_doc: dict[str, Any], exported_rules: str) -> dict[str, Any] | None:
    """A promtool test document over exported rules, or None if some input series or expression test
    cannot be translated (an expected sample named after a derived series: PromQL's result has no name)."""
    from alerts.promtest import parse_series

    out = dict(test_doc)
    out["rule_files"] = [exported_rules]
    tests = []
    for test in test_doc.get("tests") or []:
        new_inputs: list[dict[str, str]] = []
        for entry in test.get("input_series") or []:
            name, labels = parse_series(str(entry["series"]))
            translated = promtool_test_inputs(name, str(entry.get("values", "")))
            if translated is None:
                return None
            new_inputs.extend({"series": _series_text(metric, labels), "values": vals} for metric, vals in translated)
        new_test = dict(test, input_series=new_inputs)
        if test.get("promql_expr_test"):
            cases = [_expr_case(case) for case in test["promql_expr_test"]]
            if any(case is None for case in cases):
                return None
            new_test["promql_expr_test"] = cases
        tests.append(new_test)
    out["tests"] = tests
    return out


def _series_text(name: str, labels: dict[str, str]) -> str:
    label_text = ", ".join(f"{k}={_quote(v)}" for k, v in sorted(labels.items()))
    return f"{name}{{{label_text}}}"


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _expr_case(case: dict[str, Any]) -> dict[str, Any] | None:
    """One promql_expr_test over /metrics names: the expression exported, expected names renamed."""
    from alerts.promtest import parse_series

    samples = []
    for sample in case.get("exp_samples") or []:
        text = str(sample.get("labels", "") or "").strip()
        if text and not text.startswith("{"):
            name, labels = parse_series(text)
            if name in DERIVED or not (is_external(name) or name in RENAMES):
                return None
            text = _series_text(_renamed(name), labels)
        samples.append(dict(sample, labels=text))
    return dict(case, expr=to_promql(parse_expr(str(case.get("expr", "")))), exp_samples=samples)
