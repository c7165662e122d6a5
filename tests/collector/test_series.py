"""The mapping from vLLM, SGLang, DCGM and kvpilot exposition to canonical series, on realistic fixtures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from collector import series
from collector.exposition import format_le, labels_json, map_samples
from collector.scraper import parse_exposition
from collector.series import CANONICAL, MAPPINGS, Mapping

FIXTURES = Path(__file__).parent / "fixtures"
MIB = 2**20
LLAMA = "meta-llama/Llama-3.1-8B-Instruct"


def mapped(text: str) -> dict[tuple[str, str], float]:
    return {(p.name, p.labels_json): p.value for p in map_samples(parse_exposition(text))}


def fixture(name: str) -> dict[tuple[str, str], float]:
    return mapped((FIXTURES / name).read_text())


def by_name(points: dict[tuple[str, str], float], name: str) -> dict[str, float]:
    return {labels: v for (n, labels), v in points.items() if n == name}


def lab(**labels: str) -> str:
    return labels_json(labels)


def test_every_mapping_targets_a_known_canonical_series() -> None:
    assert all(m.canonical in CANONICAL for m in MAPPINGS)
    assert len({m.external for m in MAPPINGS}) == len(MAPPINGS)
    for m in MAPPINGS:
        if m.canonical.endswith("_bucket"):
            count = CANONICAL[m.canonical.removesuffix("_bucket") + "_count"]
            assert m.le_scale is not None and CANONICAL[m.canonical].unit == count.unit


@pytest.mark.parametrize(
    ("bound", "text"),
    [
        ("0.1", "0.1"),
        ("1.0", "1"),
        ("1", "1"),
        ("2560.0", "2560"),
        ("131072.0", "131072"),
        ("1e+06", "1e+06"),
        ("1000000.0", "1e+06"),
        ("1.5e-05", "1.5e-05"),
        ("0.0001", "0.0001"),
        ("0.0", "0"),
        ("+Inf", "+Inf"),
        ("-1.0", "-1"),
    ],
)
def test_le_is_written_as_prometheus_does(bound: str, text: str) -> None:
    assert format_le(float(bound)) == text


def test_vllm_series_keep_model_and_engine() -> None:
    got = fixture("vllm_dp2.prom")
    e0, e1 = lab(engine="0", model_name=LLAMA), lab(engine="1", model_name=LLAMA)
    assert by_name(got, "running") == {e0: 4.0, e1: 7.0}
    assert by_name(got, "kv_usage") == {e0: 0.25, e1: 0.5}  # not doubled by vllm:gpu_cache_usage_perc
    assert by_name(got, "prefix_cache_queries_total") == {e0: 32860.0, e1: 13600.0}
    assert by_name(got, "preemptions_total") == {e0: 5.0, e1: 3.0}
    for name in ("prefill_time_seconds", "decode_time_seconds", "inference_time_seconds", "request_prompt_tokens"):
        assert set(by_name(got, f"{name}_count")) == {e0, e1}
    assert by_name(got, "iteration_tokens_count") == {e0: 40.0, e1: 25.0}
    # The cache config is an info series: its labels are what it says (is prefix caching on?), per engine.
    configs = [json.loads(labels) for name, labels in got if name == "kv_cache_config_info"]
    assert sorted(c["engine"] for c in configs) == ["0", "1"]
    assert all(set(c) == {"engine", "enable_prefix_caching", "block_size", "num_gpu_blocks"} for c in configs)
    # Nothing else leaks into a label set: no info labels, no _created samples, no le outside buckets.
    for (name, labels), _ in got.items():
        if name == "kv_cache_config_info":
            continue
        keys = set(json.loads(labels))
        assert keys - {"le", "finished_reason", "status"} == {"engine", "model_name"}, (name, labels)
        assert ("le" in keys) == name.endswith("_bucket")
    assert not any("created" in name for name, _ in got)


def test_vllm_abort_is_not_a_finished_request() -> None:
    got = by_name(fixture("vllm_dp2.prom"), "requests_total")
    e0 = {json.loads(k)["finished_reason"]: (json.loads(k)["status"], v) for k, v in got.items() if '"engine":"0"' in k}
    assert e0 == {"stop": ("finished", 28.0), "length": ("finished", 8.0), "abort": ("aborted", 4.0)}
    text = 'vllm:request_success_total{engine="0",finished_reason="error",model_name="m"} 2.0\n'
    assert mapped(text) == {
        ("requests_total", lab(engine="0", finished_reason="error", model_name="m", status="failed")): 2
    }


def test_histograms_keep_their_buckets_with_one_spelling_of_le() -> None:
    got = fixture("vllm_dp2.prom")
    e0 = {"engine": "0", "model_name": LLAMA}
    buckets = {
        json.loads(labels)["le"]: v
        for labels, v in by_name(got, "ttft_seconds_bucket").items()
        if {k: v for k, v in json.loads(labels).items() if k != "le"} == e0
    }
    assert list(buckets) == [
        *("0.001", "0.005", "0.01", "0.02", "0.04", "0.06", "0.08", "0.1", "0.25", "0.5", "0.75"),
        *("1", "2.5", "5", "7.5", "10", "+Inf"),
    ]
    assert buckets["+Inf"] == got[("ttft_seconds_count", labels_json(e0))] == 40.0
    assert list(buckets.values()) == sorted(buckets.values())  # cumulative, as exposed
    go_style = (
        'kvpilot_time_to_first_token_seconds_bucket{le="1"} 3\nkvpilot_time_to_first_token_seconds_bucket{le="1.0"} 3\n'
    )
    assert mapped(go_style) == {("ttft_seconds_bucket", lab(le="1")): 3.0}  # the same bucket, once


def test_unit_scaling_applies_to_le(monkeypatch: pytest.MonkeyPatch) -> None:
    """A histogram in milliseconds: its bounds and sum become seconds, its counts stay counts."""
    origin = "x_latency_ms"
    fake = [
        Mapping("sglang", f"{origin}_bucket", "queue_time_seconds_bucket", le_scale=0.001, origin=origin),
        Mapping("sglang", f"{origin}_sum", "queue_time_seconds_sum", scale=0.001, origin=origin),
    ]
    for m in fake:
        monkeypatch.setitem(series.BY_EXTERNAL, m.external, m)
    monkeypatch.setitem(series.FAMILY_RANK, origin, len(MAPPINGS))
    got = mapped(f'{origin}_bucket{{le="250.0"}} 7\n{origin}_bucket{{le="+Inf"}} 9\n{origin}_sum 1500\n')
    assert got == {
        ("queue_time_seconds_bucket", lab(le="0.25")): 7.0,
        ("queue_time_seconds_bucket", lab(le="+Inf")): 9.0,
        ("queue_time_seconds_sum", "{}"): 1.5,
    }


def test_a_current_name_wins_over_its_deprecated_alias() -> None:
    text = """\
vllm:time_per_output_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 1.0
vllm:time_per_output_token_seconds_bucket{engine="0",le="0.2",model_name="m"} 1.0
vllm:time_per_output_token_seconds_count{engine="0",model_name="m"} 1.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.1",model_name="m"} 5.0
vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 5.0
vllm:time_per_output_token_seconds_count{engine="1",model_name="m"} 2.0
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.1
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.3
"""
    got = mapped(text)
    e0, e1 = lab(engine="0", model_name="m"), lab(engine="1", model_name="m")
    assert got == {
        ("itl_seconds_bucket", lab(engine="0", le="0.1", model_name="m")): 5.0,  # no le="0.2" from the old family
        ("itl_seconds_count", e0): 5.0,
        ("itl_seconds_count", e1): 2.0,  # only the old name there: it stands in
        ("kv_usage", e0): 0.3,
    }


def test_sglang_series_keep_model_ranks_and_stage() -> None:
    got = fixture("sglang.prom")
    model = "Qwen/Qwen2.5-32B-Instruct"

    def rank(dp: str, **extra: str) -> str:
        return lab(dp_rank=dp, engine_type="unified", model_name=model, pp_rank="0", tp_rank="0", **extra)

    assert by_name(got, "kv_usage") == {rank("0"): 0.31, rank("1"): 0.51}
    assert by_name(got, "preemptions_total") == {rank("0"): 3.0, rank("1"): 4.0}  # num_retracted_requests_total
    assert by_name(got, "kv_total_tokens") == {rank("0"): 420000.0, rank("1"): 420000.0}
    assert set(by_name(got, "queue_time_seconds_count")) == {rank("0"), rank("1")}
    stages = {json.loads(k)["stage"] for k in by_name(got, "stage_latency_seconds_count")}
    assert stages == {"prefill_waiting", "prefill_forward", "decode_forward"}
    assert got[("stage_latency_seconds_bucket", rank("0", stage="decode_forward", le="+Inf"))] == 20.0
    assert by_name(got, "requests_total") == {lab(model_name=model, status="aborted"): 4.0}
    assert got[("prefix_cache_hits_total", lab(model_name=model))] == 4800.0
    assert all("moe_ep_rank" not in labels for _, labels in got)


def test_dcgm_keeps_gpu_mig_instance_and_host_and_derives_totals_per_label_set() -> None:
    got = fixture("dcgm.prom")
    uuid2 = "GPU-0f9e8d7c-6b5a-4938-8271-605f4e3d2c1b"
    used = by_name(got, "memory_used_bytes")
    assert len(used) == 5  # GPUs 0 and 1, GPU 2 as a whole and its two MIG instances
    for labels in used:
        keys = set(json.loads(labels))
        assert keys in ({"gpu", "UUID", "hostname"}, {"gpu", "UUID", "hostname", "GPU_I_ID", "GPU_I_PROFILE"})
        parts = [got[(n, labels)] for n in ("memory_used_bytes", "memory_free_bytes", "memory_reserved_bytes")]
        total = got[("memory_total_bytes", labels)]
        assert total == sum(parts) and parts[0] / total <= 1.0
    mig1 = lab(GPU_I_ID="1", GPU_I_PROFILE="3g.40gb", UUID=uuid2, gpu="2", hostname="gpu-node-1")
    assert got[("memory_total_bytes", mig1)] == 40192 * MIB  # its own used + free, not the whole GPU's
    gpu0 = lab(UUID="GPU-5d2f8c1e-7a4b-4c7e-9f1a-2b3c4d5e6f70", gpu="0", hostname="gpu-node-1")
    assert got[("memory_total_bytes", gpu0)] == (72000 + 9035 + 524) * MIB  # reserved counts in the total
    assert got[("utilization", gpu0)] == pytest.approx(0.87)  # GPU_UTIL, not GR_ENGINE_ACTIVE (0.83)
    assert got[("utilization", mig1)] == pytest.approx(0.55231)  # MIG: GR_ENGINE_ACTIVE stands in
    assert got[("gpu_power_watts", gpu0)] == pytest.approx(612.437)


def test_dcgm_label_spellings_are_normalised_and_an_exposed_total_is_kept() -> None:
    text = """\
DCGM_FI_DEV_FB_USED{gpu="0",uuid="GPU-a",hostname="n1",Hostname="old"} 1024
DCGM_FI_DEV_FB_FREE{gpu="0",uuid="GPU-a",hostname="n1"} 1024
DCGM_FI_DEV_FB_TOTAL{gpu="0",uuid="GPU-a",hostname="n1"} 4096
"""
    got = mapped(text)
    gpu = lab(UUID="GPU-a", gpu="0", hostname="n1")
    assert got == {
        ("memory_used_bytes", gpu): 1024 * MIB,
        ("memory_free_bytes", gpu): 1024 * MIB,
        ("memory_total_bytes", gpu): 4096 * MIB,
    }


KVPILOT = """\
# TYPE kvpilot_kv_usage gauge
kvpilot_kv_usage 0.5
# TYPE kvpilot_swaps counter
kvpilot_swaps_total{direction="out"} 4.0
kvpilot_swaps_total{direction="in"} 1.0
kvpilot_swaps_created{direction="in"} 1.7e9
# TYPE kvpilot_requests counter
kvpilot_requests_total{status="finished"} 9.0
# TYPE kvpilot_e2e_request_latency_seconds histogram
kvpilot_e2e_request_latency_seconds_bucket{le="1.0"} 6.0
kvpilot_e2e_request_latency_seconds_bucket{le="+Inf"} 9.0
kvpilot_e2e_request_latency_seconds_count 9.0
kvpilot_e2e_request_latency_seconds_sum 4.5
# TYPE kvpilot_queue_depth gauge
kvpilot_queue_depth{le="3"} 2.0
"""


def test_kvpilot_names_keep_their_labels() -> None:
    assert mapped(KVPILOT) == {
        ("kv_usage", "{}"): 0.5,
        ("swaps_total", lab(direction="out")): 4.0,
        ("swaps_total", lab(direction="in")): 1.0,
        ("requests_total", lab(status="finished")): 9.0,
        ("e2e_seconds_bucket", lab(le="1")): 6.0,
        ("e2e_seconds_bucket", lab(le="+Inf")): 9.0,
        ("e2e_seconds_count", "{}"): 9.0,
        ("e2e_seconds_sum", "{}"): 4.5,
        ("queue_depth", "{}"): 2.0,  # le on a gauge is noise
    }
