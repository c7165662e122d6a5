"""Tuning proposals in the collector's `proposals` table: create, list, review, apply.

Status moves pending -> accepted | rejected, accepted -> applied | rejected, pending -> applied
(`tune apply` of a pending proposal accepts it implicitly); applied and rejected are final. Applying
PUTs the proposal's tunable sections to a running engine's /admin/config and records where, when and
the engine's previous tunables (for rollback) under `best_metrics.apply`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import httpx
import yaml
from sqlalchemy import Engine, select, update

from collector.db import session_factory, session_scope, translate_errors
from collector.schema import PROPOSAL_STATUSES, Proposal
from engine.config import TUNABLE_FIELDS, ConfigError, EngineConfig

log = logging.getLogger("kvpilot.tuner.proposals")

TRANSITIONS = {"pending": {"accepted", "rejected", "applied"}, "accepted": {"applied", "rejected"}}


class ProposalError(ValueError):
    """A proposal that does not exist or cannot make the asked transition."""


class ApplyError(RuntimeError):
    """The engine refused or could not be reached; nothing was marked applied."""


@dataclass(frozen=True)
class ProposalView:
    id: int
    created_at: float
    updated_at: float
    status: str
    study_name: str | None
    instance: str | None
    config_yaml: str
    report_md: str
    baseline_metrics: dict[str, Any] | None
    best_metrics: dict[str, Any] | None

    @property
    def gain(self) -> float | None:
        return (self.best_metrics or {}).get("confirmation", {}).get("gain")

    @property
    def engine(self) -> str:
        """Whose config `config_yaml` is: `kvpilot` (an EngineConfig) or `vllm` (vLLM's `--config` file)."""
        return (self.best_metrics or {}).get("engine", "kvpilot")

    def config(self) -> EngineConfig:
        if self.engine != "kvpilot":
            raise ProposalError(f"proposal {self.id} is a {self.engine} config, not a kvpilot EngineConfig")
        return EngineConfig.from_dict(yaml.safe_load(self.config_yaml) or {}, source=f"proposal {self.id}")


def _view(p: Proposal) -> ProposalView:
    return ProposalView(
        p.id,
        p.created_at,
        p.updated_at,
        p.status,
        p.study_name,
        p.instance,
        p.config_yaml,
        p.report_md,
        p.baseline_metrics,
        p.best_metrics,
    )


def create_proposal(
    db: Engine,
    *,
    config_yaml: str,
    report_md: str,
    study_name: str | None,
    instance: str | None,
    baseline_metrics: dict[str, Any],
    best_metrics: dict[str, Any],
    engine: str = "kvpilot",
) -> ProposalView:
    """A pending proposal; `config_yaml` must be a valid config of `engine` (kvpilot's EngineConfig, or vLLM's
    `--config` file, whose kind is kept in `best_metrics["engine"]`)."""
    if engine == "kvpilot":
        EngineConfig.from_dict(yaml.safe_load(config_yaml) or {}, source="proposal config")
    elif engine == "vllm":
        from integrations.vllm.config import VllmConfig

        VllmConfig.from_config_text(config_yaml, source="proposal config")
        best_metrics = {**best_metrics, "engine": "vllm"}
    else:
        raise ProposalError(f"engine must be kvpilot or vllm, got {engine!r}")
    now = time.time()
    with session_scope(session_factory(db)) as s:
        row = Proposal(
            created_at=now,
            updated_at=now,
            status="pending",
            study_name=study_name,
            instance=instance,
            config_yaml=config_yaml,
            report_md=report_md,
            baseline_metrics=baseline_metrics,
            best_metrics=best_metrics,
        )
        s.add(row)
        s.flush()
        view = _view(row)
    log.info("proposal %d created (study %s)", view.id, study_name)
    return view


def get_proposal(db: Engine, proposal_id: int) -> ProposalView:
    with session_scope(session_factory(db)) as s:
        row = s.get(Proposal, proposal_id)
        if row is None:
            raise ProposalError(f"proposal {proposal_id} does not exist")
        return _view(row)


def list_proposals(db: Engine, *, status: str | None = None, limit: int = 50) -> list[ProposalView]:
    if status is not None and status not in PROPOSAL_STATUSES:
        raise ProposalError(f"status must be one of {', '.join(PROPOSAL_STATUSES)}, got {status!r}")
    stmt = select(Proposal).order_by(Proposal.created_at.desc(), Proposal.id.desc()).limit(limit)
    if status is not None:
        stmt = stmt.where(Proposal.status == status)
    with session_scope(session_factory(db)) as s:
        return [_view(p) for p in s.scalars(stmt)]


def set_status(db: Engine, proposal_id: int, status: str, *, extra: dict[str, Any] | None = None) -> ProposalView:
    """Move a proposal to `status` if the transition is allowed (compare-and-set on the old status)."""
    if status not in PROPOSAL_STATUSES:
        raise ProposalError(f"status must be one of {', '.join(PROPOSAL_STATUSES)}, got {status!r}")
    current = get_proposal(db, proposal_id)
    if status not in TRANSITIONS.get(current.status, set()):
        raise ProposalError(f"proposal {proposal_id} is {current.status}; it cannot become {status}")
    best = dict(current.best_metrics or {})
    if extra:
        best.update(extra)
    t = Proposal.__table__
    with translate_errors(), db.begin() as conn:
        changed = conn.execute(
            update(t)
            .where(t.c.id == proposal_id, t.c.status == current.status)
            .values(status=status, updated_at=time.time(), best_metrics=best)
        ).rowcount
    if changed != 1:
        raise ProposalError(f"proposal {proposal_id} changed concurrently; retry")
    log.info("proposal %d: %s -> %s", proposal_id, current.status, status)
    return get_proposal(db, proposal_id)


def apply_proposal(
    db: Engine,
    proposal_id: int,
    *,
    engine_url: str,
    admin_token: str | None,
    timeout_s: float = 10.0,
    client: httpx.Client | None = None,
    force: bool = False,
) -> ProposalView:
    """PUT the proposal's tunables to the engine's /admin/config, then mark it applied.

    The engine must be the instance the proposal was made for (its `telemetry.instance`), unless `force`; what
    changes (tunable by tunable, the engine's value before and the proposal's) is kept under
    `best_metrics.apply.diff` and returned with the view."""
    proposal = get_proposal(db, proposal_id)
    if proposal.status not in ("pending", "accepted"):
        raise ProposalError(f"proposal {proposal_id} is {proposal.status}; only pending or accepted ones apply")
    if proposal.engine != "kvpilot":
        raise ProposalError(
            f"proposal {proposal_id} is a {proposal.engine} config: vLLM has no hot reload; restart it with "
            f"`--config proposal-{proposal_id}.yaml` (then mark it applied)"
        )
    try:
        patch = proposal.config().tunable()
    except ConfigError as exc:
        raise ProposalError(f"proposal {proposal_id} holds an invalid config: {exc}") from exc
    headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
    own = client is None
    http = client or httpx.Client(base_url=engine_url, timeout=timeout_s)
    try:
        before = _call(http, "GET", "/admin/config", headers)
        running = (before.get("config") or {}).get("telemetry", {}).get("instance")
        if proposal.instance and running and running != proposal.instance and not force:
            raise ProposalError(
                f"proposal {proposal_id} was made for instance {proposal.instance!r}, but the engine at {engine_url} "
                f"is {running!r}; nothing applied (force to apply anyway)"
            )
        diff = tunable_diff(before.get("tunable") or {}, patch)
        differs = _non_tunable_differences(before.get("config", {}), proposal.config())
        if differs:
            log.warning(
                "proposal %d: engine differs from the proposal in non-tunable sections %s; applying the tunables only",
                proposal_id,
                ", ".join(differs),
            )
        after = _call(http, "PUT", "/admin/config", headers, json=patch)
    finally:
        if own:
            http.close()
    if after.get("tunable") != patch:
        raise ApplyError(f"engine at {engine_url} answered with tunables that differ from the proposal: {after}")
    info = {
        "apply": {
            "engine_url": engine_url,
            "instance": running,
            "at": time.time(),
            "previous_tunable": before.get("tunable"),
            "diff": [list(d) for d in diff],
        }
    }
    return set_status(db, proposal_id, "applied", extra=info)


def running_tunables(engine_url: str, admin_token: str | None, *, timeout_s: float = 10.0) -> tuple[dict, str | None]:
    """(tunables, instance) of the config a running engine actually runs (GET /admin/config)."""
    headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
    with httpx.Client(base_url=engine_url, timeout=timeout_s) as http:
        body = _call(http, "GET", "/admin/config", headers)
    return body.get("tunable") or {}, (body.get("config") or {}).get("telemetry", {}).get("instance")


def tunable_diff(before: dict[str, Any], after: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(section.field, engine's value, proposal's value) for every tunable the proposal changes."""
    return [
        (f"{section}.{name}", (before.get(section) or {}).get(name), value)
        for section, fields in after.items()
        for name, value in fields.items()
        if (before.get(section) or {}).get(name) != value
    ]


def _call(http: httpx.Client, method: str, path: str, headers: dict, json: Any = None) -> dict:
    try:
        resp = http.request(method, path, headers=headers, json=json)
    except httpx.HTTPError as exc:
        raise ApplyError(f"{method} {path} failed: {exc}") from exc
    if resp.status_code >= 400:
        raise ApplyError(f"{method} {path}: HTTP {resp.status_code}: {resp.text[:500]}")
    return resp.json()


def _non_tunable_differences(engine_config: dict, proposal: EngineConfig) -> list[str]:
    mine = proposal.model_dump(mode="json")
    return [s for s in ("model", "cache") if s in engine_config and _strip(engine_config[s], s) != _strip(mine[s], s)]


def _strip(section: dict, name: str) -> dict:
    return {k: v for k, v in section.items() if k not in TUNABLE_FIELDS.get(name, ())}
