"""The vLLM search space: knobs over `VllmConfig`'s tuned arguments, in `tuner/space.yml`'s YAML form.

The same file format and the same `Param` as the kvpilot space (`tuner.space`): `params` maps an argument (vLLM's
dest name, e.g. `max_num_seqs`) to `choices` or a `low`/`high` range; `fixed` pins values for every trial. The
current config's own values are always added (`including`), so it runs as trial 0. One constraint is resolved
here as vLLM resolves it for its defaults: without chunked prefill the token budget is raised to hold a whole
`max_model_len` prompt. Whether vLLM's parser knows each name and accepts each value is checked against the
installed vLLM by `tuner.vllm.argcheck` (it needs vLLM's interpreter, so it is not part of loading).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from tuner.space import Param, SpaceError
from tuner.vllm.config import TUNABLE_ARGS, VllmConfig, VllmConfigError


@dataclass(frozen=True)
class VllmSpace:
    params: tuple[Param, ...]
    fixed: dict[str, Any]

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.params]

    def suggest(self, trial: Any) -> dict[str, Any]:
        return {p.name: p.suggest(trial) for p in self.params}

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

    def including(self, config: VllmConfig) -> VllmSpace:
        """This space widened so the config's own values are in it (choices added, ranges stretched)."""
        params = []
        for p in self.params:
            v = getattr(config, p.name)
            if v is None or p.contains(v):
                params.append(p)
            elif p.choices is not None:
                params.append(Param(p.name, choices=(*p.choices, v)))
            else:
                params.append(
                    Param(
                        p.name,
                        low=min(p.low, v),
                        high=max(p.high, v),
                        log=p.log,
                        is_int=p.is_int and isinstance(v, int),
                    )
                )
        return VllmSpace(tuple(params), self.fixed)

    def grid(self) -> list[dict[str, Any]]:
        names = self.names
        return [dict(zip(names, combo, strict=True)) for combo in itertools.product(*(p.values() for p in self.params))]

    def describe(self) -> dict[str, Any]:
        return {
            p.name: list(p.choices)
            if p.choices is not None
            else {"low": p.low, "high": p.high, "step": p.step, "log": p.log}
            for p in self.params
        }


def _param(key: str, spec: Any) -> Param:
    where = f"params.{key}"
    if key not in TUNABLE_ARGS:
        raise SpaceError(f"{where}: not a tuned vLLM argument; one of {', '.join(TUNABLE_ARGS)}", where)
    if not isinstance(spec, dict):
        raise SpaceError(f"{where}: must be a mapping with `choices` or `low`/`high`", where)
    unknown = set(spec) - {"choices", "low", "high", "step", "log"}
    if unknown:
        raise SpaceError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}", where)
    if "choices" in spec:
        choices = spec["choices"]
        if not isinstance(choices, list) or not choices or len(set(map(repr, choices))) != len(choices):
            raise SpaceError(f"{where}.choices: must be a non-empty list without duplicates", f"{where}.choices")
        return Param(key, choices=tuple(choices))
    low, high, step, log = spec.get("low"), spec.get("high"), spec.get("step"), bool(spec.get("log", False))
    for name, v in (("low", low), ("high", high), ("step", step)):
        if (v is None and name != "step") or (
            v is not None and (isinstance(v, bool) or not isinstance(v, int | float))
        ):
            raise SpaceError(f"{where}.{name}: must be a number, got {v!r}", f"{where}.{name}")
    if not low < high:
        raise SpaceError(f"{where}: low ({low}) must be below high ({high})", where)
    if step is not None and (step <= 0 or log):
        raise SpaceError(f"{where}.step: must be positive and not combined with log", f"{where}.step")
    if log and low <= 0:
        raise SpaceError(f"{where}.low: must be positive for a log range", f"{where}.low")
    is_int = isinstance(low, int) and isinstance(high, int) and (step is None or isinstance(step, int))
    return Param(key, low=low, high=high, step=step, log=log, is_int=is_int)


def vllm_space_from_dict(data: Any, *, base: VllmConfig | None = None, source: str = "vLLM space") -> VllmSpace:
    if not isinstance(data, dict):
        raise SpaceError(f"{source}: top level must be a mapping with `params`")
    unknown = set(data) - {"params", "fixed"}
    if unknown:
        raise SpaceError(f"{source}: unknown key(s) {', '.join(sorted(unknown))}", sorted(unknown)[0])
    spec = data.get("params")
    if not isinstance(spec, dict) or not spec:
        raise SpaceError(f"{source}: `params` must be a non-empty mapping", "params")
    params = tuple(_param(str(k), v) for k, v in spec.items())
    fixed = data.get("fixed") or {}
    if not isinstance(fixed, dict):
        raise SpaceError(f"{source}: `fixed` must be a mapping", "fixed")
    for key in fixed:
        if key in spec:
            raise SpaceError(f"{source}: fixed.{key} is also a searched param", f"fixed.{key}")
        _param(str(key), {"choices": [fixed[key]]})
    space = VllmSpace(params, dict(fixed))
    base = base or VllmConfig()
    for p in params:  # each choice and range end alone on `base` must make a config vLLM would start
        for value in list(p.choices) if p.choices is not None else [p.low, p.high]:
            try:
                space.apply(base, {p.name: value})
            except VllmConfigError as exc:
                raise SpaceError(
                    f"{source}: params.{p.name} value {value!r} is invalid: {exc}", f"params.{p.name}"
                ) from exc
    return space


def default_vllm_space_path() -> Path:
    return Path(str(resources.files("tuner.vllm") / "space.yml"))


def load_vllm_space(path: str | Path | None = None, *, base: VllmConfig | None = None) -> VllmSpace:
    path = Path(path) if path is not None else default_vllm_space_path()
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError as exc:
        raise SpaceError(f"search space file not found: {path}", "space") from exc
    except yaml.YAMLError as exc:
        raise SpaceError(f"{path}: not valid YAML: {exc}", "space") from exc
    return vllm_space_from_dict(data, base=base, source=str(path))
