"""`kvpilot bench engine` on a tiny workload: the JSON has every key the issue asks for, with sane values.
(Performance itself is measured by the benchmark, never asserted by a timed unit test.)"""

from __future__ import annotations

import pytest

from benchmarks import engine_bench
from engine import workload as W
from engine.config import EngineConfig
from tests.engine.conftest import TINY_MODEL

pytest.importorskip("transformers", reason="the benchmark's baseline is Hugging Face generate")


def test_bench_engine_reports_every_key(monkeypatch: pytest.MonkeyPatch) -> None:
    def small_config(quick: bool) -> EngineConfig:
        cfg = engine_bench.EngineConfig.from_dict(
            {
                "device": "cpu",
                "model": TINY_MODEL,
                "scheduler": {"max_num_seqs": 4},
                "telemetry": {"sink": "none", "trace_alloc": False},
            }
        )
        return cfg

    monkeypatch.setattr(engine_bench, "bench_config", small_config)
    monkeypatch.setattr(engine_bench, "bench_workload", lambda quick: W.mixed(6, seed=2, scale=32, output_range=(2, 8)))
    result = engine_bench.run_engine_bench(quick=True, progress=lambda msg: None, vllm=False)
    for key in ("kvpilot_tokens_per_s", "hf_tokens_per_s", "ratio", "p50_s", "p99_s", "waste", "outside_forward_share"):
        assert key in result, key
    assert set(result["waste"]) == {"fixed-16", "fixed-32", "fixed-64", "dynamic"}
    assert all(0.0 <= w < 1.0 for w in result["waste"].values())
    assert result["waste"]["fixed-16"] <= result["waste"]["fixed-64"]
    assert result["ratio"] == pytest.approx(result["kvpilot_tokens_per_s"] / result["hf_tokens_per_s"], rel=1e-2)
    assert 0.0 <= result["outside_forward_share"] < 1.0 and result["p99_s"] >= result["p50_s"] > 0
    # all three engines load one checkpoint (vLLM left out here, and the JSON says why)
    assert result["checkpoint"]["loaded_by"] == ["kvpilot", "hf"]
    assert (result["vllm_tokens_per_s"], result["ratio_vs_vllm"], result["vllm_skipped"]) == (None, None, "--no-vllm")
