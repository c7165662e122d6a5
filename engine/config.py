"""One pydantic `EngineConfig` for the whole engine (docs/architecture.md, "Contracts").

A tuning proposal is a YAML file in this schema, so `kvpilot engine serve --config proposal.yaml`
applies it. The tunable subset (`TUNABLE_FIELDS`) can be hot-reloaded through PUT /admin/config;
everything else (model shape, pool sizes, device) needs a restart because it sizes tensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

BLOCK_SIZES = (8, 16, 32, 64, 128)
PRIORITY_CLASSES = ("high", "normal", "low")


class ConfigError(ValueError):
    """A config file or patch that cannot be applied; the message and `field` name the offending field."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Strict):
    """Shape of the Llama-style decoder. `checkpoint` loads a local HF Llama directory instead."""

    vocab_size: int = Field(259, ge=4)
    dim: int = Field(256, ge=16)
    n_layers: int = Field(4, ge=1)
    n_heads: int = Field(8, ge=1)
    n_kv_heads: int = Field(2, ge=1)
    ffn_dim: int = Field(688, ge=16)
    max_position: int = Field(8192, ge=64)
    rope_theta: float = Field(10000.0, gt=0)
    norm_eps: float = Field(1e-5, gt=0)
    seed: int = 0
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    checkpoint: str | None = None

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.dim % self.n_heads:
            raise ValueError(f"model.dim ({self.dim}) must be divisible by model.n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model.n_heads ({self.n_heads}) must be divisible by model.n_kv_heads ({self.n_kv_heads})"
            )
        return self

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class CacheConfig(_Strict):
    """Paged KV cache. Pools are sized in bytes; pages of `page_tokens` are the allocator's unit."""

    page_tokens: int = Field(8, ge=1)
    hot_bytes: int = Field(64 * 2**20, ge=1)
    cold_bytes: int = Field(128 * 2**20, ge=0)
    block_policy: Literal["fixed", "dynamic"] = "fixed"
    block_size: int = 32
    dynamic_thresholds: tuple[int, int] = (512, 2048)
    dynamic_sizes: tuple[int, int, int] = (16, 32, 64)
    enable_prefix_cache: bool = True

    @field_validator("block_size")
    @classmethod
    def _known_block_size(cls, v: int) -> int:
        if v not in BLOCK_SIZES:
            raise ValueError(f"block_size must be one of {BLOCK_SIZES}, got {v}")
        return v

    @field_validator("dynamic_sizes")
    @classmethod
    def _known_dynamic_sizes(cls, v: tuple[int, int, int]) -> tuple[int, int, int]:
        for size in v:
            if size not in BLOCK_SIZES:
                raise ValueError(f"dynamic_sizes entries must be in {BLOCK_SIZES}, got {size}")
        return v

    @field_validator("dynamic_thresholds")
    @classmethod
    def _ordered_thresholds(cls, v: tuple[int, int]) -> tuple[int, int]:
        if not 0 < v[0] < v[1]:
            raise ValueError(f"dynamic_thresholds must be increasing positive token counts, got {v}")
        return v

    @model_validator(mode="after")
    def _page_divides_blocks(self) -> CacheConfig:
        for size in (self.block_size, *self.dynamic_sizes):
            if size % self.page_tokens:
                raise ValueError(f"block size {size} is not a multiple of page_tokens ({self.page_tokens})")
        return self

    def block_sizes_in_use(self) -> tuple[int, ...]:
        return (self.block_size,) if self.block_policy == "fixed" else tuple(sorted(set(self.dynamic_sizes)))


class SchedulerConfig(_Strict):
    max_num_seqs: int = Field(32, ge=1, le=4096)
    max_num_batched_tokens: int = Field(2048, ge=16)
    prefill_chunk_tokens: int = Field(512, ge=16)
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    queue_limit: int = Field(256, ge=1)
    aging_s: float = Field(5.0, gt=0, description="seconds of waiting that raise a request one class")
    # vLLM V1's scheduling, for the tuner's simulator of a vLLM (tuner/vllm/sim.py); kvpilot's own engine keeps
    # the defaults.
    enable_chunked_prefill: bool = Field(
        True,
        description="False: a waiting prompt is admitted only when all of it (up to prefill_chunk_tokens) fits the "
        "step's remaining budget",
    )
    chunk_lone_prefill: bool = Field(
        True,
        description="False: prefill_chunk_tokens applies only while another request runs or waits (a lone "
        "request's prefill may take the whole budget, as vLLM's long_prefill_token_threshold does)",
    )


class RecyclerConfig(_Strict):
    mode: Literal["passive", "active", "aggressive"] = "passive"
    recycle_interval_ms: int = Field(500, ge=1)
    threshold: float = Field(0.85, gt=0.0, le=1.0)


class WarmupConfig(_Strict):
    requests: int | None = Field(None, ge=0, description="None: 100 on CUDA, 4 on CPU")
    prompt_tokens: int = Field(64, ge=1)
    max_tokens: int = Field(8, ge=1)


class ServerConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    admin_token: str | None = None
    max_prompt_tokens: int = Field(8192, ge=1)
    max_tokens_limit: int = Field(4096, ge=1)
    max_body_bytes: int = Field(
        2 * 2**20, ge=1024, description="request bodies above this are refused (413) before they are parsed"
    )


class TelemetryConfig(_Strict):
    instance: str = "engine-0"
    run_id: str | None = None
    sink: Literal["memory", "jsonl", "http", "none"] = "memory"
    jsonl_path: str = "kvpilot-data/events.jsonl"
    collector_url: str = "http://127.0.0.1:8100"
    collector_token: str | None = None
    collector_token_file: str | None = Field(
        None, description="read the collector token from this file, re-read when it changes (rotation)"
    )
    sample_interval_s: float = Field(1.0, gt=0)
    trace_alloc: bool = True
    http_batch_size: int = Field(1000, ge=1, le=20_000, description="events per POST to the collector")
    http_flush_interval_s: float = Field(1.0, gt=0, description="a partial batch is sent after this long")
    http_queue_size: int = Field(100_000, ge=1, description="in-memory events; past it new events are dropped")
    http_flush_on_sample: bool = Field(
        True, description="a gauge sample is pushed at once (with what is queued), not at the next flush"
    )
    http_compress: bool = True
    spool_dir: str | None = Field(
        "kvpilot-data/spool", description="where batches wait while the collector is down; None: in memory"
    )
    spool_max_bytes: int = Field(256 * 2**20, ge=0, description="spool bound; the oldest batches go first")

    @model_validator(mode="after")
    def _one_token_source(self) -> TelemetryConfig:
        if self.collector_token and self.collector_token_file:
            raise ValueError("telemetry: set collector_token or collector_token_file, not both")
        return self


class EngineConfig(_Strict):
    device: Literal["auto", "cpu", "cuda"] = "auto"
    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    recycler: RecyclerConfig = RecyclerConfig()
    warmup: WarmupConfig = WarmupConfig()
    server: ServerConfig = ServerConfig()
    telemetry: TelemetryConfig = TelemetryConfig()

    @model_validator(mode="after")
    def _chunk_fits_budget(self) -> EngineConfig:
        if self.scheduler.prefill_chunk_tokens > self.scheduler.max_num_batched_tokens:
            raise ValueError("scheduler.prefill_chunk_tokens must not exceed scheduler.max_num_batched_tokens")
        return self

    @classmethod
    def from_yaml(cls, path: str | Path) -> EngineConfig:
        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except FileNotFoundError as exc:
            raise ConfigError(f"config file not found: {path}") from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: top level must be a mapping")
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> EngineConfig:
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]["loc"] if exc.errors() else ()
            field = ".".join(str(p) for p in first) or None
            raise ConfigError(f"{source}: {format_validation_error(exc)}", field) from exc

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    def tunable(self) -> dict[str, dict[str, Any]]:
        """The hot-reloadable subset, as nested dicts (what GET /admin/config returns)."""
        full = self.model_dump(mode="json")
        return {section: {k: full[section][k] for k in keys} for section, keys in TUNABLE_FIELDS.items()}

    def with_tunable(self, patch: dict[str, Any]) -> EngineConfig:
        """A new config with `patch` (nested {section: {field: value}}) applied; only tunables.

        A key the schema does not have is "unknown" (a typo, named with the closest key); a real key
        outside the tunable subset is "not hot-reloadable" (it sizes tensors: restart to change it)."""
        return self._patched(patch, tunable_only=True)

    def with_overrides(self, patch: dict[str, Any], *, frozen: dict[str, str] | None = None) -> EngineConfig:
        """A new config with any field of `patch` set (what-ifs at start-up: pool sizes too), except the
        sections of `frozen` (section -> why not); unknown keys are refused as in `with_tunable`."""
        return self._patched(patch, tunable_only=False, frozen=frozen or {})

    def _patched(
        self, patch: dict[str, Any], *, tunable_only: bool, frozen: dict[str, str] | None = None
    ) -> EngineConfig:
        if not isinstance(patch, dict):
            raise ConfigError("config patch must be a mapping of sections", "body")
        merged = self.model_dump(mode="json")
        for section, fields in patch.items():
            sections = type(self).model_fields
            if section not in sections:
                known = [s for s in sections if isinstance(merged.get(s), dict)]
                raise ConfigError(f"{section}: unknown key{_closest(section, known)}", str(section))
            if not isinstance(merged[section], dict):
                raise ConfigError(f"{section}: a top-level setting, not a section; restart to change it", section)
            if tunable_only and section not in TUNABLE_FIELDS:
                tunable = sorted(TUNABLE_FIELDS)
                raise ConfigError(f"{section}: not a hot-reloadable section (tunable: {tunable})", section)
            if frozen and section in frozen:
                raise ConfigError(f"{section}: {frozen[section]}", section)
            if not isinstance(fields, dict):
                raise ConfigError(f"{section}: must be a mapping of fields", section)
            for name, value in fields.items():
                if name not in merged[section]:
                    raise ConfigError(
                        f"{section}.{name}: unknown key{_closest(name, list(merged[section]))}", f"{section}.{name}"
                    )
                if tunable_only and name not in TUNABLE_FIELDS[section]:
                    raise ConfigError(
                        f"{section}.{name}: not hot-reloadable; restart the engine to change it", f"{section}.{name}"
                    )
                merged[section][name] = value
        return EngineConfig.from_dict(merged, source="config patch")


def _closest(name: object, known: list[str]) -> str:
    """`; did you mean X?` for a misspelt key, else the list of keys."""
    import difflib

    close = difflib.get_close_matches(str(name), known, n=1)
    return f"; did you mean {close[0]}?" if close else f"; known: {', '.join(known)}"


TUNABLE_FIELDS: dict[str, tuple[str, ...]] = {
    "cache": ("block_policy", "block_size", "dynamic_thresholds", "dynamic_sizes", "enable_prefix_cache"),
    "scheduler": (
        "max_num_seqs",
        "max_num_batched_tokens",
        "prefill_chunk_tokens",
        "preemption_mode",
        "queue_limit",
        "aging_s",
    ),
    "recycler": ("mode", "recycle_interval_ms", "threshold"),
}


def format_validation_error(exc: ValidationError) -> str:
    """`a.b: message; c: message` — the offending fields first, for CLI and HTTP errors alike."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(root)"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)
