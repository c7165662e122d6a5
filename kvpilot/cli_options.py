"""The options the `tune` and `sim` commands share, each declared once, and the groups they come in.

Typer reads a command's options from its signature. A parameter whose default is an option group (`WORKLOAD`,
`SLO_OPTIONS`, `LIVE`) stands for the group's options: `with_groups` puts them in its place (the help lists
them there) and calls the command with one value built from them (`WorkloadArgs`, `SloArgs`, `LiveArgs`). The
values are as given; the command checks them by turning them into the tuner's objects inside its own error
handling. A command that words an option its own way declares it with `but`; one that takes fewer of a group's
options fixes the others with `without`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import typer
from typer.models import OptionInfo

if TYPE_CHECKING:
    from tuner.metrics import SLO
    from tuner.workloads import WorkloadOptions

DbOpt = typer.Option(None, "--db-url", envvar="KVPILOT_DB_URL", help="kvpilot database (default: collector settings)")
ProfileOpt = typer.Option("cpu-2core", "--profile", help="cost profile: a shipped name or a JSON file")
ConfigOpt = typer.Option(None, "--config", help="current EngineConfig YAML (default: the profile's defaults)")
WORKLOAD_HELP = (
    "mixed | burst | sustained | trace:FILE | stored (the stored requests at their recorded arrivals, bursts "
    "kept; of --instance, else of every serving instance) | stored:INSTANCE | fitted (the stored requests' "
    "average rates per minute)"
)
WorkloadOpt = typer.Option("mixed", "--workload", help=WORKLOAD_HELP)
VerboseOpt = typer.Option(False, "--verbose", "-v", help="log progress details")
SeedsPerTrialOpt = typer.Option(1, "--seeds-per-trial", help="workload seeds per trial, scored together")
EngineAdminTokenOpt = typer.Option(None, "--admin-token", envvar="KVPILOT_ADMIN_TOKEN")


@dataclass(frozen=True)
class WorkloadArgs:
    """How the workload is sized and read, as given."""

    requests: int
    scale: float
    output_range: str
    load: float | None
    duration: float | None
    time_scale: float
    length_scale: float
    hours: float

    def options(self, *, max_total_tokens: int | None = None) -> WorkloadOptions:
        from tuner.workloads import WorkloadOptions

        try:
            lo, hi = (int(v) for v in self.output_range.split(","))
        except ValueError:
            raise ValueError(f"output_range: expected LOW,HIGH, got {self.output_range!r}") from None
        return WorkloadOptions(
            requests=self.requests,
            scale=self.scale,
            output_range=(lo, hi),
            load=self.load,
            duration_s=self.duration,
            time_scale=self.time_scale,
            length_scale=self.length_scale,
            hours=self.hours,
            max_total_tokens=max_total_tokens,
        ).validate()


@dataclass(frozen=True)
class SloArgs:
    """The SLOs and constraints, as given."""

    ttft_slo: float
    tpot_slo: float
    p99_e2e_slo: float | None
    p99_ttft_slo: float | None
    max_rejection_rate: float
    max_oom: int

    def slo(self) -> SLO:
        from tuner.metrics import SLO

        try:
            slo = SLO(
                ttft_s=self.ttft_slo,
                tpot_s=self.tpot_slo,
                p99_e2e_s=self.p99_e2e_slo,
                max_rejection_rate=self.max_rejection_rate,
                max_oom=self.max_oom,
                p99_ttft_s=self.p99_ttft_slo,
            ).validate()
        except ValueError as exc:
            raise ValueError(f"slo: {exc}") from None
        return slo


@dataclass(frozen=True)
class LiveArgs:
    """A running kvpilot engine: its baseline, and the live backend's trials on it."""

    engine_url: str | None
    admin_token: str | None
    window: float
    settle: float

    def backend(self, backend: str, instance: str | None) -> dict | None:
        """The live backend's settings (None for the other backends)."""
        if backend != "live":
            return None
        if not self.engine_url or not instance:
            raise ValueError("engine_url: the live backend needs --engine-url and --instance")
        return {
            "engine_url": self.engine_url,
            "admin_token": self.admin_token,
            "instance": instance,
            "window_s": self.window,
            "settle_s": self.settle,
        }


@dataclass(frozen=True)
class OptionGroup:
    """Options that come together: `(parameter, type, option)` in help order, built into `make`."""

    make: Callable[..., Any]
    options: tuple[tuple[str, Any, OptionInfo], ...]
    fixed: Mapping[str, Any] = field(default_factory=dict)  # the values of options a command does not take

    def but(self, **options: OptionInfo) -> Any:
        """These options declared otherwise (another default or help). Any, as `typer.Option`: a default."""
        unknown = set(options) - {name for name, _, _ in self.options}
        if unknown:
            raise TypeError(f"not options of this group: {', '.join(sorted(unknown))}")
        return dataclasses.replace(self, options=tuple((n, t, options.get(n, o)) for n, t, o in self.options))

    def without(self, **fixed: Any) -> Any:
        """These options not taken, their values fixed."""
        return dataclasses.replace(
            self, options=tuple(x for x in self.options if x[0] not in fixed), fixed={**self.fixed, **fixed}
        )


def with_groups(command: Callable[..., None]) -> Callable[..., None]:
    """`command` with each option-group parameter spelled out as the group's options (for typer), called with
    the group's value."""
    signature = inspect.signature(command)
    hints = typing.get_type_hints(command)
    groups = {n: p.default for n, p in signature.parameters.items() if isinstance(p.default, OptionGroup)}
    params: list[inspect.Parameter] = []
    for name, param in signature.parameters.items():
        if name in groups:
            kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
            params += [inspect.Parameter(n, kind, default=o, annotation=t) for n, t, o in groups[name].options]
        else:
            params.append(param.replace(annotation=hints.get(name, param.annotation)))

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> None:
        for name, group in groups.items():
            kwargs[name] = group.make(**{n: kwargs.pop(n) for n, _, _ in group.options}, **group.fixed)
        command(**kwargs)

    wrapper.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]  # what typer reads
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    return wrapper


WORKLOAD: Any = OptionGroup(
    WorkloadArgs,
    (
        ("requests", int, typer.Option(200, "--requests", help="requests per workload (at most)")),
        (
            "scale",
            float,
            typer.Option(4.0, "--scale", help="divide the mix's prompt lengths (4: CPU size, 1: seed size)"),
        ),
        (
            "output_range",
            str,
            typer.Option("16,256", "--output-range", help="output tokens LOW,HIGH of scenario requests"),
        ),
        (
            "load",
            float | None,
            typer.Option(None, "--load", help="arrival rate as a multiple of the default config's capacity"),
        ),
        ("duration", float | None, typer.Option(None, "--duration", help="burst/sustained/trace length in seconds")),
        ("time_scale", float, typer.Option(1.0, "--time-scale", help="trace/stored/fitted: 2.0 replays twice as fast")),
        ("length_scale", float, typer.Option(1.0, "--length-scale", help="trace/stored/fitted: divide token counts")),
        (
            "hours",
            float,
            typer.Option(24.0, "--hours", help="stored/fitted workloads: the last N hours of stored requests"),
        ),
    ),
)
SLO_OPTIONS: Any = OptionGroup(
    SloArgs,
    (
        ("ttft_slo", float, typer.Option(1.0, "--ttft-slo", help="TTFT SLO, seconds (goodput and p99 constraint)")),
        ("tpot_slo", float, typer.Option(0.1, "--tpot-slo", help="time per output token SLO, seconds")),
        (
            "p99_e2e_slo",
            float | None,
            typer.Option(None, "--p99-e2e-slo", help="optional constraint on p99 end-to-end latency, seconds"),
        ),
        (
            "p99_ttft_slo",
            float | None,
            typer.Option(None, "--p99-ttft-slo", help="constraint on p99 TTFT, seconds (default: the TTFT SLO)"),
        ),
        (
            "max_rejection_rate",
            float,
            typer.Option(0.01, "--max-rejection-rate", help="constraint: share of requests refused at admission"),
        ),
        ("max_oom", int, typer.Option(0, "--max-oom", help="constraint: failed KV allocations per trial")),
    ),
)
LIVE: Any = OptionGroup(
    LiveArgs,
    (
        ("engine_url", str | None, typer.Option(None, "--engine-url", help="live: the engine's base URL")),
        ("admin_token", str | None, EngineAdminTokenOpt),
        ("window", float, typer.Option(30.0, "--window", help="live: seconds observed per trial")),
        ("settle", float, typer.Option(5.0, "--settle", help="live: seconds after a change before observing")),
    ),
)
