"""`kvpilot alerts test`: rule unit tests in promtool's format, evaluated by kvpilot's own evaluator.

    rule_files: [builtin.yml]
    evaluation_interval: 1m
    tests:
      - interval: 1m
        input_series:
          - series: 'queue_depth{instance="a"}'
            values: '0+10x10 _ stale'
        alert_rule_test:
          - eval_time: 10m
            alertname: SchedulerBlocked
            exp_alerts: [{exp_labels: {instance: a, severity: page}, exp_annotations: {...}}]
        promql_expr_test:
          - expr: queue_depth > 50
            eval_time: 5m
            exp_samples: [{labels: 'queue_depth{instance="a"}', value: 60}]

As promtool does: every group is evaluated at each evaluation_interval step from 0 to the last eval_time,
and an alert test at eval_time compares the *firing* alerts of the last step at or before it.

Input series keep every label (`memory_usage{instance="n1", gpu="0", UUID="GPU-..."}`): each label set is
its own series, as the collector stores them. An input named externally (`DCGM_FI_DEV_FB_USED` in MiB) is
stored as the scraper would store it: under its canonical series, in base units.
"""

from __future__ import annotations

import glob
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from alerts.durations import DurationError, format_duration, parse_duration
from alerts.expr_eval import STALE_NAN, EvalError, Evaluator, is_stale
from alerts.expr_lexer import ExprSyntaxError
from alerts.expr_parser import parse_expr
from alerts.memory_source import MemorySource
from alerts.rules import RuleFileError, RuleGroup, load_rule_files
from alerts.series_catalog import resolve
from alerts.state import RuleState
from alerts.templates import go_format


class TestFileError(ValueError):
    """The test file itself is malformed (as opposed to a failing test)."""


@dataclass
class TestReport:
    file: str
    failures: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    passed: int = 0

    @property
    def ok(self) -> bool:
        return not self.failures and not self.errors

    def render(self) -> str:
        lines = [f"Unit Testing:  {self.file}"]
        if self.errors:
            lines.append("  FAILED:")
            lines.extend(f"    {e}" for e in self.errors)
        elif self.failures:
            lines.append("  FAILED:")
            lines.extend(self.failures)
        else:
            lines.append(f"  SUCCESS ({self.passed} checks)")
        return "\n".join(lines)


_SERIES = re.compile(r"^\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\{(.*)\})?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(?:,|$)')
_NUM = r"\d+\.?\d*(?:[eE][+-]?\d+)?"
_EXPAND = re.compile(rf"^([+-]?(?:{_NUM}|Inf|NaN|inf|nan))(?:([+-])({_NUM}))?x(\d+)$")


def parse_series(text: str) -> tuple[str, dict[str, str]]:
    match = _SERIES.match(text)
    if not match:
        raise TestFileError(f'bad series {text!r} (expected name{{label="value", ...}})')
    labels: dict[str, str] = {}
    body = (match.group(3) or "").strip()
    pos = 0
    while pos < len(body):
        lab = _LABEL.match(body, pos)
        if not lab:
            raise TestFileError(f"bad label matcher in series {text!r} at {body[pos:]!r}")
        labels[lab.group(1)] = lab.group(2).encode().decode("unicode_escape")
        pos = lab.end()
    return match.group(1), labels


def expand_values(text: str) -> list[float | None]:
    """promtool's notation: 'a+bxN' -> N+1 values, 'axN' -> N+1 copies, '_' missing, '_xN' N missing, 'stale'."""
    out: list[float | None] = []
    for token in str(text).split():
        if token == "_":
            out.append(None)
        elif token.startswith("_x") and token[2:].isdigit():
            out.extend([None] * int(token[2:]))
        elif token == "stale":
            out.append(STALE_NAN)
        else:
            match = _EXPAND.match(token)
            if match:
                start = float(match.group(1))
                step = float(match.group(3) or 0.0) * (-1 if match.group(2) == "-" else 1)
                out.extend(start + step * i for i in range(int(match.group(4)) + 1))
                continue
            try:
                out.append(float(token))
            except ValueError:
                raise TestFileError(
                    f"bad value {token!r} in {text!r} (use numbers, a+bxN, axN, _, _xN, stale)"
                ) from None
    return out


def run_test_file(path: str | Path) -> TestReport:
    path = Path(path)
    report = TestReport(str(path))
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        report.errors.append(f"cannot read test file: {exc}")
        return report
    try:
        _run(doc, path, report)
    except (TestFileError, DurationError) as exc:
        report.errors.append(str(exc))
    except RuleFileError as exc:
        report.errors.extend(exc.problems)
    return report


def _duration(value: object, what: str) -> float:
    try:
        return parse_duration(value if isinstance(value, str) else str(value) if value == 0 else value)
    except DurationError as exc:
        raise TestFileError(f"{what}: {exc}") from exc


def _run(doc: object, path: Path, report: TestReport) -> None:
    if not isinstance(doc, dict):
        raise TestFileError("test file must be a mapping with rule_files and tests")
    unknown = set(doc) - {"rule_files", "evaluation_interval", "group_eval_order", "tests"}
    if unknown:
        raise TestFileError(f"unknown top-level keys {sorted(unknown)}")
    files: list[str] = []
    for pattern in doc.get("rule_files") or []:
        full = str(path.parent / pattern) if not Path(pattern).is_absolute() else pattern
        matched = sorted(glob.glob(full))
        if not matched:
            raise TestFileError(f"rule_files: {pattern!r} matches no file (relative to {path.parent})")
        files.extend(matched)
    if not files:
        raise TestFileError("rule_files is empty")
    groups = load_rule_files(files)
    order = doc.get("group_eval_order") or []
    if order:
        index = {name: i for i, name in enumerate(order)}
        groups.sort(key=lambda g: index.get(g.name, len(index)))
    eval_interval = _duration(doc.get("evaluation_interval", "1m"), "evaluation_interval")
    tests = doc.get("tests") or []
    if not isinstance(tests, list):
        raise TestFileError("tests must be a list")
    for number, test in enumerate(tests):
        _run_group(test, number, groups, eval_interval, report)


def _run_group(test: dict, number: int, groups: list[RuleGroup], eval_interval: float, report: TestReport) -> None:
    name = test.get("name") or f"#{number}"
    interval = _duration(test.get("interval", format_duration(eval_interval)), f"test {name}: interval")
    external_labels = {str(k): str(v) for k, v in (test.get("external_labels") or {}).items()}
    external_url = str(test.get("external_url") or "")
    source = load_input_series(test.get("input_series") or [], interval, name)
    evaluator = Evaluator(source)
    alert_tests: dict[float, list[dict]] = {}
    for case in test.get("alert_rule_test") or []:
        alert_tests.setdefault(_duration(case.get("eval_time"), f"test {name}: eval_time"), []).append(case)
    expr_tests = test.get("promql_expr_test") or []
    defined = {r.name for g in groups for r in g.rules}
    for cases in alert_tests.values():
        for case in cases:
            if case.get("alertname") not in defined:
                report.failures.append(
                    f"    [{name}] alertname {case.get('alertname')!r} is not defined in the rule files"
                )
    times = sorted(alert_tests)
    max_t = max([*times, *(_duration(c.get("eval_time"), "eval_time") for c in expr_tests), 0.0])
    states = [RuleState(rule) for g in groups for rule in g.rules]
    current = 0
    steps = math.floor(max_t / eval_interval + 1e-9)
    for step in range(steps + 1):
        ts = step * eval_interval
        for state in states:
            try:
                result = evaluator.evaluate(state.rule.expr, ts)
            except EvalError as exc:
                report.errors.append(f"[{name}] rule {state.rule.name!r} at {format_duration(ts)}: {exc}")
                return
            assert isinstance(result, dict)
            state.evaluate(ts, result, external_labels=external_labels, external_url=external_url)
        while current < len(times) and ts <= times[current] < ts + eval_interval:
            for case in alert_tests[times[current]]:
                _check_alerts(case, times[current], states, name, report)
            current += 1
    for case in expr_tests:
        _check_expr(case, evaluator, name, report)


def load_input_series(entries: list[dict], interval: float, test_name: str) -> MemorySource:
    """Input series with all their labels. An external name is stored as the collector stores it: under
    its canonical series, scaled to base units (DCGM_FI_DEV_FB_USED in MiB -> memory_used_bytes)."""
    source = MemorySource()
    for entry in entries:
        series, labels = parse_series(str(entry.get("series", "")))
        if "__name__" in labels:
            raise TestFileError(f"test {test_name}: series {entry.get('series')!r}: give the name before '{{'")
        resolved = resolve(series)
        instance = labels.pop("instance", "")
        for i, value in enumerate(expand_values(entry.get("values", ""))):
            if value is not None:
                stored = value if resolved.scale == 1.0 or is_stale(value) else value * resolved.scale
                source.add(resolved.canonical, instance, i * interval, stored, labels)
    return source


def _fmt_alerts(items: list[tuple[dict, dict]]) -> str:
    return "[" + ", ".join(f"{{labels: {_fmt_map(lab)}, annotations: {_fmt_map(ann)}}}" for lab, ann in items) + "]"


def _fmt_map(m: dict) -> str:
    return "{" + ", ".join(f"{k}={v!r}" for k, v in sorted(m.items())) + "}"


def _check_alerts(case: dict, eval_time: float, states: list[RuleState], name: str, report: TestReport) -> None:
    alertname = case.get("alertname")
    got = sorted(
        ((dict(a.labels), dict(a.annotations)) for s in states if s.rule.name == alertname for a in s.firing()),
        key=lambda item: (sorted(item[0].items()), sorted(item[1].items())),
    )
    exp = []
    for alert in case.get("exp_alerts") or []:
        labels = {str(k): str(v) for k, v in (alert.get("exp_labels") or {}).items()}
        labels["alertname"] = str(alertname)
        annotations = {str(k): str(v) for k, v in (alert.get("exp_annotations") or {}).items()}
        exp.append((labels, annotations))
    exp.sort(key=lambda item: (sorted(item[0].items()), sorted(item[1].items())))
    if exp == got:
        report.passed += 1
        return
    lines = [
        f"    alertname: {alertname}, time: {format_duration(eval_time)},",
        f"        exp:{_fmt_alerts(exp)},",
        f"        got:{_fmt_alerts(got)}",
    ]
    for item in exp:
        if item not in got:
            lines.append(f"        - missing: {_fmt_map(item[0])} {_fmt_map(item[1])}")
    for item in got:
        if item not in exp:
            lines.append(f"        + unexpected: {_fmt_map(item[0])} {_fmt_map(item[1])}")
    report.failures.append("\n".join(lines))


def _check_expr(case: dict, evaluator: Evaluator, name: str, report: TestReport) -> None:
    text = str(case.get("expr", ""))
    eval_time = _duration(case.get("eval_time"), f"test {name}: eval_time")
    try:
        result = evaluator.evaluate(parse_expr(text), eval_time)
    except (ExprSyntaxError, EvalError) as exc:
        report.errors.append(f"[{name}] expr {text!r}: {exc}")
        return
    got: list[tuple[tuple, float]] = []
    if isinstance(result, float):
        got.append(((), result))
    else:
        got.extend(result.items())
    exp: list[tuple[tuple, float]] = []
    for sample in case.get("exp_samples") or []:
        series_text = str(sample.get("labels", "") or "")
        labels: dict[str, str] = {}
        if series_text.strip():
            if series_text.strip().startswith("{"):
                series_text = "x" + series_text.strip()
                series, labels = parse_series(series_text)
            else:
                series, labels = parse_series(series_text)
                labels["__name__"] = series
        exp.append((tuple(sorted(labels.items())), float(sample.get("value", 0))))
    got_sorted = sorted(got, key=lambda s: s[0])
    exp_sorted = sorted(exp, key=lambda s: s[0])
    same = len(got_sorted) == len(exp_sorted) and all(
        g[0] == e[0]
        and (math.isclose(g[1], e[1], rel_tol=1e-9, abs_tol=1e-12) or (math.isnan(g[1]) and math.isnan(e[1])))
        for g, e in zip(got_sorted, exp_sorted, strict=True)
    )
    if same:
        report.passed += 1
        return

    def fmt(samples: list[tuple[tuple, float]]) -> str:
        return "[" + ", ".join(f"{_fmt_map(dict(lab))} {go_format(v)}" for lab, v in samples) + "]"

    report.failures.append(
        f"    expr: {text!r}, time: {format_duration(eval_time)},\n"
        f"        exp: {fmt(exp_sorted)}\n        got: {fmt(got_sorted)}"
    )
