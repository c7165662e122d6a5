"""A vLLM server's configuration as the tuner sees it: the engine arguments it tunes and those it keeps.

`VllmConfig` holds every tunable engine argument explicitly (vLLM 0.32's own defaults for the CPU build's OpenAI
server: 128 sequences, a 2,048-token budget, 128-token blocks, chunked prefill and prefix caching on, FCFS), plus
the serve arguments a trial keeps as they are (model, dtype, max-model-len, extra arguments). It renders to vLLM's
command line (`to_args`) and to vLLM's `--config` YAML (`to_config_yaml`, dashed keys, as
`FlexibleArgumentParser.load_config_file` reads them), so a proposal is a file `vllm serve --config` takes.

The validator mirrors the checks vLLM's `SchedulerConfig` makes at start-up (the budget must hold `max_num_seqs`
tokens, and a whole `max_model_len` prompt when chunked prefill is off; the long-prefill threshold must not exceed
`max_model_len`), so a combination vLLM would refuse is refused here without a restart. What vLLM refuses anyway
(an out-of-memory KV cache, a block size its attention backend lacks) ends the trial as infeasible, with vLLM's
own message (`tuner.vllm.backend`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from engine.config import ConfigError, format_validation_error

# Tunable engine arguments: dest name -> the option vLLM's parser knows it by.
TUNABLE_ARGS: dict[str, str] = {
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "block_size": "--block-size",
    "enable_chunked_prefill": "--enable-chunked-prefill",
    "enable_prefix_caching": "--enable-prefix-caching",
    "long_prefill_token_threshold": "--long-prefill-token-threshold",
    "scheduling_policy": "--scheduling-policy",
    "kv_cache_memory_bytes": "--kv-cache-memory-bytes",
    "gpu_memory_utilization": "--gpu-memory-utilization",
    # in the issue's list, but vLLM 0.32's parser has no such option: the argument check refuses a space naming it
    "max_num_partial_prefills": "--max-num-partial-prefills",
}
BOOLEAN_ARGS = ("enable_chunked_prefill", "enable_prefix_caching")
SERVE_ARGS: dict[str, str] = {
    "model": "--model",
    "served_model_name": "--served-model-name",
    "dtype": "--dtype",
    "max_model_len": "--max-model-len",
}
LISTEN_ARGS = ("host", "port")  # in a running server's --config file; not part of the config the tuner reads
# Arguments the tuner owns (port, host) or that would stop the telemetry it measures with.
RESERVED_ARGS = ("--port", "--host", "--disable-log-stats", "--config", *TUNABLE_ARGS.values(), *SERVE_ARGS.values())
HEADER = (
    "# vLLM engine arguments proposed by kvpilot: `vllm serve --config FILE`\n"
    "# (or `python -m vllm.entrypoints.openai.api_server --config FILE`)\n"
)


class VllmConfigError(ConfigError):
    """A vLLM configuration the tuner will not run (vLLM would refuse it); `field` names the argument."""


class VllmConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # --- tuned (hot-reload does not exist in vLLM: every change is a restart) ---
    max_num_seqs: int = Field(128, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    block_size: int = Field(128, gt=0)
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = Field(0, ge=0, description="0: no cap on one request's prefill per step")
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    kv_cache_memory_bytes: int | None = Field(16 * 2**20, ge=1, description="the KV cache on CPU (and on a GPU)")
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1, description="a GPU's share when no byte size")
    max_num_partial_prefills: int | None = Field(None, ge=1, description="None: not passed (vLLM 0.32 lacks it)")

    # --- kept as they are ---
    model: str = "tiny-llama"
    served_model_name: str | None = None
    dtype: str = "float32"
    max_model_len: int = Field(512, ge=16)
    extra_args: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _what_vllm_refuses(self) -> VllmConfig:
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs})"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len})"
            )
        if self.long_prefill_token_threshold > self.max_model_len:
            raise ValueError(
                f"long_prefill_token_threshold ({self.long_prefill_token_threshold}) must be <= max_model_len "
                f"({self.max_model_len})"
            )
        for arg in self.extra_args:
            name = arg.split("=", 1)[0]
            if name in RESERVED_ARGS:
                raise ValueError(f"extra_args: {name} is set by the tuner or would stop its telemetry")
        return self

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "vLLM config") -> VllmConfig:
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]["loc"] if exc.errors() else ()
            raise VllmConfigError(
                f"{source}: {format_validation_error(exc)}", ".".join(map(str, first)) or None
            ) from exc

    def replace(self, **changes: Any) -> VllmConfig:
        return VllmConfig.from_dict({**self.model_dump(), **changes}, source="vLLM config change")

    @classmethod
    def from_config_yaml(cls, path: str | Path) -> VllmConfig:
        """Read a `--config` file (dashed or underscored keys); unknown keys go to `extra_args`, `host` and `port`
        are left out (where a server listens is not its config: the tuner picks them per trial)."""
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as exc:
            raise VllmConfigError(f"{path}: cannot read a vLLM config: {exc}") from exc
        return cls.from_config_text(text, source=str(path))

    @classmethod
    def from_config_text(cls, text: str, *, source: str = "vLLM config") -> VllmConfig:
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise VllmConfigError(f"{source}: not valid YAML: {exc}") from exc
        if not isinstance(data, dict):
            raise VllmConfigError(f"{source}: top level must be a mapping of vLLM arguments")
        known = {**TUNABLE_ARGS, **SERVE_ARGS}
        fields: dict[str, Any] = {}
        extra: list[str] = []
        for key, value in data.items():
            dest = str(key).replace("-", "_")
            if dest in LISTEN_ARGS:
                continue
            if dest in known:
                fields[dest] = value
            elif isinstance(value, bool):
                extra.append(f"--{str(key).replace('_', '-')}" if value else f"--no-{str(key).replace('_', '-')}")
            else:
                extra += [f"--{str(key).replace('_', '-')}", str(value)]
        return cls.from_dict({**fields, "extra_args": tuple(extra)}, source=source)

    # ------------------------------------------------------------------ views
    def tunable(self) -> dict[str, dict[str, Any]]:
        """The tuned arguments as one section (the study's duplicate key; the shape EngineConfig.tunable() has)."""
        return {"vllm": {k: getattr(self, k) for k in TUNABLE_ARGS}}

    def engine_args(self) -> dict[str, Any]:
        """Every argument the tuner sets explicitly, by dest name; None values are left to vLLM."""
        out = {k: getattr(self, k) for k in (*SERVE_ARGS, *TUNABLE_ARGS)}
        return {k: v for k, v in out.items() if v is not None}

    def to_args(self) -> list[str]:
        """vLLM's command line (without --host/--port, which the backend picks per trial)."""
        args: list[str] = []
        for dest, value in self.engine_args().items():
            option = {**SERVE_ARGS, **TUNABLE_ARGS}[dest]
            if dest in BOOLEAN_ARGS:
                args.append(option if value else option.replace("--", "--no-", 1))
            else:
                args += [option, str(value)]
        return [*args, *self.extra_args]

    def to_config_yaml(self) -> str:
        """vLLM's `--config` file: dashed keys, booleans as true/false (vLLM writes --no-X for false)."""
        data = {TUNABLE_ARGS.get(k, SERVE_ARGS.get(k, "--" + k))[2:]: v for k, v in self.engine_args().items()}
        data.update(_extra_as_keys(self.extra_args))
        return HEADER + yaml.safe_dump(data, sort_keys=False)

    def changed(self, other: VllmConfig) -> list[tuple[str, Any, Any]]:
        """(argument, this value, other's value) for every tuned argument that differs."""
        return [(k, getattr(self, k), getattr(other, k)) for k in TUNABLE_ARGS if getattr(self, k) != getattr(other, k)]


def _extra_as_keys(args: tuple[str, ...]) -> dict[str, Any]:
    """`--x v` -> {x: v}, `--flag` -> {flag: true}, `--no-flag` -> {flag: false} (what load_config_file inverts)."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        name, _, inline = args[i].partition("=")
        key = name[2:] if name.startswith("--") else name
        if inline:
            out[key] = inline
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            out[key] = args[i + 1]
            i += 1
        elif key.startswith("no-"):
            out[key[3:]] = False
        else:
            out[key] = True
        i += 1
    return out
