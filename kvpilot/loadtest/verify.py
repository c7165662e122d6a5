"""Nothing-lost checks shared by the faults: answers, stored events, delivered alerts.

Each check returns `{"passed", "detail", ...figures}`; the figures go into the report as they are.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence

from sqlalchemy import Engine, func, select

from alerts.outbox import SUPERSEDED
from collector import queries
from collector.schema import AlertNotification, AlertNotificationAttempt
from kvpilot.loadtest.client import RequestResult


def check(passed: bool, detail: str, **figures: object) -> dict:
    return {"passed": bool(passed), "detail": detail, **figures}


def answered_or_refused(results: Sequence[RequestResult]) -> dict:
    """Every request got a complete answer or a clean 429: no other status, broken stream or hang."""
    by = Counter(r.outcome for r in results)
    bad = [r for r in results if r.outcome not in ("ok", "refused")]
    detail = f"{by['ok']} answered, {by['refused']} refused with 429, {len(bad)} neither"
    if bad:
        detail += f" (first: {bad[0].request_id}: {bad[0].outcome} {bad[0].error})"
    return check(not bad and bool(results), detail, answered=by["ok"], refused=by["refused"], lost=len(bad))


def full_answers(results: Sequence[RequestResult]) -> dict:
    """Answered requests carry every token asked for (ignore_eos): a preempted one was resumed, not cut."""
    short = [r for r in results if r.outcome == "ok" and r.output_tokens != r.max_tokens]
    return check(not short, f"{len(short)} answered requests with fewer tokens than max_tokens", short=len(short))


def request_rows(db: Engine, run_id: str) -> list[tuple[str, str]]:
    return queries.stored_requests(db, run_id=run_id)


def stored_once(db: Engine, run_id: str, expected_ids: Sequence[str], acknowledged: int) -> dict:
    """Each expected request event is in the database exactly once, and so is every acknowledged one."""
    rows = request_rows(db, run_id)
    counts = Counter(rid for rid, _ in rows)
    dupes = sum(1 for n in counts.values() if n > 1)
    missing = [rid for rid in expected_ids if rid not in counts]
    passed = not dupes and not missing and len(rows) == acknowledged
    return check(
        passed,
        f"{len(rows)} rows for run {run_id}, {acknowledged} acknowledged, {len(missing)} missing, {dupes} duplicated",
        stored=len(rows),
        acknowledged=acknowledged,
        missing=len(missing),
        duplicated=dupes,
    )


def event_rows(db: Engine, run_id: str) -> dict[str, int]:
    return queries.stored_event_counts(db, run_id=run_id)


def duplicate_steps(db: Engine, run_id: str) -> int:
    return queries.duplicate_steps(db, run_id=run_id)


def engine_events_stored_once(
    db: Engine, run_id: str, read_sent: Callable[[], float | None], *, attempts: int = 20, pause_s: float = 0.3
) -> dict:
    """Rows stored for the engine's run equal the events its sink counts as acknowledged.

    The engine keeps emitting samples while idle, so the two are compared when a read of the counter,
    a count of the rows and a second read of the counter agree (no batch in flight in between)."""
    last: tuple[float | None, int, float | None] = (None, 0, None)
    for _ in range(attempts):
        before = read_sent()
        stored = sum(event_rows(db, run_id).values())
        after = read_sent()
        last = (before, stored, after)
        if before is not None and before == after == stored:
            break
        time.sleep(pause_s)
    before, stored, after = last
    dup_steps = duplicate_steps(db, run_id)
    passed = before is not None and before == after == stored and dup_steps == 0
    return check(
        passed,
        f"{stored} rows stored for run {run_id}; the sink counts {after} acknowledged; "
        f"{dup_steps} duplicated step numbers",
        stored=stored,
        acknowledged=after,
        duplicated_steps=dup_steps,
        by_type=event_rows(db, run_id),
    )


def notifications(db: Engine) -> list[dict]:
    with db.connect() as conn:
        rows = conn.execute(
            select(
                AlertNotification.id,
                AlertNotification.idempotency_key,
                AlertNotification.status,
                AlertNotification.attempts,
                AlertNotification.last_error,
            )
        )
        out = [
            {
                "id": r[0],
                "key": r[1],
                "status": r[2],
                "attempts": r[3],
                "superseded": r[2] == "expired" and (r[4] or "").startswith(SUPERSEDED),
            }
            for r in rows
        ]
        failed_attempts = conn.execute(
            select(func.count())
            .select_from(AlertNotificationAttempt)
            .where(AlertNotificationAttempt.outcome != "delivered")
        ).scalar_one()
    for n in out:
        n["failed_attempts_total"] = int(failed_attempts)
    return out


def alerts_delivered_once(db: Engine, receipts: Sequence[tuple[str, dict]]) -> dict:
    """Every notification in the outbox was delivered, and the receiver holds each one (by key, and each
    alert fingerprint per status) exactly once. Notifications superseded by a newer one of their group
    (a backlog collapsed while the receiver was down) are counted apart and are not expected to arrive."""
    everything = notifications(db)
    outbox = [n for n in everything if not n["superseded"]]  # a stale backlog collapsed: never to be sent
    keys = Counter(key for key, _ in receipts)
    # one alert episode = fingerprint + startsAt; a flapping alert has several, each firing and resolved once
    per_alert = Counter(
        (a.get("fingerprint"), a.get("startsAt"), a.get("status"))
        for _, body in receipts
        for a in (body.get("alerts", []) if isinstance(body, dict) else [])
    )
    undelivered = [n for n in outbox if n["status"] != "delivered"]
    missing = [n for n in outbox if keys[n["key"]] != 1]
    repeated = {f"{fp}@{at}:{st}": c for (fp, at, st), c in per_alert.items() if c != 1}
    statuses = sorted({st for _, _, st in per_alert})
    failed_attempts = everything[0]["failed_attempts_total"] if everything else 0
    passed = bool(outbox) and not undelivered and not missing and not repeated and len(keys) == len(outbox)
    return check(
        passed,
        f"{len(outbox)} notifications, {len(undelivered)} undelivered, {len(missing)} not received "
        f"exactly once, alert statuses {statuses}, {failed_attempts} failed attempts while down",
        notifications=len(outbox),
        superseded=len(everything) - len(outbox),
        receipts=len(receipts),
        undelivered=len(undelivered),
        repeated=repeated,
        failed_attempts=failed_attempts,
        alerts=len({fp for fp, _, _ in per_alert}),
        episodes=len({(fp, at) for fp, at, _ in per_alert}),
    )
