"""One `kvpilot loadtest` invocation: resolve the target (or start a local engine), plan the scenario,
measure capacity for `sustained`, run, analyze, and optionally compare cold start."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

from kvpilot.loadtest import plan as planning
from kvpilot.loadtest.analysis import analyze
from kvpilot.loadtest.capacity import measure_capacity
from kvpilot.loadtest.client import ClientOptions
from kvpilot.loadtest.coldstart import measure_cold_start
from kvpilot.loadtest.local import load_engine_config, start_engine
from kvpilot.loadtest.plan import PlanError, PlannedRequest, PlanOptions
from kvpilot.loadtest.runner import RunOptions, run_load
from kvpilot.loadtest.trace import load_trace

# --quick: the whole run (local engine start included) within 60 s on 2 CPU cores.
QUICK = {
    "duration_s": 16.0,
    "rate": 6.0,
    "length_scale": 8.0,
    "output_scale": 8.0,
    "windows": 4,
    "capacity_probe_s": 3.0,
    "cold_start_requests": 20,
}


@dataclass(frozen=True)
class LoadTestSpec:
    scenario: str
    target: str | None = None
    duration_s: float = 60.0
    rate: float = 4.0
    trace: Path | None = None
    trace_time_scale: float = 1.0
    length_scale: float = 1.0
    output_scale: float = 1.0
    max_total_tokens: int | None = None
    seed: int = 0
    api: str = "generate"
    ignore_eos: bool = True
    stream: bool = True
    timeout_s: float = 60.0
    max_concurrency: int | None = None
    windows: int = 5
    p99_metric: str = "tpot"
    collector_url: str | None = None
    collector_token: str | None = None
    run_id: str | None = None
    quick: bool = False
    engine_config: Path | None = None
    capacity_rps: float | None = None
    capacity_share: float = 0.8
    capacity_probe_s: float = 10.0
    capacity_concurrency: int = 16
    cold_start: bool = False
    cold_start_requests: int = 100
    warmup_requests: int = 8
    progress: bool = True

    def quick_defaults(self, explicit: set[str]) -> LoadTestSpec:
        """Apply --quick's shape to every option the user did not set."""
        if not self.quick:
            return self
        return replace(self, **{k: v for k, v in QUICK.items() if k not in explicit})


def make_plan(spec: LoadTestSpec, rate: float) -> list[PlannedRequest]:
    if spec.scenario not in planning.SCENARIOS:
        raise PlanError("--scenario", f"unknown scenario {spec.scenario!r}; one of {', '.join(planning.SCENARIOS)}")
    if spec.scenario == "trace":
        if spec.trace is None:
            raise PlanError("--trace", "--scenario trace needs --trace FILE (Azure CSV)")
        return load_trace(
            spec.trace,
            duration_s=spec.duration_s,
            time_scale=spec.trace_time_scale,
            length_scale=spec.length_scale,
            output_scale=spec.output_scale,
            max_total_tokens=spec.max_total_tokens,
        )
    opts = PlanOptions(
        duration_s=spec.duration_s,
        rate=rate,
        seed=spec.seed,
        length_scale=spec.length_scale,
        output_scale=spec.output_scale,
        max_total_tokens=spec.max_total_tokens,
    )
    builder = {"mixed": planning.plan_mixed, "burst": planning.plan_burst, "sustained": planning.plan_sustained}
    return builder[spec.scenario](opts)


def _client_opts(spec: LoadTestSpec, run_id: str) -> ClientOptions:
    return ClientOptions(
        api=spec.api,
        stream=spec.stream,
        timeout_s=spec.timeout_s,
        seed=spec.seed,
        run_id=run_id,
        ignore_eos=spec.ignore_eos,
    )


def run_loadtest(spec: LoadTestSpec) -> dict:
    run_id = spec.run_id or f"lt-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    if spec.windows < 2:
        raise PlanError("--windows", f"needs at least 2 windows, got {spec.windows}")
    engine_cfg = load_engine_config(spec.engine_config)
    if spec.max_total_tokens is None and spec.target is None:
        spec = replace(spec, max_total_tokens=int(engine_cfg["model"]["max_position"]) - 1)
    plan_rate = spec.rate
    with contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvpilot-loadtest-")))
        target = spec.target
        local = None
        if target is None:
            local = stack.enter_context(start_engine(engine_cfg, workdir=workdir / "engine"))
            target = local.url
        client = _client_opts(spec, run_id)
        capacity = None
        if spec.scenario == "sustained":
            if spec.capacity_rps is None:
                shapes = make_plan(replace(spec, scenario="mixed"), max(spec.rate, 1.0))
                cap = asyncio.run(
                    measure_capacity(
                        target, shapes, client, probe_s=spec.capacity_probe_s, concurrency=spec.capacity_concurrency
                    )
                )
                if cap.requests_per_s <= 0:
                    raise PlanError("--target", f"capacity probe got no answers from {target}")
                capacity = {"measured": True, **cap.as_dict()}
                capacity_rps = cap.requests_per_s
            else:
                capacity_rps = spec.capacity_rps
                capacity = {"measured": False, "requests_per_s": capacity_rps}
            plan_rate = spec.capacity_share * capacity_rps
            capacity["share"] = spec.capacity_share
            capacity["offered_rate_per_s"] = round(plan_rate, 3)
        plan = make_plan(spec, plan_rate)
        if not plan:
            raise PlanError("--duration", "the scenario planned no requests; raise --duration or --rate")
        opts = RunOptions(
            client=client,
            max_concurrency=spec.max_concurrency,
            collector_url=spec.collector_url,
            collector_token=spec.collector_token,
            progress=spec.progress,
        )
        run = asyncio.run(run_load(target, plan, opts))
        span = spec.duration_s if spec.scenario != "trace" else max(plan[-1].arrival_s, 1e-3)
        report = analyze(run, span_s=span, windows=spec.windows, metric=spec.p99_metric)
        if local is not None and local.proc.poll() is not None:
            report["criteria"]["no_errors"]["detail"] += f"; local engine exited with {local.proc.returncode}"
            report["criteria"]["no_errors"]["passed"] = False
            report["passed"] = False
    report = {
        **report,
        "scenario": spec.scenario,
        "target": spec.target or "local engine (started by loadtest)",
        "run_id": run_id,
        "duration_s": spec.duration_s,
        **_rate(spec, plan, plan_rate, capacity),
        "api": spec.api,
        "ignore_eos": spec.ignore_eos,
        "stream": spec.stream,
        "seed": spec.seed,
        "quick": spec.quick,
        "length_scale": spec.length_scale,
        "output_scale": spec.output_scale,
        "planned_mix": {k: sum(r.kind == k for r in plan) for k in ("short", "medium", "long")},
    }
    if spec.scenario == "burst":
        start, end = planning.burst_window(PlanOptions(duration_s=spec.duration_s, rate=plan_rate))
        report["burst"] = {
            "start_s": round(start, 3),
            "end_s": round(end, 3),
            "factor": 6.0,
            "sent_in_burst": sum(start <= r.arrival_s < end for r in plan),
        }
    if capacity is not None:
        report["capacity"] = capacity
    if spec.cold_start:
        with tempfile.TemporaryDirectory(prefix="kvpilot-coldstart-") as tmp:
            report["cold_start"] = measure_cold_start(
                engine_cfg,
                plan,
                RunOptions(client=_client_opts(spec, run_id + "-cold")),
                requests=spec.cold_start_requests,
                warmup_requests=spec.warmup_requests,
                workdir=Path(tmp),
            )
    return report


def _rate(spec: LoadTestSpec, plan: list[PlannedRequest], plan_rate: float, capacity: dict | None) -> dict:
    """The arrival rate the plan was made with, and where it came from: a trace has its own (--rate is
    not used), `sustained` offers a share of capacity, the others --rate."""
    if spec.scenario == "trace":
        span = plan[-1].arrival_s if len(plan) > 1 else 0.0
        rate = (len(plan) - 1) / span if span > 0 else float(len(plan))
        return {
            "rate_per_s": round(rate, 3),
            "rate_basis": f"the trace's own at --trace-time-scale {spec.trace_time_scale:g}",
        }
    if capacity is not None:
        source = "measured capacity" if capacity["measured"] else "--capacity"
        return {"rate_per_s": round(plan_rate, 3), "rate_basis": f"{spec.capacity_share:g} x {source}"}
    return {"rate_per_s": round(plan_rate, 3), "rate_basis": "--rate"}
