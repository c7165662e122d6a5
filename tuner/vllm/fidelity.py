"""How well the simulator in vLLM's mode predicts the real vLLM: every live replay of a run, re-run in the
simulator (same config, same seed, steps drawn from the calibration's spread) and compared.

Per replay: throughput (output tokens/s over the replay's window), busy time (the summed iteration elapsed time
vLLM logged in the window against the simulator's summed forward time — what the cost model predicts) and p99
end-to-end latency and TTFT. Errors are relative to the real figure. Replays of the config the cost model was
fitted on are in-sample; every other config is out of sample.

The simulator replays the traffic vLLM was offered: each request at the time the client's POST started
(`sent_at`, recorded by `integrations.vllm.client`), not at its planned arrival. On a loaded machine the client itself
sends late (hundreds of ms to seconds behind the plan, measured 2026-12-03 by `benchmarks.vllm_fidelity_diag`),
and comparing a simulation of the plan with a vLLM that got later traffic compares different workloads — the
window stretches by the client's lag, not by anything vLLM does. `error_planned` keeps the old comparison (the
simulator on the plan, as the screened search uses it) so the two can be told apart. What happens after the POST
— the API server's HTTP handling and its CPU share before the engine core queues the request — is vLLM's and
stays in the comparison.
"""

from __future__ import annotations

import dataclasses
import statistics
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import Engine

from collector.queries import stored_steps
from engine import workload as W
from integrations.vllm.config import VllmConfig
from tuner.metrics import SLO
from tuner.vllm.calibrate import VllmProfile
from tuner.vllm.sim import VllmSimBackend

METRICS = ("throughput", "busy", "e2e_p99", "ttft_p99")


def _err(sim: float | None, real: float | None) -> float | None:
    if sim is None or real is None or real <= 0:
        return None
    return abs(sim - real) / real


def as_sent(
    reqs: Sequence[W.WorkloadRequest], sent_at: Sequence[float | None], wall_start: float
) -> list[W.WorkloadRequest]:
    """The planned requests at the times the client sent them (relative to the replay's arrival 0); a request
    never sent keeps its planned time."""
    if len(sent_at) != len(reqs):
        raise ValueError(f"{len(reqs)} requests but {len(sent_at)} send times")
    return [
        r if t is None else dataclasses.replace(r, arrival_s=max(0.0, t - wall_start))
        for r, t in zip(reqs, sent_at, strict=True)
    ]


def compare(
    evaluations: Sequence[dict[str, Any]],
    profile: VllmProfile,
    workload: Callable[[int], list[W.WorkloadRequest]],
    db: Engine,
    slo: SLO,
    *,
    calibrated_on: VllmConfig | None = None,
) -> dict[str, Any]:
    """Simulate each recorded live replay (`VllmBackend.evaluations`) and return per-replay rows and the summary."""
    planned = VllmSimBackend(profile, workload, db, slo, instance="tuner-vllm-fidelity", jitter=True)
    rows = []
    for ev in evaluations:
        cfg: VllmConfig = ev["config"]
        real = ev["metrics"]
        steps = stored_steps(db, start=ev["start"], end=ev["end"], run_ids=[ev["run_id"]])
        real_figures = {
            "throughput": real.throughput_tps,
            "busy": sum(s.duration_s for s in steps),
            "e2e_p99": real.e2e_p99_s,
            "ttft_p99": real.ttft_p99_s,
            "steps": len(steps),
        }
        sim_planned = _simulate(planned, cfg, ev["seed"])
        sent_at = ev.get("sent_at")
        if sent_at:
            offered = as_sent(planned.requests(ev["seed"])[0], sent_at, ev["start"])
            sent = VllmSimBackend(
                profile, lambda _seed, offered=offered: offered, db, slo, instance="tuner-vllm-fidelity", jitter=True
            )
            sim = _simulate(sent, cfg, ev["seed"])
        else:  # a replay recorded without send times: the plan is all there is
            sim = sim_planned
        row = {
            "run_id": ev["run_id"],
            "seed": ev["seed"],
            "changed": {k: b for k, _a, b in (calibrated_on or cfg).changed(cfg)},
            "in_sample": calibrated_on is not None and cfg.to_args() == calibrated_on.to_args(),
            "as_sent": bool(sent_at),
            "real": real_figures,
            "sim": sim,
            "sim_planned": sim_planned,
        }
        row["error"] = {k: _err(sim[k], real_figures[k]) for k in METRICS}
        row["error_planned"] = {k: _err(sim_planned[k], real_figures[k]) for k in METRICS}
        rows.append(row)
    return {"replays": rows, "summary": summarize(rows)}


def _simulate(sim: VllmSimBackend, cfg: VllmConfig, seed: int) -> dict[str, Any]:
    m = sim.evaluate(cfg, run_id=f"fidelity-{uuid.uuid4().hex[:8]}", seed=seed)
    return {
        "throughput": m.throughput_tps,
        "busy": sim.last_busy_s,
        "e2e_p99": m.e2e_p99_s,
        "ttft_p99": m.ttft_p99_s,
        "steps": sim.last_replay.steps if sim.last_replay else None,
    }


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Median and max error per metric, over all replays and over the out-of-sample ones; `planned`: the same
    for the simulator on the planned arrivals."""
    out: dict[str, Any] = {}
    for scope, keep in (("all", lambda r: True), ("out_of_sample", lambda r: not r["in_sample"])):
        chosen = [r for r in rows if keep(r)]
        out[scope] = {"replays": len(chosen), **_spread(chosen, "error")}
    out["planned"] = {"replays": len(rows), **_spread(rows, "error_planned")}
    return out


def _spread(rows: Sequence[dict[str, Any]], key: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k in METRICS:
        errs = [r[key][k] for r in rows if r[key][k] is not None]
        out[k] = {"max": max(errs), "median": statistics.median(errs)} if errs else None
    return out
