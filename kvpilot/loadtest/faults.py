"""Fault injection: each fault starts its own engine (and collector, alert evaluator, webhook receiver
where it needs them), breaks one thing during the load, and checks that nothing was lost.

- collector-restart: the collector is SIGKILLed at 30% of the run and restarted on the same port and
  database at 60%. The engine's HTTP sink spools and resends; the load tester's own result batches are
  retried under their idempotency keys. Checked: every request answered or 429'd; every load-test result
  and every engine event the sink counts as acknowledged is stored exactly once; each request the load
  tester sent has its engine request event stored once.
- webhook-down: an alert (`utilization > 0`) fires during the load while the webhook receiver is down; the
  receiver comes back once a delivery attempt has failed (from 30% of the run on). Checked: each
  notification delivered and received exactly once (firing and resolved, per alert episode), with
  failed attempts recorded while it was down.
- kv-exhaustion: a small KV pool and queue take a burst. Checked: the pool really ran out (OOM or
  preemptions), every request answered in full or refused with 429, the engine idle and healthy after.
- slow-client: a share of streaming clients read one chunk per `SLOW_READ_DELAY_S`. Checked: all answered
  in full, and the other clients' P99 time per output token stays below the slow readers' pace (the engine
  did not wait on them).
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import httpx

from kvpilot.loadtest import verify
from kvpilot.loadtest.analysis import analyze
from kvpilot.loadtest.local import LocalEngine, load_engine_config, merge, start_engine
from kvpilot.loadtest.plan import PlanOptions, plan_burst, plan_mixed
from kvpilot.loadtest.runner import RunOptions, RunResult, TimedAction, run_load
from kvpilot.loadtest.scrape import parse_metrics
from kvpilot.loadtest.session import LoadTestSpec, _client_opts
from plumbing.percentile import nearest_rank
from plumbing.process import free_port

FAULTS = ("collector-restart", "webhook-down", "kv-exhaustion", "slow-client")
SLOW_SHARE = 0.25
SLOW_READ_DELAY_S = 0.1
ALERT_RULE = """groups:
  - name: kvpilot-loadtest-fault
    interval: 1s
    rules:
      - alert: LoadtestEngineBusy
        expr: utilization > 0
        for: 0s
        labels: {severity: info}
        annotations: {summary: "{{ $labels.instance }} is busy {{ $value }} of the time"}
"""


def _metrics(url: str) -> dict[str, float]:
    try:
        return parse_metrics(httpx.get(url + "/metrics", timeout=5.0).text)
    except (httpx.HTTPError, ValueError):
        return {}


def _wait(predicate: Callable[[], bool], timeout_s: float, pause_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(pause_s)
    return predicate()


def _sink_drained(engine: LocalEngine) -> bool:
    m = _metrics(engine.url)
    return m.get("telemetry_queued", 1) == 0 and m.get("telemetry_spool_bytes", 1) == 0


def _plan(spec: LoadTestSpec, *, burst: bool = False) -> list:
    opts = PlanOptions(
        duration_s=spec.duration_s,
        rate=spec.rate,
        seed=spec.seed,
        length_scale=spec.length_scale,
        output_scale=spec.output_scale,
        max_total_tokens=spec.max_total_tokens,
    )
    return plan_burst(opts) if burst else plan_mixed(opts)


def _collector(workdir: Path, port: int | None = None):
    from collector.db import upgrade
    from collector.server import start_subprocess
    from collector.settings import CollectorSettings

    db_url = f"sqlite:///{workdir / 'kvpilot.db'}"
    if port is None:
        upgrade(db_url)
    settings = CollectorSettings(
        db_url=db_url, port=port or free_port(), scrape_enabled=False, log_level="warning", ingest_token=None
    )
    return db_url, settings, start_subprocess(settings, log_path=workdir / "collector.log")


def _telemetry(url: str, run_id: str, workdir: Path) -> dict:
    return {
        "telemetry": {
            "sink": "http",
            "collector_url": url,
            "run_id": run_id,
            "instance": "loadtest-engine",
            "spool_dir": str(workdir / "spool"),
            "http_flush_interval_s": 0.1,
            "sample_interval_s": 1.0,
        }
    }


def _finish(fault: str, spec: LoadTestSpec, run: RunResult, checks: dict, figures: dict) -> dict:
    report = analyze(run, span_s=spec.duration_s, windows=spec.windows, metric=spec.p99_metric)
    passed = all(c["passed"] for c in checks.values())
    report["criteria_passed"] = report["passed"]
    report["passed"] = passed
    report["fault"] = {
        "name": fault,
        "passed": passed,
        "checks": checks,
        **figures,
        "note": "exit code follows the fault checks; the seed criteria are reported alongside",
    }
    report.update(
        {
            "scenario": f"fault:{fault}",
            "duration_s": spec.duration_s,
            "rate_per_s": spec.rate,
            "run_id": run.results[0].request_id.rsplit("-", 1)[0] if run.results else None,
        }
    )
    return report


def collector_restart(spec: LoadTestSpec, engine_cfg: dict, workdir: Path, run_id: str) -> dict:
    from collector.db import make_engine

    db_url, settings, first = _collector(workdir)
    current = {"proc": first}
    engine_run = f"{run_id}-engine"
    cfg = merge(engine_cfg, _telemetry(first.url, engine_run, workdir))

    async def kill() -> None:
        await asyncio.to_thread(current["proc"].kill)

    async def restart() -> None:
        from collector.server import start_subprocess

        current["proc"] = await asyncio.to_thread(start_subprocess, settings, log_path=workdir / "collector.log")

    try:
        with start_engine(cfg, workdir=workdir / "engine") as engine:
            actions = [
                TimedAction(0.3 * spec.duration_s, "collector SIGKILL", kill),
                TimedAction(0.6 * spec.duration_s, "collector restarted", restart),
            ]
            opts = RunOptions(client=_client_opts(spec, run_id), collector_url=first.url, progress=spec.progress)
            run = asyncio.run(run_load(engine.url, _plan(spec), opts, actions=actions))
            drained = _wait(lambda: _sink_drained(engine), 60.0)
            db = make_engine(db_url)
            try:
                published = run.published or {}
                checks = {
                    "answered_or_refused": verify.answered_or_refused(run.results),
                    "loadtest_results_stored_once": verify.stored_once(
                        db, run_id, [r.request_id for r in run.results], int(published.get("acknowledged", -1))
                    ),
                    "engine_events_stored_once": verify.engine_events_stored_once(
                        db, engine_run, lambda: _metrics(engine.url).get("telemetry_sent")
                    ),
                    "engine_request_events_once": verify.stored_once(
                        db, engine_run, [r.request_id for r in run.results], len(verify.request_rows(db, engine_run))
                    ),
                }
                checks["engine_sink_drained"] = verify.check(drained, "engine queue and spool empty after the run")
                m = _metrics(engine.url)
                dropped = m.get("telemetry_dropped", 0)
                checks["engine_sink_dropped_nothing"] = verify.check(dropped == 0, f"{int(dropped)} events dropped")
                engine_retries = int(m.get("telemetry_retries", 0))
                publisher_retries = int(published.get("retries", 0))
                checks["collector_was_down"] = verify.check(
                    engine_retries > 0 and publisher_retries > 0,
                    f"engine sink resent {engine_retries} batches, the load tester retried {publisher_retries} times",
                )
            finally:
                db.dispose()
    finally:
        current["proc"].stop()
    figures = {
        "collector_down_s": round(0.3 * spec.duration_s, 3),
        "engine_run_id": engine_run,
        "loadtest_run_id": run_id,
        "publisher": run.published,
    }
    return _finish("collector-restart", spec, run, checks, figures)


def webhook_down(spec: LoadTestSpec, engine_cfg: dict, workdir: Path, run_id: str) -> dict:
    from alerts.runner import start_evaluator
    from alerts.sink import run_webhook_sink
    from collector.db import make_engine

    db_url, _settings, coll = _collector(workdir)
    rule = workdir / "fault-rule.yml"
    rule.write_text(ALERT_RULE)
    first_sink = run_webhook_sink(port=0, log_payloads=False)
    port = first_sink.server.server_address[1]
    first_sink.stop()  # down from the start: the alert fires while nobody listens
    sinks: list = []
    evaluator = None
    try:
        evaluator = start_evaluator(
            db_url,
            rule_files=[rule],
            webhook_urls=[f"http://127.0.0.1:{port}/"],
            group_wait_s=0.0,
            group_interval_s=1.0,
            repeat_interval_s=3600.0,
            poll_s=0.25,
        )

        watch = make_engine(db_url)

        def failed_while_down() -> bool:
            outbox = verify.notifications(watch)
            return bool(outbox) and outbox[0]["failed_attempts_total"] > 0

        async def back_up() -> None:
            # up again once a delivery has failed (bounded), so the outage always meets a notification
            await asyncio.to_thread(_wait, failed_while_down, 30.0, 0.2)
            sinks.append(await asyncio.to_thread(run_webhook_sink, port=port, log_payloads=False))

        cfg = merge(engine_cfg, _telemetry(coll.url, f"{run_id}-engine", workdir))
        with start_engine(cfg, workdir=workdir / "engine") as engine:
            opts = RunOptions(client=_client_opts(spec, run_id), progress=spec.progress)
            try:
                run = asyncio.run(
                    run_load(
                        engine.url,
                        _plan(spec),
                        opts,
                        actions=[
                            TimedAction(0.3 * spec.duration_s, "webhook receiver up after a failed delivery", back_up)
                        ],
                    )
                )
            finally:
                watch.dispose()
            db = make_engine(db_url)
            try:

                def settled() -> bool:
                    outbox = verify.notifications(db)
                    return (
                        bool(sinks)
                        and len(outbox) >= 2
                        and all(n["status"] != "pending" for n in outbox)
                        and any(b.get("status") == "resolved" for b in _bodies(sinks))
                    )

                settled_ok = _wait(settled, 90.0, 0.5)
                receipts = [(r.idempotency_key, r.payload) for s in sinks for r in s.received]
                checks = {
                    "answered_or_refused": verify.answered_or_refused(run.results),
                    "alerts_delivered_once": verify.alerts_delivered_once(db, receipts),
                    "fired_and_resolved": verify.check(
                        settled_ok, "a firing and a resolved notification reached the receiver after it came back"
                    ),
                }
                sample_rows = verify.event_rows(db, f"{run_id}-engine")["sample"]
                failed = checks["alerts_delivered_once"].get("failed_attempts", 0)
                checks["receiver_was_down"] = verify.check(failed > 0, f"{failed} delivery attempts failed while down")
            finally:
                db.dispose()
    finally:
        if evaluator is not None:
            evaluator.stop()
        for s in sinks:
            s.stop()
        coll.stop()
    up_at = [a.get("at_s", 0.0) + a.get("took_s", 0.0) for a in run.actions if a["action"].startswith("webhook")]
    figures = {
        "receiver_down_until_s": round(up_at[0], 3) if up_at else None,
        "engine_sample_rows": sample_rows,
        "duplicate_posts_dropped_by_receiver": sum(s.duplicates for s in sinks),
    }
    return _finish("webhook-down", spec, run, checks, figures)


def _bodies(sinks: list) -> list[dict]:
    return [r.payload for s in sinks for r in s.received if isinstance(r.payload, dict)]


KV_EXHAUSTION_ENGINE = {
    "cache": {"hot_bytes": 512 * 1024, "cold_bytes": 256 * 1024},
    "scheduler": {"queue_limit": 8, "max_num_seqs": 32},
}


def kv_exhaustion(spec: LoadTestSpec, engine_cfg: dict, workdir: Path, run_id: str) -> dict:
    cfg = merge(engine_cfg, KV_EXHAUSTION_ENGINE)
    # Requests long enough (up to half the pool each) that a handful at once must exhaust it, however fast
    # the machine drains them: the outcome may not depend on timing.
    spec = replace(
        spec,
        max_total_tokens=min(spec.max_total_tokens or 512, 512),
        length_scale=min(spec.length_scale, 2.0),
        output_scale=min(spec.output_scale, 2.0),
    )
    with start_engine(cfg, workdir=workdir / "engine") as engine:
        opts = RunOptions(client=_client_opts(spec, run_id), progress=spec.progress)
        run = asyncio.run(run_load(engine.url, _plan(spec, burst=True), opts))
        idle = _wait(lambda: _idle(engine), 30.0)
        health = httpx.get(engine.url + "/health", timeout=5.0)
    report_probe = analyze(run, span_s=spec.duration_s, windows=spec.windows)
    oom, preempted = report_probe["oom_events"] or 0, report_probe["preemptions"] or 0
    checks = {
        "kv_pool_exhausted": verify.check(oom > 0 or preempted > 0, f"{oom} OOM events, {preempted} preemptions"),
        "answered_or_refused": verify.answered_or_refused(run.results),
        "full_answers": verify.full_answers(run.results),
        "engine_recovered": verify.check(
            idle and health.status_code == 200, f"/health {health.status_code}, idle after the burst: {idle}"
        ),
    }
    figures = {
        "hot_kv_bytes": KV_EXHAUSTION_ENGINE["cache"]["hot_bytes"],
        "oom_events": oom,
        "preemptions": preempted,
        "queue_limit": KV_EXHAUSTION_ENGINE["scheduler"]["queue_limit"],
    }
    return _finish("kv-exhaustion", spec, run, checks, figures)


def _idle(engine: LocalEngine) -> bool:
    try:
        body = httpx.get(engine.url + "/health", timeout=5.0).json()
    except (httpx.HTTPError, ValueError):
        return False
    return body.get("running") == 0 and body.get("waiting") == 0 and body.get("swapped") == 0


def slow_client(spec: LoadTestSpec, engine_cfg: dict, workdir: Path, run_id: str) -> dict:
    spec = replace(spec, stream=True)
    with start_engine(engine_cfg, workdir=workdir / "engine") as engine:
        opts = RunOptions(
            client=_client_opts(spec, run_id),
            progress=spec.progress,
            slow_share=SLOW_SHARE,
            slow_read_delay_s=SLOW_READ_DELAY_S,
        )
        run = asyncio.run(run_load(engine.url, _plan(spec), opts))
    slow = [r for r in run.results if r.slow]
    fast = [r for r in run.results if not r.slow and r.outcome == "ok"]
    fast_tpot = nearest_rank([t for r in fast if (t := r.tpot_s) is not None], 0.99)
    slow_e2e = nearest_rank([r.e2e_s for r in slow if r.outcome == "ok"], 0.5)
    checks = {
        "answered_or_refused": verify.answered_or_refused(run.results),
        "full_answers": verify.full_answers(run.results),
        "slow_clients_answered": verify.check(
            bool(slow) and all(r.outcome == "ok" for r in slow),
            f"{sum(r.outcome == 'ok' for r in slow)}/{len(slow)} slow readers got their whole answer",
        ),
        "others_not_held_up": verify.check(
            fast_tpot is not None and fast_tpot < SLOW_READ_DELAY_S,
            f"P99 time per output token of the other clients {fast_tpot} s "
            f"vs the slow readers' {SLOW_READ_DELAY_S} s per chunk",
        ),
    }
    figures = {
        "slow_clients": len(slow),
        "slow_read_delay_s": SLOW_READ_DELAY_S,
        "fast_tpot_p99_s": fast_tpot,
        "slow_e2e_p50_s": slow_e2e,
    }
    return _finish("slow-client", spec, run, checks, figures)


RUNNERS = {
    "collector-restart": collector_restart,
    "webhook-down": webhook_down,
    "kv-exhaustion": kv_exhaustion,
    "slow-client": slow_client,
}


def run_fault(fault: str, spec: LoadTestSpec) -> dict:
    if fault not in RUNNERS:
        raise ValueError(f"unknown fault {fault!r}; one of {', '.join(FAULTS)}")
    engine_cfg = load_engine_config(spec.engine_config)
    if spec.max_total_tokens is None:
        spec = replace(spec, max_total_tokens=int(engine_cfg["model"]["max_position"]) - 1)
    run_id = spec.run_id or f"lt-fault-{fault}-{int(time.time())}"
    with tempfile.TemporaryDirectory(prefix=f"kvpilot-fault-{fault}-") as tmp:
        return RUNNERS[fault](spec, engine_cfg, Path(tmp), run_id)
