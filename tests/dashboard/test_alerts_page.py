"""The alerts page follows the present: a notification sent after the page was opened (after the data's last
event, as when an engine went quiet and then down) is listed on refresh; and "run the evaluator" is said only
when no evaluator holds the lease."""

from __future__ import annotations

import json
import time

from sqlalchemy import delete

from collector.db import make_engine, session_factory, session_scope
from collector.schema import AlertEvaluatorLease, AlertNotification, AlertState
from tests.dashboard.conftest import no_exception, table_with, texts
from tests.dashboard.seed import Seed

HINT = "run `kvpilot alerts run --webhook URL`"


def _write(url: str, *rows: object, clear_states: bool = False) -> None:
    engine = make_engine(url)
    with session_scope(session_factory(engine)) as session:
        if clear_states:
            session.execute(delete(AlertState))
        session.execute(delete(AlertEvaluatorLease))
        session.add_all(rows)
    engine.dispose()


def _lease(holder: str, expires_at: float) -> AlertEvaluatorLease:
    return AlertEvaluatorLease(
        id=1, holder=holder, token=3, expires_at=expires_at, acquired_at=expires_at - 60, renewed_at=expires_at - 15
    )


def test_a_notification_sent_after_the_page_opened_is_listed_on_refresh(seeded: Seed, open_page) -> None:
    at = open_page(seeded.url, "alerts")
    no_exception(at)
    assert set(table_with(at, "notified_at", "receiver")["receiver"]) == {"team", "pager"}
    now = time.time()
    body = {
        "receiver": "oncall",
        "status": "firing",
        "version": "4",
        "alerts": [
            {
                "status": "firing",
                "labels": {"alertname": "ScrapeTargetDown", "instance": "vllm-a", "severity": "page"},
                "annotations": {"summary": "vllm-a's /metrics is down"},
                "startsAt": "2026-12-04T10:00:00Z",
                "endsAt": "0001-01-01T00:00:00Z",
            }
        ],
    }
    sent = AlertNotification(
        id=3,
        idempotency_key="n3",
        receiver="oncall",
        status="delivered",
        attempts=1,
        created_at=now,
        delivered_at=now,
        kind="webhook",
        url="http://127.0.0.1:9/hook",
        group_key="{}:{}",
        body=json.dumps(body),
        next_attempt_at=now,
        fencing_token=1,
        due_at=now,
    )
    _write(seeded.url, sent, _lease("evaluator-1", now + 60))
    at.button(key="f_refresh_now").click().run()
    no_exception(at)
    history = table_with(at, "notified_at", "receiver")
    assert "oncall" in set(history["receiver"]) and "ScrapeTargetDown" in set(history["alertname"])


def test_the_run_the_evaluator_hint_only_without_a_lease_holder(seeded: Seed, open_page) -> None:
    now = time.time()
    # Nothing pending or firing, and an evaluator holds the lease: all is well, no hint.
    _write(seeded.url, _lease("evaluator-1", now + 60), clear_states=True)
    at = open_page(seeded.url, "alerts")
    no_exception(at)
    said = texts(at)
    assert HINT not in said and "No alerts are pending or firing (evaluator `evaluator-1` holds the lease)" in said
    # Alerts firing, but the evaluator died a minute ago: its state is stale, and the page says who should run.
    _write(seeded.url, _lease("evaluator-1", now - 60))
    at.button(key="f_refresh_now").click().run()
    no_exception(at)
    said = texts(at)
    assert HINT in said and "No evaluator holds the lease** (last held by `evaluator-1`, expired" in said
