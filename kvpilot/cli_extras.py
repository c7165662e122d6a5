"""Optional extras: which modules each extra of pyproject.toml brings, and the one CLI message when one is missing.

The base install (the collector, the alerts, `kvpilot status`, the CLI itself) imports no torch, Streamlit or
Optuna, so a collector host installs small. A command that needs more calls `require_extras(...)` first: it exits
with the install line instead of an ImportError traceback from deep inside the command.
"""

from __future__ import annotations

import importlib.util

import typer

# The top-level modules an extra installs (mirrors [project.optional-dependencies]); `tune` includes `engine`.
_ENGINE = ("torch", "numpy", "safetensors", "tokenizers")
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "engine": _ENGINE,
    "dashboard": ("streamlit", "altair"),
    "tune": ("optuna", *_ENGINE),
}


def missing_module(extra: str) -> str | None:
    """The first module of `extra` that cannot be found, or None when all are installed."""
    for module in EXTRA_MODULES[extra]:
        try:
            if importlib.util.find_spec(module) is None:
                return module
        except (ImportError, ValueError):  # a finder that refuses it; a module without a spec
            return module
    return None


def command_path(ctx: typer.Context) -> str:
    """`kvpilot engine serve`, however the CLI was started (the script, `python -m kvpilot.cli`, a test runner)."""
    return "kvpilot" + ctx.command_path.removeprefix(ctx.find_root().command_path)


def require_extras(ctx: typer.Context, *extras: str) -> None:
    """Exit 1 with "`kvpilot X` needs the E extra: pip install 'kvpilot[E]'" when a module of `extras` is missing."""
    missing = {extra: module for extra in extras if (module := missing_module(extra)) is not None}
    if not missing:
        return
    noun = "extra" if len(missing) == 1 else "extras"
    typer.echo(
        f"`{command_path(ctx)}` needs the {', '.join(missing)} {noun}: pip install 'kvpilot[{','.join(missing)}]' "
        f"(not installed: {', '.join(sorted(set(missing.values())))})",
        err=True,
    )
    raise typer.Exit(1)
