"""Datasheet roofline profiles: GPU-scale what-ifs without a GPU.

`h200_llama3_8b()` is the shipped `tuner/profiles/h200-llama3-8b.json` (regenerate with
`python -m tuner.roofline > tuner/profiles/h200-llama3-8b.json`). Figures: H200 SXM HBM3e 4.8 TB/s,
989 TFLOP/s dense bf16, 141 GB; PCIe Gen5 x16 ~55 GB/s effective for swaps. Llama-3-8B: 8.03 B
parameters (16.06 GB in bf16), 32 layers, 32 query / 8 KV heads of 128 dims: 2 x 32 x 8 x 128 x 2 bytes
= 131072 B (128 KiB) of KV per token. Efficiency factors are typical of vLLM-class kernels (60% of
peak FLOP/s in prefill, 80% of HBM bandwidth in decode); overheads are per step and per sequence.
"""

from __future__ import annotations

from engine.config import ModelConfig
from tuner.profile import CostProfile, HardwareSpec, ModelProfile, RooflineCost

H200 = HardwareSpec(
    name="NVIDIA H200 SXM (datasheet)",
    kind="gpu",
    hbm_bytes=141 * 10**9,
    hbm_bandwidth_Bps=4.8e12,
    peak_flops=989e12,
    compute_efficiency=0.6,
    bandwidth_efficiency=0.8,
    host_link_Bps=55e9,
)

LLAMA3_8B = ModelProfile(
    name="Llama-3-8B",
    config=ModelConfig(
        vocab_size=128256,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        max_position=8192,
        rope_theta=500000.0,
        dtype="bfloat16",
    ),
    params=8_030_261_248,
    weights_bytes=16_060_522_496,
    kv_bytes_per_token=131072,
)


def h200_llama3_8b() -> CostProfile:
    # KV pool: 90% of HBM less the weights (as vLLM's gpu_memory_utilization=0.9), host tier 64 GiB.
    hot = int(H200.hbm_bytes * 0.9) - LLAMA3_8B.weights_bytes
    return CostProfile(
        name="h200-llama3-8b",
        kind="roofline",
        description="H200 SXM + Llama-3-8B bf16 from datasheet roofline figures (not measured)",
        hardware=H200,
        model=LLAMA3_8B,
        roofline=RooflineCost(step_overhead_s=0.0015, per_seq_overhead_s=10e-6),
        engine_defaults={
            "device": "cuda",
            "cache": {
                "page_tokens": 16,
                "hot_bytes": hot,
                "cold_bytes": 64 * 2**30,
                "block_size": 32,
                "dynamic_sizes": [16, 32, 64],
            },
            "scheduler": {
                "max_num_seqs": 256,
                "max_num_batched_tokens": 8192,
                "prefill_chunk_tokens": 2048,
                "queue_limit": 4096,
            },
        },
    )


if __name__ == "__main__":
    print(h200_llama3_8b().to_json(), end="")
