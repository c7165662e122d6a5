"""Series mapping (kvpilot, vLLM, SGLang, DCGM names and units) and the scraper against real HTTP."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from typing import ClassVar

import pytest
from sqlalchemy import Engine, insert

from collector import queries as q
from collector.schema import ScrapeTarget
from collector.scraper import Scraper, parse_exposition
from collector.series import CANONICAL, MAPPINGS, map_samples

VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 7.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.42
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="m"} 12.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 4.0
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 10.0
vllm:time_to_first_token_seconds_count{model_name="m"} 10.0
vllm:time_to_first_token_seconds_sum{model_name="m"} 2.5
# TYPE vllm:some_new_metric gauge
vllm:some_new_metric 1.0
"""

SGLANG = """\
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 5.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 2.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m"} 0.28
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="m"} 0.75
# TYPE sglang:generation_tokens counter
sglang:generation_tokens_total{model_name="m"} 1000.0
"""

DCGM = """\
# HELP DCGM_FI_DEV_GPU_UTIL GPU utilization (in %).
# TYPE DCGM_FI_DEV_GPU_UTIL gauge
DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-a",Hostname="h"} 80
DCGM_FI_DEV_GPU_UTIL{gpu="1",UUID="GPU-b",Hostname="h"} 40
# TYPE DCGM_FI_DEV_FB_USED gauge
DCGM_FI_DEV_FB_USED{gpu="0",UUID="GPU-a",Hostname="h"} 1024
DCGM_FI_DEV_FB_USED{gpu="1",UUID="GPU-b",Hostname="h"} 3072
# TYPE DCGM_FI_DEV_FB_FREE gauge
DCGM_FI_DEV_FB_FREE{gpu="0",UUID="GPU-a",Hostname="h"} 3072
DCGM_FI_DEV_FB_FREE{gpu="1",UUID="GPU-b",Hostname="h"} 1024
"""

KVPILOT = """\
# TYPE kvpilot_kv_usage gauge
kvpilot_kv_usage 0.5
# TYPE kvpilot_swaps counter
kvpilot_swaps_total{direction="out"} 4.0
kvpilot_swaps_total{direction="in"} 1.0
# TYPE kvpilot_requests counter
kvpilot_requests_total{status="finished"} 9.0
# TYPE kvpilot_e2e_request_latency_seconds histogram
kvpilot_e2e_request_latency_seconds_bucket{le="+Inf"} 9.0
kvpilot_e2e_request_latency_seconds_count 9.0
kvpilot_e2e_request_latency_seconds_sum 4.5
"""


def as_dict(text: str) -> dict[tuple[str, str], float]:
    return {(p.name, p.labels): p.value for p in map_samples(parse_exposition(text))}


def test_every_mapping_targets_a_known_canonical_series() -> None:
    assert all(m.canonical in CANONICAL for m in MAPPINGS)
    assert len({m.external for m in MAPPINGS}) == len(MAPPINGS)


def test_vllm_names() -> None:
    got = as_dict(VLLM)
    assert got == {
        ("running", "{}"): 7.0,
        ("queue_depth", "{}"): 3.0,
        ("kv_usage", "{}"): 0.42,
        ("preemptions_total", "{}"): 12.0,
        ("ttft_seconds_count", "{}"): 10.0,
        ("ttft_seconds_sum", "{}"): 2.5,
    }


def test_sglang_names() -> None:
    assert as_dict(SGLANG) == {
        ("running", "{}"): 5.0,
        ("queue_depth", "{}"): 2.0,
        ("kv_usage", "{}"): 0.28,
        ("prefix_hit_rate", "{}"): 0.75,
        ("generation_tokens_total", "{}"): 1000.0,
    }


def test_dcgm_units_are_converted_and_total_derived() -> None:
    got = as_dict(DCGM)
    mib = 2**20
    assert got[("utilization", '{"gpu":"0"}')] == pytest.approx(0.8)
    assert got[("memory_used_bytes", '{"gpu":"1"}')] == 3072 * mib
    assert got[("memory_free_bytes", '{"gpu":"1"}')] == 1024 * mib
    assert got[("memory_total_bytes", '{"gpu":"0"}')] == 4096 * mib


def test_kvpilot_names_keep_their_labels() -> None:
    got = as_dict(KVPILOT)
    assert got[("swaps_total", '{"direction":"out"}')] == 4.0
    assert got[("requests_total", '{"status":"finished"}')] == 9.0
    assert got[("e2e_seconds_sum", "{}")] == 4.5 and got[("kv_usage", "{}")] == 0.5


class _Exporter(http.server.BaseHTTPRequestHandler):
    pages: ClassVar[dict[str, tuple[int, str]]] = {}

    def do_GET(self) -> None:
        status, body = self.pages.get(self.path, (404, "not found"))
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        return None


@pytest.fixture
def exporter() -> Iterator[str]:
    _Exporter.pages = {
        "/vllm": (200, VLLM),
        "/dcgm": (200, DCGM),
        "/broken": (200, "this is { not prometheus"),
        "/err": (500, "oops"),
    }
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Exporter)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_scraper_stores_points_and_health(db_engine: Engine, exporter: str) -> None:
    from collector.server import free_port

    dead = f"http://127.0.0.1:{free_port()}/metrics"
    with db_engine.begin() as conn:
        conn.execute(
            insert(ScrapeTarget.__table__),
            [
                {"url": url, "job": job, "instance": inst, "interval_s": 10.0, "enabled": True, "created_at": 0.0}
                for url, job, inst in [
                    (f"{exporter}/vllm", "vllm", "vllm-0"),
                    (f"{exporter}/dcgm", "dcgm", "node-0"),
                    (f"{exporter}/broken", "x", "broken"),
                    (f"{exporter}/err", "x", "err"),
                    (dead, "x", "dead"),
                ]
            ],
        )
    now = 1_760_000_000.0
    scraper = Scraper(db_engine, timeout_s=2.0, clock=lambda: now)
    try:
        outcomes = {o.url.rsplit("/", 1)[-1]: o for o in scraper.run_once()}
        assert outcomes["vllm"].up and outcomes["vllm"].points == 6
        assert not outcomes["broken"].up and not outcomes["err"].up and not outcomes["metrics"].up
        assert "HTTP 500" in (outcomes["err"].error or "")
        assert scraper.due_targets(now + 5) == []  # interval not elapsed
        assert len(scraper.due_targets(now + 10)) == 5
    finally:
        scraper.stop()
    health = {h.instance: h for h in q.target_health(db_engine)}
    assert health["vllm-0"].up is True and health["vllm-0"].last_error is None
    assert health["vllm-0"].scrape_duration_s is not None and health["vllm-0"].last_scrape_at == now
    assert health["dead"].up is False and "Connect" in (health["dead"].last_error or "")
    assert q.series_points(db_engine, name="kv_usage", start=now, end=now + 1) == {"vllm-0": [(now, 0.42)]}
    up = q.series_points(db_engine, name="up", start=now, end=now + 1)
    assert up["vllm-0"] == [(now, 1.0)] and up["dead"] == [(now, 0.0)]
    util = q.series_points(db_engine, name="utilization", start=now, end=now + 1)
    assert util == {"node-0": [(now, pytest.approx(0.6))]}  # two GPUs averaged
    usage = q.series_points(db_engine, name="memory_usage", start=now, end=now + 1)
    assert usage == {"node-0": [(now, pytest.approx(0.5))]}
    json.dumps([h.__dict__ for h in health.values()])
