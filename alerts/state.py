"""The alert state machine, exactly as Prometheus's rules/alerting.go computes it, with an injected clock.

inactive -> pending (condition true) -> firing (true for `for`) -> resolved (false, after `keep_firing_for`).
A resolved alert is kept for 15 minutes so it is reported as resolved, then forgotten; a pending alert
whose condition goes false is dropped without notification. State objects are plain data so the SQL
store can persist them and a restarted evaluator resumes mid-pending or mid-firing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from alerts.alertmanager import fingerprint
from alerts.expr_eval import NAME, Vector
from alerts.rules import AlertRule
from alerts.templates import TemplateError

log = logging.getLogger(__name__)
RESOLVED_RETENTION_S = 15 * 60.0
INACTIVE, PENDING, FIRING = "inactive", "pending", "firing"


@dataclass
class ActiveAlert:
    rule: str
    fingerprint: str
    labels: dict[str, str]
    annotations: dict[str, str]
    state: str
    active_at: float
    value: float
    fired_at: float | None = None
    resolved_at: float | None = None
    keep_firing_since: float | None = None
    last_eval_at: float = 0.0


@dataclass
class Transition:
    """What changed in one evaluation: the store persists these and the dispatcher notifies from them."""

    alert: ActiveAlert
    old_state: str
    new_state: str
    dropped: bool = False  # removed from the active set (pending gone, or resolved retention over)


@dataclass
class RuleState:
    rule: AlertRule
    active: dict[str, ActiveAlert] = field(default_factory=dict)

    def evaluate(
        self, ts: float, result: Vector, *, external_labels: dict[str, str] | None = None, external_url: str = ""
    ) -> list[Transition]:
        """Apply one evaluation result at `ts`; returns the transitions (state changes and drops)."""
        rule = self.rule
        seen: set[str] = set()
        transitions: list[Transition] = []
        for sample_labels, value in result.items():
            base = {k: v for k, v in sample_labels if k != NAME}
            labels = dict(base)
            for key, template in rule.label_templates.items():
                labels[key] = _render(template, base, value, external_labels, external_url, rule.name, key)
            labels["alertname"] = rule.name
            annotations = {
                key: _render(t, base, value, external_labels, external_url, rule.name, key)
                for key, t in rule.annotation_templates.items()
            }
            fp = fingerprint(labels)
            if fp in seen:
                raise ValueError(
                    f"rule {rule.name!r}: vector contains metrics with the same labelset after applying alert labels"
                )
            seen.add(fp)
            alert = self.active.get(fp)
            if alert is not None and alert.state != INACTIVE:
                alert.value, alert.annotations, alert.labels, alert.last_eval_at = value, annotations, labels, ts
                continue
            old = alert.state if alert is not None else INACTIVE
            self.active[fp] = ActiveAlert(rule.name, fp, labels, annotations, PENDING, ts, value, last_eval_at=ts)
            transitions.append(Transition(self.active[fp], old, PENDING))

        for fp, alert in list(self.active.items()):
            if fp not in seen:
                keep_firing = False
                if alert.state == FIRING and rule.keep_firing_for_s > 0:
                    if alert.keep_firing_since is None:
                        alert.keep_firing_since = ts
                    keep_firing = ts - alert.keep_firing_since < rule.keep_firing_for_s
                if alert.state == PENDING or (
                    alert.resolved_at is not None and ts - alert.resolved_at > RESOLVED_RETENTION_S
                ):
                    del self.active[fp]
                    old = alert.state
                    if alert.state == PENDING:
                        alert.state = INACTIVE
                    transitions.append(Transition(alert, old, INACTIVE, dropped=True))
                    continue
                if alert.state != INACTIVE and not keep_firing:
                    old = alert.state
                    alert.state = INACTIVE
                    alert.resolved_at = ts
                    transitions.append(Transition(alert, old, INACTIVE))
                if not keep_firing:
                    continue
            else:
                alert.keep_firing_since = None
            if alert.state == PENDING and ts - alert.active_at >= rule.for_s:
                alert.state = FIRING
                alert.fired_at = ts
                transitions.append(Transition(alert, PENDING, FIRING))
        return transitions

    def firing(self) -> list[ActiveAlert]:
        return [a for a in self.active.values() if a.state == FIRING]


def _render(template, labels, value, external_labels, external_url, rule: str, key: str) -> str:
    try:
        return template.render(labels, value, external_labels, external_url)
    except TemplateError as exc:
        log.warning("alert %s: template %s failed: %s", rule, key, exc)
        return f"<error expanding template: {exc}>"
