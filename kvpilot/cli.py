"""The `kvpilot` command. Each area registers its own typer sub-app from its own module."""

from __future__ import annotations

import typer

from kvpilot.cli_alerts import alerts_app
from kvpilot.cli_collector import collector_app, db_app
from kvpilot.cli_dashboard import dashboard_cmd
from kvpilot.cli_engine import engine_app
from kvpilot.cli_extras import require_extras
from kvpilot.cli_loadtest import loadtest_cmd
from kvpilot.cli_model import model_app
from kvpilot.cli_plugins import mount_bench
from kvpilot.cli_status import status_cmd
from kvpilot.cli_tune import sim_app, tune_app
from kvpilot.cli_tune_vllm import tune_vllm_app
from kvpilot.cli_vllm import vllm_app

app = typer.Typer(no_args_is_help=True, add_completion=False, help="kvpilot: observe and tune LLM serving.")
app.add_typer(engine_app, name="engine", help="Run the inference engine.")
app.add_typer(model_app, name="model", help="Make local model checkpoints.")
app.add_typer(vllm_app, name="vllm", help="Run vLLM with its telemetry wired to the collector.")
mount_bench(app)
app.add_typer(collector_app, name="collector", help="Run the telemetry collector.")
app.add_typer(db_app, name="db", help="Migrate and prune the collector database.")
app.add_typer(alerts_app, name="alerts", help="Prometheus-style alert rules and an Alertmanager-compatible notifier.")
tune_app.add_typer(
    tune_vllm_app, name="vllm", help="Tune a real vLLM: study (restarts it per trial) or screen (simulated only)."
)
app.add_typer(tune_app, name="tune", help="Tune the engine config: Optuna studies, nightly proposals, apply.")
app.add_typer(sim_app, name="sim", help="The simulator: calibrate cost profiles, run what-ifs.")
app.command("loadtest")(loadtest_cmd)
app.command("dashboard")(dashboard_cmd)
app.command("status")(status_cmd)


def _version(value: bool) -> None:
    if value:
        from kvpilot import __version__

        typer.echo(f"kvpilot {__version__}")
        raise typer.Exit(0)


@app.callback()
def main(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="print the version and exit"
    ),
) -> None:
    """kvpilot: observe and tune LLM serving."""


@app.command()
def demo(
    ctx: typer.Context,
    duration_s: float = typer.Option(30.0, "--duration", help="seconds of load (mixed, with a burst)"),
    keep_running: bool | None = typer.Option(
        None, "--keep-running/--exit", help="keep serving after the load until Ctrl-C (default: if a terminal)"
    ),
) -> None:
    """Run the whole loop on embedded defaults (SQLite, CPU)."""
    require_extras(ctx, "engine", "dashboard", "tune")
    from kvpilot.demo import run_demo

    raise typer.Exit(run_demo(duration_s=duration_s, keep_running=keep_running))


if __name__ == "__main__":
    app()
