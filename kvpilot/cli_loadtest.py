"""`kvpilot loadtest`: open-loop HTTP load with the seed's scenarios, pass criteria and fault injection.

Exit codes: 0 every criterion (or, with --fault, every nothing-lost check) passed; 1 a criterion failed;
2 bad input (the message names the option).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from urllib.parse import urlsplit

import typer

from kvpilot.cli_extras import require_extras

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}
FAULTS = ("collector-restart", "webhook-down", "kv-exhaustion", "slow-client")


def parse_duration(text: str, option: str = "--duration") -> float:
    match = _DURATION.match(text)
    if not match or float(match.group(1)) <= 0:
        raise typer.BadParameter(f"{text!r} is not a positive duration (e.g. 30s, 5m, 6h)", param_hint=option)
    return float(match.group(1)) * _UNITS[match.group(2)]


def _check_url(url: str | None, option: str) -> str | None:
    if url is None:
        return None
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise typer.BadParameter(f"{url!r} is not an http(s) URL", param_hint=option)
    return url.rstrip("/")


def _fail(option: str, message: str) -> typer.Exit:
    typer.echo(f"kvpilot loadtest: {option}: {message}", err=True)
    return typer.Exit(2)


def loadtest_cmd(
    ctx: typer.Context,
    target: str = typer.Option(
        None, "--target", help="engine base URL (e.g. http://127.0.0.1:8000); omit with --quick to start a local engine"
    ),
    scenario: str = typer.Option("mixed", "--scenario", help="mixed | burst | sustained | trace"),
    duration: str = typer.Option("60s", "--duration", help="how long arrivals go on (30s, 5m, 6h)"),
    rate: float = typer.Option(4.0, "--rate", help="base arrival rate, requests/s (Poisson)"),
    trace: Path = typer.Option(None, "--trace", help="Azure trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens)"),
    trace_time_scale: float = typer.Option(1.0, "--trace-time-scale", help="replay speed-up (2 = twice as fast)"),
    length_scale: float = typer.Option(1.0, "--length-scale", help="divide prompt lengths by this"),
    output_scale: float = typer.Option(1.0, "--output-scale", help="divide output lengths by this"),
    max_total_tokens: int = typer.Option(None, "--max-total-tokens", min=3, help="clip prompt + output"),
    api: str = typer.Option("generate", "--api", help="generate (/generate) | openai (/v1/completions)"),
    stream: bool = typer.Option(True, "--stream/--no-stream", help="stream tokens (client-side TTFT)"),
    ignore_eos: bool = typer.Option(
        True, "--ignore-eos/--no-ignore-eos", help="generate the planned output lengths (a trace's) even past EOS"
    ),
    request_timeout: str = typer.Option("60s", "--request-timeout", help="a request not answered by then fails"),
    max_concurrency: int = typer.Option(None, "--max-concurrency", min=1, help="cap on requests in flight"),
    windows: int = typer.Option(5, "--windows", min=2, help="windows for P99 drift and utilization"),
    p99_metric: str = typer.Option(
        "tpot",
        "--p99-metric",
        help="latency for the P99 criterion: tpot | ttft | e2e "
        "(tpot: per output token, so the length mix does not decide a window's P99)",
    ),
    collector: str = typer.Option(None, "--collector", help="collector URL; store per-request results there"),
    collector_token: str = typer.Option(None, "--collector-token", envvar="KVPILOT_INGEST_TOKEN"),
    run_id: str = typer.Option(None, "--run-id", help="run id of the stored results (default: generated)"),
    capacity: float = typer.Option(None, "--capacity", help="sustained: known capacity in req/s (skip probe)"),
    capacity_share: float = typer.Option(0.8, "--capacity-share", help="sustained: share of capacity offered"),
    cold_start: bool = typer.Option(False, "--cold-start", help="compare the first requests with/without warm-up"),
    cold_start_requests: int = typer.Option(100, "--cold-start-requests", min=1),
    warmup_requests: int = typer.Option(8, "--warmup-requests", min=1, help="warm-up for the cold-start compare"),
    engine_config: Path = typer.Option(None, "--engine-config", help="EngineConfig YAML for engines started here"),
    fault: str = typer.Option(None, "--fault", help=" | ".join(FAULTS) + " (starts its own processes)"),
    quick: bool = typer.Option(False, "--quick", help="short CPU-sized run (< 60 s with its own engine)"),
    seed: int = typer.Option(0, "--seed"),
    json_path: Path = typer.Option(None, "--json", help="write the report here"),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="progress bar on stderr"),
) -> None:
    """Open-loop load against an engine; exit 0 only when every pass criterion holds."""
    from engine.config import ConfigError
    from kvpilot.loadtest.plan import PlanError
    from kvpilot.loadtest.publish import PublishError
    from kvpilot.loadtest.report import render_table, write_json
    from kvpilot.loadtest.session import LoadTestSpec, run_loadtest
    from plumbing.process import ProcessStartError

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    explicit = {name for name in ctx.params if _source_name(ctx, name) not in (None, "DEFAULT")}
    if scenario not in ("mixed", "burst", "sustained", "trace"):
        raise _fail("--scenario", f"unknown scenario {scenario!r}; one of mixed, burst, sustained, trace")
    if api not in ("generate", "openai"):
        raise _fail("--api", f"unknown API {api!r}; one of generate, openai")
    if p99_metric not in ("e2e", "ttft", "tpot"):
        raise _fail("--p99-metric", f"unknown metric {p99_metric!r}; one of e2e, ttft, tpot")
    if fault is not None and fault not in FAULTS:
        raise _fail("--fault", f"unknown fault {fault!r}; one of {', '.join(FAULTS)}")
    if target is None and not quick and fault is None:
        raise _fail("--target", "required (or --quick to start a local engine, or --fault)")
    if fault is not None and target is not None:
        raise _fail("--target", "--fault starts and breaks its own engine and collector; drop --target")
    if not 0 < capacity_share <= 1:
        raise _fail("--capacity-share", f"must be in (0, 1], got {capacity_share}")
    if capacity is not None and capacity <= 0:
        raise _fail("--capacity", f"must be positive, got {capacity}")
    if scenario == "trace" and trace is None:
        raise _fail("--trace", "--scenario trace needs --trace FILE (Azure CSV)")
    if trace is not None and not trace.is_file():
        raise _fail("--trace", f"no such file: {trace}")
    if target is None:  # --quick and --fault start their own engine here
        require_extras(ctx, "engine")
    try:
        spec = LoadTestSpec(
            scenario=scenario,
            target=_check_url(target, "--target"),
            duration_s=parse_duration(duration),
            rate=rate,
            trace=trace,
            trace_time_scale=trace_time_scale,
            length_scale=length_scale,
            output_scale=output_scale,
            max_total_tokens=max_total_tokens,
            seed=seed,
            api=api,
            ignore_eos=ignore_eos,
            stream=stream,
            timeout_s=parse_duration(request_timeout, "--request-timeout"),
            max_concurrency=max_concurrency,
            windows=windows,
            p99_metric=p99_metric,
            collector_url=_check_url(collector, "--collector"),
            collector_token=collector_token,
            run_id=run_id,
            quick=quick,
            engine_config=engine_config,
            capacity_rps=capacity,
            capacity_share=capacity_share,
            cold_start=cold_start,
            cold_start_requests=cold_start_requests,
            warmup_requests=warmup_requests,
            progress=progress,
        )
    except typer.BadParameter as exc:
        raise _fail(exc.param_hint or "option", exc.message) from None
    spec = spec.quick_defaults(_explicit_spec_fields(explicit))
    if spec.target is not None:
        from kvpilot.loadtest.runner import TargetUnreachableError, check_target

        try:
            check_target(spec.target)
        except TargetUnreachableError as exc:
            typer.echo(f"kvpilot loadtest: --target: {exc}", err=True)
            raise typer.Exit(1) from None
    try:
        if fault is not None:
            from kvpilot.loadtest.faults import run_fault

            report = run_fault(fault, spec)
        else:
            report = run_loadtest(spec)
    except PlanError as exc:
        raise _fail(exc.option, str(exc).split(": ", 1)[-1]) from None
    except ConfigError as exc:
        raise _fail("--engine-config", str(exc)) from None
    except (ProcessStartError, PublishError) as exc:
        typer.echo(f"kvpilot loadtest: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(render_table(report), err=True)
    if json_path is not None:
        write_json(report, json_path)
    raise typer.Exit(0 if report["passed"] else 1)


def _source_name(ctx: typer.Context, name: str) -> str | None:
    """Where a parameter's value came from (typer vendors click, so compare by name)."""
    source = ctx.get_parameter_source(name)
    return getattr(source, "name", None)


_SPEC_NAMES = {
    "duration": "duration_s",
    "rate": "rate",
    "length_scale": "length_scale",
    "output_scale": "output_scale",
    "windows": "windows",
    "cold_start_requests": "cold_start_requests",
}


def _explicit_spec_fields(explicit: set[str]) -> set[str]:
    return {_SPEC_NAMES.get(name, name) for name in explicit}
