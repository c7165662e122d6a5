"""The demo's pieces without running the whole demo: the burst that lasts until the alert fired, the
alert verdicts and their reasons, the summary's counts, the tuning baseline."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from alerts.rules import DEMO_RULES, load_rule_files
from collector.db import make_engine
from engine.config import EngineConfig
from engine.events import RequestEvent, SampleEvent
from engine.preflight import check_engine_config
from kvpilot import demo_alerts as DA
from kvpilot.demo import demo_engine_config
from kvpilot.demo_load import BurstGate, arrivals, drive_demo_load
from kvpilot.demo_report import dashboard_line, stored_counts, weights_line
from kvpilot.demo_tune import DEMO_PROFILE, tuning_config
from tuner.metrics import store_events
from tuner.nightly import NightlyResult
from tuner.profile import load_profile


def test_the_burst_lasts_until_the_alert_fired_and_at_least_its_minimum() -> None:
    fired = {"now": False}
    gate = BurstGate(start_s=5.0, min_s=2.0, max_s=30.0, done=lambda: fired["now"])
    assert not gate.active(4.9) and gate.active(5.0)
    fired["now"] = True
    assert gate.active(6.0)  # fired already, but the burst runs its minimum
    assert not gate.active(7.5) and gate.ended_s == 7.5 and gate.outcome == "the alert fired"
    assert not gate.active(8.0) and gate.length_s == 2.5  # over for good


def test_the_burst_stops_at_its_bound_and_says_so() -> None:
    gate = BurstGate(start_s=1.0, min_s=2.0, max_s=10.0, done=lambda: False)
    assert gate.active(10.9) and not gate.active(11.0)
    assert gate.length_s == 10.0 and "bound of 10 s" in gate.outcome


def test_arrivals_go_on_past_the_duration_while_the_burst_is_on() -> None:
    clock = {"t": 0.0}
    fire_at = 14.0
    gate = BurstGate(start_s=3.0, min_s=2.0, max_s=40.0, done=lambda: clock["t"] >= fire_at)

    def now() -> float:
        return clock["t"]

    times = []
    for t, _ in arrivals(gate, duration_s=10.0, base_rate=4.0, now=now):
        clock["t"] = t
        times.append(t)
    assert times[-1] > 10.0 and gate.outcome == "the alert fired"  # the load ran until the alert fired
    assert gate.ended_s is not None and fire_at <= gate.ended_s < fire_at + 1.0
    before = sum(1 for t in times if t < 3.0) / 3.0
    during = sum(1 for t in times if 3.0 <= t < gate.ended_s) / (gate.ended_s - 3.0)
    assert during > 3 * before  # +500%, give or take Poisson


def test_drive_demo_load_reports_the_burst_and_the_weights() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        body = {
            "output_tokens": 3,
            "weights": "random",
            "timings": {"e2e_s": 0.01, "ttft_s": 0.005},
        }
        return httpx.Response(200, json=body)

    said: list[str] = []
    start = time.monotonic()
    report = asyncio.run(
        drive_demo_load(
            "http://engine",
            duration_s=2.0,
            stop=threading.Event(),
            say=said.append,
            base_rate=20.0,
            burst_done=lambda: time.monotonic() - start > 1.0,
            transport=httpx.MockTransport(answer),
        )
    )
    assert report["answered"] == report["sent"] > 0 and report["weights"] == "random"
    assert report["burst_outcome"] == "the alert fired" and report["burst_s"] >= 2.0  # its minimum
    assert any("burst ended" in line for line in said)


def _notification(*states: str, instance: str = DA.INSTANCE, starts: str = "T1") -> dict:
    labels = {"alertname": DA.ALERT, "instance": instance}
    return {"alerts": [{"labels": labels, "status": s, "startsAt": starts, "endsAt": "T9"} for s in states]}


def test_fired_and_resolved_come_from_what_the_sink_received() -> None:
    assert not DA.fired([]) and not DA.resolved([])
    assert DA.fired([_notification("firing")]) and not DA.resolved([_notification("firing")])
    assert DA.resolved([_notification("firing"), _notification("resolved")])
    assert not DA.resolved([_notification("firing"), _notification("resolved"), _notification("firing")])
    other = {"alerts": [{"labels": {"alertname": "SchedulerBlocked", "instance": DA.INSTANCE}, "status": "firing"}]}
    assert not DA.fired([other])
    # the tuner's simulated trials share the database and may trip the rule: not the demo engine's alert
    assert not DA.fired([_notification("firing", instance="tuner-sim")])


def test_history_counts_firing_episodes() -> None:
    assert DA.history([]) == f"{DA.ALERT}: no notification"
    flapped = [
        _notification("firing", starts="T1"),
        _notification("resolved", starts="T1"),
        _notification("firing", starts="T5"),
        _notification("resolved", starts="T5"),
    ]
    assert DA.history(flapped) == f"{DA.ALERT} {{instance=demo-engine}}: fired 2 times (first at T1), resolved at T9"
    assert DA.history(flapped[:1]).endswith("fired once (first at T1), still firing")


def test_the_threshold_is_the_demo_rule_s() -> None:
    rule = next(r for g in load_rule_files([DEMO_RULES]) for r in g.rules if r.name == DA.ALERT)
    assert f"kv_usage > {DA.THRESHOLD:g}" in rule.expr_text and rule.for_s == 3.0


def test_stretch_measures_the_longest_run_above_the_threshold() -> None:
    points = [(0.0, 0.5), (1.0, 0.95), (2.0, 0.97), (3.0, 0.5), (4.0, 0.92), (5.0, 0.93), (6.5, 0.99), (7.0, 0.4)]
    s = DA.stretch("kv_usage", points, 0.9)
    assert s.longest_above_s == 2.5 and s.peak == 0.99 and s.last == 0.4 and s.samples == 8
    assert DA.stretch("kv_usage", [], 0.9).samples == 0


def test_why_not_fired_names_the_figure_the_threshold_and_the_time() -> None:
    low = [DA.Stretch("kv_usage", 40, peak=0.87, last=0.1), DA.Stretch("memory_usage", 0)]
    assert DA.why_not_fired(low, threshold=0.9, for_s=3) == "kv_usage peaked at 0.870, never above the rule's 0.9"
    short = [DA.Stretch("kv_usage", 40, peak=0.96, longest_above_s=2.2, last=0.1)]
    assert DA.why_not_fired(short, threshold=0.9, for_s=3) == (
        "kv_usage was above 0.9 for at most 2.2 s in a row (peak 0.960), under the rule's for: 3s"
    )
    held = [DA.Stretch("kv_usage", 40, peak=0.96, longest_above_s=5.0, last=0.1)]
    assert "no firing notification reached the webhook sink" in DA.why_not_fired(held, threshold=0.9, for_s=3)
    assert "no kv_usage or memory_usage samples" in DA.why_not_fired([], threshold=0.9, for_s=3)
    still = [DA.Stretch("kv_usage", 40, peak=0.99, longest_above_s=9.0, last=0.97)]
    assert DA.why_not_resolved(still, threshold=0.9) == "kv_usage was still at 0.970 (above 0.9)"


def test_stretches_and_counts_are_read_from_the_stored_run(sqlite_url: str) -> None:
    t0 = time.time() - 30
    common = {"instance": "demo-engine", "run_id": "demo-x"}
    samples = [SampleEvent(**common, ts=t0 + i * 0.5, kv_usage=0.95 if 4 <= i <= 8 else 0.3) for i in range(20)]
    requests = [
        RequestEvent(
            **common,
            ts=t0 + i,
            request_id=f"{'warmup-' if i < 2 else 'r'}{i}",
            status="finished",
            prompt_tokens=5,
            output_tokens=4,
            queue_s=0,
            prefill_s=0.1,
            ttft_s=0.1,
            decode_s=0.1,
            e2e_s=0.2,
            warmup=i < 2,
        )
        for i in range(7)
    ]
    db = make_engine(sqlite_url)
    store_events(db, [*samples, *requests], key_prefix="demo-test")
    db.dispose()
    stretches = DA.read_stretches(sqlite_url, instance="demo-engine", start=t0 - 1, end=time.time())
    kv = next(s for s in stretches if s.figure == "kv_usage")
    assert kv.samples == 20 and kv.longest_above_s == 2.0 and kv.peak == 0.95
    counts = stored_counts(sqlite_url, run_id="demo-x", start=t0 - 1, end=time.time())
    assert (counts.requests, counts.warmup_requests) == (5, 2)


def test_the_summary_never_shows_a_stopped_dashboard_and_says_the_weights_are_random() -> None:
    exited = dashboard_line("http://127.0.0.1:8501", keep_running=False, db_url="sqlite:///x.db")
    assert "http://" not in exited and "kvpilot dashboard --db-url sqlite:///x.db" in exited
    assert "http://127.0.0.1:8501" in dashboard_line("http://127.0.0.1:8501", keep_running=True, db_url="x")
    assert "random weights" in weights_line("random") and "model.checkpoint" in weights_line("random")


def test_the_tuning_baseline_is_the_config_the_demo_engine_ran() -> None:
    engine_cfg = demo_engine_config("http://127.0.0.1:1", 1234, "demo-x", "t0k3n")
    check_engine_config(EngineConfig.from_dict(engine_cfg))  # it serves
    current = tuning_config(engine_cfg)
    assert "server" not in current and "telemetry" not in current  # ports, token and run id are this run's
    assert current["cache"] == engine_cfg["cache"] and current["scheduler"] == engine_cfg["scheduler"]
    # the simulator runs the profile's model: the demo engine runs the same one, so KV sizes match
    profile = load_profile(DEMO_PROFILE)
    cfg = EngineConfig.from_dict(yaml.safe_load(yaml.safe_dump(current)))
    assert profile.engine_config(cfg).model_dump() == cfg.model_dump()


def test_the_nightly_outcome_lists_kept_and_dropped_changes() -> None:
    pruning = {
        "knobs": [
            {"knob": "scheduler.max_num_seqs", "current": 32, "proposed": 64, "effect": 0.08, "kept": True},
            {"knob": "recycler.threshold", "current": 0.85, "proposed": 0.7, "effect": 0.001, "kept": False},
        ]
    }
    files = {"report": Path("r.md")}
    no_study: Any = None  # the lines read no study
    result = NightlyResult(no_study, "propose: serves +8.0% traffic", None, None, files, "", pruning)
    lines = result.lines()
    assert lines[0] == "propose: serves +8.0% traffic"
    assert "scheduler.max_num_seqs: 32 -> 64" in lines[1] and lines[1].endswith("kept")
    assert lines[2].endswith("dropped (inside the noise)") and lines[3] == "  report: r.md"


def test_each_demo_run_gets_its_own_admin_token(tmp_path, monkeypatch) -> None:
    import kvpilot.demo as demo

    monkeypatch.setattr(demo, "DATA_DIR", tmp_path)
    first, second = demo._fresh_admin_token(), demo._fresh_admin_token()
    assert first != second and len(first) >= 24 and "demo-admin" not in (first, second)
    stored = tmp_path / "admin-token"
    assert stored.read_text().strip() == second and (stored.stat().st_mode & 0o777) == 0o600
