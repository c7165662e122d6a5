"""`kvpilot bench tune-vllm`: tune a real vLLM (CPU build) for SLO capacity with the simulation-screened search,
against a live-only Optuna search on the same vLLM, with the live comparison's own A/A check.

The plan — workload, SLOs, seeds, budgets, whether memory is fixed — is fixed here, before any measurement, and
written to the JSON file before the first tuning run (`plan`); nothing in it depends on results. The running config
is vLLM 0.32's CPU defaults with a 16 MiB KV cache (the test peer's: `kvpilot model init` checkpoint, max-model-len
512, float32). The objective is SLO capacity (`tuner.capacity`): the largest multiple of the workload's arrival
rate whose replay keeps p99 TTFT as users see it, p99 TPOT, and >= 99% finished within the SLOs.

1. The running config on the tuning seed(s) at the recorded rate, then its capacity (a bracketing search on its
   server); the cost model is fitted from the steps the collector stored for those replays.
2. Screening: an Optuna study on the simulator in vLLM's mode (`sim_trials` configs) past the running config's
   simulated capacity, the KV cache's size held (unless --allow-memory); the `top_k` best, each pruned in the
   simulator, confirmed live (one vLLM restart each), then the predicted and live capacity of each
   (`rank_correlation`: Spearman over those configs). The candidate is the confirmation with the most live
   capacity (`tuner.vllm.tune.choose`), compared on the held-out seeds whatever its one search said.
3. A live-only Optuna (TPE) study on vLLM, `live_only_trials` trials at the same overload, from the same running
   config; its best config's capacity (`live_only_best_capacity_rps`).
4. Held-out: the running config against the candidate, both servers up, the idle one paused, ABBA pairs of short
   capacity measurements until the 90% interval of the capacity ratio says (`verdict`), and the same protocol
   with the running config on both servers (`aa_verdict`, which must not be `proposal`).
5. A proposal (vLLM `--config` YAML, markdown report, DB row) only if the verdict is `proposal`.
6. Fidelity: every recorded-rate live replay re-run in the simulator (throughput, busy time, p99), errors
   relative to real; `client_late_p99_s` is the worst replay's p99 of how late requests left the client.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from integrations.vllm import VllmExitedError, VllmSetupError, find_vllm_python
from integrations.vllm.config import VllmConfig
from kvpilot.vllm.workbench import Workbench, workbench
from tuner import workloads as WL
from tuner.backends import InfeasibleTrialError, NotMeasuredError
from tuner.capacity import MIN_MULTIPLIER, Capacity, at_rate
from tuner.compare import Comparison
from tuner.jobs import workload_factory
from tuner.metrics import SLO, TrialMetrics
from tuner.pipeline import Choice, Verdict
from tuner.study import StudyResult, run_study
from tuner.vllm import fidelity
from tuner.vllm.backend import VllmBackend
from tuner.vllm.space import load_vllm_space
from tuner.vllm.tune import (
    SCREEN_OVERLOAD,
    Budget,
    LateWorkload,
    Outcome,
    ReportTo,
    TuneError,
    VllmTuning,
    checkpoint_model,
)


class TuneVllmBenchError(RuntimeError):
    """The bench could not measure (vLLM would not start or serve, a replay the client sent late every time):
    the message says which; the JSON file keeps the plan, `status: failed` and the error."""


MODEL = "bench"
KV_BYTES = 16 * 2**20
# The workload: the seed's `sustained` scenario at half vLLM's defaults' offline capacity (the scenario mix,
# 96 requests at once, measured live before any tuning and written to the JSON before the first tuning run), for
# 10 s, lengths scaled to the 512-token model. Under capacity, as production traffic mostly is: the capacity search
# replays it at multiples of its rate, each replay as long as the recording (`tuner.capacity.at_rate`), to find
# how much more each config takes.
# History (docs/benchmarks.md): the first plans measured goodput at one rate (the `burst` scenario at 12 req/s, then
# `sustained` at 1.25 x capacity); under capacity nothing could gain, past it goodput swung 198-733 tokens/s
# across seeds. This plan (SLO capacity, memory fixed, ABBA comparison) replaced them after those results.
WORKLOAD = {"scenario": "sustained", "load": 0.5, "duration_s": 10.0, "scale": 8.0, "output_range": [16, 128]}
# Interactive SLOs at this CPU's scale: p99 TTFT (user-facing) within 2 s, p99 TPOT within 0.2 s, >= 99% finished;
# goodput counts requests within TTFT 1 s and TPOT 0.2 s.
SLO_PLAN = {"ttft_s": 1.0, "tpot_s": 0.2, "p99_ttft_s": 2.0, "max_rejection_rate": 0.01}
# A screened candidate keeps a change only when reverting it costs simulated goodput on every tuning seed and at
# least this much on average, or misses the SLOs (tuner.prune.drop_noise_knobs, the nightly job's rule).
PRUNE_MIN_EFFECT = 0.01
# `--running-max-num-seqs`: a deliberately poor running config (e.g. 2, the memory unchanged) that a tuning must
# beat; bounded by what the space searches
MAX_RUNNING_SEQS = 256
BUDGETS = {
    True: {
        "tuning_seeds": [0],
        "sim_trials": 100,
        "top_k": 1,
        "live_only_trials": 3,
        # 3 pairs, each a round of three fresh servers (about 220 s), the three sides taking each depth of the
        # nesting once (`tuner.compare.rotation`): with run 20's pair sd (0.014, fresh isolated servers) 3 pairs
        # tell about +-2.4%, within the 3% margin; 5 pairs took 27 of run 20's 34 minutes
        "heldout_seeds": [1000, 1001, 1002],
        "repeats": 1,
        "capacity_replays": 6,
        "pair_replays": 4,
        "min_pairs": 3,
        "margin": 0.03,
        "fresh_servers": True,
    },
    False: {
        "tuning_seeds": [0, 1],
        "sim_trials": 400,
        "top_k": 2,
        "live_only_trials": 9,
        "heldout_seeds": [1000, 1001, 1002, 1003],
        "repeats": 2,
        "capacity_replays": 8,
        "pair_replays": 4,
        "min_pairs": 3,
        "margin": 0.03,
        "fresh_servers": True,
    },
}


def plan(quick: bool, allow_memory: bool = False, running_max_num_seqs: int | None = None) -> dict[str, Any]:
    if running_max_num_seqs is not None and not 1 <= running_max_num_seqs <= MAX_RUNNING_SEQS:
        raise ValueError(f"running_max_num_seqs: must be within 1..{MAX_RUNNING_SEQS}, got {running_max_num_seqs}")
    seqs = "" if running_max_num_seqs is None else f", --max-num-seqs {running_max_num_seqs}"
    return {
        "objective": "slo_capacity",
        "workload": WORKLOAD,
        "slo": SLO_PLAN,
        "memory_fixed": not allow_memory,
        "running_config": f"vLLM 0.32 CPU defaults, 16 MiB KV{seqs}",
        "running_max_num_seqs": running_max_num_seqs,
        "prune_min_effect": PRUNE_MIN_EFFECT,
        **BUDGETS[quick],
    }


class _Overloaded:
    """The live backend replaying each seed's workload `multiplier` times as fast (the live-only study's objective:
    goodput past the running config's capacity, as the screen's simulator sees it)."""

    name = "vllm"

    def __init__(self, backend: VllmBackend, multiplier: float) -> None:
        self.backend, self.multiplier = backend, multiplier

    def evaluate(self, config: VllmConfig, *, run_id: str, seed: int) -> TrialMetrics:
        reqs, prompts = at_rate(*self.backend.requests(seed), self.multiplier)
        return self.backend.measure_requests(config, reqs, prompts, run_id=run_id)


def _say(t0: float, message: str) -> None:
    print(f"[tune-vllm {time.time() - t0:6.0f}s] {message}", file=sys.stderr, flush=True)


def run_tune_vllm_bench(
    *,
    quick: bool = False,
    allow_memory: bool = False,
    json_path: Path | None = None,
    python: str | None = None,
    out_dir: Path | None = None,
    running_max_num_seqs: int | None = None,
) -> dict[str, Any]:
    t0 = time.time()
    the_plan = plan(quick, allow_memory, running_max_num_seqs)
    result: dict[str, Any] = {"plan": the_plan, "status": "running", "quick": quick}
    if json_path is not None:  # the plan is on disk before the first measurement
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2) + "\n")
    work = (out_dir or Path("kvpilot-data/bench-tune-vllm")) / time.strftime("%Y%m%dT%H%M%S")
    try:
        python = find_vllm_python(python)
        # Each trial's vLLM registers its /metrics as a scrape target on the workbench's collector (its own admin
        # token, loopback targets allowed) and the backend deletes it when that vLLM stops.
        with workbench(work) as wb:
            result.update(_run(the_plan, work, wb, python, t0, json_path))
    except (TuneError, NotMeasuredError, InfeasibleTrialError, VllmExitedError, VllmSetupError) as exc:
        result.update(status="failed", error=str(exc), wall_s=round(time.time() - t0, 1), work_dir=str(work))
        if json_path is not None:
            json_path.write_text(json.dumps(result, indent=2) + "\n")
        raise TuneVllmBenchError(f"{exc} (logs in {work})") from exc
    return result


def _tuning(
    the_plan: dict[str, Any], work: Path, wb: Workbench, python: str, t0: float
) -> tuple[_BenchTuning, VllmBackend, LateWorkload, VllmConfig]:
    checkpoint, db = wb.checkpoint, wb.db
    slo = SLO(**SLO_PLAN).validate()
    base = VllmConfig(model=str(checkpoint), served_model_name=MODEL, kv_cache_memory_bytes=KV_BYTES)
    if the_plan["running_max_num_seqs"] is not None:
        base = base.replace(max_num_seqs=the_plan["running_max_num_seqs"])
    workload = LateWorkload()
    backend = VllmBackend(
        workload=workload,
        db=db,
        slo=slo,
        python=python,
        collector_url=wb.collector_url,
        admin_token=wb.admin_token,
        log_dir=work / "vllm-logs",
    )
    budget = Budget(
        tuning_seeds=tuple(the_plan["tuning_seeds"]),
        sim_trials=the_plan["sim_trials"],
        top_k=the_plan["top_k"],
        heldout_seeds=tuple(the_plan["heldout_seeds"]),
        repeats=the_plan["repeats"],
        min_effect=the_plan["prune_min_effect"],
        capacity_replays=the_plan["capacity_replays"],
        pair_replays=the_plan["pair_replays"],
        min_pairs=the_plan["min_pairs"],
        margin=the_plan["margin"],
        fresh_servers=the_plan["fresh_servers"],
    )
    tuning = _BenchTuning(
        backend=backend,
        db=db,
        base=base,
        space=load_vllm_space(base=base),
        slo=slo,
        budget=budget,
        model=checkpoint_model(checkpoint, base.dtype),
        workload=workload,
        name="bench",
        say=lambda message: _say(t0, message),
        allow_memory=not the_plan["memory_fixed"],
        t0=t0,
        live_only_trials=the_plan["live_only_trials"],
    )
    return tuning, backend, workload, base


@dataclass
class _BenchTuning(VllmTuning):
    """The tuning the bench measures, with its two additions: a live-only search after the screen's confirmation
    (`confirm`), and the A/A check, in the held-out comparison's rounds (`held_out`) or alone when no candidate
    was compared (`finish`)."""

    live_only_trials: int = 3
    live_only_study: StudyResult | None = None
    live_only_capacity: Capacity | None = None

    def confirm(self) -> Choice:
        choice = super().confirm()
        t = time.time()
        running = self.running_capacity
        assert running is not None  # the baseline phase measured it
        overload = SCREEN_OVERLOAD * max(running.multiplier, MIN_MULTIPLIER)
        study = run_study(
            _Overloaded(self.backend, overload),
            self.space,
            self.base,
            name="live-only",
            trials=self.live_only_trials,
            slo=self.slo.past_capacity(),  # past capacity, as the screen's simulated trials
            workload_seed=list(self.budget.tuning_seeds),
            random_baseline=False,
            progress=False,
        )
        best = self.space.apply(self.base, study.best.params) if study.best is not None else self.base
        self.live_only_study = study
        self.live_only_capacity = running if best == self.base else _capacity_or_none(self, best)
        cap = self.live_only_capacity
        self.live_only = {"trials": study.measured, "best_capacity_rps": cap.estimate_rps if cap else 0.0}
        self.phases["live_only_s"] = round(time.time() - t, 1)
        _say(
            self.t0,
            f"live-only search: {study.measured} trials, best {self.base.changed(best) or 'the running config'}",
        )
        return choice

    def held_out(self, candidate: VllmConfig) -> Comparison:
        """The held-out comparison and the A/A check in shared rounds (A B A' A' B A)."""
        heldout, _ = self.held_out_with_aa(candidate)
        return heldout

    def finish(self, verdict: Verdict) -> Outcome:
        if self.aa is None:  # no candidate was compared: the A/A check alone
            self.aa_check()
        return super().finish(verdict)


def _run(
    the_plan: dict[str, Any], work: Path, wb: Workbench, python: str, t0: float, json_path: Path | None
) -> dict[str, Any]:
    tuning, backend, workload, base = _tuning(the_plan, work, wb, python, t0)
    db = wb.db
    opts = WL.WorkloadOptions(
        load=WORKLOAD["load"],
        duration_s=WORKLOAD["duration_s"],
        scale=WORKLOAD["scale"],
        output_range=tuple(WORKLOAD["output_range"]),
        max_total_tokens=512,
    )
    # the traffic's rate comes from vLLM's defaults whatever the running config: a poor one (max_num_seqs 2)
    # anchored it at 3.4 req/s once, a traffic neither the search nor the sender measured well
    defaults = base.replace(max_num_seqs=VllmConfig().max_num_seqs)
    try:  # the anchor's vLLM starts before the pipeline, which stops its own servers however it ends
        workload.factory, wdesc = workload_factory(
            WORKLOAD["scenario"], opts, capacity=lambda o: tuning.capacity_rps(o, anchor=defaults)
        )
        the_plan["capacity_rps"] = wdesc["capacity_rps"]
        the_plan["workload_described"] = WL.describe(workload(the_plan["tuning_seeds"][0]))
        if json_path is not None:  # the measured offline capacity joins the plan before the first tuning run
            json_path.write_text(json.dumps({"plan": the_plan, "status": "running"}, indent=2) + "\n")
        tuning.report_to = ReportTo(
            title="kvpilot vLLM tuning — bench tune-vllm",
            workload={**WORKLOAD, "capacity_rps": the_plan["capacity_rps"]},
            out_dir=work / "proposals",
            report_path=work / "report.md",
        )
        outcome = tuning.run()
    finally:
        backend.close()
    running, profile, screened = tuning.running_capacity, tuning.profile, tuning._screened()
    aa, live_only, lo_cap = tuning.aa, tuning.live_only_study, tuning.live_only_capacity
    assert running is not None and profile is not None and aa is not None and live_only is not None
    fid = fidelity.compare(backend.evaluations, profile, workload, db, tuning.slo, calibrated_on=base)
    lo_rps = lo_cap.estimate_rps if lo_cap is not None else 0.0
    h = tuning.heldout
    p = outcome.proposal
    rows = tuning.confirmed
    screened_best = max(r["live_capacity_rps"] for r in rows)
    load = os.getloadavg()
    return {
        "status": "done",
        "objective": "slo_capacity",
        "memory_fixed": the_plan["memory_fixed"],
        "workload": {**WORKLOAD, "capacity_rps": the_plan["capacity_rps"], "rate_rps": running.rate_rps},
        "slo": SLO_PLAN,
        "default_capacity_rps": h.mean_capacity("running") if h else running.estimate_rps,
        "proposal_capacity_rps": h.mean_capacity("candidate") if h else running.estimate_rps,
        "capacity_gain": h.gain if h else 0.0,
        "capacity_gain_low": h.gain_low if h else None,
        "capacity_gain_high": h.gain_high if h else None,
        "verdict": h.verdict if h else "no gain",  # no candidate (the decision says why): nothing compared
        "aa_verdict": aa.verdict,
        "aa": aa.as_dict(),
        # the spread of the A/A pairs' log ratios: two servers' difference plus the measurements' noise, per pair
        "aa_log_ratio_sd": statistics.stdev(r) if len(r := [x["log_ratio"] for x in aa.pairs]) >= 2 else None,
        "heldout": h.as_dict() if h else None,
        "running_capacity": running.summary(),
        "goodput_at_rate_tps": running.goodput_at_rate_tps,
        "live_trials": screened.live_trials,
        "sim_trials": screened.sim_trials,
        "screened_best_capacity_rps": screened_best,
        "live_only_best_capacity_rps": lo_rps,
        "live_only_trials": live_only.measured,
        "client_late_p99_s": max(backend.late_p99_s, default=None),
        "fidelity": fid["summary"],
        "rank_correlation": tuning.rank_correlation(),
        "load_average": {"1m": round(load[0], 2), "5m": round(load[1], 2), "15m": round(load[2], 2)},
        "targets": {
            "aa_not_proposal": aa.verdict != "proposal",
            "verdict_proposal_has_gain_low_above_0": (h is None or h.verdict != "proposal" or h.gain_low > 0),
            "screened_at_least_live_only": screened_best >= lo_rps,
            "live_trials_at_most_a_third": screened.live_trials * 3 <= live_only.measured,
        },
        "decision": outcome.decision,
        "notes": outcome.notes,
        "proposed_changes": outcome.changed,
        "proposal": {"id": p.row.id, "config": str(p.config_path), "report": str(p.report_path)} if p else None,
        "screened": tuning.screened_rows(),
        "capacities": [{k: v for k, v in r.items() if k != "config"} for r in rows],
        "live_only": [
            {
                "params_changed": {k: v for k, v in t.params.items() if tuning.space.from_config(base).get(k) != v},
                "goodput": t.goodput,
                "feasible": t.feasible,
                "infeasible": t.infeasible,
            }
            for t in live_only.trials
        ],
        "restart_cost": outcome.restart,
        "scrape_targets_left": backend.stale_targets,  # trial targets the collector refused to delete (expected: [])
        "profile": {**outcome.profile, "source": profile.source},
        "fidelity_replays": fid["replays"],
        "phases_s": tuning.phases,
        "pipeline_s": outcome.verdict.phases_s,
        "wall_s": round(time.time() - t0, 1),
        "work_dir": str(work),
    }


def _capacity_or_none(tuning: VllmTuning, config: VllmConfig) -> Capacity | None:
    """The live-only best's capacity, searched from the running config's as the screened best's confirmation is
    (`VllmTuning.capacity_near_running`); None if it fails."""
    try:
        return tuning.capacity_near_running(config, label="live-only")
    except InfeasibleTrialError as exc:
        _say(tuning.t0, f"live-only best: infeasible: {exc.reason[:300]}")
        return None
    except NotMeasuredError as exc:  # the sender's fault, not the config's: no capacity to report for it
        _say(tuning.t0, f"live-only best: not measured: {exc.reason[:300]}")
        return None
