"""Assemble a tuning job from names: workload spec, backend, profile, base config, database."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import Engine

from collector.db import check_schema_current, make_engine
from engine import workload as W
from engine.config import EngineConfig
from tuner import workloads as WL
from tuner.backends import Backend, EngineBackend, SimBackend
from tuner.metrics import SLO
from tuner.profile import CostProfile
from tuner.replay import TrialSink, replay
from tuner.sim import sim_engine

log = logging.getLogger("kvpilot.tuner.jobs")

BACKENDS = ("sim", "engine", "live")


def open_db(db_url: str) -> Engine:
    """The kvpilot database, refused with the fix if it is not migrated to head."""
    db = make_engine(db_url, sqlite_synchronous="NORMAL")
    try:
        check_schema_current(db)
    except Exception:
        db.dispose()
        raise
    return db


def capacity_rps(profile: CostProfile, base: EngineConfig, opts: WL.WorkloadOptions) -> float:
    """Requests/s the base config sustains on the profile: an offline run of the scenario mix."""
    engine, _ = sim_engine(base, profile, sink=TrialSink(keep_steps=False))
    result = replay(engine, WL.offline_mix(opts))
    if not result.finished or result.duration_s <= 0:
        raise WL.WorkloadError("capacity", "the capacity run finished no request")
    return len(result.finished) / result.duration_s


WORKLOADS = f"{', '.join(WL.SCENARIOS)}, trace:FILE, stored[:INSTANCE], fitted"


def workload_kind(spec: str) -> str:
    """`scenario`, `trace`, `stored` (the stored requests as they came) or `fitted` (their average rates) for a
    workload spec, checked before anything is measured; WorkloadError for anything else. `collector` is the
    former name of `fitted`."""
    if spec in WL.SCENARIOS:
        return "scenario"
    if spec in ("fitted", "collector"):
        return "fitted"
    if spec == "stored":
        return "stored"
    kind, sep, arg = spec.partition(":")
    if sep and kind in ("trace", "stored"):
        if not arg:
            example = "trace:AzureLLMInferenceTrace_conv.csv" if kind == "trace" else "stored:vllm-a"
            raise WL.WorkloadError(
                "workload", f"{kind}: needs {'a file' if kind == 'trace' else 'an instance'}, e.g. {example}"
            )
        return kind
    raise WL.WorkloadError("workload", f"unknown workload {spec!r}; one of {WORKLOADS}")


def workload_factory(
    spec: str,
    opts: WL.WorkloadOptions,
    *,
    profile: CostProfile | None = None,
    base: EngineConfig | None = None,
    db: Engine | None = None,
    instances: list[str] | None = None,
    capacity: Callable[[WL.WorkloadOptions], float] | None = None,
) -> tuple[Callable[[int], list[W.WorkloadRequest]], dict[str, Any]]:
    """seed -> requests for `spec` (a scenario name, `trace:FILE`, `stored`, `stored:INSTANCE` or `fitted`), and a
    description. A scenario's rate is relative to `capacity(opts)` (requests/s of the running config) when given,
    else to the capacity of `base` on `profile`'s simulator; `stored` replays the requests the collector stored in
    the last `hours` (of `stored:INSTANCE`, else of `instances`, else of every serving instance) at their
    recorded arrivals, the same requests for every seed; `fitted` samples the window's average rates."""
    kind = workload_kind(spec)
    opts.validate()
    if opts.max_total_tokens is None and base is not None:
        opts = WL.WorkloadOptions(**{**opts.__dict__, "max_total_tokens": WL.default_max_total(base)})
    if kind == "scenario":
        if capacity is None:
            if profile is None or base is None:
                raise ValueError("workload_factory: a scenario needs `capacity` or a profile and a base config")
            cap = capacity_rps(profile, base, opts)
        else:
            cap = capacity(opts)
        desc = {"kind": spec, "capacity_rps": round(cap, 3), "requests": opts.requests, "scale": opts.scale}
        return (lambda seed: WL.scenario(spec, cap, opts, seed=seed)), desc
    if kind == "trace":
        path = Path(spec.split(":", 1)[1])
        reqs = WL.load_trace(path, opts)
        desc = {"kind": "trace", "file": str(path), **WL.describe(reqs)}
        return (lambda seed: list(reqs)), desc
    if db is None:
        raise WL.WorkloadError("workload", f"the {kind} workload needs a database")
    if kind == "fitted":
        fitted = WL.fit_from_collector(db, opts, instances=instances)
        desc = {
            "kind": "fitted",
            "hours": opts.hours,
            "observed_requests": fitted.requests,
            "buckets": len(fitted.rates),
        }
        return (lambda seed: fitted.sample(opts, seed=seed)), desc
    _, sep, named = spec.partition(":")
    chosen = [named] if sep else instances
    try:
        recorded = WL.recorded_traffic(db, opts, instances=chosen)
    except WL.WorkloadError as exc:
        raise WL.WorkloadError("workload", f"{spec}: {exc}") from exc
    reqs = recorded.requests
    desc = {
        "kind": "stored",
        "instance": ", ".join(chosen) if chosen else "every serving instance",
        "hours": opts.hours,
        **WL.describe(reqs),
        "unfinished": recorded.unfinished,
        "lengths_filled": recorded.filled,
        "user_arrivals": recorded.user_arrivals,
    }
    return (lambda seed: list(reqs)), desc


def make_backend(
    kind: str,
    *,
    profile: CostProfile,
    workload: Callable[[int], list[W.WorkloadRequest]],
    db: Engine,
    slo: SLO,
    live: dict[str, Any] | None = None,
) -> Backend:
    if kind == "sim":
        return SimBackend(profile, workload, db, slo)
    if kind == "engine":
        return EngineBackend(workload, db, slo)
    if kind == "live":
        from tuner.live import LiveBackend

        return LiveBackend(db=db, slo=slo, workload=workload, **(live or {}))
    raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {kind!r}")


def base_config(path: str | Path | None, profile: CostProfile, backend: str) -> EngineConfig:
    """The current config (a file, else the profile's defaults). On the simulator the profile's model
    is what runs; the proposal keeps the file's own model section."""
    if path is not None:
        return EngineConfig.from_yaml(path)
    return profile.engine_config(None)
