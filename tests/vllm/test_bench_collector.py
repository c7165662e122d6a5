"""`kvpilot bench vllm`'s own collector takes the launcher's scrape target with nothing in the environment (no vLLM
needed): run as a newcomer runs it, the bench must still get vLLM's /metrics scraped, or its `series_labels` are
empty and `vllm_requests_total` null."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest

from benchmarks.vllm_bench import bench_collector
from integrations.vllm.wiring import register_target


def test_the_bench_collector_registers_a_loopback_vllm_with_its_own_admin_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [k for k in os.environ if k.startswith("KVPILOT_")]:
        monkeypatch.delenv(name)
    settings, collector = bench_collector(tmp_path)
    try:
        assert settings.admin_token and settings.admin_token != settings.ingest_token
        with httpx.Client(timeout=10.0) as client:
            created = register_target(
                client,
                collector.url,
                token=settings.admin_token,
                metrics_url="http://127.0.0.1:9/metrics",  # a vLLM on this host: loopback must be allowed
                instance="bench-vllm-1",
                labels={"node": "n1"},
                interval_s=5.0,
            )
            assert created == "created"
            # the collector commits a target after its 201 is on the wire (its session closes after the
            # response), so a listing right after may not show it yet: wait for it, briefly
            deadline, urls = time.monotonic() + 10.0, []
            while time.monotonic() < deadline and not urls:
                auth = {"Authorization": f"Bearer {settings.ingest_token}"}
                urls = [t["url"] for t in client.get(f"{collector.url}/v1/targets", headers=auth).json()]
                time.sleep(0.1)
            assert urls == ["http://127.0.0.1:9/metrics"]
    finally:
        collector.stop()
