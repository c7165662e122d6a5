"""Cost profiles: what one engine step costs on some hardware for some model, from the batch's shape.

Two kinds. `linear` is fitted by `kvpilot sim calibrate` from real engine steps (least squares over
the batch-shape features below). `roofline` is built from datasheet figures — HBM bandwidth, dense
bf16 FLOP/s, efficiency factors — plus the model's weight and KV bytes, so GPU-scale what-ifs are
possible without a GPU. A profile is a JSON file; loading validates every field and names the bad one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from itertools import pairwise
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from engine.config import ConfigError, EngineConfig, ModelConfig, format_validation_error

PROFILE_SCHEMA = 1
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class ProfileError(ValueError):
    """A profile file that cannot be used; `field` names the offending field."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True, slots=True)
class StepShape:
    """The features of one scheduled step that its duration depends on."""

    prefill_tokens: int = 0  # new tokens computed for sequences in prefill (incl. recompute)
    prefill_seqs: int = 0
    decode_seqs: int = 0  # sequences decoding one token
    decode_ctx_tokens: int = 0  # KV tokens the decode batch attends to (sum of context lengths)
    decode_kv_slots: int = 0  # the same, padded to whole KV blocks (what paged attention reads)
    decode_blocks: int = 0  # KV blocks the decode batch spans (per-block gather overhead)
    decode_attn_tokens: int = 0  # key slots the torch executor's decode attention computes (padded per group)
    decode_groups: int = 0  # decode attention groups (a fixed cost per group and layer)
    attn_pairs: int = 0  # query x key pairs of the prefill chunks (causal, incl. earlier chunks)
    prefill_ctx_tokens: int = 0  # KV tokens the prefill chunks read (earlier chunks + themselves)
    swap_tokens: int = 0  # KV tokens copied between the hot and cold tier

    @property
    def num_seqs(self) -> int:
        return self.prefill_seqs + self.decode_seqs

    @property
    def rows(self) -> int:
        """Token rows through the dense layers (every prefill token and one per decoding sequence)."""
        return self.prefill_tokens + self.decode_seqs

    # A matmul's time is concave in its rows at the small end: one row runs as a matrix-vector product,
    # a few rows cost almost as much each as a full pass over the weights, and from some 4-8 rows on a row
    # costs a fraction of that (on this EPYC: 2.9 ms at one decoding sequence, 3.5 at 2, 4.3 at 4, 4.6 at
    # 8, then about 0.1 ms a row). These saturating features let non-negative coefficients bend the line.
    @property
    def rows_upto_2(self) -> int:
        return min(self.rows, 2)

    @property
    def rows_upto_8(self) -> int:
        return min(self.rows, 8)


LINEAR_FEATURES = (
    "prefill_tokens",
    "prefill_seqs",
    "decode_seqs",
    "decode_ctx_tokens",
    "decode_attn_tokens",
    "decode_groups",
    "decode_blocks",
    "attn_pairs",
    "prefill_ctx_tokens",
    "swap_tokens",
    "rows_upto_2",
    "rows_upto_8",
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class HardwareSpec(_Strict):
    name: str = Field(min_length=1)
    kind: Literal["cpu", "gpu"]
    threads: int | None = Field(None, ge=1)
    hbm_bytes: int | None = Field(None, ge=1, description="device memory, for sizing the KV pool")
    hbm_bandwidth_Bps: float | None = Field(None, gt=0)
    peak_flops: float | None = Field(None, gt=0, description="dense bf16 FLOP/s")
    compute_efficiency: float = Field(0.6, gt=0, le=1, description="achieved share of peak FLOP/s")
    bandwidth_efficiency: float = Field(0.8, gt=0, le=1, description="achieved share of HBM bandwidth")
    host_link_Bps: float | None = Field(None, gt=0, description="host<->device copies (swap)")


class ModelProfile(_Strict):
    name: str = Field(min_length=1)
    config: ModelConfig
    params: int = Field(ge=1)
    weights_bytes: int = Field(ge=1)
    kv_bytes_per_token: int = Field(ge=1)

    @model_validator(mode="after")
    def _kv_matches_shape(self) -> ModelProfile:
        c = self.config
        expect = 2 * c.n_layers * c.n_kv_heads * c.head_dim * _DTYPE_BYTES[c.dtype]
        if self.kv_bytes_per_token != expect:
            raise ValueError(
                f"kv_bytes_per_token is {self.kv_bytes_per_token} but the shape gives 2 x {c.n_layers} layers x "
                f"{c.n_kv_heads} KV heads x {c.head_dim} dims x {_DTYPE_BYTES[c.dtype]} bytes = {expect}"
            )
        return self


class LinearCost(_Strict):
    """t = c0 + sum(coef * feature): seconds per step, every coefficient >= 0."""

    c0_s: float = Field(ge=0)
    prefill_tokens: float = Field(0.0, ge=0)
    prefill_seqs: float = Field(0.0, ge=0)
    decode_seqs: float = Field(0.0, ge=0)
    decode_ctx_tokens: float = Field(0.0, ge=0)
    decode_attn_tokens: float = Field(0.0, ge=0)
    decode_groups: float = Field(0.0, ge=0)
    decode_blocks: float = Field(0.0, ge=0)
    attn_pairs: float = Field(0.0, ge=0)
    prefill_ctx_tokens: float = Field(0.0, ge=0)
    swap_tokens: float = Field(0.0, ge=0)
    rows_upto_2: float = Field(0.0, ge=0)
    rows_upto_8: float = Field(0.0, ge=0)

    def predict(self, s: StepShape) -> float:
        return (
            self.c0_s
            + self.prefill_tokens * s.prefill_tokens
            + self.prefill_seqs * s.prefill_seqs
            + self.decode_seqs * s.decode_seqs
            + self.decode_ctx_tokens * s.decode_ctx_tokens
            + self.decode_attn_tokens * s.decode_attn_tokens
            + self.decode_groups * s.decode_groups
            + self.decode_blocks * s.decode_blocks
            + self.attn_pairs * s.attn_pairs
            + self.prefill_ctx_tokens * s.prefill_ctx_tokens
            + self.swap_tokens * s.swap_tokens
            + self.rows_upto_2 * s.rows_upto_2
            + self.rows_upto_8 * s.rows_upto_8
        )


class RooflineCost(_Strict):
    """t = max(FLOPs / achieved FLOP/s, bytes / achieved bandwidth) + overheads + swap copies."""

    step_overhead_s: float = Field(ge=0, description="scheduler, launch and sampling per step")
    per_seq_overhead_s: float = Field(0.0, ge=0)


def jitter_at(quantiles: list[float] | None, u: float) -> float:
    """The step-time factor at quantile `u` in [0, 1], linear between evenly spaced `quantiles`; 1.0 without them."""
    q = quantiles
    if not q:
        return 1.0
    x = min(max(u, 0.0), 1.0) * (len(q) - 1)
    i = min(int(x), len(q) - 2)
    return q[i] + (q[i + 1] - q[i]) * (x - i)


class FitReport(_Strict):
    samples: int = Field(ge=1)
    r2: float
    mape: float = Field(ge=0)
    p90_abs_rel_error: float = Field(ge=0)
    calibrated_at: str
    grid: list[str] = Field(default_factory=list)


class CostProfile(_Strict):
    schema_version: Literal[1] = PROFILE_SCHEMA
    name: str = Field(min_length=1)
    kind: Literal["linear", "roofline"]
    description: str = ""
    hardware: HardwareSpec
    model: ModelProfile
    linear: LinearCost | None = None
    roofline: RooflineCost | None = None
    engine_defaults: dict[str, Any] = Field(default_factory=dict, description="EngineConfig sections to start from")
    fit: FitReport | None = None
    step_jitter: list[float] | None = Field(
        None,
        min_length=2,
        description="quantiles (evenly spaced, 0 to 1) of measured / predicted step time in the calibration, "
        "scaled to mean 1: how much one step varies around the cost model's mean on this machine",
    )

    @model_validator(mode="after")
    def _kind_has_its_section(self) -> CostProfile:
        q = self.step_jitter
        if q is not None and (q[0] <= 0 or any(b < a for a, b in pairwise(q))):
            raise ValueError("step_jitter: quantiles must be positive and ascending")
        if self.kind == "linear" and self.linear is None:
            raise ValueError("kind 'linear' needs a `linear` section of coefficients")
        if self.kind == "roofline":
            if self.roofline is None:
                raise ValueError("kind 'roofline' needs a `roofline` section")
            missing = [f for f in ("hbm_bandwidth_Bps", "peak_flops") if getattr(self.hardware, f) is None]
            if missing:
                raise ValueError(f"kind 'roofline' needs hardware.{missing[0]}")
        try:
            EngineConfig.from_dict({**self.engine_defaults, "model": self.model.config.model_dump()})
        except ConfigError as exc:
            raise ValueError(f"engine_defaults: {exc}") from exc
        return self

    # ------------------------------------------------------------------ the cost model
    def jitter(self, u: float) -> float:
        """The step-time factor at quantile `u` in [0, 1]; 1.0 when the profile has none."""
        return jitter_at(self.step_jitter, u)

    def predict(self, s: StepShape) -> float:
        """Seconds the engine spends on a step of this shape (schedule + forward + postprocess)."""
        if self.kind == "linear":
            return self.linear.predict(s)
        hw, m, r = self.hardware, self.model, self.roofline
        cfg = m.config
        tokens = s.prefill_tokens + s.decode_seqs
        flops = 2.0 * m.params * tokens + 4.0 * cfg.n_layers * cfg.dim * (s.attn_pairs + s.decode_ctx_tokens)
        kv = m.kv_bytes_per_token
        moved = m.weights_bytes + kv * (s.decode_kv_slots + s.prefill_ctx_tokens + tokens)
        compute_s = flops / (hw.peak_flops * hw.compute_efficiency)
        memory_s = moved / (hw.hbm_bandwidth_Bps * hw.bandwidth_efficiency)
        swap_s = kv * s.swap_tokens / hw.host_link_Bps if hw.host_link_Bps else 0.0
        return max(compute_s, memory_s) + r.step_overhead_s + r.per_seq_overhead_s * s.num_seqs + swap_s

    def engine_config(self, base: EngineConfig | None = None) -> EngineConfig:
        """The config a simulated engine runs: `base` (or the profile's defaults) with the profile's model."""
        data = base.model_dump(mode="json") if base is not None else dict(self.engine_defaults)
        data["model"] = self.model.config.model_dump(mode="json")
        return EngineConfig.from_dict(data, source=f"profile {self.name}")

    # ------------------------------------------------------------------ files
    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=2) + "\n"

    def save(self, path: str | Path) -> Path:
        """Write atomically: a reader never sees half a profile."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(self.to_json())
        tmp.replace(path)
        return path

    @classmethod
    def from_dict(cls, data: Any, source: str = "profile") -> CostProfile:
        return validate_profile(cls, data, source)


_P = TypeVar("_P", bound=BaseModel)


def validate_profile(cls: type[_P], data: Any, source: str) -> _P:
    """`data` as a profile of class `cls`; ProfileError naming the first bad field otherwise."""
    if not isinstance(data, dict):
        raise ProfileError(f"{source}: a profile must be a JSON object")
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        field = ".".join(str(p) for p in errors[0]["loc"]) if errors and errors[0]["loc"] else None
        raise ProfileError(f"{source}: {format_validation_error(exc)}", field) from exc


def shipped_profiles() -> dict[str, Path]:
    """Profiles bundled with kvpilot (tuner/profiles/*.json), by name."""
    folder = Path(str(resources.files("tuner") / "profiles"))
    return {p.stem: p for p in sorted(folder.glob("*.json"))}


def resolve_profile(name_or_path: str | Path) -> Path:
    """The file of a shipped profile by name, or `name_or_path` itself if it is a file; ProfileError if neither."""
    shipped = shipped_profiles()
    path = shipped.get(str(name_or_path)) or Path(name_or_path)
    if not path.is_file():
        raise ProfileError(f"profile {name_or_path!r} not found: not a file and not one of {sorted(shipped)}")
    return path


def read_profile_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{path}: not valid JSON: {exc}") from exc


def load_profile(name_or_path: str | Path) -> CostProfile:
    """A shipped profile by name (`cpu-2core`, `h200-llama3-8b`) or a JSON file by path."""
    path = resolve_profile(name_or_path)
    data = read_profile_json(path)
    if isinstance(data, dict) and data.get("kind") == "vllm":
        raise ProfileError(
            f"{path}: a vLLM profile (kind 'vllm'): it runs in the simulator's vLLM mode (tuner.vllm, "
            "`kvpilot bench tuner`), while kvpilot's engine needs a linear or roofline profile",
            "kind",
        )
    return CostProfile.from_dict(data, source=str(path))
