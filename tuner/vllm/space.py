"""The vLLM search space: knobs over `VllmConfig`'s tuned arguments, in `tuner/space.yml`'s YAML form.

The same file format, parser and `KnobSpace` as the kvpilot space (`tuner.space`): `params` maps an argument
(vLLM's dest name, e.g. `max_num_seqs`) to `choices` or a `low`/`high` range; `fixed` pins values for every
trial. The current config's own values are always added (`including`), so it runs as trial 0. One constraint
is resolved here as vLLM resolves it for its defaults: without chunked prefill the token budget is raised to
hold a whole `max_model_len` prompt. Whether vLLM's parser knows each name and accepts each value is checked
against the installed vLLM by `integrations.vllm.argcheck` (it needs vLLM's interpreter, so it is not part of loading).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from integrations.vllm.config import TUNABLE_ARGS, VllmConfig
from tuner.space import KnobSpace, parse_space, read_space_file


@dataclass(frozen=True)
class VllmSpace(KnobSpace):
    def to_patch(self, values: dict[str, Any]) -> dict[str, dict[str, Any]]:
        return {"vllm": {**self.fixed, **values}}

    def apply(self, base: VllmConfig, values: dict[str, Any]) -> VllmConfig:
        """`base` with the trial's values (and `fixed`); raises VllmConfigError for what vLLM would refuse."""
        changes = {**self.fixed, **values}
        merged = {**base.model_dump(), **changes}
        if not merged["enable_chunked_prefill"] and merged["max_num_batched_tokens"] < merged["max_model_len"]:
            merged["max_num_batched_tokens"] = merged["max_model_len"]
        return VllmConfig.from_dict(merged, source=f"trial values {changes}")

    def from_config(self, config: VllmConfig) -> dict[str, Any]:
        return {p.name: getattr(config, p.name) for p in self.params}


def _tuned_arg_problem(key: str) -> str | None:
    return None if key in TUNABLE_ARGS else f"not a tuned vLLM argument; one of {', '.join(TUNABLE_ARGS)}"


def vllm_space_from_dict(data: Any, *, base: VllmConfig | None = None, source: str = "vLLM space") -> VllmSpace:
    return parse_space(data, VllmSpace, base=base or VllmConfig(), key_problem=_tuned_arg_problem, source=source)


def default_vllm_space_path() -> Path:
    return Path(str(resources.files("tuner.vllm") / "space.yml"))


def load_vllm_space(path: str | Path | None = None, *, base: VllmConfig | None = None) -> VllmSpace:
    path = Path(path) if path is not None else default_vllm_space_path()
    return vllm_space_from_dict(read_space_file(path), base=base, source=str(path))


MEMORY_ARGS = ("kv_cache_memory_bytes", "gpu_memory_utilization")


def at_fixed_memory(space: VllmSpace, base: VllmConfig) -> VllmSpace:
    """`space` with the KV cache's memory held at the running config's (`MEMORY_ARGS` fixed to `base`'s values,
    no longer searched): memory is a budget the operator sets, and more of it wins whatever else changes."""
    params = tuple(p for p in space.params if p.name not in MEMORY_ARGS)
    fixed = {k: v for k, v in space.fixed.items() if k not in MEMORY_ARGS}
    return VllmSpace(params, {**fixed, **{k: getattr(base, k) for k in MEMORY_ARGS}})


def memory_changes(base: VllmConfig, config: VllmConfig) -> dict[str, tuple[Any, Any]]:
    """The memory arguments `config` changes from `base`: name -> (running, proposed)."""
    return {k: (getattr(base, k), getattr(config, k)) for k in MEMORY_ARGS if getattr(base, k) != getattr(config, k)}
