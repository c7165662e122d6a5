"""`kvpilot bench ...`: benchmarks that print progress to stderr and write JSON figures.

`bench_app` is the `kvpilot.bench` entry point (pyproject.toml): the CLI mounts it from the installed metadata,
so no runtime package imports the benchmarks.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import typer

from kvpilot.cli_extras import require_extras

bench_app = typer.Typer(no_args_is_help=True)
_LOAD_AT_START: list[float] = []


@bench_app.callback()
def _bench() -> None:
    """Benchmarks with JSON output."""
    _LOAD_AT_START[:] = [round(x, 2) for x in os.getloadavg()]


JsonOpt = typer.Option(None, "--json", help="write the figures to this file as JSON")
QuickOpt = typer.Option(False, "--quick", help="a smaller run (within 60 s on 2 cores)")


def emit(result: dict, json_path: Path | None) -> None:
    """Print (and write) a bench's figures, with the machine's load average (1, 5, 15 min) when the bench
    started and ended unless the bench measured its own: a figure from a loaded machine says so."""
    if _LOAD_AT_START and not any(key.startswith("load_average") for key in result):
        end = [round(x, 2) for x in os.getloadavg()]
        result = {**result, "load_average": {"start": list(_LOAD_AT_START), "end": end, "cpus": os.cpu_count()}}
    text = json.dumps(result, indent=2)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(text + "\n")
    typer.echo(text)


ErrorKinds = type[Exception] | tuple[type[Exception], ...]


@contextmanager
def exits(command: str, *codes: tuple[ErrorKinds, int]) -> Iterator[None]:
    """Each error of a kind in `codes` (kinds, exit code), first match first, ends the command with one line
    `kvpilot bench COMMAND: message` on stderr and that exit code; no traceback."""
    try:
        yield
    except Exception as exc:
        for kinds, code in codes:
            if isinstance(exc, kinds):
                typer.echo(f"kvpilot bench {command}: {exc}", err=True)
                raise typer.Exit(code) from None
        raise


QuickVllmOpt = typer.Option(False, "--quick", help="a smaller run (vLLM's start-ups make it minutes, see above)")
VllmPythonOpt = typer.Option(None, "--vllm-python", help="Python with vLLM (KVPILOT_VLLM_PYTHON, ./.venv-vllm)")


@bench_app.command("engine")
def bench_engine(
    ctx: typer.Context,
    quick: bool = QuickVllmOpt,
    json_path: Path | None = JsonOpt,
    vllm: bool = typer.Option(
        True, "--vllm/--no-vllm", help="also serve the checkpoint with vLLM (left out, with the reason, if not found)"
    ),
    vllm_python: str | None = VllmPythonOpt,
) -> None:
    """kvpilot's engine vs Hugging Face generate (static batching) and vLLM, one checkpoint, the mixed workload
    (--quick: ~7 min on 2 cores, vLLM's start-up included)."""
    require_extras(ctx, "engine")
    try:
        import transformers  # noqa: F401
    except ImportError:
        typer.echo("bench engine needs transformers: pip install 'kvpilot[bench]'", err=True)
        raise typer.Exit(2) from None
    from benchmarks.engine_bench import run_engine_bench

    emit(run_engine_bench(quick=quick, vllm=vllm, vllm_python=vllm_python), json_path)


@bench_app.command("vllm")
def bench_vllm(
    ctx: typer.Context,
    quick: bool = QuickVllmOpt,
    json_path: Path | None = JsonOpt,
    vllm_python: str | None = VllmPythonOpt,
) -> None:
    """A real vLLM launched by kvpilot under a mixed load: what the collector stored against what was sent and
    what vLLM counted, and the telemetry's cost in vLLM throughput (--quick: 2 rounds, ~8 min on 2 cores)."""
    require_extras(ctx, "engine")
    from benchmarks.vllm_bench import run_vllm_bench

    try:
        emit(run_vllm_bench(quick=quick, vllm_python=vllm_python), json_path)
    except RuntimeError as exc:
        typer.echo(f"kvpilot bench vllm: {exc}", err=True)
        raise typer.Exit(2) from None


@bench_app.command("alerts")
def bench_alerts(quick: bool = QuickOpt, json_path: Path | None = JsonOpt) -> None:
    """Alert delivery latency (condition held -> webhook receipt) and rule evaluation throughput."""
    from benchmarks.alerts import run_alerts_bench

    emit(run_alerts_bench(quick=quick), json_path)


@bench_app.command("ingest")
def bench_ingest(
    quick: bool = QuickOpt,
    json_path: Path | None = JsonOpt,
    overload: bool = typer.Option(
        False, "--overload", help="4, 64 and 256 concurrent senders: accepted events/s, refusals, /health, RSS, losses"
    ),
    abuse: bool = typer.Option(
        False,
        "--abuse",
        help="crafted amplifying bodies and scrape pages, each on a fresh collector: answer, RSS, /health",
    ),
) -> None:
    """HTTP ingest into SQLite (and PostgreSQL if reachable) vs the raw driver ceiling; telemetry overhead."""
    if overload and abuse:
        typer.echo("kvpilot bench ingest: --overload and --abuse are separate runs; choose one", err=True)
        raise typer.Exit(2)
    if abuse:
        from benchmarks.ingest_abuse import run_abuse_bench

        emit(run_abuse_bench(quick=quick), json_path)
        return
    if overload:
        from benchmarks.ingest_overload import run_overload_bench

        emit(run_overload_bench(quick=quick), json_path)
        return
    from benchmarks.ingest import run_ingest_bench

    emit(run_ingest_bench(quick=quick), json_path)


@bench_app.command("fleet")
def bench_fleet(
    quick: bool = typer.Option(False, "--quick", help="a shorter run, still 1,000 instances and 2 collectors (~5 min)"),
    collectors: int = typer.Option(
        2, "--collectors", min=1, max=8, help="collector processes (2 is the bench's figure; 1 or 3 show what one buys)"
    ),
    engines_per_relay: int = typer.Option(
        8,
        "--engines-per-relay",
        min=1,
        max=64,
        help="engines behind each node relay, whose pushes go as one bundle (1: every engine pushes alone)",
    ),
    engine_flush_s: float = typer.Option(
        1.0,
        "--engine-flush-s",
        min=0.25,
        max=5.0,
        help="the simulated engines' push interval (the sink's http_flush_interval_s, 1 s by default): the floor "
        "of the ingest lag, against more pushes a second",
    ),
    rule_interval: str = typer.Option(
        "250ms",
        "--rule-interval",
        help="the paging rule's evaluation interval, a Prometheus duration (250ms to 1m): what a slower or faster "
        "rule costs and buys",
    ),
    json_path: Path | None = JsonOpt,
    pg_url: str | None = typer.Option(
        None,
        "--pg-url",
        help="PostgreSQL server to create the run's database on (KVPILOT_BENCH_PG_URL, KVPILOT_TEST_PG_URL, "
        "else postgresql+psycopg://postgres@127.0.0.1:5432/test)",
    ),
) -> None:
    """1,000 simulated engines, OTLP spans, a 100-node DCGM scrape and 2 alert evaluators against 2 collectors
    on one PostgreSQL: events/s against COPY's ceiling, ingest lag, alert delivery, page reads, losses."""
    from dataclasses import replace

    from alerts.durations import DurationError, parse_duration
    from benchmarks.fleet import FleetBenchError, FleetConfig, pg_url_from_env, run_fleet_bench

    try:
        interval_s = parse_duration(rule_interval)
    except DurationError as exc:
        raise typer.BadParameter(str(exc), param_hint="--rule-interval") from None
    if not 0.25 <= interval_s <= 60:
        raise typer.BadParameter(f"{rule_interval!r} is outside 250ms to 1m", param_hint="--rule-interval")
    config = replace(
        FleetConfig.for_run(quick, collectors),
        engines_per_relay=engines_per_relay,
        rule_interval_s=interval_s,
        engine_flush_s=engine_flush_s,
    )
    with exits("fleet", (FleetBenchError, 2)), _terminated_as_exit():
        emit(run_fleet_bench(pg_url or pg_url_from_env(), config), json_path)


@contextmanager
def _terminated_as_exit() -> Iterator[None]:
    """SIGTERM (a timeout, a service manager) ends the run as Ctrl-C does, through its `finally` blocks: the
    collectors, the relay and the senders it started are stopped and its database dropped, not left running
    (they were, under `timeout`)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(*_: object) -> None:
        raise SystemExit(143)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@bench_app.command("latency-sketch")
def bench_latency_sketch(
    quick: bool = typer.Option(False, "--quick", help="10 minutes of a fleet's requests, 2 rounds (~1 min)"),
    minutes: int | None = typer.Option(
        None, "--minutes", min=1, max=120, help="minutes of a 1,000-engine fleet's requests to load (default 30)"
    ),
    json_path: Path | None = JsonOpt,
    pg_url: str | None = typer.Option(None, "--pg-url", help="PostgreSQL server to create the run's database on"),
) -> None:
    """A fleet's Latency page reads over an hour with every request sorted against the per-minute latency
    sketch, on the same rows, alternated A B B A; the sketch's error against the exact quantiles."""
    from benchmarks.fleet import FleetBenchError, pg_url_from_env
    from benchmarks.latency_reads import run_latency_sketch_bench

    span = minutes if minutes is not None else (10 if quick else 30)
    with exits("latency-sketch", (FleetBenchError, 2)):
        emit(run_latency_sketch_bench(pg_url or pg_url_from_env(), minutes=span, rounds=2 if quick else 3), json_path)


@bench_app.command("sim")
def bench_sim(
    ctx: typer.Context,
    quick: bool = QuickOpt,
    json_path: Path | None = JsonOpt,
    profile: str = typer.Option("cpu-2core", "--profile", help="calibrated CPU profile to check"),
    recalibrate: bool = typer.Option(
        True,
        "--recalibrate/--no-recalibrate",
        help="fit a fresh profile (quick grid) in the same run first, so the error is the cost model's and not the "
        "drift of a shared CPU's speed since the profile was calibrated; --no-recalibrate checks the profile "
        "as shipped",
    ),
) -> None:
    """Simulator fidelity: the same workloads on the torch engine and the simulator (throughput, p99 error)."""
    require_extras(ctx, "tune")
    from benchmarks.sim_bench import run_sim_bench

    emit(run_sim_bench(quick=quick, profile=profile, recalibrate=recalibrate), json_path)


@bench_app.command("tuner")
def bench_tuner(
    ctx: typer.Context,
    quick: bool = typer.Option(False, "--quick", help="shorter workloads and gain studies (minutes on 2 cores)"),
    json_path: Path | None = JsonOpt,
    profile: list[str] = typer.Option(
        None,
        "--profile",
        help="a frozen bench profile (benchmarks/profiles: cpu-2core, h200-llama3-8b, vllm-cpu-tiny) or a profile "
        "file; repeat for several (default: all three frozen ones)",
    ),
    gain: bool = typer.Option(
        True, "--gain/--no-gain", help="also tune each profile's full space and confirm the gain over the default"
    ),
) -> None:
    """Samplers compared on pinned landscapes (trials to within 2% of the exhaustive optimum); gain over default."""
    require_extras(ctx, "tune")
    import dataclasses

    from benchmarks.tuner_bench import BenchConfig, run_tuner_bench
    from benchmarks.tuner_landscape import BENCH_PROFILES
    from tuner.profile import ProfileError

    try:
        config = BenchConfig.for_run(quick)
        if not gain:
            config = dataclasses.replace(config, gain_trials=0)
        result = run_tuner_bench(profiles=profile or BENCH_PROFILES, config=config)
    except ProfileError as exc:
        typer.echo(f"kvpilot: {exc}", err=True)
        raise typer.Exit(2) from None
    emit(result, json_path)


@bench_app.command("tune-vllm")
def bench_tune_vllm(
    ctx: typer.Context,
    quick: bool = typer.Option(False, "--quick", help="smaller budgets (within 15 minutes on 2 cores)"),
    json_path: Path | None = JsonOpt,
    vllm_python: str | None = typer.Option(None, "--vllm-python", help="vLLM's interpreter (default: as `vllm serve`)"),
    out_dir: Path | None = typer.Option(None, "--out-dir", help="where the run's DB, logs and proposal go"),
    allow_memory: bool = typer.Option(
        False, "--allow-memory", help="search the KV cache's size too (default: held at the running config's)"
    ),
    running_max_num_seqs: int | None = typer.Option(
        None,
        "--running-max-num-seqs",
        help="the running config's --max-num-seqs (default: vLLM's); e.g. 2 for a deliberately poor one",
    ),
) -> None:
    """Tune a real vLLM for SLO capacity: simulation-screened search vs a live-only search; the candidate against
    the running config in alternating live pairs on held-out seeds, with an A/A check."""
    require_extras(ctx, "tune")
    from benchmarks.tune_vllm_bench import TuneVllmBenchError, run_tune_vllm_bench

    with exits("tune-vllm", (ValueError, 2), (TuneVllmBenchError, 1)):
        result = run_tune_vllm_bench(
            quick=quick,
            allow_memory=allow_memory,
            json_path=json_path,
            python=vllm_python,
            out_dir=out_dir,
            running_max_num_seqs=running_max_num_seqs,
        )
    emit(result, json_path)


@bench_app.command("vllm-placement")
def bench_vllm_placement(
    ctx: typer.Context,
    rounds: int = typer.Option(8, "--rounds", help="rounds of two fresh servers, alternating the two ways (>= 4)"),
    json_path: Path | None = JsonOpt,
    vllm_python: str | None = VllmPythonOpt,
    out_dir: Path | None = typer.Option(None, "--out-dir", help="where the run's DB and logs go"),
) -> None:
    """An A/A on this machine: two fresh vLLM-CPU servers of one config per round, measured A B B A, with the
    model worker kept alone on its cores (the tuner's way) and as started, rounds alternating."""
    require_extras(ctx, "tune")
    from benchmarks.vllm_placement import run_placement_bench
    from integrations.vllm import VllmExitedError, VllmSetupError
    from tuner.backends import InfeasibleTrialError, NotMeasuredError

    failures = (VllmSetupError, VllmExitedError, InfeasibleTrialError, NotMeasuredError)
    with exits("vllm-placement", (ValueError, 2), (failures, 1)):
        result = run_placement_bench(
            rounds=rounds, python=vllm_python, out_dir=out_dir, say=lambda m: typer.echo(m, err=True)
        )
    emit(result, json_path)
