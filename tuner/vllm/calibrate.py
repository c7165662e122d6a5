"""The simulator's cost model for a vLLM, fitted to the steps the collector stored from vLLM's iteration lines.

No grid run: the traffic vLLM already served (its `--enable-logging-iteration-details` lines, stored as step
rows by the launcher) is the calibration, when there is enough of it (`MIN_STEPS`). A step row gives the batch's
shape — context (prefill) requests and tokens, generation (decode) requests, KV blocks in use — and vLLM's
"iteration elapsed time", which covers the model's forward and sampling only (`EngineCore.step` times
`future.result()`), not the scheduling, the output processing and the hand-off around it. So two things are fit:

- `elapsed`: the existing linear cost model (`tuner.calibrate.fit`: non-negative least squares on error
  relative to the prediction, gross outliers dropped) over the features a step row has: prefill tokens, prefill
  and decode sequences, KV tokens held (blocks used x block size, standing in for the context the batch
  attends to) and the two saturating row terms; its spread is kept as `step_jitter` (`tuner.calibrate`);
- `overhead`: what a step costs around its forward, from steps that ran back to back — a step with generation
  requests follows the previous one at once, so the gap between their stored times is a whole cycle. The gaps
  are read times of log lines, jittery one by one but exact in sum, so the overhead is fitted by plain
  (mean-preserving) non-negative least squares on `[1, num_seqs]`, without dropping anything.

The simulator advances its clock by elapsed x jitter + overhead per step and counts the elapsed part as busy
time, as vLLM's lines do.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from collector.queries import StoredStep
from engine.config import ModelConfig
from tuner.calibrate import Sample, _nnls, fit, fit_report, jitter_quantiles
from tuner.profile import (
    PROFILE_SCHEMA,
    CostProfile,
    FitReport,
    LinearCost,
    ModelProfile,
    StepShape,
    jitter_at,
    read_profile_json,
    resolve_profile,
    validate_profile,
)

MIN_STEPS = 200  # fewer stored steps than this: not enough traffic to calibrate from
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class CalibrationError(ValueError):
    """Not enough (or no usable) stored steps to fit a cost model from."""


class VllmProfile(BaseModel):
    """A vLLM's step cost on one machine for one model, fitted from its own stored steps."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[1] = PROFILE_SCHEMA
    kind: Literal["vllm"] = "vllm"  # tells a vLLM profile file from a kvpilot engine one (`tuner.profile`)
    name: str
    description: str = ""
    model: ModelProfile
    block_size: int = Field(gt=0, description="the block size of the calibration runs (KV tokens = blocks x it)")
    elapsed: LinearCost
    overhead_s: float = Field(ge=0, description="per step, around the forward")
    overhead_per_seq_s: float = Field(ge=0)
    step_jitter: list[float] | None = None
    fit: FitReport
    source: dict[str, Any] = Field(default_factory=dict, description="runs and steps it was fitted on")

    def predict(self, shape: StepShape, num_seqs: int) -> tuple[float, float]:
        """(cycle seconds, elapsed seconds) of a step: what the clock advances and what vLLM's line logs."""
        elapsed = self.elapsed.predict(shape)
        return elapsed + self.overhead_s + self.overhead_per_seq_s * num_seqs, elapsed

    def jitter(self, u: float) -> float:
        return jitter_at(self.step_jitter, u)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.model_dump_json(indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> VllmProfile:
        return cls.model_validate_json(Path(path).read_text())

    @classmethod
    def from_dict(cls, data: Any, source: str = "vLLM profile") -> VllmProfile:
        return validate_profile(cls, data, source)


def parse_any_profile(data: Any, source: str) -> CostProfile | VllmProfile:
    """A profile of either family from its JSON: `kind: vllm` is a vLLM profile, any other a kvpilot one."""
    if isinstance(data, dict) and data.get("kind") == "vllm":
        return VllmProfile.from_dict(data, source=source)
    return CostProfile.from_dict(data, source=source)


def load_any_profile(name_or_path: str | Path) -> CostProfile | VllmProfile:
    """A shipped profile by name or a profile file by path, kvpilot's or vLLM's (`kvpilot sim profiles` lists
    both; `tuner.profile.load_profile` takes kvpilot's only)."""
    path = resolve_profile(name_or_path)
    return parse_any_profile(read_profile_json(path), str(path))


def model_profile(model: ModelConfig) -> ModelProfile:
    """The KV bytes per token of a model (what sizes vLLM's blocks in `kv_cache_memory_bytes`)."""
    bpt = 2 * model.n_layers * model.n_kv_heads * model.head_dim * _DTYPE_BYTES[model.dtype]
    params = model.vocab_size * model.dim * 2 + model.n_layers * (
        4 * model.dim * model.dim + 3 * model.dim * model.ffn_dim
    )
    return ModelProfile(
        name=f"llama-d{model.dim}-l{model.n_layers}",
        config=model.model_copy(update={"checkpoint": None}),
        params=params,
        weights_bytes=params * _DTYPE_BYTES[model.dtype],
        kv_bytes_per_token=bpt,
    )


def step_shape(step: StoredStep, block_size: int) -> StepShape:
    """A stored step as the cost model's features (vLLM's line has no per-request positions: no attention pairs).

    vLLM counts a request as "generation" once it has an output token, so a preempted request recomputing its
    prompt and output on resumption is a generation request with hundreds of tokens (vllm/v1/utils.py
    `compute_iteration_details`). One token per generation request otherwise (no speculative decoding): when a
    line's generation tokens are more than its generation requests can be (every sequence but the one taking
    the context tokens), one of them is such a resumption, whose tokens are prefill work, as the simulator
    counts them."""
    gen_reqs = step.num_seqs - (1 if step.prefill_tokens > 0 else 0)
    decode, prefill = step.decode_tokens, step.prefill_tokens
    if decode > gen_reqs > 0:
        decode = gen_reqs - 1
        prefill += step.decode_tokens - decode
    return StepShape(
        prefill_tokens=prefill,
        prefill_seqs=max(0, step.num_seqs - decode),
        decode_seqs=decode,
        decode_ctx_tokens=step.kv_blocks_used * block_size,
    )


def _cycles(steps: Sequence[StoredStep]) -> list[tuple[StoredStep, float]]:
    """(step, seconds since the previous step's line) for steps that followed the previous one at once."""
    out = []
    for prev, cur in itertools.pairwise(steps):
        same_run = cur.run_id == prev.run_id and cur.instance == prev.instance and cur.step == prev.step + 1
        if same_run and cur.decode_tokens > 0 and prev.num_seqs > 0:
            out.append((cur, cur.ts - prev.ts))
    return out


def fit_overhead(steps: Sequence[StoredStep]) -> tuple[float, float, int]:
    """(seconds per step, seconds per sequence, pairs used): gap - elapsed ~ a + b x num_seqs, a, b >= 0."""
    pairs = _cycles(steps)
    if len(pairs) < 20:
        return 0.0, 0.0, len(pairs)
    a = np.array([[1.0, float(s.num_seqs)] for s, _ in pairs])
    y = np.array([gap - s.duration_s for s, gap in pairs])
    coef = _nnls(a, y)
    return float(coef[0]), float(coef[1]), len(pairs)


def fit_profile(
    steps: Sequence[StoredStep],
    *,
    model: ModelConfig,
    block_size: int,
    name: str = "vllm-cpu",
    description: str = "",
    min_steps: int = MIN_STEPS,
) -> VllmProfile:
    """Fit the profile from stored steps (all of one block size); CalibrationError when there are too few."""
    usable = [s for s in steps if s.num_seqs > 0 and s.duration_s > 0]
    if len(usable) < min_steps:
        raise CalibrationError(
            f"{len(usable)} stored vLLM steps with work (need >= {min_steps}): let it serve more traffic "
            "(or lower min_steps)"
        )
    samples = [Sample(step_shape(s, block_size), s.duration_s) for s in usable]
    elapsed, stats = fit(samples)
    overhead, per_seq, pairs = fit_overhead(steps)
    runs = sorted({s.run_id or "" for s in usable})
    return VllmProfile(
        name=name,
        description=description,
        model=model_profile(model),
        block_size=block_size,
        elapsed=elapsed,
        overhead_s=overhead,
        overhead_per_seq_s=per_seq,
        step_jitter=jitter_quantiles(samples, elapsed) if len(samples) >= 41 else None,
        fit=fit_report(stats, grid=[]),
        source={
            "runs": runs,
            "steps": len(usable),
            "back_to_back_pairs": pairs,
            "median_elapsed_s": statistics.median(s.duration_s for s in usable),
            "elapsed_total_ratio": round(stats["total_ratio"], 4),
        },
    )
