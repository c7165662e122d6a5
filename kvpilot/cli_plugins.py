"""Sub-commands other packages register with `kvpilot`: the benchmarks' `kvpilot bench` is one.

The runtime packages never import `benchmarks` (docs/architecture.md): `benchmarks` declares its typer app
in the `kvpilot.bench` entry-point group (pyproject.toml), the packaging's plugin mechanism, and the CLI
mounts what the installed metadata lists. An install without it (or a checkout whose editable install
predates the entry point) gets a `kvpilot bench` that says so and exits 2.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from importlib.metadata import EntryPoint, entry_points

import typer

BENCH_GROUP = "kvpilot.bench"
HELP = "Benchmarks with JSON output."
NOT_INSTALLED = (
    "kvpilot bench: the benchmarks are not installed (no `kvpilot.bench` entry point); "
    "install kvpilot from its source tree: `make venv` or `pip install -e .`"
)


def installed() -> Iterable[EntryPoint]:
    return entry_points(group=BENCH_GROUP)


def mount_bench(app: typer.Typer, found: Callable[[], Iterable[EntryPoint]] = installed) -> None:
    """Mount the typer app the `kvpilot.bench` entry point names as `bench`, else a `bench` that explains."""
    for point in sorted(found(), key=lambda p: p.name):
        try:
            bench = point.load()
        except ImportError as exc:
            _unavailable(app, f"kvpilot bench: the benchmarks ({point.value}) do not load: {exc}")
            return
        if not isinstance(bench, typer.Typer):
            _unavailable(app, f"kvpilot bench: the `{BENCH_GROUP}` entry point {point.value} is not a typer app")
            return
        app.add_typer(bench, name="bench", help=HELP)
        return
    _unavailable(app, NOT_INSTALLED)


def _unavailable(app: typer.Typer, message: str) -> None:
    """A `bench` command that takes any arguments and only says why there are no benchmarks."""

    @app.command("bench", help=HELP, context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def unavailable() -> None:
        typer.echo(message, err=True)
        raise typer.Exit(2)
