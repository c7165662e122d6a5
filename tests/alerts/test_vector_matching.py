"""Per-label-set evaluation: selection on any label, Prometheus's vector matching and its errors, external names.

The error strings are Prometheus 2.42's own, as `promtool test rules` printed them for the same series.
"""

from __future__ import annotations

import math

import pytest

from alerts.expr_eval import EvalError, Evaluator
from alerts.expr_parser import parse_expr
from alerts.memory_source import MemorySource
from alerts.rules import RuleFileError, load_rules_text
from collector.series import MIB

T = 600.0


def _source(series: dict[str, float]) -> MemorySource:
    """'name{k="v",...}' -> value, one sample at T."""
    from alerts.promtest import parse_series

    source = MemorySource()
    for text, value in series.items():
        name, labels = parse_series(text)
        instance = labels.pop("instance", "")
        source.add(name, instance, T, value, labels)
    return source


def _eval(source: MemorySource, expr: str) -> dict[tuple, float]:
    result = Evaluator(source).evaluate(parse_expr(expr), T)
    assert isinstance(result, dict)
    return result


def _l(**labels: str) -> tuple:
    return tuple(sorted(labels.items()))


GPUS = {
    'a{instance="x", gpu="0", node="n"}': 1.0,
    'a{instance="x", gpu="1", node="n"}': 2.0,
    'b{instance="y", node="n"}': 3.0,
    'b{instance="z", node="n"}': 4.0,
    'c{instance="y", node="n", model="m"}': 5.0,
}


@pytest.mark.parametrize(
    ("expr", "message"),
    [
        (
            "a * on(node) b",
            'found duplicate series for the match group {node="n"} on the right hand-side of the operation: '
            '[{__name__="b", instance="z", node="n"}, {__name__="b", instance="y", node="n"}];many-to-many '
            "matching not allowed: matching labels must be unique on one side",
        ),
        (
            "a * on(node) group_right b",
            'found duplicate series for the match group {node="n"} on the left hand-side of the operation: '
            '[{__name__="a", gpu="1", instance="x", node="n"}, {__name__="a", gpu="0", instance="x", node="n"}];'
            "many-to-many matching not allowed: matching labels must be unique on one side",
        ),
        (
            "b * on(node) group_left a",
            'found duplicate series for the match group {node="n"} on the right hand-side of the operation: '
            '[{__name__="a", gpu="1", instance="x", node="n"}, {__name__="a", gpu="0", instance="x", node="n"}];'
            "many-to-many matching not allowed: matching labels must be unique on one side",
        ),
        (
            "a * on(node) c",
            "multiple matches for labels: many-to-one matching must be explicit (group_left/group_right)",
        ),
        (
            "a < on(node) c",
            "multiple matches for labels: many-to-one matching must be explicit (group_left/group_right)",
        ),
        ("a + on(node) group_left(gpu) c", "multiple matches for labels: grouping labels must ensure unique matches"),
        (
            "a + on(node) group_left(gpu) (c * 0 + 10)",
            "multiple matches for labels: grouping labels must ensure unique matches",
        ),
    ],
)
def test_matching_errors_are_prometheus_own(expr, message):
    with pytest.raises(EvalError) as info:
        _eval(_source(GPUS), expr)
    assert str(info.value) == message


def test_filtered_samples_do_not_count_as_duplicates():
    assert _eval(_source(GPUS), "a > on(node) group_left(gpu) c") == {}  # as Prometheus: no error


def test_group_left_copies_labels_from_the_one_side():
    source = _source(GPUS)
    assert _eval(source, "a * on(node) group_left c") == {
        _l(gpu="0", instance="x", node="n"): 5.0,
        _l(gpu="1", instance="x", node="n"): 10.0,
    }
    assert _eval(source, "a * on(node) group_left(instance, model) c") == {
        _l(gpu="0", instance="y", model="m", node="n"): 5.0,
        _l(gpu="1", instance="y", model="m", node="n"): 10.0,
    }
    assert _eval(source, "c * on(node) group_right a") == _eval(source, "a * on(node) group_left c")
    # a listed label the one side lacks is removed from the result, as Prometheus does
    assert _eval(source, 'a{gpu="0"} * on(node) group_left(gpu) c') == {_l(instance="x", node="n"): 5.0}
    assert _eval(source, "a * ignoring(gpu, instance) group_left c") == {}  # c has `model`: no match


def test_one_to_one_on_and_ignoring():
    source = _source(
        {
            'used{instance="d", gpu="0"}': 60.0,
            'used{instance="d", gpu="1"}': 30.0,
            'total{instance="d", gpu="0"}': 80.0,
            'total{instance="d", gpu="1"}': 80.0,
        }
    )
    assert _eval(source, "used / total") == {_l(gpu="0", instance="d"): 0.75, _l(gpu="1", instance="d"): 0.375}
    assert _eval(source, "used / ignoring(instance) total") == {_l(gpu="0"): 0.75, _l(gpu="1"): 0.375}
    assert _eval(source, "used > on(gpu, instance) total * 0.5") == {_l(gpu="0", instance="d"): 60.0}
    assert _eval(source, "used > bool on(gpu, instance) total * 0.5") == {
        _l(gpu="0", instance="d"): 1.0,
        _l(gpu="1", instance="d"): 0.0,
    }


def test_selection_matches_any_label_and_pushes_instance_down():
    source = _source(
        {
            'utilization{instance="d", gpu="0", Hostname="h1"}': 0.2,
            'utilization{instance="d", gpu="1", Hostname="h1"}': 0.9,
            'utilization{instance="e"}': 0.5,
        }
    )
    calls = []
    inner = source.points

    def spy(name, start, end, instances=None):
        calls.append(instances)
        return inner(name, start, end, instances)

    source.points = spy  # type: ignore[method-assign]  # a spy on the source's reads
    name = ("__name__", "utilization")
    assert _eval(source, 'utilization{gpu="1"}') == {(("Hostname", "h1"), name, ("gpu", "1"), ("instance", "d")): 0.9}
    assert set(_eval(source, 'utilization{gpu!="1"}')) == {
        (("Hostname", "h1"), name, ("gpu", "0"), ("instance", "d")),
        (name, ("instance", "e")),
    }
    assert len(_eval(source, 'utilization{gpu=""}')) == 1  # absent label matches the empty value
    assert len(_eval(source, 'utilization{gpu=~"0|1"}')) == 2
    assert len(_eval(source, 'utilization{gpu=~"1."}')) == 0  # fully anchored
    assert len(_eval(source, 'utilization{gpu!~"1"}')) == 2
    assert len(_eval(source, 'utilization{instance="d", gpu="0"}')) == 1
    assert calls[-1] == ["d"]


def test_aggregation_by_and_without_over_gpus():
    source = _source(
        {
            'utilization{instance="d", node="n1", gpu="0"}': 0.25,
            'utilization{instance="d", node="n1", gpu="1"}': 0.75,
            'utilization{instance="e", node="n2", gpu="0"}': math.nan,
            'utilization{instance="e", node="n2", gpu="1"}': 0.5,
        }
    )
    assert _eval(source, "avg by (node) (utilization{node='n1'})") == {_l(node="n1"): 0.5}
    assert _eval(source, "max by (node) (utilization)") == {_l(node="n1"): 0.75, _l(node="n2"): 0.5}
    assert _eval(source, "count without (gpu) (utilization)") == {
        _l(instance="d", node="n1"): 2.0,
        _l(instance="e", node="n2"): 2.0,
    }
    assert _eval(source, "sum(utilization{node='n1'})") == {(): 1.0}


def test_histogram_quantile_groups_by_all_labels_but_le():
    source = _source(
        {
            'ttft_seconds_bucket{instance="a", le="0.5"}': 5.0,
            'ttft_seconds_bucket{instance="a", le="1"}': 10.0,
            'ttft_seconds_bucket{instance="a", le="+Inf"}': 10.0,
            'ttft_seconds_bucket{instance="a", le="oops"}': 10.0,  # malformed bound: skipped
            'ttft_seconds_bucket{instance="b"}': 3.0,  # no le: skipped
        }
    )
    assert _eval(source, "histogram_quantile(0.75, ttft_seconds_bucket)") == {_l(instance="a"): 0.75}
    assert math.isnan(_eval(source, "histogram_quantile(0.5, ttft_seconds_bucket{le!='+Inf'})")[_l(instance="a")])


def test_external_names_resolve_in_their_own_unit():
    source = MemorySource()
    # as the collector stores them: canonical names, base units
    source.add("memory_used_bytes", "dcgm", T, 75_000 * MIB, {"gpu": "0"})
    source.add("utilization", "dcgm", T, 29 * 0.01, {"gpu": "0"})
    source.add("queue_depth", "vllm", T, 12.0)
    assert _eval(source, "DCGM_FI_DEV_FB_USED > 70000") == {
        _l(__name__="DCGM_FI_DEV_FB_USED", gpu="0", instance="dcgm"): 75_000.0
    }
    assert 29 * 0.01 / 0.01 != 29  # why the percent is rounded back
    assert _eval(source, "DCGM_FI_DEV_GPU_UTIL <= 29") == {
        _l(__name__="DCGM_FI_DEV_GPU_UTIL", gpu="0", instance="dcgm"): 29.0
    }
    assert _eval(source, "vllm:num_requests_waiting") == {_l(__name__="vllm:num_requests_waiting", instance="vllm"): 12}


def _rule(expr: str) -> str:
    return f"groups:\n  - name: g\n    rules:\n      - alert: A\n        expr: '{expr}'\n"


def test_rule_files_accept_external_names_and_name_the_canonical_series():
    assert load_rules_text(_rule("vllm:num_requests_waiting > 10 and sglang:num_queue_reqs > 1"))
    assert load_rules_text(_rule("DCGM_FI_DEV_FB_USED > 70000"))
    assert load_rules_text(_rule("kvpilot_kv_usage > 0.9"))
    assert load_rules_text(_rule("histogram_quantile(0.9, rate(vllm:time_to_first_token_seconds_bucket[5m])) > 1"))
    assert load_rules_text(_rule("histogram_quantile(0.9, rate(ttft_seconds_bucket[5m])) > 1"))
    with pytest.raises(RuleFileError) as info:
        load_rules_text(_rule("vllm:num_requests_waitin > 10"))
    assert (
        "unknown series 'vllm:num_requests_waitin'; did you mean vllm:num_requests_waiting (canonical queue_depth)"
        in (str(info.value))
    )


def test_memory_source_keeps_label_sets_and_the_old_call():
    source = MemorySource()
    source.add("x", "i", 1.0, 1.0)
    source.add("x", "i", 1.0, 2.0, {"gpu": "0"})
    source.add_many("x", "i", [(2.0, 3.0), (3.0, 4.0)], {"gpu": "0"})
    assert source.points("x", 0, 10) == {
        (("instance", "i"),): [(1.0, 1.0)],
        (("gpu", "0"), ("instance", "i")): [(1.0, 2.0), (2.0, 3.0), (3.0, 4.0)],
    }
    assert source.points("x", 0, 10, ["other"]) == {}
