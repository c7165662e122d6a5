"""The search space: knobs over the hot-reloadable EngineConfig fields, loaded from YAML and validated.

A trial's parameters map to an EngineConfig patch (`to_patch`); the current config maps back to
parameters (`from_config`) so it can be enqueued as the first trial. Constraints between knobs are
resolved in `to_patch` (a prefill chunk never exceeds the token budget), and the patch is validated
by the config itself, so a trial never runs a config the engine would refuse.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Self, TypeVar

import yaml

from engine.config import BLOCK_SIZES, TUNABLE_FIELDS, ConfigError, EngineConfig

BLOCK_POLICY = "block_policy"
S = TypeVar("S", bound="KnobSpace")


class SpaceError(ValueError):
    """A search space that cannot be used; `field` names the offending key (e.g. `params.recycler.mode`)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Param:
    name: str
    choices: tuple[Any, ...] | None = None
    low: float | None = None
    high: float | None = None
    step: float | None = None
    log: bool = False
    is_int: bool = False

    def suggest(self, trial: Any) -> Any:
        if self.choices is not None:
            return trial.suggest_categorical(self.name, list(self.choices))
        if self.is_int:
            return trial.suggest_int(self.name, int(self.low), int(self.high), step=int(self.step or 1), log=self.log)
        return trial.suggest_float(self.name, self.low, self.high, step=self.step, log=self.log)

    def contains(self, value: Any) -> bool:
        if self.choices is not None:
            return value in self.choices
        if not self.low <= value <= self.high:
            return False
        if self.step:
            k = (value - self.low) / self.step
            return math.isclose(k, round(k), abs_tol=1e-9)
        return True

    def values(self) -> list[Any]:
        """Every value (for grids); a continuous range has none."""
        if self.choices is not None:
            return list(self.choices)
        if self.step is None and not self.is_int:
            raise SpaceError(f"{self.name}: a continuous range has no grid; give choices or a step", self.name)
        step = self.step or 1
        n = round((self.high - self.low) / step)
        vals = [self.low + k * step for k in range(n + 1)]
        return [int(v) for v in vals] if self.is_int else [round(v, 10) for v in vals]


def parse_block_policy(value: str) -> dict[str, Any]:
    """`fixed-32` / `dynamic-512-2048` -> cache fields."""
    parts = str(value).split("-")
    try:
        if parts[0] == "fixed" and len(parts) == 2:
            size = int(parts[1])
            if size not in BLOCK_SIZES:
                raise ValueError
            return {"block_policy": "fixed", "block_size": size}
        if parts[0] == "dynamic" and len(parts) == 3:
            low, high = int(parts[1]), int(parts[2])
            if not 0 < low < high:
                raise ValueError
            return {"block_policy": "dynamic", "dynamic_thresholds": [low, high]}
    except ValueError:
        pass
    raise SpaceError(
        f"block_policy choice {value!r}: expected fixed-N (N in {BLOCK_SIZES}) or dynamic-LOW-HIGH", BLOCK_POLICY
    )


def block_policy_of(config: EngineConfig) -> str:
    c = config.cache
    if c.block_policy == "fixed":
        return f"fixed-{c.block_size}"
    return f"dynamic-{c.dynamic_thresholds[0]}-{c.dynamic_thresholds[1]}"


@dataclass(frozen=True)
class KnobSpace:
    """What every search space shares: the searched `params`, the `fixed` values every trial sets, and the
    sampler's side (suggest, grid, describe, widening to hold a config). A subclass maps values onto its
    engine's config: `apply(base, values)` (raising ConfigError for what the engine would refuse),
    `from_config(config)` and `to_patch(values)`."""

    params: tuple[Param, ...]
    fixed: dict[str, Any]

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.params]

    def suggest(self, trial: Any) -> dict[str, Any]:
        return {p.name: p.suggest(trial) for p in self.params}

    def apply(self, base: Any, values: dict[str, Any]) -> Any:
        raise NotImplementedError

    def from_config(self, config: Any) -> dict[str, Any]:
        raise NotImplementedError

    def including(self, config: Any) -> Self:
        """This space widened so the config's own values are in it (choices added, ranges stretched); a knob
        the config leaves unset (None: the engine's own default) is left as it is."""
        current = self.from_config(config)
        params = []
        for p in self.params:
            v = current[p.name]
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
        return dataclasses.replace(self, params=tuple(params))

    def grid(self) -> list[dict[str, Any]]:
        """Every point of a discrete space (the benchmark's exhaustive reference)."""
        names = self.names
        return [dict(zip(names, combo, strict=True)) for combo in itertools.product(*(p.values() for p in self.params))]

    def describe(self) -> dict[str, Any]:
        return {
            p.name: list(p.choices)
            if p.choices is not None
            else {"low": p.low, "high": p.high, "step": p.step, "log": p.log}
            for p in self.params
        }


@dataclass(frozen=True)
class SearchSpace(KnobSpace):
    """The kvpilot engine's space: knobs named `section.field` over EngineConfig's tunable fields."""

    def to_patch(self, values: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """Trial parameters (plus `fixed`) -> an EngineConfig patch of tunable sections."""
        patch: dict[str, dict[str, Any]] = {}
        for name, value in {**self.fixed, **values}.items():
            if name == BLOCK_POLICY:
                patch.setdefault("cache", {}).update(parse_block_policy(value))
            else:
                section, field = name.split(".", 1)
                patch.setdefault(section, {})[field] = value
        sched = patch.get("scheduler", {})
        if "max_num_batched_tokens" in sched or "prefill_chunk_tokens" in sched:
            budget = sched.get("max_num_batched_tokens")
            chunk = sched.get("prefill_chunk_tokens")
            if budget is not None and chunk is not None and chunk > budget:
                sched["prefill_chunk_tokens"] = budget  # a chunk larger than the budget could never run
        return patch

    def apply(self, base: EngineConfig, values: dict[str, Any]) -> EngineConfig:
        """`base` with the trial's patch; a chunk above an unchanged budget is clamped the same way."""
        patch = self.to_patch(values)
        sched = patch.setdefault("scheduler", {})
        budget = sched.get("max_num_batched_tokens", base.scheduler.max_num_batched_tokens)
        if sched.get("prefill_chunk_tokens", base.scheduler.prefill_chunk_tokens) > budget:
            sched["prefill_chunk_tokens"] = budget
        if not sched:
            del patch["scheduler"]
        return base.with_tunable(patch)

    def from_config(self, config: EngineConfig) -> dict[str, Any]:
        """The config's own values of every knob (what trial 0 runs)."""
        full = config.model_dump(mode="json")
        out: dict[str, Any] = {}
        for p in self.params:
            if p.name == BLOCK_POLICY:
                out[p.name] = block_policy_of(config)
            else:
                section, field = p.name.split(".", 1)
                out[p.name] = full[section][field]
        return out


def _param(where: str, key: str, spec: Any) -> Param:
    """One `params` entry (its key already checked); `where` is its field path for errors."""
    if not isinstance(spec, dict):
        raise SpaceError(f"{where}: must be a mapping with `choices` or `low`/`high`", where)
    unknown = set(spec) - {"choices", "low", "high", "step", "log"}
    if unknown:
        raise SpaceError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}", where)
    if "choices" in spec:
        choices = spec["choices"]
        if not isinstance(choices, list) or not choices:
            raise SpaceError(f"{where}.choices: must be a non-empty list", f"{where}.choices")
        if len(set(map(repr, choices))) != len(choices):
            raise SpaceError(f"{where}.choices: has duplicates", f"{where}.choices")
        return Param(key, choices=tuple(choices))
    missing = [end for end in ("low", "high") if end not in spec]
    if missing:
        field = f"{where}.{missing[0]}" if len(missing) == 1 else where
        raise SpaceError(f"{where}: needs `choices` or both `low` and `high`", field)
    low, high, step, log = spec["low"], spec["high"], spec.get("step"), bool(spec.get("log", False))
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


def parse_space(
    data: Any, space_type: type[S], *, base: Any, key_problem: Callable[[str], str | None], source: str
) -> S:
    """A space of `space_type` from its YAML form (`params`, `fixed`), every error naming its field.

    The engine's side comes as two checks: `key_problem(key)` says what is wrong with a knob's name (None: it
    is a knob of this engine), and every value must make a config the engine accepts: `fixed` alone on `base`,
    then each choice and each range end alone (with `fixed`) through `space_type.apply`, whose ConfigError
    (or SpaceError) becomes a SpaceError naming the knob."""
    if not isinstance(data, dict):
        raise SpaceError(f"{source}: top level must be a mapping with `params`")
    unknown = set(data) - {"params", "fixed"}
    if unknown:
        raise SpaceError(f"{source}: unknown key(s) {', '.join(sorted(unknown))}", sorted(unknown)[0])
    params_spec = data.get("params")
    if not isinstance(params_spec, dict) or not params_spec:
        raise SpaceError(f"{source}: `params` must be a non-empty mapping", "params")
    fixed = data.get("fixed") or {}
    if not isinstance(fixed, dict):
        raise SpaceError(f"{source}: `fixed` must be a mapping", "fixed")
    for section, keys in (("params", params_spec), ("fixed", fixed)):
        for key in keys:
            problem = key_problem(str(key))
            if problem is not None:
                raise SpaceError(f"{section}.{key}: {problem}", f"{section}.{key}")
            if section == "fixed" and key in params_spec:
                raise SpaceError(f"{source}: fixed.{key} is also a searched param", f"fixed.{key}")
    params = tuple(_param(f"params.{k}", str(k), v) for k, v in params_spec.items())
    space = space_type(params, dict(fixed))
    try:
        space.apply(base, {})
    except (ConfigError, SpaceError) as exc:
        raise SpaceError(f"{source}: fixed values are invalid: {exc}", "fixed") from exc
    for p in space.params:
        for value in list(p.choices) if p.choices is not None else [p.low, p.high]:
            try:
                space.apply(base, {p.name: value})
            except (ConfigError, SpaceError) as exc:
                raise SpaceError(
                    f"{source}: params.{p.name} value {value!r} is invalid: {exc}", f"params.{p.name}"
                ) from exc
    return space


def read_space_file(path: Path) -> Any:
    """A space file's YAML, a SpaceError (field `space`) when it is missing or not YAML."""
    try:
        return yaml.safe_load(path.read_text())
    except FileNotFoundError as exc:
        raise SpaceError(f"search space file not found: {path}", "space") from exc
    except yaml.YAMLError as exc:
        raise SpaceError(f"{path}: not valid YAML: {exc}", "space") from exc


def _tunable_key_problem(key: str) -> str | None:
    if key == BLOCK_POLICY:
        return None
    section, _, field = key.partition(".")
    if section in TUNABLE_FIELDS and field in TUNABLE_FIELDS[section]:
        return None
    known = [BLOCK_POLICY] + [f"{s}.{f}" for s, fs in TUNABLE_FIELDS.items() for f in fs]
    return f"not a hot-reloadable field; one of {', '.join(known)}"


def space_from_dict(data: Any, *, base: EngineConfig | None = None, source: str = "space") -> SearchSpace:
    return parse_space(data, SearchSpace, base=base or EngineConfig(), key_problem=_tunable_key_problem, source=source)


def default_space_path() -> Path:
    return Path(str(resources.files("tuner") / "space.yml"))


def load_space(path: str | Path | None = None, *, base: EngineConfig | None = None) -> SearchSpace:
    path = Path(path) if path is not None else default_space_path()
    return space_from_dict(read_space_file(path), base=base, source=str(path))
