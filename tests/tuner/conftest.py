"""Tuner test helpers: a small linear profile on the engine tests' tiny model, so results never depend
on the shipped (re-calibrated) CPU profile's numbers."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig, ModelConfig
from tuner.profile import CostProfile, HardwareSpec, LinearCost, ModelProfile
from tuner.workloads import WorkloadOptions

TINY_MODEL = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128, "max_position": 1024, "seed": 7}
TINY_BPT = 2 * 2 * 2 * 16 * 4  # 2 x layers x kv heads x head dim x float32


def tiny_profile(**coef: float) -> CostProfile:
    cost = {
        "c0_s": 0.002,
        "prefill_tokens": 4e-5,
        "prefill_seqs": 2e-4,
        "decode_seqs": 2e-4,
        "decode_attn_tokens": 5e-7,
        "swap_tokens": 1e-6,
        **coef,
    }
    return CostProfile(
        name="tiny-test",
        kind="linear",
        hardware=HardwareSpec(name="test cpu", kind="cpu", threads=1),
        model=ModelProfile(
            name="tiny",
            config=ModelConfig(**TINY_MODEL),
            params=100_000,
            weights_bytes=400_000,
            kv_bytes_per_token=TINY_BPT,
        ),
        linear=LinearCost(**cost),
        engine_defaults={
            "device": "cpu",
            "cache": {"hot_bytes": 4 * 2**20, "cold_bytes": 4 * 2**20},
            "scheduler": {"max_num_seqs": 32, "max_num_batched_tokens": 1024, "queue_limit": 512},
        },
    )


@pytest.fixture
def profile() -> CostProfile:
    return tiny_profile()


@pytest.fixture
def base(profile: CostProfile) -> EngineConfig:
    return profile.engine_config(None)


SMALL = WorkloadOptions(requests=40, scale=16.0, output_range=(4, 24))
