"""`kvpilot tune vllm study|nightly|screen`: tune the engine arguments of a real vLLM (`tuner.vllm.tune`).

`study` measures the running config's SLO capacity live, screens the space in the simulator calibrated from the
steps the collector stored (the KV cache's size held unless --allow-memory), confirms the best few live (one vLLM
restart each) and compares the best with the running config in alternating live pairs on held-out seeds; the
proposal (vLLM `--config` file, report, `proposals` row) is written only when that comparison's verdict is
`proposal` (the 90% interval of the capacity ratio above 1).
`screen` is the same screen with no vLLM started: the simulator calibrated from what the collector already holds
for `--instance`, and the configs it ranks best with their predicted goodput; it writes nothing into the
collector's database (the simulated study is kept in the Optuna storage beside it). `nightly` is `study` on an
instance's own stored traffic for a timer (exit 0 with or without a proposal). The workload is by default the
stored requests at their recorded arrivals (`stored`); trial vLLMs listen on `--port-range` when given.

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

from kvpilot.cli_extras import require_extras
from kvpilot.cli_options import (
    SLO_OPTIONS,
    WORKLOAD,
    WORKLOAD_HELP,
    DbOpt,
    SeedsPerTrialOpt,
    SloArgs,
    VerboseOpt,
    WorkloadArgs,
    with_groups,
)
from kvpilot.cli_tune import _db_url, _errors, _report, _setup_logging
from kvpilot.cli_vllm import COLLECTOR_HELP, TOKEN_HELP, check_collector_url

tune_vllm_app = typer.Typer(no_args_is_help=True)

NO_PROPOSAL = 3

ConfigOpt = typer.Option(..., "--config", help="the running vLLM's config YAML (vLLM's --config form): the baseline")
ModelOpt = typer.Option(None, "--model", help="the checkpoint directory (default: the config's `model`)")
SpaceOpt = typer.Option(None, "--space", help="vLLM search space YAML (default tuner/vllm/space.yml)")
WorkloadOpt = typer.Option("stored", "--workload", help=WORKLOAD_HELP)
CapacityOpt = typer.Option(
    None,
    "--capacity",
    help="scenarios: the running config's requests/s (default: study measures it live, screen simulates it)",
)
VLLM_WORKLOAD = WORKLOAD.but(
    load=typer.Option(None, "--load", help="scenarios: arrival rate as a multiple of the running config's capacity"),
    hours=typer.Option(
        24.0, "--hours", help="how far back the collector is read: stored/fitted workloads and --instance's steps"
    ),
)
ScreenOpt = typer.Option(200, "--screen", help="configs simulated")
SeedOpt = typer.Option(0, "--seed", help="the first tuning seed (and the Optuna seed)")
ConfirmOpt = typer.Option(2, "--confirm", help="the best simulated configs confirmed live (a restart each)")
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
    from tuner.backends import NotMeasuredError
    from tuner.vllm.tune import TuneError

    with _errors():
        try:
            yield
        except VllmSetupError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
        except (TuneError, ArgCheckError, _CollectorDown, NotMeasuredError) as exc:
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


def _base(config: Path, model: Path | None):
    """(running config, the model's shape) from the config file and --model."""
    from integrations.vllm.config import VllmConfig
    from tuner.vllm.tune import checkpoint_model

    base = VllmConfig.from_config_yaml(config)
    if model is not None:
        base = base.replace(model=str(model))
    return base, checkpoint_model(base.model, base.dtype)


def _check_space(space, path: Path | None, base, python: str | None, *, say) -> str:
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


def _sayer(t0: float):
    def say(message: str) -> None:
        print(f"[tune vllm {time.time() - t0:5.0f}s] {message}", file=sys.stderr, flush=True)

    return say


@dataclasses.dataclass(frozen=True)
class StudyArgs:
    """One vLLM tuning's inputs as the CLI took them (`study` and `nightly` alike), before any check."""

    config: Path
    model: Path | None
    space: Path | None
    workload: str
    capacity: float | None
    opts: WorkloadArgs
    slo: SloArgs
    screen: int
    confirm: int
    seed: int
    seeds_per_trial: int
    heldout_seeds: int
    repeats: int
    instance: str | None
    min_steps: int
    running_url: str | None
    running_run_id: str | None
    port_range: str | None
    collector: str
    ingest_token: str | None
    admin_token: str | None
    db_url: str | None
    vllm_python: str | None
    arg_check: bool
    study_name: str | None
    out_dir: Path
    log_dir: Path | None
    allow_memory: bool = False  # search the KV cache's size too
    keep_servers: bool = False  # held-out rounds on the same servers (no restart per round)
    capacity_replays: int = 7  # a full capacity search's replays at most
    pair_replays: int = 4  # one held-out measurement's replays at most


def _check_seeds(seeds_per_trial: int, heldout_seeds: int) -> None:
    if seeds_per_trial < 1:
        raise ValueError(f"seeds: --seeds-per-trial must be >= 1, got {seeds_per_trial}")
    if heldout_seeds < 2:
        raise ValueError(
            f"heldout_seeds: --heldout-seeds must be >= 2, got {heldout_seeds}: the gain's lower bound needs at "
            "least two paired runs, so with one no proposal could ever be written"
        )


def _run_study(a: StudyArgs, *, t0: float, say) -> dict[str, Any]:
    """Check everything, run the tuning (`tuner.vllm.tune.VllmTuning`), write the report (and the proposal when
    the gain holds); the summary."""
    from integrations.vllm import find_vllm_python
    from tuner.jobs import open_db, workload_factory, workload_kind
    from tuner.storage import open_storage
    from tuner.vllm.backend import VllmBackend, parse_port_range
    from tuner.vllm.calibrate import CalibrationError
    from tuner.vllm.space import load_vllm_space
    from tuner.vllm.summary import study_summary
    from tuner.vllm.tune import Budget, LateWorkload, ReportTo, VllmTuning

    workload_kind(a.workload)
    slo = a.slo.slo()
    _check_seeds(a.seeds_per_trial, a.heldout_seeds)
    ports = parse_port_range(a.port_range) if a.port_range is not None else None
    budget = Budget(
        tuning_seeds=tuple(range(a.seed, a.seed + a.seeds_per_trial)),
        sim_trials=a.screen,
        top_k=a.confirm,
        heldout_seeds=tuple(range(1000 + a.seed, 1000 + a.seed + a.heldout_seeds)),
        repeats=a.repeats,
        fresh_servers=not a.keep_servers,
        capacity_replays=a.capacity_replays,
        pair_replays=a.pair_replays,
    ).validate()
    if a.capacity is not None and not a.capacity > 0:
        raise ValueError(f"capacity: must be positive, got {a.capacity}")
    if (a.running_url is None) != (a.running_run_id is None):
        raise ValueError("running_url: --running-url and --running-run-id go together")
    collector_url = check_collector_url(a.collector)
    base, model_shape = _base(a.config, a.model)
    opts = a.opts.options(max_total_tokens=base.max_model_len)
    sp = load_vllm_space(a.space, base=base)
    python = find_vllm_python(a.vllm_python)
    name = a.study_name or f"tune-vllm-{uuid.uuid4().hex[:8]}"
    hours = a.opts.hours
    url = _db_url(a.db_url)
    db = open_db(url)
    try:
        _check_collector(collector_url, a.ingest_token)
        checked = _check_space(sp, a.space, base, python if a.arg_check else None, say=say)
        late = LateWorkload()
        backend = VllmBackend(
            workload=late,
            db=db,
            slo=slo,
            python=python,
            collector_url=collector_url,
            ingest_token=a.ingest_token,
            admin_token=a.admin_token or None,
            log_dir=a.log_dir or Path("kvpilot-data/tune-vllm") / name,
            ports=ports,
        )
        if a.running_url is not None and a.running_run_id is not None:
            backend.attach(base, url=a.running_url.rstrip("/"), run_id=a.running_run_id)
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
            steps_instances=[a.instance] if a.instance else [],
            steps_since=t0 - hours * 3600.0,
            min_steps=a.min_steps,
            say=say,
            progress=True,
            storage=open_storage(url),  # the screen's study, listed on the dashboard's Tuning page
            allow_memory=a.allow_memory,
            t0=t0,
        )
        try:
            hook = (lambda _opts: a.capacity) if a.capacity is not None else tuning.capacity_rps
            late.factory, wdesc = workload_factory(
                a.workload, opts, db=db, instances=[a.instance] if a.instance else None, capacity=hook
            )
            if a.capacity is not None:
                wdesc["capacity_given"] = True
            tuning.report_to = ReportTo(
                title=f"kvpilot vLLM tuning — {name}",
                workload=wdesc,
                out_dir=a.out_dir,
                report_path=a.out_dir / f"report-{name}.md",
                instance=a.instance,
            )
            outcome = tuning.run()
        except CalibrationError as exc:
            raise CalibrationError(f"{exc}; {CALIBRATION_HINT}") from None
        finally:
            backend.close()
    finally:
        db.dispose()
    return study_summary(tuning, outcome, name=name, workload=wdesc, checked=checked, t0=t0)


PortRangeOpt = typer.Option(
    None, "--port-range", help="ports the trial vLLMs listen on, LOW-HIGH (e.g. 20000-20100; default: any free port)"
)
HeldoutSeedsOpt = typer.Option(
    3, "--heldout-seeds", help="new workload seeds for the before/after check (at least 2: the gain's lower bound)"
)
KeepServersOpt = typer.Option(
    False,
    "--keep-servers",
    help="run every held-out round on the same servers, not fresh ones (a restart of each per round saved; a "
    "server's own speed then sits in every pair, and the interval does not cover it)",
)
CapacityReplaysOpt = typer.Option(
    7,
    "--capacity-replays",
    help="replays of one full capacity search at most (the running config's, each confirmation's)",
)
PairReplaysOpt = typer.Option(
    4, "--pair-replays", help="replays of one held-out measurement at most (it stops at its first bracket, 2 or more)"
)
CollectorOpt = typer.Option("http://127.0.0.1:8100", "--collector", envvar="KVPILOT_COLLECTOR_URL", help=COLLECTOR_HELP)
IngestTokenOpt = typer.Option(None, "--ingest-token", envvar="KVPILOT_INGEST_TOKEN", help=TOKEN_HELP)
AdminTokenOpt = typer.Option(
    None,
    "--admin-token",
    envvar="KVPILOT_ADMIN_TOKEN",
    help="the collector's admin token: each trial's vLLM /metrics is a scrape target while it runs",
)
OutDirOpt = typer.Option(Path("kvpilot-data/proposals"), "--out-dir", "--out", help="proposal files go here")
LogDirOpt = typer.Option(None, "--log-dir", help="trial vLLM logs (default kvpilot-data/tune-vllm/NAME)")


@tune_vllm_app.command("study")
@with_groups
def study_cmd(
    ctx: typer.Context,
    config: Path = ConfigOpt,
    model: Path | None = ModelOpt,
    space: Path | None = SpaceOpt,
    workload: str = WorkloadOpt,
    capacity: float | None = CapacityOpt,
    workload_args: WorkloadArgs = VLLM_WORKLOAD,
    slo_args: SloArgs = SLO_OPTIONS,
    screen: int = ScreenOpt,
    confirm: int = ConfirmOpt,
    seed: int = SeedOpt,
    seeds_per_trial: int = SeedsPerTrialOpt,
    heldout_seeds: int = HeldoutSeedsOpt,
    repeats: int = typer.Option(1, "--repeats", help="passes over the held-out seeds"),
    keep_servers: bool = KeepServersOpt,
    capacity_replays: int = CapacityReplaysOpt,
    pair_replays: int = PairReplaysOpt,
    instance: str | None = typer.Option(
        None,
        "--instance",
        help="a vLLM instance: the stored workload replays its requests, and its stored steps (last --hours) join "
        "the calibration",
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
    port_range: str | None = PortRangeOpt,
    collector: str = CollectorOpt,
    ingest_token: str | None = IngestTokenOpt,
    admin_token: str | None = AdminTokenOpt,
    db_url: str | None = DbOpt,
    vllm_python: str | None = VllmPythonOpt,
    arg_check: bool = ArgCheckOpt,
    study_name: str | None = typer.Option(None, "--study-name", help="names its runs, report and proposal"),
    out_dir: Path = OutDirOpt,
    log_dir: Path | None = LogDirOpt,
    allow_memory: bool = typer.Option(
        False,
        "--allow-memory",
        help="search the KV cache's size too (default: held at the running config's; the proposal then shows "
        "the extra memory on its own line, with the best at fixed memory beside it)",
    ),
    json_path: Path | None = JsonOpt,
    verbose: bool = VerboseOpt,
) -> None:
    """Tune a vLLM for a workload's SLO capacity; a proposal (vLLM --config file) only if the live comparison's
    90% interval of the capacity ratio is above 1.

    The running config live, a simulated screen, live confirmations (one vLLM restart each, about a minute on a CPU)
    and a held-out check. Exit codes: 0 a proposal written, 3 none (the running config stays), 2 bad input, 1 a
    failure while running."""
    require_extras(ctx, "tune")
    _setup_logging(verbose)
    t0 = time.time()
    args = StudyArgs(
        config=config, model=model, space=space, workload=workload, capacity=capacity,
        opts=workload_args, slo=slo_args,
        screen=screen, confirm=confirm, seed=seed, seeds_per_trial=seeds_per_trial, heldout_seeds=heldout_seeds,
        repeats=repeats, instance=instance, min_steps=min_steps, running_url=running_url,
        running_run_id=running_run_id, port_range=port_range, collector=collector, ingest_token=ingest_token,
        admin_token=admin_token, db_url=db_url, vllm_python=vllm_python, arg_check=arg_check, study_name=study_name,
        out_dir=out_dir, log_dir=log_dir, allow_memory=allow_memory, keep_servers=keep_servers,
        capacity_replays=capacity_replays, pair_replays=pair_replays,
    )  # fmt: skip
    with _vllm_errors():
        from tuner.vllm.summary import study_lines

        summary = _run_study(args, t0=t0, say=_sayer(t0))
        _report(study_lines(summary), summary, json_path)
    if summary["proposal"] is None:
        raise typer.Exit(NO_PROPOSAL)


@tune_vllm_app.command("nightly")
@with_groups
def nightly_cmd(
    config: Path = ConfigOpt,
    instance: str = typer.Option(
        ..., "--instance", help="the vLLM instance whose stored requests are replayed and whose steps calibrate"
    ),
    model: Path | None = ModelOpt,
    space: Path | None = SpaceOpt,
    workload: str = WorkloadOpt,
    workload_args: WorkloadArgs = WORKLOAD.but(
        requests=typer.Option(400, "--requests", help="the latest N stored requests of the window, at most"),
        hours=typer.Option(24.0, "--hours", help="how far back the stored requests and steps are read"),
    ).without(scale=4.0, output_range="16,256", load=None, duration=None, length_scale=1.0),
    slo_args: SloArgs = SLO_OPTIONS.without(max_oom=0),
    screen: int = ScreenOpt,
    confirm: int = ConfirmOpt,
    heldout_seeds: int = HeldoutSeedsOpt,
    keep_servers: bool = KeepServersOpt,
    capacity_replays: int = CapacityReplaysOpt,
    pair_replays: int = PairReplaysOpt,
    min_steps: int = MinStepsOpt,
    port_range: str | None = PortRangeOpt,
    collector: str = CollectorOpt,
    ingest_token: str | None = IngestTokenOpt,
    admin_token: str | None = AdminTokenOpt,
    db_url: str | None = DbOpt,
    vllm_python: str | None = VllmPythonOpt,
    out_dir: Path = OutDirOpt,
    log_dir: Path | None = LogDirOpt,
    json_path: Path | None = JsonOpt,
    verbose: bool = VerboseOpt,
) -> None:
    """The nightly job for a vLLM: `study` on the instance's own stored traffic as it came (last --hours), its
    stored steps in the calibration; a proposal only when the gain holds. Exit 0 with or without a proposal (a
    timer's success), 2 bad input, 1 a failure while running. docs/tuning.md has a cron and a systemd example."""
    _setup_logging(verbose)
    t0 = time.time()
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(t0))
    args = StudyArgs(
        config=config, model=model, space=space, workload=workload, capacity=None,
        opts=workload_args, slo=slo_args,
        screen=screen, confirm=confirm, seed=0, seeds_per_trial=1, heldout_seeds=heldout_seeds, repeats=1,
        instance=instance, min_steps=min_steps, running_url=None, running_run_id=None, port_range=port_range,
        collector=collector, ingest_token=ingest_token, admin_token=admin_token, db_url=db_url,
        vllm_python=vllm_python, arg_check=True, study_name=f"nightly-vllm-{stamp}-{uuid.uuid4().hex[:4]}",
        out_dir=out_dir, log_dir=log_dir, keep_servers=keep_servers,
        capacity_replays=capacity_replays, pair_replays=pair_replays,
    )  # fmt: skip
    with _vllm_errors():
        summary = _run_study(args, t0=t0, say=_sayer(t0))
        if json_path is not None:
            _report([], summary, json_path)
    typer.echo(summary["decision"])
    p = summary["proposal"]
    if p is not None:
        typer.echo(f"  config: {p['config']}\n  report: {p['report']}")
        typer.echo(f"  proposal id {p['id']} (pending): restart vLLM with `vllm serve --config {p['config']}`")
    else:
        typer.echo(f"  report: {summary['report']}")


CALIBRATION_HINT = (
    "the running config's replays stored too few steps: a longer workload (--requests, --duration), another "
    "tuning seed (--seeds-per-trial), or --instance NAME to add a vLLM's stored steps"
)


@tune_vllm_app.command("screen")
@with_groups
def screen_cmd(
    ctx: typer.Context,
    config: Path = ConfigOpt,
    instance: str = typer.Option(
        ..., "--instance", help="the vLLM instance whose stored steps (last --hours) calibrate the simulator"
    ),
    model: Path | None = ModelOpt,
    space: Path | None = SpaceOpt,
    workload: str = WorkloadOpt,
    capacity: float | None = CapacityOpt,
    workload_args: WorkloadArgs = VLLM_WORKLOAD,
    slo_args: SloArgs = SLO_OPTIONS,
    screen: int = ScreenOpt,
    top: int = typer.Option(5, "--top", help="configs shown, best first (each pruned in the simulator)"),
    seed: int = SeedOpt,
    seeds_per_trial: int = SeedsPerTrialOpt,
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
    require_extras(ctx, "tune")
    _setup_logging(verbose)
    t0 = time.time()
    say = _sayer(t0)
    with _vllm_errors():
        from integrations.vllm import VllmSetupError, find_vllm_python
        from tuner import workloads as WL
        from tuner.jobs import open_db, workload_factory, workload_kind
        from tuner.report import num
        from tuner.storage import open_storage
        from tuner.vllm.space import load_vllm_space
        from tuner.vllm.summary import changes_text, none_confirmed
        from tuner.vllm.tune import MAX_LIVE, MAX_SIM_TRIALS, calibrate_from_store, preview, sim_capacity_rps

        workload_kind(workload)
        slo = slo_args.slo()
        if screen < 1 or top < 1 or seeds_per_trial < 1:
            raise ValueError("screen: --screen, --top and --seeds-per-trial must be >= 1")
        if screen > MAX_SIM_TRIALS:
            raise ValueError(f"sim_trials: at most {MAX_SIM_TRIALS}, got {screen}")
        if seeds_per_trial > MAX_LIVE:
            raise ValueError(f"tuning_seeds: at most {MAX_LIVE}, got {seeds_per_trial}")
        if capacity is not None and not capacity > 0:
            raise ValueError(f"capacity: must be positive, got {capacity}")
        base, model_shape = _base(config, model)
        opts = workload_args.options(max_total_tokens=base.max_model_len)
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
                start=t0 - workload_args.hours * 3600.0,
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
            f"  running config: {num(base_goodput, ' goodput tokens/s')} predicted"
            + ("" if running is None or running.feasible else " (infeasible under the SLOs)"),
            f"  study {sim.name}: on the dashboard's Tuning page",
        ]
        if not best:
            lines.append(f"  nothing to show: {none_confirmed(sum(t.feasible for t in sim.completed))}")
        for i, row in enumerate(data["top"], 1):
            gain = f" ({row['gain']:+.1%})" if row["gain"] is not None else ""
            back = f"  [put back: {', '.join(row['put_back'])}]" if row["put_back"] else ""
            lines.append(
                f"  {i}. {num(row['sim_goodput_tps'], ' goodput tokens/s')}{gain}: {changes_text(row['changed'])}{back}"
            )
        lines.append(
            "  predictions only (the simulator misses vLLM's frontend; docs/tuning.md 'Tuning a vLLM'): "
            "confirm live with `kvpilot tune vllm study`"
        )
        _report(lines, data, json_path)
