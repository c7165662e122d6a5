"""Check a vLLM search space against the installed vLLM: its own argument parser and config validation.

vLLM lives in its own interpreter (`integrations.vllm.find_vllm_python`), so the check runs a small probe there: it
builds vLLM's `FlexibleArgumentParser` with `EngineArgs.add_cli_args`, dumps the options it knows (dest, option
string, choices, default) as JSON, and for each probe — the base config's command line with one knob set to one of
its values — parses the arguments as `vllm serve` would and builds vLLM's `SchedulerConfig` and `CacheConfig`
from them (the pydantic validation vLLM runs at start-up: ranges, the budget against `max_num_seqs` and
`max_model_len`), and on the CPU platform asks the CPU attention backend whether it supports the block size.
Nothing is started and no model is loaded: a check of the shipped space takes seconds.

A space is anything shaped like the tuner's `VllmSpace` (the `SearchSpace` protocol): the check reads its knobs and
applies them to a config, so it needs no tuner code.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from integrations.vllm.config import BOOLEAN_ARGS, TUNABLE_ARGS, VllmConfig

PROBE = r"""
import json, sys
request = json.load(sys.stdin)
import vllm
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.config import CacheConfig, SchedulerConfig
from vllm.platforms import current_platform

parser = FlexibleArgumentParser()
EngineArgs.add_cli_args(parser)
class Refused(Exception):
    pass
def error(message):
    raise Refused(message)
parser.error = error
options = {}
for action in parser._actions:
    longs = [s for s in action.option_strings if s.startswith("--") and not s.startswith("--no-")]
    if longs and action.dest not in options:
        options[action.dest] = {
            "option": longs[0], "choices": [str(c) for c in action.choices] if action.choices else None,
            "default": repr(action.default), "action": type(action).__name__,
        }
cpu_attention = None
if current_platform.is_cpu():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend as cpu_attention
results = []
for probe in request["probes"]:
    try:
        a = parser.parse_args(probe["args"])
        SchedulerConfig(
            max_model_len=a.max_model_len, is_encoder_decoder=False,
            max_num_seqs=a.max_num_seqs or 128, max_num_batched_tokens=a.max_num_batched_tokens or 2048,
            long_prefill_token_threshold=a.long_prefill_token_threshold,
            enable_chunked_prefill=True if a.enable_chunked_prefill is None else a.enable_chunked_prefill,
            policy=a.scheduling_policy,
        )
        cache = {"enable_prefix_caching": True if a.enable_prefix_caching is None else a.enable_prefix_caching}
        for name in ("block_size", "kv_cache_memory_bytes", "gpu_memory_utilization"):
            if getattr(a, name) is not None:
                cache[name] = getattr(a, name)
        CacheConfig(**cache)
        block = a.block_size
        if cpu_attention is not None and block is not None and not cpu_attention.supports_block_size(block):
            raise Refused(f"block size {a.block_size} is not supported by vLLM's CPU attention backend")
        results.append({"label": probe["label"], "ok": True, "error": None})
    except Exception as exc:
        results.append({"label": probe["label"], "ok": False, "error": f"{type(exc).__name__}: {exc}"[:600]})
json.dump({"version": vllm.__version__, "cpu": current_platform.is_cpu(), "options": options, "results": results},
          sys.stdout)
"""


class Knob(Protocol):
    """One searched argument: its `choices`, else its range `low`..`high`."""

    @property
    def name(self) -> str: ...
    @property
    def choices(self) -> tuple[Any, ...] | None: ...
    @property
    def low(self) -> float | None: ...
    @property
    def high(self) -> float | None: ...


class SearchSpace(Protocol):
    """A vLLM search space: the searched knobs, the fixed values, and their application to a config."""

    @property
    def params(self) -> Sequence[Knob]: ...
    @property
    def fixed(self) -> dict[str, Any]: ...
    @property
    def names(self) -> list[str]: ...
    def apply(self, base: VllmConfig, values: dict[str, Any]) -> VllmConfig: ...


class ArgCheckError(RuntimeError):
    """The probe could not run in vLLM's interpreter (no vLLM, a crash); the message ends with its stderr."""


@dataclass
class ArgCheck:
    """What the installed vLLM says about a space: `problems` empty means every name and value is accepted."""

    version: str
    cpu: bool
    options: dict[str, dict[str, Any]]
    problems: list[str] = field(default_factory=list)
    probes: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


def probes(space: SearchSpace, base: VllmConfig) -> list[dict[str, Any]]:
    """One command line per knob value: the base config with that one value (as the space's loader checks)."""
    out: list[dict[str, Any]] = [{"label": "base", "args": base.to_args()}]
    for p in space.params:
        for value in list(p.choices) if p.choices is not None else [p.low, p.high]:
            if value is None:
                continue
            try:
                config = space.apply(base, {p.name: value})
            except ValueError as exc:
                out.append({"label": f"{p.name}={value!r}", "args": None, "error": str(exc)})
                continue
            out.append({"label": f"{p.name}={value!r}", "args": config.to_args()})
    return out


def run_probe(python: str, requests: list[dict[str, Any]], *, max_model_len: int, timeout_s: float = 180.0) -> dict:
    body = json.dumps({"probes": requests, "max_model_len": max_model_len})
    try:
        done = subprocess.run(
            [python, "-c", PROBE], input=body, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ArgCheckError(f"the vLLM argument probe did not run with {python}: {exc}") from exc
    if done.returncode != 0:
        raise ArgCheckError(
            f"the vLLM argument probe failed with {python} (exit {done.returncode}):\n{done.stderr[-2000:]}"
        )
    return json.loads(done.stdout)


def check_space(space: SearchSpace, base: VllmConfig, *, python: str) -> ArgCheck:
    """Every knob must be an option of vLLM's parser (by dest name, with the option string the tuner writes), its
    choices within the parser's own, and every value accepted by the parser and vLLM's config validation."""
    planned = probes(space, base)
    runnable = [p for p in planned if p.get("args") is not None]
    answer = run_probe(
        python, [{"label": p["label"], "args": p["args"]} for p in runnable], max_model_len=base.max_model_len
    )
    check = ArgCheck(version=answer["version"], cpu=answer["cpu"], options=answer["options"], probes=len(planned))
    for name in [*space.names, *space.fixed]:
        opt = check.options.get(name)
        if opt is None:
            check.problems.append(f"{name}: vLLM {check.version}'s parser has no such option")
            continue
        if opt["option"] != TUNABLE_ARGS[name]:
            check.problems.append(f"{name}: vLLM's option is {opt['option']}, the tuner writes {TUNABLE_ARGS[name]}")
        if name in BOOLEAN_ARGS and opt["action"] != "BooleanOptionalAction":
            check.problems.append(f"{name}: vLLM's option is not a --X/--no-X flag ({opt['action']})")
        param = next((p for p in space.params if p.name == name), None)
        if opt["choices"] and param is not None and param.choices is not None:
            extra = [c for c in param.choices if str(c) not in opt["choices"]]
            if extra:
                check.problems.append(f"{name}: {extra} not among vLLM's choices {opt['choices']}")
    for p in planned:
        if p.get("args") is None:
            check.problems.append(f"{p['label']}: the tuner refuses it: {p['error']}")
    for result in answer["results"]:
        if not result["ok"]:
            check.problems.append(f"{result['label']}: vLLM refuses it: {result['error']}")
    return check
