"""Rule language, rule files, promtool-format tests, and the PromQL export checked by the real promtool."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from alerts.alertmanager import fingerprint, labelset_string
from alerts.expr_lexer import ExprSyntaxError
from alerts.expr_parser import parse_expr
from alerts.promql_export import export_yaml, promtool_test_file, write_export
from alerts.promtest import expand_values, run_test_file
from alerts.rules import BUILTIN_RULES, DEMO_RULES, RuleFileError, load_rule_files, load_rules_text
from alerts.templates import compile_template, go_format

HERE = Path(__file__).parent
TEST_FILES = sorted(glob.glob(str(HERE / "rules" / "*_test.yml")))


def test_every_builtin_rule_has_a_promtool_test():
    names = {r.name for g in load_rule_files([BUILTIN_RULES]) for r in g.rules}
    tested = set()
    for f in TEST_FILES:
        for t in yaml.safe_load(Path(f).read_text())["tests"]:
            tested |= {c["alertname"] for c in t.get("alert_rule_test", [])}
    assert names <= tested


@pytest.mark.parametrize("path", TEST_FILES, ids=lambda p: Path(p).stem)
def test_builtin_rule_tests_pass(path):
    report = run_test_file(path)
    assert report.ok, report.render()


def test_wrong_expectation_fails_with_readable_diff(tmp_path):
    doc = yaml.safe_load((HERE / "rules" / "memory_pressure_test.yml").read_text())
    doc["rule_files"] = [str(BUILTIN_RULES)]
    doc["tests"][0]["alert_rule_test"][0]["eval_time"] = "7m"  # it is firing then
    path = tmp_path / "bad_test.yml"
    path.write_text(yaml.safe_dump(doc))
    report = run_test_file(path)
    assert not report.ok
    text = report.render()
    assert "alertname: MemoryPressure, time: 7m" in text and "+ unexpected" in text


def test_series_notation():
    assert expand_values("-2+4x3") == [-2, 2, 6, 10]
    assert expand_values("1-2x4") == [1, -1, -3, -5, -7]
    assert expand_values("1x4") == [1, 1, 1, 1, 1]
    values = expand_values("1 _x3 stale")
    assert values[:4] == [1, None, None, None] and values[4] != values[4]


@pytest.mark.parametrize(
    ("expr", "line", "column", "needle"),
    [
        ("rate(queue_depth)", 1, 6, "range vector"),
        ("queue_depth >", 1, 14, "end of input"),
        ("queue_depth and 1", 1, 13, "instant vectors"),
        ('queue_depth{"job"="x"}', 1, 13, "expected a label name"),
        ("a + group_left b", 1, 5, "needs on(...) or ignoring(...)"),
        ("a and on(x) group_left b", 1, 3, 'no grouping allowed for "and"'),
        ("a * on(x) group_left(x) b", 1, 3, "must not occur in ON and GROUP clause"),
        ("queue_depth >\n  @", 2, 3, "unexpected character"),
        ("nope(queue_depth)", 1, 1, "unknown function"),
        ("queue_depth[5x]", 1, 13, "bad number or duration"),
    ],
)
def test_parse_errors_have_positions(expr, line, column, needle):
    with pytest.raises(ExprSyntaxError) as info:
        parse_expr(expr)
    assert (info.value.line, info.value.column) == (line, column) and needle in info.value.message


BAD_FILES = {
    "syntax": (
        "groups:\n  - name: g\n    rules:\n      - alert: A\n        expr: queue_depth >\n",
        "r.yml:7:28: rule 'A': expr: unexpected end of input",
    ),
    "unknown series": (
        "groups:\n  - name: g\n    rules:\n      - alert: A\n        expr: queue_dept > 1\n",
        "unknown series 'queue_dept'; did you mean queue_depth",
    ),
    "bad duration": (
        "groups:\n  - name: g\n    rules:\n      - alert: A\n        expr: up == 0\n        for: 5x\n",
        "for: not a valid duration",
    ),
    "numeric duration": (
        "groups:\n  - name: g\n    rules:\n      - alert: A\n        expr: up == 0\n        for: 5\n",
        "duration must be a string",
    ),
    "yaml": ("groups: [\n", "YAML syntax error"),
    "recording": ("groups:\n  - name: g\n    rules:\n      - record: x\n        expr: up\n", "recording rules"),
    "template": (
        "groups:\n  - name: g\n    rules:\n      - alert: A\n        expr: up == 0\n"
        "        annotations: {s: '{{ range . }}'}\n",
        "unsupported template action",
    ),
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_bad_rule_files_rejected_whole(name):
    text, needle = BAD_FILES[name]
    good = "      - alert: Good\n        expr: up == 0\n"
    with pytest.raises(RuleFileError) as info:
        load_rules_text(text if name in ("yaml",) else text.replace("    rules:\n", "    rules:\n" + good), "r.yml")
    assert needle in str(info.value)


def test_expr_error_points_into_the_file():
    text = "groups:\n  - name: g\n    rules:\n      - alert: A\n        expr: |\n          up ==\n            @\n"
    with pytest.raises(RuleFileError) as info:
        load_rules_text(text, "r.yml")
    assert "r.yml:7:13: rule 'A': expr: unexpected character '@'" in str(info.value)


def test_bad_file_among_good_loads_nothing(tmp_path):
    good, bad = tmp_path / "good.yml", tmp_path / "bad.yml"
    good.write_text("groups:\n  - name: g1\n    rules:\n      - alert: A\n        expr: up == 0\n")
    bad.write_text("groups:\n  - name: g2\n    rules:\n      - alert: B\n        expr: up ==\n")
    with pytest.raises(RuleFileError):
        load_rule_files([good, bad])
    assert load_rule_files([good, DEMO_RULES])


def test_fingerprint_is_fnv1a_over_sorted_labels():
    assert fingerprint({}) == "cbf29ce484222325"  # FNV-1a 64 offset basis: Alertmanager's empty label set
    a = fingerprint({"alertname": "X", "instance": "a"})
    assert a == fingerprint({"instance": "a", "alertname": "X"}) and len(a) == 16
    assert a != fingerprint({"alertname": "Xinstance", "": "a"})  # the 0xff separator matters
    assert labelset_string({"b": "2", "a": 'q"'}) == '{a="q\\"", b="2"}'


def test_templates_render_like_prometheus():
    t = compile_template(
        "{{ $labels.instance }}: {{ $value }} {{ $value | humanize }} {{ .Value | humanizePercentage }}"
    )
    assert t.render({"instance": "a"}, 0.25) == "a: 0.25 250m 25%"
    assert go_format(1e6) == "1e+06" and go_format(123456.0) == "123456" and go_format(100.0) == "100"


def _promtool() -> str | None:
    path = shutil.which("promtool")
    if path is None and os.environ.get("KVPILOT_REQUIRE_PROMTOOL") == "1":
        pytest.fail("KVPILOT_REQUIRE_PROMTOOL=1 but promtool is not on PATH")
    if path is None:
        pytest.skip("promtool not on PATH (apt-get install prometheus)")
    return path


def test_export_passes_promtool_check(tmp_path):
    promtool = _promtool()
    out = tmp_path / "kvpilot.rules.yml"
    write_export(load_rule_files([BUILTIN_RULES, DEMO_RULES]), out)
    proc = subprocess.run([promtool, "check", "rules", str(out)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "kvpilot_queue_depth > 100" in out.read_text()


@pytest.mark.parametrize("path", TEST_FILES, ids=lambda p: Path(p).stem)
def test_same_tests_pass_on_real_prometheus(path, tmp_path):
    """Our evaluator vs Prometheus itself: the promtool tests run against the exported PromQL."""
    promtool = _promtool()
    source = yaml.safe_load(Path(path).read_text())
    rule_files = [Path(path).parent / f for f in source["rule_files"]]
    (tmp_path / "exported.yml").write_text(export_yaml(load_rule_files(rule_files)))
    doc = promtool_test_file(source, "exported.yml")
    if doc is None:
        pytest.skip("series exported as a different PromQL shape (rate of a counter / histogram quantile)")
    test_path = tmp_path / Path(path).name
    test_path.write_text(yaml.safe_dump(doc))
    proc = subprocess.run([promtool, "test", "rules", str(test_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
