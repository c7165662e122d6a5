"""A local bench for runs against a real vLLM: the random-weight checkpoint, a SQLite database at the schema's
head and a collector on it, all under one work folder.

`kvpilot vllm calibrate`, `kvpilot bench tune-vllm` and the fidelity diagnostic each start vLLMs whose iteration
lines, spans and /metrics go to this collector. The collector has its own admin token and allows loopback scrape
targets, so each vLLM's /metrics is scraped while it runs (target writes are administration).
"""

from __future__ import annotations

import secrets
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import Engine

from collector.db import make_engine, upgrade
from collector.server import start_subprocess
from collector.settings import CollectorSettings


@dataclass(frozen=True)
class Workbench:
    work: Path
    checkpoint: Path  # `kvpilot model init --seed 0`
    db_url: str
    db: Engine
    collector_url: str
    admin_token: str


def make_checkpoint(checkpoint: Path) -> Path:
    """The `kvpilot model init --seed 0` checkpoint at `checkpoint` (kept if it is there already)."""
    if not (checkpoint / "config.json").exists():
        subprocess.run(
            [sys.executable, "-m", "kvpilot.cli", "model", "init", str(checkpoint), "--seed", "0"],
            check=True,
            capture_output=True,
        )
    return checkpoint


def local_collector_settings(db_url: str, **extra: object) -> CollectorSettings:
    """A loopback collector for vLLMs launched next to it: an admin token of its own (registering a vLLM's
    /metrics is administration) and loopback scrape targets allowed. Both are set here, not left to the
    caller's environment, where a newcomer's shell has neither."""
    fields: dict = {
        "db_url": db_url,
        "port": 0,
        "log_level": "warning",
        "sqlite_synchronous": "NORMAL",
        "admin_token": secrets.token_urlsafe(24),
        "scrape_allow_nets": "127.0.0.0/8",
        **extra,
    }
    return CollectorSettings(**fields)


@contextmanager
def workbench(work: Path) -> Iterator[Workbench]:
    """Checkpoint, database and collector under `work`; the collector is stopped on the way out."""
    work.mkdir(parents=True, exist_ok=True)
    checkpoint = make_checkpoint(work / "checkpoint")
    db_url = f"sqlite:///{work / 'kvpilot.db'}"
    upgrade(db_url)
    settings = local_collector_settings(db_url)
    collector = start_subprocess(settings, log_path=work / "collector.log")
    db = make_engine(db_url)
    try:
        yield Workbench(work, checkpoint, db_url, db, collector.url, settings.admin_token or "")
    finally:
        db.dispose()
        collector.stop()
