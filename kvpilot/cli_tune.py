"""`kvpilot tune ...` (studies, nightly proposals, apply/review) and `kvpilot sim ...` (calibrate, what-if).

Bad input exits 2 with `error: <field>: <message>`; a failure while running (database down, engine
refusing a config) exits 1. Nothing is written before the input has been validated.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer

from kvpilot.cli_extras import require_extras
from kvpilot.cli_options import (
    LIVE,
    SLO_OPTIONS,
    WORKLOAD,
    WORKLOAD_HELP,
    ConfigOpt,
    DbOpt,
    EngineAdminTokenOpt,
    LiveArgs,
    ProfileOpt,
    SeedsPerTrialOpt,
    SloArgs,
    VerboseOpt,
    WorkloadArgs,
    WorkloadOpt,
    with_groups,
)

tune_app = typer.Typer(no_args_is_help=True)
sim_app = typer.Typer(no_args_is_help=True)
proposals_app = typer.Typer(no_args_is_help=True)
tune_app.add_typer(proposals_app, name="proposals", help="List and review tuning proposals.")

log = logging.getLogger("kvpilot.cli.tune")


def _db_url(value: str | None) -> str:
    from collector.settings import CollectorSettings

    return value or CollectorSettings().db_url


@contextlib.contextmanager
def _errors() -> Iterator[None]:
    """Known failures -> a one-line message and an exit code (2 bad input, 1 runtime)."""
    from collector.errors import CollectorError, SchemaOutdatedError
    from engine.config import ConfigError
    from tuner.profile import ProfileError
    from tuner.proposals import ApplyError, ProposalError
    from tuner.space import SpaceError
    from tuner.workloads import WorkloadError

    try:
        yield
    except (ConfigError, ProfileError, SpaceError, WorkloadError, ProposalError, SchemaOutdatedError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    except (ApplyError, CollectorError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def _emit(data: Any, json_path: Path | None) -> None:
    text = json.dumps(data, indent=2, default=str)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(text + "\n")
    typer.echo(text)


def _report(lines: list[str], data: Any, json_path: Path | None) -> None:
    """A human summary on stdout; the JSON only with --json (written to that file)."""
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(data, indent=2, default=str) + "\n")
        lines = [*lines, f"JSON written to {json_path}"]
    typer.echo("\n".join(lines))


KVPILOT_SLO = SLO_OPTIONS.without(p99_ttft_slo=None)  # kvpilot's engine: p99 TTFT is the TTFT SLO
BackendOpt = typer.Option("sim", "--backend", help="sim | engine | live")
SeedOpt = typer.Option(0, "--seed")


def _only_knobs(space, knobs: list[str]):
    """The space narrowed to `knobs` (all of it when none are named): a study over exactly those knobs."""
    from tuner.space import SearchSpace, SpaceError

    if not knobs:
        return space
    unknown = [k for k in knobs if k not in space.names]
    if unknown:
        raise SpaceError(f"knob: {', '.join(unknown)} not in the search space; one of {', '.join(space.names)}", "knob")
    return SearchSpace(tuple(p for p in space.params if p.name in knobs), space.fixed)


@tune_app.command("study")
@with_groups
def study_cmd(
    ctx: typer.Context,
    trials: int = typer.Option(40, "--trials", help="trials in the study (and in the random baseline)"),
    backend: str = BackendOpt,
    sampler: str | None = typer.Option(
        None,
        "--sampler",
        help="tpe | tpe-startup10 | tpe-startup3 | tpe-independent | random (default: the one `bench tuner` chose)",
    ),
    multi_objective: bool = typer.Option(False, "--multi-objective", help="throughput vs p99, Pareto front"),
    random_baseline: bool = typer.Option(True, "--random-baseline/--no-random-baseline"),
    study_name: str | None = typer.Option(None, "--study-name", help="join or resume this study (parallel workers)"),
    space: Path | None = typer.Option(None, "--space", help="search space YAML (default tuner/space.yml)"),
    knob: list[str] = typer.Option(
        [], "--knob", help="search only this knob of the space (repeatable); the others keep the config's values"
    ),
    config: Path | None = ConfigOpt,
    profile: str = ProfileOpt,
    workload: str = WorkloadOpt,
    workload_args: WorkloadArgs = WORKLOAD,
    instance: str | None = typer.Option(None, "--instance", help="stored/fitted/live: the engine instance"),
    slo_args: SloArgs = KVPILOT_SLO,
    seed: int = SeedOpt,
    seeds_per_trial: int = SeedsPerTrialOpt,
    db_url: str | None = DbOpt,
    storage: str | None = typer.Option(
        None,
        "--storage",
        envvar="KVPILOT_TUNER_STORAGE_URL",
        help="Optuna storage URL (default: next to the kvpilot database)",
    ),
    live_args: LiveArgs = LIVE,
    json_path: Path | None = typer.Option(None, "--json", help="also write the summary as JSON to this file"),
    verbose: bool = VerboseOpt,
) -> None:
    """Run (or join) an Optuna study on the simulator, the engine or a live engine; prints a summary."""
    require_extras(ctx, "tune")
    _setup_logging(verbose)
    with _errors():
        import uuid

        from tuner.jobs import BACKENDS, base_config, make_backend, open_db, workload_factory
        from tuner.profile import load_profile
        from tuner.report import study_lines, study_summary
        from tuner.space import load_space
        from tuner.storage import open_storage
        from tuner.study import DEFAULT_SAMPLER, SAMPLERS, run_study

        if backend not in BACKENDS:
            raise ValueError(f"backend: one of {', '.join(BACKENDS)}, got {backend!r}")
        sampler = sampler or DEFAULT_SAMPLER
        if sampler not in SAMPLERS:
            raise ValueError(f"sampler: one of {', '.join(SAMPLERS)}, got {sampler!r}")
        if trials < 1:
            raise ValueError(f"trials: must be >= 1, got {trials}")
        if seeds_per_trial < 1:
            raise ValueError(f"seeds_per_trial: must be >= 1, got {seeds_per_trial}")
        live = live_args.backend(backend, instance)
        slo = slo_args.slo()
        opts = workload_args.options()
        prof = load_profile(profile)
        base = base_config(config, prof, backend)
        sp = _only_knobs(load_space(space, base=base), knob)
        url = _db_url(db_url)
        db = open_db(url)
        try:
            factory, wdesc = workload_factory(
                workload, opts, profile=prof, base=base, db=db, instances=[instance] if instance else None
            )
            be = make_backend(backend, profile=prof, workload=factory, db=db, slo=slo, live=live)
            name = study_name or f"tune-{uuid.uuid4().hex[:8]}"
            result = run_study(
                be,
                sp,
                base,
                name=name,
                trials=trials,
                slo=slo,
                storage=open_storage(url, storage_url=storage),
                sampler=sampler,
                seed=seed,
                workload_seed=list(range(seed, seed + seeds_per_trial)),
                multi_objective=multi_objective,
                random_baseline=random_baseline,
            )
        finally:
            db.dispose()
        summary = study_summary(result, workload=wdesc, backend=backend, multi_objective=multi_objective)
        lines = study_lines(summary)
        _report(lines, summary, json_path)


@tune_app.command("nightly")
@with_groups
def nightly_cmd(
    ctx: typer.Context,
    trials: int = typer.Option(40, "--trials"),
    backend: str = BackendOpt,
    out_dir: Path = typer.Option(Path("kvpilot-data/proposals"), "--out-dir", help="proposal files go here"),
    workload: str = typer.Option("stored", "--workload", help=WORKLOAD_HELP),
    config: Path | None = ConfigOpt,
    profile: str = ProfileOpt,
    space: Path | None = typer.Option(None, "--space"),
    workload_args: WorkloadArgs = WORKLOAD,
    instance: str | None = typer.Option(None, "--instance", help="replay the stored requests of this instance only"),
    slo_args: SloArgs = KVPILOT_SLO,
    confirm_seeds: int = typer.Option(
        3, "--confirm-seeds", help="new workload seeds for the capacity confirmation (2..10: one ABBA pair each)"
    ),
    seeds_per_trial: int = SeedsPerTrialOpt,
    margin: float = typer.Option(
        0.03, "--margin", help="capacity ratios within 1 +- this are 'no gain': a proposal's interval must pass it"
    ),
    min_effect: float = typer.Option(
        0.01, "--min-effect", help="drop a change whose revert costs less goodput than this (the noise)"
    ),
    seed: int = SeedOpt,
    db_url: str | None = DbOpt,
    storage: str | None = typer.Option(None, "--storage", envvar="KVPILOT_TUNER_STORAGE_URL"),
    live_args: LiveArgs = LIVE.but(
        engine_url=typer.Option(
            None, "--engine-url", help="the running engine: its tunables are the baseline (live: trials run there)"
        )
    ),
    verbose: bool = VerboseOpt,
) -> None:
    """The stored traffic as it came -> study -> capacity confirmation on new seeds -> a proposal (only if the
    whole 90% interval of the capacity gain is above 1).

    For a vLLM: `kvpilot tune vllm nightly`."""
    require_extras(ctx, "tune")
    _setup_logging(verbose)
    with _errors():
        from tuner.nightly import run_nightly

        live = live_args.backend(backend, instance)
        result = run_nightly(
            db_url=_db_url(db_url),
            out_dir=out_dir,
            trials=trials,
            backend=backend,
            profile=profile,
            workload=workload,
            options=workload_args.options(),
            config_path=config,
            space_path=space,
            slo=slo_args.slo(),
            seed=seed,
            confirm_seeds=confirm_seeds,
            seeds_per_trial=seeds_per_trial,
            margin=margin,
            min_effect=min_effect,
            instance=instance,
            storage_url=storage,
            live=live,
            engine_url=live_args.engine_url,
            admin_token=live_args.admin_token,
        )
        for line in result.lines():
            typer.echo(line)


@tune_app.command("apply")
def apply_cmd(
    ctx: typer.Context,
    proposal_id: int = typer.Argument(..., help="proposal id"),
    engine_url: str = typer.Option("http://127.0.0.1:8000", "--engine-url"),
    admin_token: str | None = EngineAdminTokenOpt,
    force: bool = typer.Option(
        False, "--force", help="apply even if the engine is another instance than the proposal's"
    ),
    db_url: str | None = DbOpt,
) -> None:
    """Apply a proposal's tunables to a running engine through /admin/config (it must be the proposal's instance)."""
    require_extras(ctx, "tune")
    _setup_logging(False)
    with _errors():
        from tuner.jobs import open_db
        from tuner.proposals import apply_proposal

        db = open_db(_db_url(db_url))
        try:
            view = apply_proposal(db, proposal_id, engine_url=engine_url, admin_token=admin_token, force=force)
        finally:
            db.dispose()
        applied = (view.best_metrics or {}).get("apply", {})
        typer.echo(f"proposal {view.id} applied to {engine_url} (instance {applied.get('instance') or '?'})")
        diff = applied.get("diff") or []
        for key, was, now in diff:
            typer.echo(f"  {key}: {was} -> {now}")
        if not diff:
            typer.echo("  no tunable changed: the engine already ran the proposal's values")


def _review(proposal_id: int, status: str, db_url: str | None) -> None:
    with _errors():
        from tuner.jobs import open_db
        from tuner.proposals import set_status

        db = open_db(_db_url(db_url))
        try:
            view = set_status(db, proposal_id, status)
        finally:
            db.dispose()
        typer.echo(f"proposal {view.id}: {view.status}")


@proposals_app.command("list")
def proposals_list(
    ctx: typer.Context,
    status: str | None = typer.Option(None, "--status", help="pending | accepted | rejected | applied"),
    limit: int = typer.Option(50, "--limit"),
    db_url: str | None = DbOpt,
) -> None:
    """Proposals, newest first: id, status, engine (kvpilot or vllm), confirmed gain, study."""
    require_extras(ctx, "tune")
    with _errors():
        from tuner.jobs import open_db
        from tuner.proposals import list_proposals

        db = open_db(_db_url(db_url))
        try:
            rows = list_proposals(db, status=status, limit=limit)
        finally:
            db.dispose()
        for p in rows:
            gain = f"{p.gain:+.1%}" if p.gain is not None else "—"
            typer.echo(f"{p.id:>5}  {p.status:<9} {p.engine:<7} gain {gain:>7}  {p.study_name or ''}")
        if not rows:
            typer.echo("no proposals")


@proposals_app.command("show")
def proposals_show(
    ctx: typer.Context, proposal_id: int = typer.Argument(..., help="proposal id"), db_url: str | None = DbOpt
) -> None:
    """A proposal's report (markdown) and its config (YAML: `kvpilot engine serve --config`, or for a vLLM
    proposal `vllm serve --config`)."""
    require_extras(ctx, "tune")
    with _errors():
        from tuner.jobs import open_db
        from tuner.proposals import get_proposal

        db = open_db(_db_url(db_url))
        try:
            p = get_proposal(db, proposal_id)
        finally:
            db.dispose()
        typer.echo(p.report_md)
        typer.echo(p.config_yaml)


@proposals_app.command("accept")
def proposals_accept(
    ctx: typer.Context, proposal_id: int = typer.Argument(..., help="proposal id"), db_url: str | None = DbOpt
) -> None:
    """Mark a pending proposal accepted (reviewed; `kvpilot tune apply ID` applies it)."""
    require_extras(ctx, "tune")
    _review(proposal_id, "accepted", db_url)


@proposals_app.command("reject")
def proposals_reject(
    ctx: typer.Context, proposal_id: int = typer.Argument(..., help="proposal id"), db_url: str | None = DbOpt
) -> None:
    """Mark a pending or accepted proposal rejected (final)."""
    require_extras(ctx, "tune")
    _review(proposal_id, "rejected", db_url)


# --- kvpilot sim ------------------------------------------------------------------------------------


@sim_app.command("calibrate")
def calibrate_cmd(
    ctx: typer.Context,
    out: Path = typer.Option(Path("tuner/profiles/cpu-2core.json"), "--out", help="profile JSON to write"),
    name: str = typer.Option("cpu-2core", "--name"),
    config: Path | None = typer.Option(None, "--config", help="engine config to calibrate (default: CPU bench model)"),
    quick: bool = typer.Option(False, "--quick", help="a smaller grid"),
    threads: int | None = typer.Option(1, "--threads", help="torch threads during calibration (recorded)"),
    verbose: bool = VerboseOpt,
) -> None:
    """Run the torch engine over a grid of batch shapes and fit the cost model."""
    require_extras(ctx, "tune")
    _setup_logging(verbose)
    with _errors():
        from tqdm import tqdm

        from engine.config import EngineConfig
        from tuner.calibrate import calibrate, grid_steps

        cfg = EngineConfig.from_yaml(config) if config is not None else None
        with tqdm(total=grid_steps(quick), desc="calibrate", unit="run") as bar:

            def progress(msg: str) -> None:
                bar.set_postfix_str(msg[:40])
                bar.update(1)

            profile = calibrate(name=name, config=cfg, quick=quick, threads=threads, progress=progress)
        profile.save(out)
        typer.echo(f"wrote {out}: {profile.fit.samples} steps, R^2 {profile.fit.r2}, MAPE {profile.fit.mape:.1%}")


@sim_app.command("profiles")
def profiles_cmd(ctx: typer.Context) -> None:
    """List the shipped cost profiles."""
    require_extras(ctx, "tune")
    with _errors():
        from tuner.profile import shipped_profiles
        from tuner.vllm.calibrate import VllmProfile, load_any_profile

        for name in shipped_profiles():
            p = load_any_profile(name)
            where = "vLLM (CPU build)" if isinstance(p, VllmProfile) else p.hardware.name
            typer.echo(f"{name:<20} {p.kind:<8} {where} / {p.model.name}")


@sim_app.command("run")
@with_groups
def sim_run_cmd(
    ctx: typer.Context,
    profile: str = ProfileOpt,
    config: Path | None = ConfigOpt,
    set_: list[str] = typer.Option(
        [],
        "--set",
        help="override any cache/scheduler/recycler/... field, e.g. cache.hot_bytes=268435456 (repeatable; "
        "the profile sets the model)",
    ),
    workload: str = WorkloadOpt,
    workload_args: WorkloadArgs = WORKLOAD,
    slo_args: SloArgs = SLO_OPTIONS.without(p99_e2e_slo=None, p99_ttft_slo=None, max_rejection_rate=1.0, max_oom=10**9),
    seed: int = SeedOpt,
    db_url: str | None = typer.Option(None, "--db-url", help="store the run here (default: a temporary database)"),
    json_path: Path | None = typer.Option(None, "--json", help="also write the figures as JSON to this file"),
    verbose: bool = VerboseOpt,
) -> None:
    """What-if: one config on the simulator (e.g. `--profile h200-llama3-8b --set scheduler.max_num_seqs=128`)."""
    require_extras(ctx, "tune")
    _setup_logging(verbose)
    with _errors():
        import uuid

        import yaml

        from collector.db import upgrade
        from tuner.backends import SimBackend
        from tuner.jobs import base_config, open_db, workload_factory
        from tuner.profile import load_profile
        from tuner.report import num as _num

        prof = load_profile(profile)
        base = base_config(config, prof, "sim")
        patch: dict[str, dict[str, Any]] = {}
        for item in set_:
            key, eq, raw = item.partition("=")
            if not eq or "." not in key:
                raise ValueError(f"--set: expected section.field=value, got {item!r}")
            section, field = key.split(".", 1)
            patch.setdefault(section, {})[field] = yaml.safe_load(raw)
        frozen = {"model": f"the simulator runs the profile's model ({prof.model.name}); pick another --profile"}
        cfg = base.with_overrides(patch, frozen=frozen) if patch else base
        slo = slo_args.slo()
        opts = workload_args.options()
        with tempfile.TemporaryDirectory() as tmp:
            url = db_url or f"sqlite:///{tmp}/sim.db"
            if db_url is None:
                upgrade(url)
            db = open_db(url)
            try:
                factory, wdesc = workload_factory(workload, opts, profile=prof, base=cfg, db=db)
                backend = SimBackend(prof, factory, db, slo)
                metrics = backend.evaluate(cfg, run_id=f"sim-{uuid.uuid4().hex[:8]}", seed=seed)
            finally:
                db.dispose()
        rep = backend.last_replay
        data = {
            "profile": prof.name,
            "workload": wdesc,
            "patch": patch,
            "metrics": metrics.as_dict(),
            "simulated_s": rep.duration_s if rep else None,
            "steps": rep.steps if rep else None,
            "wall_s": round(backend.sim_seconds, 3),
        }
        m = metrics
        speed = f", {rep.duration_s / backend.sim_seconds:.0f}x real time" if rep and backend.sim_seconds > 0 else ""
        lines = [
            f"sim run on {prof.name}, workload {wdesc.get('kind')}"
            + (
                ", changed " + ", ".join(f"{sec}.{k}={v}" for sec, kv in patch.items() for k, v in kv.items())
                if patch
                else ", the profile's config"
            ),
            f"  {m.finished}/{m.requests} requests finished, {m.rejected} refused, {m.preemptions} preemptions",
            f"  throughput {_num(m.throughput_tps, ' tokens/s')}, goodput {_num(m.goodput_tps, ' tokens/s')} "
            f"({m.good_fraction:.0%} of requests within TTFT {slo.ttft_s:g} s and TPOT {slo.tpot_s:g} s)",
            f"  TTFT p50 {_num(m.ttft_p50_s, ' s')}, p99 {_num(m.ttft_p99_s, ' s')}; "
            f"TPOT p99 {_num(m.tpot_p99_s, ' s')}; end-to-end p99 {_num(m.e2e_p99_s, ' s')}",
            f"  simulated {_num(rep.duration_s if rep else None, ' s')} in {backend.sim_seconds:.3g} s{speed}",
        ]
        _report(lines, data, json_path)


tune_app.command("run", help="Alias of `tune study`.")(study_cmd)
