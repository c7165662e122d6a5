"""The tuner bench's landscapes, pinned: which profile file, and the workload, space and SLOs on it.

A landscape is what the tuner bench measures samplers on: a cost profile, a workload sized to that profile's
capacity, a small discrete search space (every point simulated: the exhaustive optimum) and SLOs. Results are
only comparable on the same landscape, so the bench pins all of it:

- **Frozen profiles.** The bench runs on its own copies, `benchmarks/profiles/*.json`, not on `tuner/profiles/`:
  re-calibrating the shipped `cpu-2core` (which `kvpilot sim calibrate` does on any machine, any day) must not
  move the bench's figures. The JSON reports each profile's file, sha256, schema_version and kind, and the hash of
  the shipped profile of the same name with whether the two are the same file. Moving the bench to a new
  calibration is a deliberate act: copy the file over and bump BENCH_VERSION.
- **BENCH_VERSION** numbers the rest of the landscape (workloads, spaces, the SLO rule, budgets, the sampler
  candidates and the rule that picks one). Bump it with any change to them; the version history is below.
- **SLOs from the profile's own speed** (`derive_slo`): TTFT = 8x the predicted time of one prefill of the
  workload's median prompt; the p99 TTFT bound 110x that prefill time; TPOT = 4x the predicted decode step of a
  batch of 16 sequences at the median prompt plus half the median output. On the CPU profile this gives about
  the fixed SLOs of version 1 (0.3 s, 4 s, 30 ms), so its landscape barely moved; on another profile it scales
  with that profile's step times.

Versions: 1 (before 2026-12-03): the CPU profile from tuner/profiles, fixed SLOs 0.3 s / 30 ms / p99 4 s, TPE vs
random. 2: three frozen profiles, SLOs derived per profile, five samplers compared on 40-trial studies.
"""

from __future__ import annotations

import hashlib
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Engine

from engine import workload as W
from engine.config import EngineConfig
from integrations.vllm.config import VllmConfig
from tuner import workloads as WL
from tuner.backends import SimBackend
from tuner.jobs import capacity_rps
from tuner.metrics import SLO
from tuner.profile import CostProfile, ProfileError, StepShape, read_profile_json, shipped_profiles
from tuner.sim import decode_attention
from tuner.space import SearchSpace, load_space, space_from_dict
from tuner.vllm.calibrate import VllmProfile, parse_any_profile
from tuner.vllm.sim import VllmSimBackend
from tuner.vllm.space import VllmSpace, load_vllm_space, vllm_space_from_dict
from tuner.vllm.tune import sim_capacity_rps

BENCH_VERSION = 2
FROZEN_DIR = Path(__file__).resolve().parent / "profiles"
BENCH_PROFILES = ("cpu-2core", "h200-llama3-8b", "vllm-cpu-tiny")

# The SLO rule (see the module docstring): multiples of the profile's own predicted step times.
TTFT_PREFILLS = 8.0
P99_TTFT_PREFILLS = 110.0
TPOT_DECODES = 4.0
REFERENCE_BATCH = 16

KVPILOT_SPACE = {
    # 4 x 4 x 4 x 2 configs; `including(default)` adds the default's own prefill chunk (512), so the
    # grid (192 points) holds the default config too.
    "params": {
        "block_policy": {"choices": ["fixed-16", "fixed-32", "fixed-64", "dynamic-512-2048"]},
        "scheduler.max_num_seqs": {"choices": [8, 16, 32, 64]},
        "scheduler.max_num_batched_tokens": {"choices": [512, 1024, 2048, 4096]},
        "scheduler.prefill_chunk_tokens": {"choices": [256, 1024]},
    }
}
VLLM_SPACE = {
    # 4 x 4 x 3 x 2 x 2 = 192 configs, vLLM's CPU defaults (128 sequences, 2048 tokens, block 128, chunked
    # prefill, no long-prefill cap) among them.
    "params": {
        "max_num_seqs": {"choices": [16, 32, 64, 128]},
        "max_num_batched_tokens": {"choices": [512, 1024, 2048, 4096]},
        "block_size": {"choices": [32, 64, 128]},
        "enable_chunked_prefill": {"choices": [True, False]},
        "long_prefill_token_threshold": {"choices": [0, 128]},
    }
}
VLLM_KV_BYTES = 16 * 2**20  # the running config of `kvpilot vllm calibrate` and `bench tune-vllm`


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass(frozen=True)
class PinnedProfile:
    """A profile as the bench ran it: the file, its hash, and what it parsed to."""

    name: str
    path: Path
    sha256: str
    frozen: bool  # one of the bench's own copies (benchmarks/profiles)
    profile: CostProfile | VllmProfile

    @property
    def kind(self) -> str:
        return self.profile.kind

    def describe(self) -> dict[str, Any]:
        shipped = shipped_profiles().get(self.name)
        shipped_hash = sha256_file(shipped) if shipped is not None else None
        return {
            "name": self.name,
            "kind": self.kind,
            "schema_version": self.profile.schema_version,
            "sha256": self.sha256,
            "path": str(self.path),
            "frozen_copy": self.frozen,
            "description": self.profile.description,
            "shipped": {
                "path": str(shipped) if shipped is not None else None,
                "sha256": shipped_hash,
                "same_as_pinned": shipped_hash == self.sha256,
            },
        }


def frozen_profiles() -> dict[str, Path]:
    return {p.stem: p for p in sorted(FROZEN_DIR.glob("*.json"))}


def pin_profile(name_or_path: str | Path) -> PinnedProfile:
    """A frozen bench profile by name, or any profile file by path (kvpilot's or a vLLM one); ProfileError if
    it is neither, or the file is not a valid profile."""
    frozen = frozen_profiles()
    path = frozen.get(str(name_or_path)) or Path(name_or_path)
    if not path.is_file():
        raise ProfileError(
            f"profile {name_or_path!r} not found: not a file and not one of the bench's frozen profiles "
            f"{sorted(frozen)} ({FROZEN_DIR})"
        )
    raw = path.read_bytes()
    profile = parse_any_profile(read_profile_json(path), str(path))
    return PinnedProfile(
        name=profile.name,
        path=path,
        sha256=hashlib.sha256(raw).hexdigest(),
        frozen=path.resolve().parent == FROZEN_DIR,
        profile=profile,
    )


def derive_slo(
    profile: CostProfile | VllmProfile, prompt: int, output: int, *, block_tokens: int, page_tokens: int
) -> tuple[SLO, dict]:
    """The bench's SLOs from the profile's predicted step times (module docstring), and how they were derived."""
    ctx = prompt + output // 2
    b = REFERENCE_BATCH
    if isinstance(profile, VllmProfile):
        prefill = profile.predict(StepShape(prefill_tokens=prompt, prefill_seqs=1, decode_ctx_tokens=prompt), 1)[0]
        decode = profile.predict(StepShape(decode_seqs=b, decode_ctx_tokens=b * ctx), b)[0]
    else:
        pairs = prompt * (prompt + 1) // 2
        prefill = profile.predict(
            StepShape(prefill_tokens=prompt, prefill_seqs=1, attn_pairs=pairs, prefill_ctx_tokens=prompt)
        )
        blocks = math.ceil(ctx / block_tokens)
        attn, groups = decode_attention([ctx] * b, page_tokens)
        decode = profile.predict(
            StepShape(
                decode_seqs=b,
                decode_ctx_tokens=b * ctx,
                decode_kv_slots=b * blocks * block_tokens,
                decode_blocks=b * blocks,
                decode_attn_tokens=attn,
                decode_groups=groups,
            )
        )
    slo = SLO(
        ttft_s=round(TTFT_PREFILLS * prefill, 6),
        tpot_s=round(TPOT_DECODES * decode, 6),
        max_rejection_rate=0.01,
        p99_ttft_s=round(P99_TTFT_PREFILLS * prefill, 6),
    ).validate()
    derivation = {
        "rule": (
            f"ttft = {TTFT_PREFILLS:g} x prefill; p99_ttft = {P99_TTFT_PREFILLS:g} x prefill; "
            f"tpot = {TPOT_DECODES:g} x decode step (the profile's predicted step times)"
        ),
        "median_prompt_tokens": prompt,
        "median_output_tokens": output,
        "prefill_s": round(prefill, 6),
        "prefill_shape": f"one sequence, {prompt} prompt tokens in one step",
        "decode_step_s": round(decode, 6),
        "decode_shape": f"{b} sequences decoding at {ctx} tokens of context",
    }
    return slo, derivation


@dataclass
class Landscape:
    """One profile's landscape: the default config, the grid space, the tuning space, workload and SLOs."""

    pinned: PinnedProfile
    default: EngineConfig | VllmConfig
    space: SearchSpace | VllmSpace
    full_space: SearchSpace | VllmSpace
    opts: WL.WorkloadOptions
    capacity_rps: float
    slo: SLO
    slo_derivation: dict[str, Any]

    def workload(
        self, scenario: str, opts: WL.WorkloadOptions | None = None
    ) -> Callable[[int], list[W.WorkloadRequest]]:
        o, cap = opts or self.opts, self.capacity_rps
        return lambda seed: WL.scenario(scenario, cap, o, seed=seed)

    def backend(self, scenario: str, db: Engine, opts: WL.WorkloadOptions | None = None) -> Any:
        prof = self.pinned.profile
        if isinstance(prof, VllmProfile):
            return VllmSimBackend(prof, self.workload(scenario, opts), db, self.slo)
        return SimBackend(prof, self.workload(scenario, opts), db, self.slo)

    def describe(self) -> dict[str, Any]:
        s = self.slo
        return {
            "workload": {
                "kind": "burst",
                "requests": self.opts.requests,
                "scale": self.opts.scale,
                "output_range": list(self.opts.output_range),
                "max_total_tokens": self.opts.max_total_tokens,
                "capacity_rps": round(self.capacity_rps, 3),
            },
            "space": self.space.describe(),
            "default_config": self.default.tunable(),
            "slo": {"ttft_s": s.ttft_s, "tpot_s": s.tpot_s, "p99_ttft_s": s.p99_ttft_s, "max_rejection_rate": 0.01},
            "slo_derivation": self.slo_derivation,
        }


def landscape(pinned: PinnedProfile, *, requests: int) -> Landscape:
    """The landscape of a pinned profile: kvpilot's engine on a kvpilot profile, vLLM's mode on a vLLM one."""
    prof = pinned.profile
    if isinstance(prof, VllmProfile):
        default: EngineConfig | VllmConfig = VllmConfig(kv_cache_memory_bytes=VLLM_KV_BYTES)
        # lengths scaled to the 512-token model, as `kvpilot vllm calibrate` and `bench tune-vllm` replay them
        opts = WL.WorkloadOptions(requests=requests, scale=8.0, output_range=(16, 128), max_total_tokens=512)
        space: SearchSpace | VllmSpace = vllm_space_from_dict(VLLM_SPACE, base=default).including(default)
        full: SearchSpace | VllmSpace = load_vllm_space(base=default)
        cap = sim_capacity_rps(prof, default, WL.offline_mix(opts))
        block = page = default.block_size
    else:
        # The default tunables (block 32 fixed, threshold 0.85, recycle 500 ms, passive, 32 seqs, 2048-token
        # budget) on the profile's own memory pools and model.
        default = prof.engine_config(None).with_tunable(EngineConfig().tunable())
        gpu = prof.hardware.kind == "gpu"  # GPU profiles replay the seed's lengths; CPU ones a quarter of them
        opts = WL.WorkloadOptions(
            requests=requests,
            scale=1.0 if gpu else 4.0,
            output_range=(32, 512) if gpu else (16, 128),
            max_total_tokens=default.model.max_position,
        )
        space = space_from_dict(KVPILOT_SPACE, base=default).including(default)
        full = load_space(base=default)
        cap = capacity_rps(prof, default, opts)
        block, page = default.cache.block_size, default.cache.page_tokens
    reqs = WL.scenario("burst", cap, opts, seed=0)
    prompt = int(statistics.median(r.prompt_tokens for r in reqs))
    output = int(statistics.median(r.output_tokens for r in reqs))
    slo, derivation = derive_slo(prof, prompt, output, block_tokens=block, page_tokens=page)
    return Landscape(pinned, default, space, full, opts, cap, slo, derivation)
