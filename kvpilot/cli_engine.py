"""`kvpilot engine serve`: the HTTP engine on a config file (a tuning proposal is one)."""

from __future__ import annotations

import logging
from pathlib import Path

import typer

from engine.config import ConfigError, EngineConfig
from engine.preflight import check_engine_config
from kvpilot.cli_extras import require_extras

engine_app = typer.Typer(no_args_is_help=True)


def load_config(path: Path | None, overrides: dict | None = None) -> EngineConfig:
    """The config from `path` (or defaults) with CLI overrides, through the same checks for `engine config`
    and `engine serve` (pool sizes against the model's shape); a ConfigError becomes one line and exit 2."""
    try:
        cfg = EngineConfig.from_yaml(path) if path is not None else EngineConfig()
        if overrides:
            merged = cfg.model_dump(mode="json")
            for section, values in overrides.items():
                merged[section].update({k: v for k, v in values.items() if v is not None})
            cfg = EngineConfig.from_dict(merged, source="command line")
        check_engine_config(cfg)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    return cfg


@engine_app.command("serve")
def serve(
    ctx: typer.Context,
    config: Path | None = typer.Option(None, "--config", help="EngineConfig YAML (e.g. a tuning proposal)"),
    host: str | None = typer.Option(None, help="bind address (default from config: 127.0.0.1)"),
    port: int | None = typer.Option(None, help="port (default from config: 8000)"),
    admin_token: str | None = typer.Option(None, envvar="KVPILOT_ADMIN_TOKEN", help="bearer token for /admin"),
    warmup: int | None = typer.Option(None, help="warm-up requests before serving (default: config)"),
    log_level: str = typer.Option("info", help="uvicorn and kvpilot log level"),
) -> None:
    """Serve /generate, /v1/completions, /metrics, /health and /admin/config."""
    require_extras(ctx, "engine")
    import uvicorn

    from engine.factory import build_app

    cfg = load_config(
        config,
        {"server": {"host": host, "port": port, "admin_token": admin_token}, "warmup": {"requests": warmup}},
    )
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        app = build_app(cfg)
    except Exception as exc:  # whatever stops the start (no CUDA, bad tensors): one line, no traceback
        typer.echo(f"error: the engine did not start: {exc}", err=True)
        raise typer.Exit(1) from None
    uvicorn.run(app, host=cfg.server.host, port=cfg.server.port, log_level=log_level)


@engine_app.command("config")
def show_config(config: Path | None = typer.Option(None, "--config", help="EngineConfig YAML to validate")) -> None:
    """Validate a config file and print it in full (defaults filled in)."""
    typer.echo(load_config(config).to_yaml())
