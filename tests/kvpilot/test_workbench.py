"""The local bench the vLLM runs share (`kvpilot vllm calibrate`, `bench tune-vllm`, the fidelity diagnostic)."""

from __future__ import annotations

import httpx
import pytest
from sqlalchemy import inspect

from kvpilot.vllm.workbench import workbench


def test_the_workbench_has_a_checkpoint_a_database_at_head_and_a_collector_that_takes_loopback_targets(tmp_path):
    with workbench(tmp_path / "w") as wb:
        assert (wb.checkpoint / "config.json").exists() and (wb.checkpoint / "model.safetensors").exists()
        assert {"steps", "requests", "scrape_targets"} <= set(inspect(wb.db).get_table_names())
        target = {"url": "http://127.0.0.1:9/metrics", "instance": "trial"}
        admin = {"Authorization": f"Bearer {wb.admin_token}"}
        assert httpx.post(f"{wb.collector_url}/v1/targets", json=target).status_code == 401
        created = httpx.post(f"{wb.collector_url}/v1/targets", json=target, headers=admin)
        assert created.status_code == 201, created.text
        url = wb.collector_url
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=2.0)  # stopped on the way out
    with workbench(tmp_path / "w") as again:  # a second run keeps the checkpoint and the stored rows
        assert again.checkpoint == wb.checkpoint
        listed = httpx.get(
            f"{again.collector_url}/v1/targets", headers={"Authorization": f"Bearer {again.admin_token}"}
        )
        assert [t["instance"] for t in listed.json()] == ["trial"]
