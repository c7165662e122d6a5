"""`kvpilot dashboard`: the Streamlit app (`streamlit run dashboard/app.py` underneath), and a programmatic start.

proc = start_dashboard("sqlite:///kvpilot-data/kvpilot.db", port=8501, log_path="dashboard.log")
plumbing.process.wait_healthy("http://127.0.0.1:8501" + HEALTH_PATH, proc, timeout_s=60, log_path="dashboard.log")
...
plumbing.process.stop_process(proc)
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import typer

from kvpilot.cli_extras import require_extras
from plumbing import bind
from plumbing.process import spawn

HEALTH_PATH = "/_stcore/health"  # Streamlit's: 200 once the app serves


def app_path() -> Path:
    """dashboard/app.py wherever the `dashboard` package is installed (a checkout or site-packages)."""
    spec = importlib.util.find_spec("dashboard")
    if spec is not None and spec.origin is not None:
        return Path(spec.origin).resolve().parent / "app.py"
    return Path(__file__).resolve().parent.parent / "dashboard" / "app.py"


def dashboard_command(*, port: int, host: str, headless: bool) -> list[str]:
    """The streamlit command line: no file watcher, no usage stats, nothing opened unless asked."""
    return [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        str(app_path()),
        "--server.headless",
        "true" if headless else "false",
        "--browser.gatherUsageStats",
        "false",
        "--server.port",
        str(port),
        "--server.address",
        host,
        "--server.fileWatcherType",
        "none",
        "--server.runOnSave",
        "false",
        "--global.developmentMode",
        "false",
        "--client.toolbarMode",
        "minimal",
    ]


def check_bind(host: str) -> None:
    """Refuse a non-loopback address without a write password (docs/architecture.md: services bind loopback unless
    configured otherwise and refuse a non-loopback bind without a token). ValueError says what to set."""
    from dashboard.settings import load

    bind.check_bind(
        host,
        has_credential=bind.is_loopback(host) or load().password is not None,  # settings read only when needed
        service="the dashboard",
        missing="a password: set KVPILOT_DASHBOARD_PASSWORD (12+ characters; visitors sign in with it), or keep "
        "the default --host 127.0.0.1 behind an authenticating proxy (KVPILOT_DASHBOARD_TRUST_PROXY_HEADER)",
    )


def _env(db_url: str | None) -> dict[str, str]:
    env = dict(os.environ)
    if db_url:
        env["KVPILOT_DB_URL"] = db_url
    return env


def dashboard_url(host: str, port: int) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
    return f"http://{shown}:{port}"


def start_dashboard(
    db_url: str | None,
    port: int = 8501,
    *,
    host: str = "127.0.0.1",
    headless: bool = True,
    log_path: str | Path | None = None,
) -> subprocess.Popen:
    """Start the dashboard in the background (the demo's entry point); output goes to `log_path` or is dropped."""
    if not app_path().is_file():
        raise FileNotFoundError(f"dashboard app not found at {app_path()}")
    check_bind(host)
    return spawn(dashboard_command(port=port, host=host, headless=headless), log_path=log_path, env=_env(db_url))


def dashboard_cmd(
    ctx: typer.Context,
    db_url: str | None = typer.Option(
        None, "--db-url", help="database URL (default: KVPILOT_DB_URL or ./kvpilot-data/kvpilot.db)"
    ),
    port: int = typer.Option(8501, help="port to listen on"),
    host: str = typer.Option(
        "127.0.0.1", help="address to listen on; another than loopback needs KVPILOT_DASHBOARD_PASSWORD"
    ),
    headless: bool = typer.Option(True, "--headless/--open", help="--open also opens a browser tab"),
) -> None:
    """Open the dashboard: latency by stage, KV memory, alerts, tuning proposals and scrape targets."""
    require_extras(ctx, "dashboard")
    try:
        check_bind(host)
    except ValueError as exc:  # pydantic's ValidationError (a bad setting) is one too
        typer.echo(f"kvpilot dashboard: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"kvpilot dashboard on {dashboard_url(host, port)} (Ctrl-C to stop)")
    proc = subprocess.Popen(dashboard_command(port=port, host=host, headless=headless), env=_env(db_url))
    # A service manager (or a test) stops us with SIGTERM: pass it on, so Streamlit is not left orphaned.
    signal.signal(signal.SIGTERM, lambda *_: proc.terminate())
    try:
        code = proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
    raise typer.Exit(code if code >= 0 else 0)
