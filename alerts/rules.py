"""Rule files in Prometheus's format, loaded all-or-nothing with errors that name file, line and rule.

    groups:
      - name: kvpilot
        interval: 15s
        rules:
          - alert: SchedulerBlocked
            expr: utilization < 0.5 and queue_depth > 100
            for: 2m
            keep_firing_for: 1m
            labels: {severity: page}
            annotations: {summary: "{{ $labels.instance }} queue {{ $value }}"}

A file with any error yields no rules at all (`RuleFileError` lists every problem), so a bad edit never
leaves an evaluator half-loaded. Recording rules (`record:`) are refused with a clear message.

Rules evaluate per label set, as Prometheus's do: `memory_usage > 0.9` fires once per GPU, with the
GPU's labels (gpu, UUID, Hostname, ...) in the alert. Selectors may match any label.

Series names. A selector names a canonical series (`kvpilot alerts check --list-series`) or an external
name the collector maps to one (collector.series.BY_EXTERNAL: `vllm:num_requests_waiting`,
`sglang:num_queue_reqs`, `DCGM_FI_DEV_FB_USED`, `kvpilot_kv_usage`; `<name>_bucket` wherever the
histogram's `<name>_count` is mapped). An external name is an alias of its canonical series: it reads
every engine's samples of that series, not only the ones that engine's exporter reported (add a matcher
such as `{instance=~"vllm-.*"}` to narrow it). Where the mapping converts units (DCGM's FB_* in MiB ->
bytes, GPU_UTIL percent -> ratio), values are converted back: the rule reads the name in the unit its
exporter uses, so `DCGM_FI_DEV_FB_USED > 70000` means 70000 MiB, as the author wrote it (and as the same
rule means on a stock Prometheus; `kvpilot alerts export-prometheus` keeps external names as written).
An unknown name is an error naming the closest canonical and external names.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from alerts.durations import DurationError, parse_duration
from alerts.expr_ast import Node, selectors, value_type
from alerts.expr_lexer import ExprSyntaxError
from alerts.expr_parser import parse_expr
from alerts.series_catalog import is_known, unknown_series_hint
from alerts.templates import Template, TemplateError, compile_template

BUILTIN_RULES = Path(__file__).resolve().parent / "rules" / "builtin.yml"
DEMO_RULES = Path(__file__).resolve().parent / "rules" / "demo.yml"
DEFAULT_INTERVAL_S = 60.0
_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_GROUP_KEYS = {"name", "interval", "rules", "limit"}
_RULE_KEYS = {"alert", "expr", "for", "keep_firing_for", "labels", "annotations"}


class RuleFileError(ValueError):
    """Every problem found in one or more rule files; nothing from them was loaded."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class AlertRule:
    name: str
    expr_text: str
    expr: Node = field(compare=False)
    for_s: float
    keep_firing_for_s: float
    labels: dict[str, str]
    annotations: dict[str, str]
    label_templates: dict[str, Template] = field(compare=False, repr=False)
    annotation_templates: dict[str, Template] = field(compare=False, repr=False)
    group: str = ""
    source: str = ""  # file:line of the rule, for logs


@dataclass(frozen=True)
class RuleGroup:
    name: str
    interval_s: float
    rules: tuple[AlertRule, ...]
    file: str = ""
    limit: int = 0


def load_rule_files(paths: Sequence[str | Path], *, default_interval_s: float = DEFAULT_INTERVAL_S) -> list[RuleGroup]:
    problems: list[str] = []
    groups: list[RuleGroup] = []
    for path in paths:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            problems.append(f"{path}: cannot read rule file: {exc.strerror or exc}")
            continue
        file_groups, file_problems = _load_text(text, str(path), default_interval_s)
        groups.extend(file_groups)
        problems.extend(file_problems)
    seen: dict[str, str] = {}
    for group in groups:
        if group.name in seen:
            problems.append(f"{group.file}: group name {group.name!r} is also used in {seen[group.name]}")
        seen.setdefault(group.name, group.file)
    if problems:
        raise RuleFileError(problems)
    return groups


def load_rules_text(
    text: str, filename: str = "<rules>", *, default_interval_s: float = DEFAULT_INTERVAL_S
) -> list[RuleGroup]:
    groups, problems = _load_text(text, filename, default_interval_s)
    if problems:
        raise RuleFileError(problems)
    return groups


def _load_text(text: str, filename: str, default_interval_s: float) -> tuple[list[RuleGroup], list[str]]:
    try:
        root = yaml.compose(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{filename}:{mark.line + 1}:{mark.column + 1}" if mark else filename
        return [], [f"{where}: YAML syntax error: {getattr(exc, 'problem', None) or exc}"]
    if root is None:
        return [], [f"{filename}: empty rule file (expected a top-level 'groups:' list)"]
    problems: list[str] = []
    if not isinstance(root, yaml.MappingNode):
        return [], [f"{_where(filename, root)}: expected a mapping with a 'groups' key"]
    top = _mapping(root)
    for key, (knode, _v) in top.items():
        if key != "groups":
            problems.append(f"{_where(filename, knode)}: unknown top-level key {key!r} (only 'groups' is allowed)")
    if "groups" not in top:
        return [], [*problems, f"{filename}: missing top-level 'groups' list"]
    groups_node = top["groups"][1]
    if not isinstance(groups_node, yaml.SequenceNode):
        return [], [*problems, f"{_where(filename, groups_node)}: 'groups' must be a list"]
    groups: list[RuleGroup] = []
    seen_groups: set[str] = set()
    for gnode in groups_node.value:
        group = _load_group(gnode, filename, default_interval_s, problems)
        if group is None:
            continue
        if group.name in seen_groups:
            problems.append(f"{_where(filename, gnode)}: group {group.name!r} is defined more than once")
        seen_groups.add(group.name)
        groups.append(group)
    return groups, problems


def _load_group(gnode: yaml.Node, filename: str, default_interval_s: float, problems: list[str]) -> RuleGroup | None:
    if not isinstance(gnode, yaml.MappingNode):
        problems.append(f"{_where(filename, gnode)}: each group must be a mapping with name and rules")
        return None
    g = _mapping(gnode)
    for key, (knode, _v) in g.items():
        if key not in _GROUP_KEYS:
            problems.append(f"{_where(filename, knode)}: unknown group key {key!r} (allowed: {sorted(_GROUP_KEYS)})")
    name = _scalar(g, "name")
    if not name:
        problems.append(f"{_where(filename, gnode)}: group needs a non-empty 'name'")
        name = "?"
    interval_s = default_interval_s
    if "interval" in g:
        try:
            interval_s = parse_duration(_scalar(g, "interval"))
        except DurationError as exc:
            problems.append(f"{_where(filename, g['interval'][1])}: group {name!r}: interval: {exc}")
        if interval_s <= 0:
            problems.append(f"{_where(filename, g['interval'][1])}: group {name!r}: interval must be > 0")
            interval_s = default_interval_s
    limit = 0
    if "limit" in g:
        raw_limit = _scalar(g, "limit")
        if not raw_limit.isdigit():
            problems.append(f"{_where(filename, g['limit'][1])}: group {name!r}: limit must be a non-negative integer")
        else:
            limit = int(raw_limit)
    rules: list[AlertRule] = []
    rules_node = g.get("rules", (None, None))[1]
    if not isinstance(rules_node, yaml.SequenceNode):
        problems.append(f"{_where(filename, rules_node or gnode)}: group {name!r}: 'rules' must be a list")
        return None
    seen: dict[tuple, str] = {}
    for rnode in rules_node.value:
        rule = _load_rule(rnode, filename, name, problems)
        if rule is None:
            continue
        rule_key = (rule.name, tuple(sorted(rule.labels.items())))
        if rule_key in seen:
            problems.append(
                f"{rule.source}: group {name!r}: alert {rule.name!r} with the same labels is already "
                f"defined at {seen[rule_key]}"
            )
        seen.setdefault(rule_key, rule.source)
        rules.append(rule)
    return RuleGroup(name, interval_s, tuple(rules), filename, limit)


def _load_rule(rnode: yaml.Node, filename: str, group: str, problems: list[str]) -> AlertRule | None:
    where = _where(filename, rnode)
    if not isinstance(rnode, yaml.MappingNode):
        problems.append(f"{where}: group {group!r}: each rule must be a mapping")
        return None
    r = _mapping(rnode)
    if "record" in r:
        problems.append(
            f"{where}: group {group!r}: recording rules ('record: {_scalar(r, 'record')}') are not "
            "supported; only alerting rules"
        )
        return None
    name = _scalar(r, "alert")
    if not name:
        problems.append(f"{where}: group {group!r}: rule needs 'alert: <name>'")
        return None
    ctx = f"{where}: rule {name!r} (group {group!r})"
    before = len(problems)
    for key, (knode, _v) in r.items():
        if key not in _RULE_KEYS:
            problems.append(
                f"{_where(filename, knode)}: rule {name!r}: unknown key {key!r} (allowed: {sorted(_RULE_KEYS)})"
            )
    if not _LABEL_NAME.match(name):
        problems.append(f"{ctx}: alert name must match [a-zA-Z_][a-zA-Z0-9_]*")
    durations: dict[str, float] = {}
    for key in ("for", "keep_firing_for"):
        durations[key] = 0.0
        if key in r:
            try:
                durations[key] = parse_duration(_typed_scalar(r[key][1]))
            except DurationError as exc:
                problems.append(f"{_where(filename, r[key][1])}: rule {name!r}: {key}: {exc}")
    expr: Node | None = None
    expr_text = ""
    if "expr" not in r:
        problems.append(f"{ctx}: missing 'expr'")
    else:
        expr_node = r["expr"][1]
        expr_text = str(expr_node.value) if isinstance(expr_node, yaml.ScalarNode) else ""
        if not isinstance(expr_node, yaml.ScalarNode) or not expr_text.strip():
            problems.append(f"{_where(filename, expr_node)}: rule {name!r}: expr must be a non-empty string")
        else:
            expr = _parse_rule_expr(expr_text, expr_node, filename, name, problems)
    labels = _string_map(r, "labels", filename, name, problems)
    annotations = _string_map(r, "annotations", filename, name, problems)
    for label in labels:
        if not _LABEL_NAME.match(label) or label.startswith("__"):
            problems.append(f"{ctx}: invalid label name {label!r}")
    if "alertname" in labels:
        problems.append(f"{ctx}: 'alertname' is set from 'alert:' and cannot be a label")
    label_templates = _compile_all(labels, f"{ctx}: label", problems)
    annotation_templates = _compile_all(annotations, f"{ctx}: annotation", problems)
    if len(problems) > before or expr is None:
        return None
    return AlertRule(
        name,
        expr_text.strip(),
        expr,
        durations["for"],
        durations["keep_firing_for"],
        labels,
        annotations,
        label_templates,
        annotation_templates,
        group,
        where,
    )


def _parse_rule_expr(text: str, node: yaml.ScalarNode, filename: str, rule: str, problems: list[str]) -> Node | None:
    try:
        expr = parse_expr(text)
    except ExprSyntaxError as exc:
        line, column = _file_position(node, exc.line, exc.column)
        problems.append(
            f"{filename}:{line}:{column}: rule {rule!r}: expr: {exc.message} "
            f"(expr line {exc.line}, column {exc.column})"
        )
        return None
    if value_type(expr) != "vector":
        line, column = _file_position(node, 1, 1)
        problems.append(
            f"{filename}:{line}:{column}: rule {rule!r}: expr must give an instant vector, not a number "
            "(compare a series, e.g. 'x > 1')"
        )
        return None
    for sel in selectors(expr):
        if not is_known(sel.name):
            line, column = _file_position(node, sel.line, sel.column)
            problems.append(
                f"{filename}:{line}:{column}: rule {rule!r}: unknown series {sel.name!r}{unknown_series_hint(sel.name)}"
            )
    return expr


def _file_position(node: yaml.ScalarNode, line: int, column: int) -> tuple[int, int]:
    """Map an expression-relative position to the rule file (block scalars start on the next line)."""
    mark = node.start_mark
    if node.style in ("|", ">"):
        indent = 0
        if mark.buffer is not None:
            lines = mark.buffer.split("\n")
            body = lines[mark.line + 1] if mark.line + 1 < len(lines) else ""
            indent = len(body) - len(body.lstrip(" "))
        return mark.line + 1 + line, indent + column
    quote = 1 if node.style in ("'", '"') else 0
    if line == 1:
        return mark.line + 1, mark.column + quote + column
    return mark.line + line, column


def _compile_all(templates: dict[str, str], ctx: str, problems: list[str]) -> dict[str, Template]:
    out: dict[str, Template] = {}
    for key, text in templates.items():
        try:
            out[key] = compile_template(text)
        except TemplateError as exc:
            problems.append(f"{ctx} {key!r}: {exc}")
    return out


def _string_map(r: dict, key: str, filename: str, rule: str, problems: list[str]) -> dict[str, str]:
    if key not in r:
        return {}
    node = r[key][1]
    if isinstance(node, yaml.ScalarNode) and node.value in ("", "null", "~"):
        return {}
    if not isinstance(node, yaml.MappingNode):
        problems.append(f"{_where(filename, node)}: rule {rule!r}: {key} must be a mapping of strings")
        return {}
    out: dict[str, str] = {}
    for knode, vnode in node.value:
        if not isinstance(vnode, yaml.ScalarNode):
            problems.append(f"{_where(filename, vnode)}: rule {rule!r}: {key}.{knode.value} must be a string")
            continue
        out[str(knode.value)] = str(vnode.value)
    return out


def _mapping(node: yaml.MappingNode) -> dict[str, tuple[yaml.Node, yaml.Node]]:
    return {str(k.value): (k, v) for k, v in node.value}


def _scalar(m: dict, key: str) -> str:
    if key not in m or not isinstance(m[key][1], yaml.ScalarNode):
        return ""
    return str(m[key][1].value)


def _typed_scalar(node: yaml.Node) -> str | int | float:
    """A duration value as YAML typed it, so a bare `for: 5` is refused rather than read as seconds."""
    if not isinstance(node, yaml.ScalarNode):
        return repr(node)
    if node.style is None and re.fullmatch(r"-?\d+(\.\d+)?", node.value) and node.value != "0":
        return float(node.value)
    return str(node.value)


def _where(filename: str, node: yaml.Node | None) -> str:
    if node is None:
        return filename
    return f"{filename}:{node.start_mark.line + 1}"
