"""The vLLM backend's scrape targets on a real collector (no vLLM needed): a trial's /metrics target, registered
with the admin token as the launcher registers it, is gone after the trial's vLLM is stopped; a delete the
collector refuses is logged and counted, not ignored."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import httpx
import pytest

from collector.db import make_engine
from collector.server import run_in_thread
from collector.settings import CollectorSettings
from engine.workload import WorkloadRequest
from integrations.vllm import VllmExitedError
from integrations.vllm.config import VllmConfig
from integrations.vllm.wiring import register_target
from plumbing.serving import ThreadServer
from tuner.backends import InfeasibleTrialError
from tuner.metrics import SLO
from tuner.vllm.backend import VllmBackend

TOKEN = "ingest-s3cret"
ADMIN_TOKEN = "adm1n-s3cret"
TRIAL_URL = "http://127.0.0.1:9"  # a trial vLLM's address; nothing is scraped (scraping is off)


@pytest.fixture
def collector(sqlite_url: str) -> Iterator[ThreadServer]:
    settings = CollectorSettings(
        db_url=sqlite_url,
        ingest_token=TOKEN,
        admin_token=ADMIN_TOKEN,
        port=0,
        scrape_enabled=False,
        scrape_allow_nets="127.0.0.0/8",
        log_level="warning",
    )
    with run_in_thread(settings) as handle:
        yield handle


class _StoppedLauncher:
    """What `_stop` needs of a trial's launcher: its URL, its registration and a stop with nothing left to stop."""

    url = TRIAL_URL
    proc = None
    target = "created"

    def stop(self, timeout_s: float) -> int:
        return 0


def _backend(collector: ThreadServer, sqlite_url: str, admin_token: str | None) -> VllmBackend:
    return VllmBackend(
        workload=lambda seed: [WorkloadRequest(0.0, 8, 4)],
        db=make_engine(sqlite_url),
        slo=SLO(),
        python="python3",
        collector_url=collector.url,
        ingest_token=TOKEN,
        admin_token=admin_token,
    )


def _register(collector: ThreadServer) -> None:
    with httpx.Client(timeout=5.0) as client:
        created = register_target(
            client,
            collector.url,
            token=ADMIN_TOKEN,
            metrics_url=f"{TRIAL_URL}/metrics",
            instance="tuner-vllm",
            labels={},
            interval_s=None,
        )
    assert created == "created"


def _targets(collector: ThreadServer) -> list[str]:
    resp = httpx.get(f"{collector.url}/v1/targets", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5.0)
    resp.raise_for_status()
    return [t["url"] for t in resp.json()]


def test_a_stopped_trials_scrape_target_is_deleted_with_the_admin_token(
    collector: ThreadServer, sqlite_url: str
) -> None:
    from tuner.vllm.backend import Launch, _Server

    _register(collector)
    backend = _backend(collector, sqlite_url, ADMIN_TOKEN)
    config = VllmConfig(model="/m")
    launch = Launch(run_id="trial-1", config=config, started_at=0.0)
    backend._servers[tuple(config.to_args())] = _Server(_StoppedLauncher(), launch, "m", TRIAL_URL)  # type: ignore[arg-type]  # a fake launcher
    backend.close()  # the trial's cleanup: stop its vLLM, delete its target
    assert _targets(collector) == [] and backend.stale_targets == []
    assert launch.stop_s is not None
    backend.db.dispose()


def test_a_refused_delete_is_logged_and_counted(
    collector: ThreadServer, sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    _register(collector)
    # The ingest token where the admin token belongs (what the backend used to delete with): the collector refuses
    wrong = _backend(collector, sqlite_url, TOKEN)
    with caplog.at_level(logging.WARNING, logger="kvpilot.tuner.vllm.backend"):
        assert wrong.remove_target(f"{TRIAL_URL}/metrics") is False
    assert wrong.stale_targets == [f"{TRIAL_URL}/metrics"] and _targets(collector) == [f"{TRIAL_URL}/metrics"]
    assert "left on the collector" in caplog.text and "403" in caplog.text
    right = _backend(collector, sqlite_url, ADMIN_TOKEN)
    assert right.remove_target(f"{TRIAL_URL}/metrics") is True and _targets(collector) == []
    assert right.remove_target(f"{TRIAL_URL}/metrics") is True  # nothing left to delete is not a failure
    for b in (wrong, right):
        b.db.dispose()


def test_the_trials_launcher_registers_with_the_admin_token_and_a_refused_start_leaves_no_target(
    collector: ThreadServer, sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tuner.vllm.backend as backend_module

    options = []

    class _RefusedLauncher:
        """vLLM refuses the trial's arguments after the launcher registered its /metrics."""

        def __init__(self, opts) -> None:
            options.append(opts)
            self.url = TRIAL_URL

        def start(self) -> None:
            _register(collector)
            raise VllmExitedError("vLLM exited with 1: ValueError: bad --block-size")

        def stop(self, timeout_s: float) -> int:
            return 1

    monkeypatch.setattr(backend_module, "VllmLauncher", _RefusedLauncher)
    backend = _backend(collector, sqlite_url, ADMIN_TOKEN)
    with pytest.raises(InfeasibleTrialError, match="bad --block-size"):
        backend.evaluate(VllmConfig(model="/m"), run_id="trial-2", seed=0)
    assert options[0].admin_token == ADMIN_TOKEN and options[0].ingest_token == TOKEN
    assert _targets(collector) == [] and backend.stale_targets == []
    backend.db.dispose()


def test_a_renewal_starts_every_server_at_once_on_ports_of_their_own_and_a_failed_start_stops_the_rest(
    collector: ThreadServer, sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The held-out rounds' fresh servers (`VllmBackend.renew`, on a real vLLM in tests/vllm): every server of the
    renewal launched before any is waited for, each on its own port (none bound yet when the next is chosen), the
    ones it replaces stopped first, and any other server of ours not pinned (none idles beside the measurements);
    a start that fails stops those that came up and those still starting, and keeps none of them."""
    import tuner.vllm.backend as backend_module

    calls: list[str] = []

    class _Launcher:
        """A trial launcher that starts at once and serves unless its model is `/refused`."""

        def __init__(self, opts) -> None:
            self.run_id = opts.run_id
            self.url = f"http://127.0.0.1:{opts.vllm_args[opts.vllm_args.index('--port') + 1]}"
            self.refused = "/refused" in opts.vllm_args
            self.proc, self.target, self.stopped = None, None, False

        def start(self) -> None:
            calls.append(f"start {self.run_id}")

        def wait_ready(self, timeout_s: float) -> None:
            calls.append(f"wait {self.run_id}")
            if self.refused:
                raise VllmExitedError("vLLM exited with 1: ValueError: refused")

        def stop(self, timeout_s: float) -> int:
            calls.append(f"stop {self.run_id}")
            self.stopped = True
            return 0

    monkeypatch.setattr(backend_module, "VllmLauncher", _Launcher)
    monkeypatch.setattr(backend_module, "warm_up", lambda url, model, **kw: calls.append(f"warm {url}"))
    backend = _backend(collector, sqlite_url, ADMIN_TOKEN)
    backend.ports = range(20000, 20010)
    good, refused = VllmConfig(model="/m"), VllmConfig(model="/refused")
    for slot in ("", "aa"):  # the comparison's sides; /m2 stands for a confirmation's server, not pinned
        backend.pin(good, slot)
    backend.renew([(good, "", "a-r1"), (good, "aa", "aa-r1"), (refused.replace(model="/m2"), "", "b-r1")])
    assert calls[:6] == ["start a-r1", "start aa-r1", "start b-r1", "wait a-r1", "wait aa-r1", "wait b-r1"]
    first = {key: server.launcher for key, server in backend._servers.items()}
    assert len({s.url for s in backend._servers.values()}) == 3 and all(s.warmed for s in backend._servers.values())
    calls.clear()
    backend.renew([(good, "", "a-r2"), (good, "aa", "aa-r2")])
    assert calls[:3] == ["stop a-r1", "stop aa-r1", "stop b-r1"] and calls[3:5] == ["start a-r2", "start aa-r2"]
    assert backend._servers[("", *good.to_args())].launcher is not first[("", *good.to_args())]
    calls.clear()
    with pytest.raises(InfeasibleTrialError, match="refused"):
        backend.renew([(good, "", "a-r3"), (refused, "", "r-r3"), (good, "aa", "aa-r3")])
    assert calls[:2] == ["stop a-r2", "stop aa-r2"]
    started = ["start a-r3", "start r-r3", "start aa-r3", "wait a-r3", "wait r-r3"]
    assert calls[2:] == [*started, "stop r-r3", "stop aa-r3", "stop a-r3"]
    assert backend._servers == {}  # the renewal's own, all gone
    assert [x.error is not None for x in backend.launches[-3:]] == [False, True, True]
    with pytest.raises(ValueError, match="attached"):
        backend.attach(good, url="http://127.0.0.1:9", run_id="theirs")
        backend.renew([(good, "", "a-r4")])
    backend.close()
    backend.db.dispose()
