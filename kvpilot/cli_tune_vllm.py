"""`kvpilot tune vllm study|screen`: tune the engine arguments of a real vLLM (`tuner.vllm.tune`).

`study` measures the running config live, screens the space in the simulator calibrated from the steps the
collector stored, confirms the best few live (one vLLM restart each) and checks the best on held-out seeds; the
proposal (vLLM `--config` file, report, `proposals` row) is written only when the gain's lower bound is above 0.
`screen` is the same screen with no vLLM started: the simulator calibrated from what the collector already holds
for `--instance`, and the configs it ranks best with their predicted goodput.

Exit codes: 0 done (study: a proposal written); 3 study done without a proposal (the running config stays);
2 bad input (nothing started); 1 a failure while running (collector unreachable, the running config not served).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer

from kvpilot.cli_tune import (
    DbOpt,
    DurationOpt,
    E2eOpt,
    LengthScaleOpt,
    OomOpt,
    OutRangeOpt,
    RejOpt,
    RequestsOpt,
    ScaleOpt,
    TimeScaleOpt,
    TpotOpt,
    TtftOpt,
    VerboseOpt,
    _db_url,
    _errors,
    _num,
    _options,
    _report,
    _setup_logging,
    _slo,
)
from kvpilot.cli_vllm import COLLECTOR_HELP, TOKEN_HELP, check_collector_url

tune_vllm_app = typer.Typer(no_args_is_help=True)

NO_PROPOSAL = 3
HELDOUT_KEYS = (
    "seeds",
    "repeats",
    "default_goodput",
    "proposal_goodput",
    "gain",
    "gain_low",
    "holds",
    "best_feasible_all",
)

ConfigOpt = typer.Option(..., "--config", help="the running vLLM's config YAML (vLLM's --config form): the baseline")
ModelOpt = typer.Option(None, "--model", help="the checkpoint directory (default: the config's `model`)")
SpaceOpt = typer.Option(None, "--space", help="vLLM search space YAML (default tuner/vllm/space.yml)")
WorkloadOpt = typer.Option(
    "mixed", "--workload", help="mixed | burst | sustained | trace:FILE | collector | stored:INSTANCE"
)
CapacityOpt = typer.Option(
    None,
    "--capacity",
    help="scenarios: the running config's requests/s (default: study measures it live, screen simulates it)",
)
LoadOpt = typer.Option(None, "--load", help="scenarios: arrival rate as a multiple of the running config's capacity")
HoursOpt = typer.Option(
    24.0, "--hours", help="how far back the collector is read: collector/stored workloads and --instance's steps"
)
P99TtftOpt = typer.Option(None, "--p99-ttft-slo", help="constraint on p99 TTFT, seconds (default: the TTFT SLO)")
ScreenOpt = typer.Option(200, "--screen", help="configs simulated")
SeedOpt = typer.Option(0, "--seed", help="the first tuning seed (and the Optuna seed)")
SeedsOpt = typer.Option(1, "--seeds-per-trial", help="workload seeds per trial, scored together")
MinStepsOpt = typer.Option(200, "--min-steps", help="stored vLLM steps the calibration needs at least")
VllmPythonOpt = typer.Option(None, "--vllm-python", help="Python with vLLM (KVPILOT_VLLM_PYTHON, ./.venv-vllm)")
ArgCheckOpt = typer.Option(
    True, "--arg-check/--no-arg-check", help="check the space against the installed vLLM's own parser first"
)
JsonOpt = typer.Option(None, "--json", help="also write the result as JSON to this file")


@contextlib.contextmanager
def _vllm_errors() -> Iterator[None]:
    """`tune`'s error mapping plus vLLM's: a missing interpreter is bad input, a failure while running exits 1."""
    from integrations.vllm import VllmSetupError
    from integrations.vllm.argcheck import ArgCheckError
    from tuner.vllm.tune import TuneError

    with _errors():
        try:
            yield
        except VllmSetupError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
        except (TuneError, ArgCheckError, _CollectorDown) as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None


class _CollectorDown(RuntimeError):
    pass


def _check_collector(url: str, ingest_token: str | None) -> None:
    """The collector answers /health and takes the ingest token, before any vLLM starts."""
    import httpx

    headers = {"Authorization": f"Bearer {ingest_token}"} if ingest_token else {}
    try:
        with httpx.Client(timeout=5.0) as client:
            health = client.get(f"{url}/health")
            if health.status_code != 200:
                raise _CollectorDown(f"collector at {url}: /health answered {health.status_code}: {health.text[:200]}")
            targets = client.get(f"{url}/v1/targets", headers=headers)
    except httpx.HTTPError as exc:
        raise _CollectorDown(
            f"collector: cannot reach {url}: {exc or type(exc).__name__} (start `kvpilot collector serve` or pass "
            "--collector / KVPILOT_COLLECTOR_URL)"
        ) from None
    if targets.status_code in (401, 403):
        raise ValueError(
            f"ingest_token: the collector at {url} refuses it ({targets.status_code}); pass --ingest-token or "
            "KVPILOT_INGEST_TOKEN"
        )


def _base(config: Path, model: Path | None):  # type: ignore[no-untyped-def]
    """(running config, the model's shape) from the config file and --model."""
    from integrations.vllm.config import VllmConfig
    from tuner.vllm.tune import checkpoint_model

    base = VllmConfig.from_config_yaml(config)
    if model is not None:
        base = base.replace(model=str(model))
    return base, checkpoint_model(base.model, base.dtype)


def _slo_with_ttft(ttft, tpot, p99_e2e, p99_ttft, max_rejection, max_oom):  # type: ignore[no-untyped-def]
    slo = _slo(ttft, tpot, p99_e2e, max_rejection, max_oom)
    if p99_ttft is not None and not p99_ttft > 0:
        raise ValueError(f"slo: p99_ttft_s: must be positive, got {p99_ttft}")
    return dataclasses.replace(slo, p99_ttft_s=p99_ttft)


def _opts(requests, scale, output_range, load, duration, time_scale, length_scale, hours, base):  # type: ignore[no-untyped-def]
    """The workload options with prompt + output clipped to vLLM's max-model-len."""
    opts = _options(requests, scale, output_range, load, duration, time_scale, length_scale, hours)
    return dataclasses.replace(opts, max_total_tokens=base.max_model_len)


def _check_space(space, path: Path | None, base, python: str | None, *, say) -> str:  # type: ignore[no-untyped-def]
    """The space against the installed vLLM's own parser (when `python` is given); what the check said."""
    from integrations.vllm.argcheck import check_space
    from tuner.space import SpaceError
    from tuner.vllm.space import default_vllm_space_path

    if python is None:
        return "not checked against vLLM"
    say("checking the space against the installed vLLM's own argument parser")
    check = check_space(space, base, python=python)
    if not check.ok:
        where = path or default_vllm_space_path()
        raise SpaceError(f"{where}: vLLM {check.version} refuses: " + "; ".join(check.problems), "space")
    return f"checked against vLLM {check.version} ({check.probes} probes)"


def _sayer(t0: float):  # type: ignore[no-untyped-def]
    def say(message: str) -> None:
        print(f"[tune vllm {time.time() - t0:5.0f}s] {message}", file=sys.stderr, flush=True)

    return say


def _spread(s: dict[str, float]) -> str:
    return f"{_num(s['mean'])} ± {_num(s['sd'])} ({_num(s['min'])}–{_num(s['max'])}, n={s['n']})"


def _changes(changed: dict[str, Any]) -> str:
    return ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in changed.items()) or "none"


def _none_confirmed(sim_feasible: int) -> str:
    if sim_feasible == 0:
        return (
            "no simulated config met the constraints (p99 TTFT, p99 end-to-end, refusals); loosen "
            "--p99-ttft-slo / --p99-e2e-slo or lower the load"
        )
    return "every feasible simulated config pruned back to the running one (no change moved its goodput by 1%)"


@tune_vllm_app.command("study")
def study_cmd(
    config: Path = ConfigOpt,
    model: Path | None = ModelOpt,
    space: Path | None = SpaceOpt,
    workload: str = WorkloadOpt,
    capacity: float | None = CapacityOpt,
    requests: int = RequestsOpt,
    scale: float = ScaleOpt,
    output_range: str = OutRangeOpt,
    load: float | None = LoadOpt,
    duration: float | None = DurationOpt,
    time_scale: float = TimeScaleOpt,
    length_scale: float = LengthScaleOpt,
    hours: float = HoursOpt,
    ttft_slo: float = TtftOpt,
    tpot_slo: float = TpotOpt,
    p99_e2e_slo: float | None = E2eOpt,
    p99_ttft_slo: float | None = P99TtftOpt,
    max_rejection_rate: float = RejOpt,
    max_oom: int = OomOpt,
    screen: int = ScreenOpt,
    confirm: int = typer.Option(2, "--confirm", help="the best simulated configs confirmed live (a restart each)"),
    seed: int = SeedOpt,
    seeds_per_trial: int = SeedsOpt,
    heldout_seeds: int = typer.Option(3, "--heldout-seeds", help="new workload seeds for the before/after check"),
    repeats: int = typer.Option(1, "--repeats", help="passes over the held-out seeds"),
    instance: str | None = typer.Option(
        None, "--instance", help="a vLLM instance whose stored steps (last --hours) join the calibration"
    ),
    min_steps: int = MinStepsOpt,
    running_url: str | None = typer.Option(
        None,
        "--running-url",
        help="a vLLM already serving --config with its telemetry on this collector under --running-run-id: the "
        "running config is measured there (no start, never stopped)",
    ),
    running_run_id: str | None = typer.Option(
        None, "--running-run-id", help="its run id (kvpilot vllm serve --run-id)"
    ),
    collector: str = typer.Option(
        "http://127.0.0.1:8100", "--collector", envvar="KVPILOT_COLLECTOR_URL", help=COLLECTOR_HELP
    ),
    ingest_token: str | None = typer.Option(None, "--ingest-token", envvar="KVPILOT_INGEST_TOKEN", help=TOKEN_HELP),
    admin_token: str | None = typer.Option(
        None,
        "--admin-token",
        envvar="KVPILOT_ADMIN_TOKEN",
        help="the collector's admin token: each trial's vLLM /metrics is a scrape target while it runs",
    ),
    db_url: str | None = DbOpt,
    vllm_python: str | None = VllmPythonOpt,
    arg_check: bool = ArgCheckOpt,
    study_name: str | None = typer.Option(None, "--study-name", help="names its runs, report and proposal"),
    out_dir: Path = typer.Option(Path("kvpilot-data/proposals"), "--out-dir", "--out", help="proposal files go here"),
    log_dir: Path | None = typer.Option(
        None, "--log-dir", help="trial vLLM logs (default kvpilot-data/tune-vllm/NAME)"
    ),
    json_path: Path | None = JsonOpt,
    verbose: bool = VerboseOpt,
) -> None:
    """Tune a vLLM for a workload; a proposal (vLLM --config file) only if its gain's lower bound is > 0.

    The running config live, a simulated screen, live confirmations (one vLLM restart each, about a minute on a CPU)
    and a held-out check. Exit codes: 0 a proposal written, 3 none (the running config stays), 2 bad input, 1 a
    failure while running."""
    _setup_logging(verbose)
    t0 = time.time()
    say = _sayer(t0)
    with _vllm_errors():
        from integrations.vllm import find_vllm_python
        from tuner.jobs import open_db, workload_factory, workload_kind
        from tuner.storage import open_storage
        from tuner.vllm.backend import VllmBackend
        from tuner.vllm.calibrate import CalibrationError
        from tuner.vllm.space import load_vllm_space
        from tuner.vllm.tune import Budget, LateWorkload, VllmTuning

        workload_kind(workload)
        slo = _slo_with_ttft(ttft_slo, tpot_slo, p99_e2e_slo, p99_ttft_slo, max_rejection_rate, max_oom)
        if seeds_per_trial < 1 or heldout_seeds < 1:
            raise ValueError("seeds: --seeds-per-trial and --heldout-seeds must be >= 1")
        tuning_seeds = tuple(range(seed, seed + seeds_per_trial))
        budget = Budget(
            tuning_seeds=tuning_seeds,
            sim_trials=screen,
            top_k=confirm,
            heldout_seeds=tuple(range(1000 + seed, 1000 + seed + heldout_seeds)),
            repeats=repeats,
        ).validate()
        if capacity is not None and not capacity > 0:
            raise ValueError(f"capacity: must be positive, got {capacity}")
        if (running_url is None) != (running_run_id is None):
            raise ValueError("running_url: --running-url and --running-run-id go together")
        collector_url = check_collector_url(collector)
        base, model_shape = _base(config, model)
        opts = _opts(requests, scale, output_range, load, duration, time_scale, length_scale, hours, base)
        sp = load_vllm_space(space, base=base)
        python = find_vllm_python(vllm_python)
        name = study_name or f"tune-vllm-{uuid.uuid4().hex[:8]}"
        url = _db_url(db_url)
        db = open_db(url)
        try:
            _check_collector(collector_url, ingest_token)
            checked = _check_space(sp, space, base, python if arg_check else None, say=say)
            late = LateWorkload()
            backend = VllmBackend(
                workload=late,
                db=db,
                slo=slo,
                python=python,
                collector_url=collector_url,
                ingest_token=ingest_token,
                admin_token=admin_token or None,
                log_dir=log_dir or Path("kvpilot-data/tune-vllm") / name,
            )
            if running_url is not None and running_run_id is not None:
                backend.attach(base, url=running_url.rstrip("/"), run_id=running_run_id)
            tuning = VllmTuning(
                backend=backend,
                db=db,
                base=base,
                space=sp,
                slo=slo,
                budget=budget,
                model=model_shape,
                workload=late,
                name=name,
                steps_instances=[instance] if instance else [],
                steps_since=t0 - hours * 3600.0,
                min_steps=min_steps,
                say=say,
                progress=True,
                storage=open_storage(url),  # the screen's study, listed on the dashboard's Tuning page
                t0=t0,
            )
            try:
                hook = (lambda _opts: capacity) if capacity is not None else tuning.capacity_rps
                late.factory, wdesc = workload_factory(
                    workload, opts, db=db, instances=[instance] if instance else None, capacity=hook
                )
                if capacity is not None:
                    wdesc["capacity_given"] = True
                tuning.run()
            except CalibrationError as exc:
                raise CalibrationError(f"{exc}; {CALIBRATION_HINT}") from None
            finally:
                backend.close()
            outcome = tuning.finish(
                title=f"kvpilot vLLM tuning — {name}",
                workload=wdesc,
                out_dir=out_dir,
                instance=instance,
                report_path=out_dir / f"report-{name}.md",
            )
        finally:
            db.dispose()
        summary = _study_summary(tuning, outcome, name=name, workload=wdesc, checked=checked, t0=t0)
        _report(_study_lines(summary), summary, json_path)
    if outcome.proposal is None:
        raise typer.Exit(NO_PROPOSAL)


CALIBRATION_HINT = (
    "the running config's replays stored too few steps: a longer workload (--requests, --duration), another "
    "tuning seed (--seeds-per-trial), or --instance NAME to add a vLLM's stored steps"
)


def _broken(metrics: dict[str, Any] | None, slo) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """The constraints a measurement broke and by how much (`TrialMetrics.constraints`: > 0 is broken)."""
    from tuner.metrics import TrialMetrics

    if not metrics:
        return {}
    return {k: v for k, v in TrialMetrics(**metrics).constraints(slo).items() if v > 0}


def _study_summary(tuning, outcome, *, name: str, workload: dict, checked: str, t0: float) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    screened, h, base = tuning.screened, tuning.heldout, tuning.baseline
    p = outcome.proposal
    return {
        "study": name,
        "decision": outcome.decision,
        "proposal": {"id": p.row.id, "config": str(p.config_path), "report": str(p.report_path)} if p else None,
        "report": str(outcome.report_path),
        "changed": outcome.changed,
        "workload": workload,
        "slo": dataclasses.asdict(tuning.slo),
        "budget": dataclasses.asdict(tuning.budget),
        "space": checked,
        "baseline": {
            "goodput_tps": base.metrics["goodput_tps"] if base.metrics else None,
            "feasible": base.feasible,
            "constraints_broken": _broken(base.metrics, tuning.slo),
            "sim_goodput_tps": base.sim_goodput,
            "metrics": base.metrics,
        },
        "sim_trials": screened.sim_trials,
        "sim_feasible": sum(t.feasible for t in screened.sim.completed),
        "live_trials": screened.live_trials,
        "screened": tuning.screened_rows(),
        "heldout": None if h is None else {k: h[k] for k in HELDOUT_KEYS},
        "restart_cost": outcome.restart,
        "scrape_targets": {  # each started trial's /metrics: registered ('created'/'exists'/None), and left behind
            "registered": [x.target for x in tuning.backend.launches],
            "left": tuning.backend.stale_targets,
        },
        "profile": outcome.profile,
        "phases_s": tuning.phases,
        "wall_s": round(time.time() - t0, 1),
    }


def _study_lines(s: dict[str, Any]) -> list[str]:
    w = s["workload"]
    lines = [f"tune vllm study {s['study']}: {s['decision']}"]
    rate = f", capacity {w['capacity_rps']} req/s" if "capacity_rps" in w else ""
    lines.append(f"  workload: {w.get('kind')}{rate}; space {s['space']}")
    h = s["heldout"]
    if h is not None:
        lines.append(
            f"  running config: {_spread(h['default_goodput'])} goodput tokens/s on held-out seeds {h['seeds']}"
        )
        lines.append(f"  best found:     {_spread(h['proposal_goodput'])}")
        lines.append(f"  gain {h['gain']:+.1%}, one-sided 90% lower bound {h['gain_low']:+.1%} (paired by seed)")
    else:
        b = s["baseline"]
        broken = ", ".join(f"{k} over its limit by {v:.3g}" for k, v in b["constraints_broken"].items())
        verdict = "" if b["feasible"] else f" (infeasible: {broken or 'not measured'})"
        lines.append(f"  running config: {_num(b['goodput_tps'], ' goodput tokens/s')} on the tuning seeds{verdict}")
    lines.append(f"  changes: {_changes(s['changed'])}")
    prof = s["profile"]
    lines.append(
        f"  search: {s['sim_trials']} configs simulated (cost model from {prof.get('steps')} stored steps, "
        f"R² {prof.get('r2')}), {s['live_trials']} measured live"
    )
    if len(s["screened"]) == 1:
        lines.append(f"    nothing confirmed live: {_none_confirmed(s['sim_feasible'])}")
    for row in s["screened"][1:]:
        live = f"{_num(row['live_goodput'])} live" if row["feasible"] else f"infeasible: {row['infeasible'] or 'SLO'}"
        lines.append(f"    {_changes(row['changed'])}: {_num(row['sim_goodput'])} simulated, {live}")
    r = s["restart_cost"]
    if r.get("ready_s"):
        rd, st = r["ready_s"], r.get("stop_s") or {}
        lines.append(
            f"  restart cost per trial: {rd['mean']} s to serve ({rd['min']}–{rd['max']}) over {r['launches']} "
            f"start(s), {st.get('mean', '—')} s to stop; {r['refused_or_crashed']} refused or crashed"
        )
    p = s["proposal"]
    if p is not None:
        lines.append(
            f"  proposal {p['id']} (pending): {p['config']} — restart vLLM with `vllm serve --config {p['config']}`"
        )
        lines.append(f"  report: {p['report']}")
    else:
        lines.append(f"  report: {s['report']}")
    lines.append(f"  wall time {s['wall_s']:.0f} s")
    return lines


@tune_vllm_app.command("screen")
def screen_cmd(
    config: Path = ConfigOpt,
    instance: str = typer.Option(
        ..., "--instance", help="the vLLM instance whose stored steps (last --hours) calibrate the simulator"
    ),
    model: Path | None = ModelOpt,
    space: Path | None = SpaceOpt,
    workload: str = WorkloadOpt,
    capacity: float | None = CapacityOpt,
    requests: int = RequestsOpt,
    scale: float = ScaleOpt,
    output_range: str = OutRangeOpt,
    load: float | None = LoadOpt,
    duration: float | None = DurationOpt,
    time_scale: float = TimeScaleOpt,
    length_scale: float = LengthScaleOpt,
    hours: float = HoursOpt,
    ttft_slo: float = TtftOpt,
    tpot_slo: float = TpotOpt,
    p99_e2e_slo: float | None = E2eOpt,
    p99_ttft_slo: float | None = P99TtftOpt,
    max_rejection_rate: float = RejOpt,
    max_oom: int = OomOpt,
    screen: int = ScreenOpt,
    top: int = typer.Option(5, "--top", help="configs shown, best first (each pruned in the simulator)"),
    seed: int = SeedOpt,
    seeds_per_trial: int = SeedsOpt,
    min_steps: int = MinStepsOpt,
    db_url: str | None = DbOpt,
    vllm_python: str | None = VllmPythonOpt,
    arg_check: bool = ArgCheckOpt,
    json_path: Path | None = JsonOpt,
    verbose: bool = VerboseOpt,
) -> None:
    """Screen without vLLM: the simulator's best configs and their predicted goodput; nothing is started.

    The cost model is fitted from the steps the collector stored for --instance (a vLLM started by `kvpilot vllm
    serve` or shipped by `kvpilot collector tail`)."""
    _setup_logging(verbose)
    t0 = time.time()
    say = _sayer(t0)
    with _vllm_errors():
        from integrations.vllm import VllmSetupError, find_vllm_python
        from tuner import workloads as WL
        from tuner.jobs import open_db, workload_factory, workload_kind
        from tuner.storage import open_storage
        from tuner.vllm.space import load_vllm_space
        from tuner.vllm.tune import MAX_LIVE, MAX_SIM_TRIALS, calibrate_from_store, preview, sim_capacity_rps

        workload_kind(workload)
        slo = _slo_with_ttft(ttft_slo, tpot_slo, p99_e2e_slo, p99_ttft_slo, max_rejection_rate, max_oom)
        if screen < 1 or top < 1 or seeds_per_trial < 1:
            raise ValueError("screen: --screen, --top and --seeds-per-trial must be >= 1")
        if screen > MAX_SIM_TRIALS:
            raise ValueError(f"sim_trials: at most {MAX_SIM_TRIALS}, got {screen}")
        if seeds_per_trial > MAX_LIVE:
            raise ValueError(f"tuning_seeds: at most {MAX_LIVE}, got {seeds_per_trial}")
        if capacity is not None and not capacity > 0:
            raise ValueError(f"capacity: must be positive, got {capacity}")
        base, model_shape = _base(config, model)
        opts = _opts(requests, scale, output_range, load, duration, time_scale, length_scale, hours, base)
        sp = load_vllm_space(space, base=base)
        python = None
        if arg_check:
            try:
                python = find_vllm_python(vllm_python)
            except VllmSetupError as exc:
                if vllm_python is not None:
                    raise
                say(f"the space is not checked against vLLM: {exc}")
        url = _db_url(db_url)
        db = open_db(url)
        try:
            checked = _check_space(sp, space, base, python, say=say)
            profile = calibrate_from_store(
                db,
                model=model_shape,
                block_size=base.block_size,
                start=t0 - hours * 3600.0,
                end=t0 + 60.0,
                instances=[instance],
                min_steps=min_steps,
            )
            say(f"cost model from {profile.source['steps']} stored steps: R² {profile.fit.r2}, MAPE {profile.fit.mape}")

            def simulated(o: WL.WorkloadOptions) -> float:
                return sim_capacity_rps(profile, base, WL.offline_mix(o))

            factory, wdesc = workload_factory(
                workload, opts, db=db, instances=[instance], capacity=(lambda _o: capacity) if capacity else simulated
            )
            wdesc["capacity"] = "given" if capacity else "simulated"
            seeds = list(range(seed, seed + seeds_per_trial))
            sim, best, sim_s = preview(
                db=db,
                base=base,
                space=sp,
                slo=slo,
                profile=profile,
                workload=factory,
                sim_trials=screen,
                top=top,
                seeds=seeds,
                name=f"screen-{uuid.uuid4().hex[:8]}",
                progress=True,
                storage=open_storage(url),  # listed on the dashboard's Tuning page
            )
        finally:
            db.dispose()
        running = sim.baseline
        base_goodput = running.goodput if running else None
        data = {
            "study": sim.name,  # kept in the database's Optuna storage: the dashboard's Tuning page lists it
            "instance": instance,
            "workload": wdesc,
            "space": checked,
            "slo": dataclasses.asdict(slo),
            "profile": {
                "steps": profile.source["steps"],
                "r2": profile.fit.r2,
                "mape": profile.fit.mape,
                "runs": profile.source["runs"],
            },
            "sim_trials": sim.measured,
            "sim_seconds": round(sim_s, 1),
            "running": {
                "sim_goodput_tps": base_goodput,
                "feasible": running.feasible if running else None,
                "metrics": running.metrics if running else None,
            },
            "top": [
                {
                    "changed": {k: b for k, _a, b in base.changed(c.config)},
                    "sim_goodput_tps": c.sim_goodput,
                    "gain": (c.sim_goodput / base_goodput - 1.0) if base_goodput else None,
                    "put_back": c.reverted,
                    "config_yaml": c.config.to_config_yaml(),
                }
                for c in best
            ],
        }
        lines = [
            f"tune vllm screen: {sim.measured} configs simulated ({sim_s:.0f} s simulating) on a cost model from "
            f"{profile.source['steps']} stored steps of {instance} (R² {profile.fit.r2}, MAPE {profile.fit.mape})",
            f"  workload: {wdesc.get('kind')}"
            + (f", capacity {wdesc['capacity_rps']} req/s ({wdesc['capacity']})" if "capacity_rps" in wdesc else "")
            + f"; space {checked}",
            f"  running config: {_num(base_goodput, ' goodput tokens/s')} predicted"
            + ("" if running is None or running.feasible else " (infeasible under the SLOs)"),
            f"  study {sim.name}: on the dashboard's Tuning page",
        ]
        if not best:
            lines.append(f"  nothing to show: {_none_confirmed(sum(t.feasible for t in sim.completed))}")
        for i, row in enumerate(data["top"], 1):
            gain = f" ({row['gain']:+.1%})" if row["gain"] is not None else ""
            back = f"  [put back: {', '.join(row['put_back'])}]" if row["put_back"] else ""
            lines.append(
                f"  {i}. {_num(row['sim_goodput_tps'], ' goodput tokens/s')}{gain}: {_changes(row['changed'])}{back}"
            )
        lines.append(
            "  predictions only (the simulator misses vLLM's frontend; docs/tuning.md 'Tuning a vLLM'): "
            "confirm live with `kvpilot tune vllm study`"
        )
        _report(lines, data, json_path)
