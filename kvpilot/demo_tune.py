"""The demo's tuning step: a short nightly job on the simulator whose baseline is the config the demo's
engine really ran, replaying the requests this run stored at their recorded arrivals: the burst the demo
is about is in what the tuner measures (`tuning_workload`).

The simulator runs the cost profile's model, so the demo's engine runs that same model (`DEMO_PROFILE`):
then the study's current config is the demo engine's, KV sizes included, not a stand-in of another size.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
import yaml

from kvpilot.demo_alerts import INSTANCE

if TYPE_CHECKING:
    from tuner.workloads import WorkloadOptions

DEMO_PROFILE = "cpu-2core"
# A demo's load, 2 requests/s for 20 s and the burst at 12/s until the alert fires, is 60-200 requests on most
# machines: all of it (the latest 300 when a burst ran long).
TUNING_REQUESTS = 300
SECTIONS = ("device", "model", "cache", "scheduler", "recycler", "warmup")  # not ports, tokens, run ids


def profile_model() -> dict[str, Any]:
    """The model section of the profile the simulator costs steps with."""
    from tuner.profile import load_profile

    return load_profile(DEMO_PROFILE).model.config.model_dump(mode="json")


def tuning_config(engine_cfg: dict[str, Any]) -> dict[str, Any]:
    """The demo engine's config as the tuner's current config: what shapes serving, without the
    server and telemetry sections (ports, the admin token and the run id belong to this run only)."""
    return {k: v for k, v in engine_cfg.items() if k in SECTIONS}


def tuning_workload(since: float, now: float) -> tuple[str, WorkloadOptions]:
    """The workload spec and options the demo tunes on: this run's stored requests (not an earlier demo's) as
    they came, bursts kept."""
    from tuner.workloads import WorkloadOptions

    hours = (now - since + 60) / 3600
    return "stored", WorkloadOptions(hours=hours, requests=TUNING_REQUESTS, time_scale=1.0)


def run_demo_tuning(
    db_url: str, engine_cfg: dict[str, Any], *, data_dir: Path, since: float, say: Callable[[str], None]
) -> None:
    from tuner.nightly import run_nightly

    current = data_dir / "current-config.yaml"
    current.write_text(
        "# the config the demo engine ran (kvpilot demo): the tuning study's baseline\n"
        + yaml.safe_dump(tuning_config(engine_cfg), sort_keys=False)
    )
    workload, options = tuning_workload(since, time.time())
    say(
        f"tuning: 12 trials on the simulator from the demo engine's own config ({current}), replaying this run's "
        "requests at their recorded arrivals (the burst kept); each change of the best trial is then checked alone, "
        "then its SLO capacity compared with the current config's on 2 new seeds"
    )
    result = run_nightly(
        db_url=db_url,
        out_dir=data_dir / "proposals",
        trials=12,
        profile=DEMO_PROFILE,
        workload=workload,
        options=options,
        instance=INSTANCE,
        confirm_seeds=2,
        config_path=current,
        progress=False,
    )
    first, *rest = result.lines()
    for line in [f"  tuning: {first}", *(f"  {line}" for line in rest)]:
        typer.echo(line)
