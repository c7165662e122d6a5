"""`kvpilot vllm serve -- <vllm args>`: vLLM with its steps, spans and /metrics wired to the collector.

Exit codes: vLLM's own (128 + N when a signal N ended it); 2 when it could not be started as asked.
"""

from __future__ import annotations

import logging
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from urllib.parse import urlsplit

import typer

from kvpilot.cli_extras import require_extras

vllm_app = typer.Typer(no_args_is_help=True, add_completion=False)

COLLECTOR_HELP = "collector base URL (KVPILOT_COLLECTOR_URL)"
TOKEN_HELP = "the collector's ingest token (KVPILOT_INGEST_TOKEN)"


def check_collector_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or len(url) > 2000:
        raise typer.BadParameter(f"{url!r} is not an http(s) URL", param_hint="--collector")
    return url.rstrip("/")


def parse_labels(items: list[str] | None) -> dict[str, str]:
    labels: dict[str, str] = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise typer.BadParameter(f"{item!r} is not NAME=VALUE", param_hint="--label")
        labels[name] = value
    return labels


@vllm_app.command(
    "serve",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    no_args_is_help=False,
)
def serve_cmd(
    vllm_args: list[str] = typer.Argument(None, help="vLLM's own arguments, after -- (e.g. --model DIR --port 8000)"),
    collector: str = typer.Option(
        "http://127.0.0.1:8100", "--collector", envvar="KVPILOT_COLLECTOR_URL", help=COLLECTOR_HELP
    ),
    ingest_token: str | None = typer.Option(None, "--ingest-token", envvar="KVPILOT_INGEST_TOKEN", help=TOKEN_HELP),
    admin_token: str | None = typer.Option(
        None, "--admin-token", envvar="KVPILOT_ADMIN_TOKEN", help="the collector's admin token, to register /metrics"
    ),
    instance: str | None = typer.Option(None, "--instance", help="instance name of its telemetry (default host:port)"),
    run_id: str | None = typer.Option(None, "--run-id", help="run id of its telemetry (default: a new one)"),
    label: list[str] = typer.Option(None, "--label", help="static label of its scraped series, NAME=VALUE (repeat)"),
    scrape_interval: float | None = typer.Option(None, "--scrape-interval", min=1.0, max=86400.0, help="seconds"),
    vllm_python: str | None = typer.Option(None, "--vllm-python", help="Python with vLLM (KVPILOT_VLLM_PYTHON)"),
    spool_dir: Path = typer.Option(Path("kvpilot-data/spool"), "--spool-dir", help="step batches wait here"),
    log_file: Path | None = typer.Option(None, "--log-file", help="also append vLLM's output to this file"),
    traces: bool = typer.Option(True, "--traces/--no-traces", help="point vLLM's OTLP span exporter at the collector"),
) -> None:
    """Run vLLM's OpenAI server; ship its iteration lines as steps, register its /metrics, export its spans."""
    from integrations.vllm import LaunchOptions, VllmLauncher, VllmSetupError, find_vllm_python

    collector_url, labels = check_collector_url(collector), parse_labels(label)
    logging.basicConfig(level=logging.INFO, format="kvpilot: %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per batch sent
    try:
        options = LaunchOptions(
            vllm_args=list(vllm_args or []),
            python=find_vllm_python(vllm_python),
            collector_url=collector_url,
            ingest_token=ingest_token or None,
            admin_token=admin_token or None,
            instance=instance,
            run_id=run_id,
            labels=labels,
            scrape_interval_s=scrape_interval,
            spool_dir=spool_dir,
            log_file=log_file,
            traces=traces,
        )
        launcher = VllmLauncher(options, passthrough=sys.stderr.buffer)
        launcher.start()
    except (VllmSetupError, ValueError) as exc:
        typer.echo(f"kvpilot: {exc}", err=True)
        raise typer.Exit(2) from None

    received: list[int] = []

    def forward(signum: int, _frame: FrameType | None) -> None:
        received.append(signum)
        if len(received) >= 3:  # a third Ctrl-C: the user means it
            launcher.kill()
        else:
            launcher.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = launcher.wait()
    finally:
        launcher.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    stats, sink = launcher.stats, launcher.sink
    sent = getattr(sink, "sent", None)
    spooled = len(getattr(sink, "spool", ()))
    typer.echo(
        f"kvpilot: vLLM exited with {code}; {stats.iteration_lines} iteration lines, {stats.steps} steps "
        f"({sent} acknowledged, {spooled} batch(es) waiting in the spool), {stats.unparsable} unparsable, "
        f"{launcher.placer.moved} placed before their line (lines that came out in a burst)",
        err=True,
    )
    raise typer.Exit(code if code >= 0 else 128 - code)


@vllm_app.command("calibrate")
def calibrate_cmd(
    ctx: typer.Context,
    out: Path = typer.Option(Path("tuner/profiles/vllm-cpu-tiny.json"), "--out", help="profile JSON to write"),
    name: str | None = typer.Option(None, "--name", help="profile name (default: the file's stem)"),
    vllm_python: str | None = typer.Option(None, "--vllm-python", help="Python with vLLM (KVPILOT_VLLM_PYTHON)"),
    work_dir: Path = typer.Option(
        Path("kvpilot-data/vllm-calibrate"), "--work-dir", help="checkpoint, database and vLLM logs of the runs"
    ),
) -> None:
    """Fit a vLLM cost profile on this machine: vLLM serves calibration traffic, its iteration lines are the fit."""
    require_extras(ctx, "tune")
    from integrations.vllm import VllmSetupError, find_vllm_python
    from kvpilot.vllm.calibrate import calibrate_vllm
    from tuner.vllm.calibrate import CalibrationError

    logging.basicConfig(level=logging.WARNING, format="kvpilot: %(message)s", stream=sys.stderr)
    try:
        python = find_vllm_python(vllm_python)
        profile = calibrate_vllm(
            name=name or out.stem, python=python, work_dir=work_dir / time.strftime("%Y%m%dT%H%M%S")
        )
    except (VllmSetupError, CalibrationError, RuntimeError, OSError, ValueError) as exc:
        typer.echo(f"kvpilot: {exc}", err=True)
        raise typer.Exit(2) from None
    profile.save(out)
    typer.echo(
        f"wrote {out}: {profile.fit.samples} steps, R² {profile.fit.r2}, MAPE {profile.fit.mape}, "
        f"overhead {1000 * profile.overhead_s:.2f} ms/step + {1000 * profile.overhead_per_seq_s:.3f} ms/sequence"
    )
