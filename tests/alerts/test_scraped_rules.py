"""Built-in rules over scraped series, end to end: real HTTP exporters -> scraper -> SQL -> rules, per label set.

Two GPUs on one node at 95% and 75% of memory: MemoryPressure fires for exactly the full GPU, with its
labels. A vLLM engine on that node with a deep queue while both GPUs idle: SchedulerBlocked fires for the
engine, joined to its node's GPUs through the static target label `node`.
"""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from typing import ClassVar

import pytest
from sqlalchemy import insert

from alerts.metrics import AlertMetrics
from alerts.rules import BUILTIN_RULES, load_rule_files
from alerts.runner import AlertEvaluator
from alerts.sql_source import SqlSource
from collector.db import session_factory
from collector.exposition import labels_json
from collector.netpolicy import LOOPBACK_NETS, AddressPolicy
from collector.schema import ScrapeTarget
from collector.scraper import Scraper
from tests.alerts.conftest import FakeClock

T = 1_760_000_040.0
MIB_TOTAL = 81_559

DCGM = """\
# TYPE DCGM_FI_DEV_GPU_UTIL gauge
DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-aaa",Hostname="gpu-node-1",device="nvidia0"} 12
DCGM_FI_DEV_GPU_UTIL{gpu="1",UUID="GPU-bbb",Hostname="gpu-node-1",device="nvidia1"} 8
# TYPE DCGM_FI_DEV_FB_USED gauge
DCGM_FI_DEV_FB_USED{gpu="0",UUID="GPU-aaa",Hostname="gpu-node-1",device="nvidia0"} %(used0)d
DCGM_FI_DEV_FB_USED{gpu="1",UUID="GPU-bbb",Hostname="gpu-node-1",device="nvidia1"} %(used1)d
# TYPE DCGM_FI_DEV_FB_FREE gauge
DCGM_FI_DEV_FB_FREE{gpu="0",UUID="GPU-aaa",Hostname="gpu-node-1",device="nvidia0"} %(free0)d
DCGM_FI_DEV_FB_FREE{gpu="1",UUID="GPU-bbb",Hostname="gpu-node-1",device="nvidia1"} %(free1)d
"""

VLLM = """\
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="llama"} 150
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="llama"} 4
"""


def _dcgm_page() -> str:
    used0, used1 = round(0.95 * MIB_TOTAL), round(0.75 * MIB_TOTAL)
    return DCGM % {"used0": used0, "used1": used1, "free0": MIB_TOTAL - used0, "free1": MIB_TOTAL - used1}


class _Pages(http.server.BaseHTTPRequestHandler):
    pages: ClassVar[dict[str, str]] = {}

    def do_GET(self) -> None:
        data = self.pages[self.path].encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        return None


@pytest.fixture
def exporters() -> Iterator[str]:
    _Pages.pages = {"/dcgm": _dcgm_page(), "/vllm": VLLM}
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Pages)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_memory_pressure_per_gpu_and_scheduler_blocked_across_targets(db_engine, exporters, config_for, sink):
    node = labels_json({"node": "gpu-node-1"})
    with db_engine.begin() as conn:
        conn.execute(
            insert(ScrapeTarget.__table__),
            [
                {
                    "url": f"{exporters}/{job}",
                    "job": job,
                    "instance": f"gpu-node-1:{port}",
                    "labels": node,
                    "interval_s": 15.0,
                    "enabled": True,
                    "created_at": T,
                }
                for job, port in (("dcgm", 9400), ("vllm", 8000))
            ],
        )
    clock = FakeClock(T)
    scraper = Scraper(db_engine, clock=lambda: clock.now, policy=AddressPolicy(LOOPBACK_NETS))  # exporters on loopback
    source = SqlSource(db_engine, clock=clock)
    ev = AlertEvaluator(
        session_factory(db_engine),
        load_rule_files([BUILTIN_RULES]),
        source,
        config_for(sink),
        clock=clock,
        metrics=AlertMetrics(),
    )
    try:
        for k in range(25):  # 6 minutes of 15-s scrapes and ticks: past MemoryPressure's `for: 5m`
            clock.now = T + 15.0 * k
            scraper.run_once(now=clock.now)
            assert ev.tick().error is None
    finally:
        scraper.stop()
        if ev.delivery is not None:
            ev.delivery.close()
    active = {(state.rule.name, alert.state): alert for state in ev.states.values() for alert in state.active.values()}
    firing = [a for (rule, st), a in active.items() if rule == "MemoryPressure"]
    assert len(firing) == 1, firing  # GPU 1 at 75% never fires; nothing is averaged into 85%
    (pressure,) = firing
    assert pressure.state == "firing" and pressure.value == pytest.approx(0.95, abs=1e-4)
    assert {k: pressure.labels[k] for k in ("gpu", "UUID", "hostname", "node", "instance")} == {
        "gpu": "0",
        "UUID": "GPU-aaa",
        "hostname": "gpu-node-1",
        "node": "gpu-node-1",
        "instance": "gpu-node-1:9400",
    }
    blocked = [a for (rule, _), a in active.items() if rule == "SchedulerBlocked"]
    assert len(blocked) == 1 and blocked[0].labels["instance"] == "gpu-node-1:8000"
    assert blocked[0].labels["node"] == "gpu-node-1" and blocked[0].value == 150
