"""The live backend against a running engine app: apply, observe through the database, roll back, guard.
The admin calls go through a TestClient (which runs the app's lifespan), the requests through an ASGI transport."""

from __future__ import annotations

import threading

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from collector.db import make_engine, upgrade
from collector.server import start_subprocess
from collector.settings import CollectorSettings
from engine import workload as W
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.server import create_app
from kvpilot.loadtest.local import start_engine
from tuner import workloads as WL
from tuner.live import LiveBackend
from tuner.metrics import SLO, store_events
from tuner.space import space_from_dict
from tuner.study import run_study

from .conftest import TINY_MODEL


class DbSink:
    """Stands in for engine -> HTTP sink -> collector: request events land in the database at once."""

    def __init__(self, db) -> None:
        self.db = db
        self.n = 0
        self.lock = threading.Lock()

    def emit(self, event) -> None:
        if event.type == "request":
            with self.lock:
                self.n += 1
                store_events(self.db, [event], key_prefix=f"live-{self.n}")

    def flush(self) -> None:
        return None

    def close(self) -> None:
        return None


def _setup(sqlite_url: str):
    db = make_engine(sqlite_url)
    cfg = EngineConfig.from_dict(
        {
            "device": "cpu",
            "model": dict(TINY_MODEL),
            "warmup": {"requests": 0},
            "server": {"admin_token": "tok"},
            "telemetry": {"instance": "live-1", "trace_alloc": False},
        }
    )
    engine = LLMEngine(cfg, sink=DbSink(db))
    return db, cfg, create_app(engine, CollectorRegistry()), engine


def _workload(seed: int) -> list:
    return WL.scenario("mixed", 20.0, WL.WorkloadOptions(requests=40, scale=32.0, output_range=(2, 6)), seed=seed)


def test_live_trial_applies_observes_and_rolls_back(sqlite_url: str) -> None:
    db, cfg, app, engine = _setup(sqlite_url)
    with TestClient(app, base_url="http://engine", headers={"Authorization": "Bearer tok"}) as client:
        backend = LiveBackend(
            db=db,
            slo=SLO(ttft_s=2.0, tpot_s=0.5),
            workload=_workload,
            engine_url="http://engine",
            instance="live-1",
            window_s=2.0,
            settle_s=0.3,
            guard_interval_s=0.5,
            drive=True,
            drive_concurrency=4,
            ingest_lag_s=0.2,
            client=client,
            transport=httpx.ASGITransport(app),
        )
        trial = cfg.with_tunable({"scheduler": {"max_num_seqs": 4}})
        seen: list[int] = []
        original = backend._call

        def spy(method, path, json=None):
            if method == "PUT":
                seen.append(json["scheduler"]["max_num_seqs"])
            return original(method, path, json)

        backend._call = spy  # type: ignore[method-assign]  # a spy on the backend's HTTP calls
        metrics = backend.evaluate(trial, run_id="live-t0", seed=0)
        assert seen == [4, 32]  # applied, then rolled back
        assert engine.config.scheduler.max_num_seqs == 32
        assert metrics.requests > 0 and metrics.finished > 0
    db.dispose()


def test_live_guard_ends_a_bad_trial_early(sqlite_url: str) -> None:
    db, cfg, app, engine = _setup(sqlite_url)
    with TestClient(app, base_url="http://engine", headers={"Authorization": "Bearer tok"}) as client:
        flood = lambda seed: [W.WorkloadRequest(0.0, 16, 64) for _ in range(40)]  # noqa: E731 - all at once
        backend = LiveBackend(
            db=db,
            slo=SLO(ttft_s=2.0, tpot_s=0.5),
            workload=flood,
            engine_url="http://engine",
            instance="live-1",
            window_s=6.0,
            settle_s=0.0,
            guard_interval_s=0.5,
            guard_rejection_rate=0.05,
            drive=True,
            drive_concurrency=8,
            ingest_lag_s=0.2,
            client=client,
            transport=httpx.ASGITransport(app),
        )
        trial = cfg.with_tunable({"scheduler": {"max_num_seqs": 1, "queue_limit": 1}})
        metrics = backend.evaluate(trial, run_id="live-bad", seed=0)
        assert backend.aborted_trials == 1 and metrics.window_s < 6.0
        assert metrics.rejected > 0 and not metrics.feasible(SLO(ttft_s=2.0, tpot_s=0.5))
        assert engine.config.scheduler.queue_limit == cfg.scheduler.queue_limit
    db.dispose()


@pytest.mark.slow
def test_live_study_through_a_real_collector_and_engine_processes(tmp_path) -> None:
    """The whole live loop with nothing stood in: an engine process pushes its telemetry over its HTTP sink
    to a collector process; the study applies each trial through the engine's /admin/config, drives the
    workload at /generate, reads the trial's metrics back from the collector's database and rolls back."""
    url = f"sqlite:///{tmp_path}/live.db"
    upgrade(url)
    collector = start_subprocess(
        CollectorSettings(db_url=url, port=0, scrape_enabled=False), log_path=tmp_path / "collector.log"
    )
    engine = None
    db = make_engine(url)
    try:
        engine = start_engine(
            {
                "device": "cpu",
                "model": dict(TINY_MODEL),
                "warmup": {"requests": 0},
                "server": {"admin_token": "tok"},
                "telemetry": {
                    "instance": "live-e2e",
                    "sink": "http",
                    "collector_url": collector.url,
                    "trace_alloc": False,
                    "http_flush_interval_s": 0.2,
                    "spool_dir": str(tmp_path / "spool"),
                },
            },
            workdir=tmp_path,
        )
        base = EngineConfig.from_dict({"device": "cpu", "model": dict(TINY_MODEL)})
        backend = LiveBackend(
            db=db,
            slo=SLO(ttft_s=2.0, tpot_s=0.5),
            workload=_workload,
            engine_url=engine.url,
            instance="live-e2e",
            admin_token="tok",
            window_s=2.0,
            settle_s=0.3,
            guard_interval_s=0.5,
            drive=True,
            drive_concurrency=4,
            ingest_lag_s=1.0,
        )
        space = space_from_dict({"params": {"scheduler.max_num_seqs": {"choices": [4, 32]}}}, base=base)
        result = run_study(
            backend,
            space,
            base,
            name="live-e2e",
            trials=2,
            slo=SLO(ttft_s=2.0, tpot_s=0.5),
            seed=0,
            random_baseline=False,
            progress=False,
        )
        measured = [t for t in result.trials if t.duplicate_of is None]
        assert len(measured) == 2 and all(t.state == "COMPLETE" for t in measured)
        for t in measured:  # each window's requests went engine -> HTTP sink -> collector -> SQL
            assert t.metrics["requests"] > 0 and t.metrics["finished"] > 0
        restored = httpx.get(f"{engine.url}/admin/config", headers={"Authorization": "Bearer tok"}).json()
        assert restored["tunable"]["scheduler"]["max_num_seqs"] == 32  # the original, after every trial
    finally:
        db.dispose()
        if engine is not None:
            engine.stop()
        collector.stop()


def _replayed() -> list:
    """12 short requests at 4/s: what the replaying tests send."""
    return WL.scenario("mixed", 4.0, WL.WorkloadOptions(requests=12, scale=32.0, output_range=(2, 6)), seed=1)


def _replaying(db, slo: SLO, client: TestClient, transport: httpx.AsyncBaseTransport) -> LiveBackend:
    """A live backend whose admin calls go through `client` and whose requests go through `transport`."""
    return LiveBackend(
        db=db,
        slo=slo,
        workload=_workload,
        engine_url="http://engine",
        instance="live-1",
        settle_s=0.0,
        drive_concurrency=12,
        ingest_lag_s=0.2,
        client=client,
        transport=transport,
    )


def test_capacity_search_on_a_live_engine_replays_each_request_once_and_rolls_back(sqlite_url: str) -> None:
    from tuner.capacity import breaches, replay_capacity, requests_at
    from tuner.replay import prepare_prompts

    db, cfg, app, engine = _setup(sqlite_url)
    slo = SLO(ttft_s=5.0, tpot_s=1.0)
    reqs = _replayed()
    with TestClient(app, base_url="http://engine", headers={"Authorization": "Bearer tok"}) as client:
        backend = _replaying(db, slo, client, httpx.ASGITransport(app))
        trial = cfg.with_tunable({"scheduler": {"max_num_seqs": 8}})
        cap = replay_capacity(backend, trial, reqs, prepare_prompts(reqs, 1), slo=slo, run_id="cap", max_replays=2)
        assert engine.config.scheduler.max_num_seqs == 32  # rolled back after every replay
    db.dispose()
    assert len(cap.probes) == 2 and cap.probes[0].multiplier == 1.0
    for probe in cap.probes:  # each replay's window holds exactly its own requests (x2: the recording twice)
        assert probe.metrics.requests == requests_at(reqs, probe.multiplier) and probe.holds == (
            breaches(probe.metrics, slo) == ()
        )
    assert cap.multiplier == max((p.multiplier for p in cap.probes if p.holds), default=0.0)


class _Flaky(httpx.AsyncBaseTransport):
    """Every second request never reaches the engine: one in four fails on the wire, one in four is answered 500
    by a proxy in front of it."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner, self.n = inner, 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.n += 1
        if self.n % 4 == 2:
            raise httpx.ConnectError("connection refused", request=request)
        if self.n % 4 == 0:
            return httpx.Response(500, request=request)
        return await self.inner.handle_async_request(request)


def test_requests_the_engine_never_recorded_count_against_the_config(sqlite_url: str, caplog) -> None:
    """A request that failed on the wire or was answered with an error never becomes a row: counted against
    the config (requests, failed, rejection rate), logged, and totalled on the backend."""
    from tuner.capacity import breaches
    from tuner.replay import prepare_prompts

    db, cfg, app, _ = _setup(sqlite_url)
    slo = SLO(ttft_s=5.0, tpot_s=1.0)
    reqs = _replayed()
    with TestClient(app, base_url="http://engine", headers={"Authorization": "Bearer tok"}) as client:
        backend = _replaying(db, slo, client, _Flaky(httpx.ASGITransport(app)))
        with caplog.at_level("WARNING", logger="kvpilot.tuner.live"):
            m = backend.measure_requests(cfg, reqs, prepare_prompts(reqs, 1), run_id="flaky")
    db.dispose()
    assert m.requests == 12 and m.finished == 6 and m.failed >= 6 and m.rejection_rate >= 0.5
    assert backend.lost_requests == 6 and "6 request(s) lost" in caplog.text and "'wire': 3" in caplog.text
    assert any("finished" in b for b in breaches(m, slo))  # half of them lost: the SLOs do not hold
