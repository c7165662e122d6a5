"""The engine's HTTP API: every endpoint, every bad input, admission control, hot reload, metrics."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading

import pytest
from fastapi.testclient import TestClient

from engine.factory import build_app
from tests.engine.conftest import tiny_config

ADMIN = {"Authorization": "Bearer s3cret"}


@pytest.fixture
def client() -> TestClient:
    cfg = tiny_config(
        server={"admin_token": "s3cret", "max_prompt_tokens": 200, "max_tokens_limit": 64}, scheduler={"queue_limit": 8}
    )
    with TestClient(build_app(cfg, warmup=False)) as c:
        yield c


def test_generate_returns_text_and_stage_timings(client: TestClient) -> None:
    r = client.post("/generate", json={"prompt": "hello", "max_tokens": 6, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["output_tokens"] == 6 and body["prompt_tokens"] == 6 and body["finish_reason"] == "length"
    t = body["timings"]
    assert t["e2e_s"] >= t["ttft_s"] >= t["queue_s"] >= 0
    assert t["e2e_s"] == pytest.approx(t["queue_s"] + t["prefill_s"] + t["decode_s"], abs=1e-3)


def test_generate_stream_sends_tokens_then_a_final_record(client: TestClient) -> None:
    with client.stream(
        "POST", "/generate", json={"prompt": "hi", "max_tokens": 5, "stream": True, "ignore_eos": True}
    ) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert sum(len(e.get("token_ids", [])) for e in events[:-1]) == 5
    assert events[-1]["finished"] is True and events[-1]["output_tokens"] == 5


def test_openai_completions_plain_and_streaming(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"model": "x", "prompt": "abc", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] <= 4
    assert body["choices"][0]["finish_reason"] in ("length", "stop")
    with client.stream("POST", "/v1/completions", json={"prompt": "abc", "max_tokens": 3, "stream": True}) as s:
        lines = [line for line in s.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] is not None


@pytest.mark.parametrize(
    ("body", "status", "field"),
    [
        ({"prompt": ""}, 422, "prompt"),
        ({"prompt": "x" * 500}, 400, "prompt"),
        ({"prompt": "x", "max_tokens": 0}, 422, "max_tokens"),
        ({"prompt": "x", "max_tokens": 65}, 400, "max_tokens"),
        ({"prompt": "x", "priority": "urgent"}, 422, "priority"),
        ({"prompt": "x", "priority": 7}, 422, "priority"),
        ({"prompt": "x", "temperature": -1}, 422, "temperature"),
        ({"prompt": "x", "top_p": 0}, 422, "top_p"),
        ({"prompt": "x", "bogus": 1}, 422, "bogus"),
        ({"max_tokens": 3}, 422, "prompt"),
    ],
)
def test_bad_generate_input_names_the_field_and_engine_keeps_serving(
    client: TestClient, body: dict, status: int, field: str
) -> None:
    r = client.post("/generate", json=body)
    assert r.status_code == status, r.text
    detail = r.json()["detail"]
    names = [detail["field"]] if isinstance(detail, dict) else [".".join(map(str, e["loc"])) for e in detail]
    assert any(field in n for n in names), detail
    assert client.post("/generate", json={"prompt": "ok", "max_tokens": 2}).status_code == 200


def test_bad_completion_input(client: TestClient) -> None:
    assert client.post("/v1/completions", json={"prompt": "x", "n": 2}).status_code == 422
    assert client.post("/v1/completions", json={"prompt": ["a", "b"]}).status_code == 422
    assert (
        client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}).status_code
        == 422
    )


def test_queue_limit_answers_429_never_an_oom() -> None:
    cfg = tiny_config(scheduler={"queue_limit": 2, "max_num_seqs": 1})
    app = build_app(cfg, warmup=False)
    results: list[int] = []
    with TestClient(app) as c:

        def fire() -> None:
            results.append(
                c.post("/generate", json={"prompt": "p" * 50, "max_tokens": 40, "ignore_eos": True}).status_code
            )

        threads = [threading.Thread(target=fire) for _ in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        metrics = c.get("/metrics").text
    assert set(results) <= {200, 429} and 429 in results and 200 in results
    rejected = [line for line in metrics.splitlines() if line.startswith("kvpilot_rejected_total")]
    assert float(rejected[0].split()[-1]) == results.count(429)


def test_admin_config_requires_token_and_hot_reloads(client: TestClient) -> None:
    assert client.get("/admin/config").status_code == 401
    assert client.get("/admin/config", headers={"Authorization": "Bearer nope"}).status_code == 403
    r = client.get("/admin/config", headers=ADMIN)
    assert r.status_code == 200 and "admin_token" not in json.dumps(r.json())
    r = client.put(
        "/admin/config", json={"cache": {"block_policy": "dynamic"}, "scheduler": {"max_num_seqs": 3}}, headers=ADMIN
    )
    assert r.status_code == 200
    assert r.json()["tunable"]["scheduler"]["max_num_seqs"] == 3
    assert client.app.state.kv.engine.scheduler.cfg.max_num_seqs == 3
    assert client.app.state.kv.engine.kv.policy.kind == "dynamic"
    for bad, field in [
        ({"scheduler": {"max_num_seqs": 0}}, "scheduler.max_num_seqs"),
        ({"model": {"dim": 8}}, "model"),
        ({"cache": {"hot_bytes": 1}}, "cache.hot_bytes"),
        ({"cache": {"block_size": 24}}, "cache.block_size"),
    ]:
        r = client.put("/admin/config", json=bad, headers=ADMIN)
        assert r.status_code == 422 and r.json()["detail"]["field"] == field, r.text
    assert client.post("/generate", json={"prompt": "still up", "max_tokens": 2}).status_code == 200


def test_admin_disabled_without_token() -> None:
    with TestClient(build_app(tiny_config(), warmup=False)) as c:
        assert c.get("/admin/config", headers=ADMIN).status_code == 403


def test_health_and_metrics_text(client: TestClient) -> None:
    client.post("/generate", json={"prompt": "warm", "max_tokens": 3})
    h = client.get("/health").json()
    assert h["status"] == "ok" and h["device"] == "cpu"
    text = client.get("/metrics").text
    for name in (
        "kvpilot_queue_depth",
        "kvpilot_running_seqs",
        "kvpilot_kv_usage",
        "kvpilot_swaps_total",
        "kvpilot_preemptions_total",
        "kvpilot_time_to_first_token_seconds_bucket",
        "kvpilot_inter_token_latency_seconds_bucket",
        "kvpilot_e2e_request_latency_seconds_bucket",
        "kvpilot_queue_time_seconds_bucket",
    ):
        assert name in text, name
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("KVPILOT_REQUIRE_PROMTOOL") == "1":
            pytest.fail("promtool is required (KVPILOT_REQUIRE_PROMTOOL=1) but not on PATH")
        pytest.skip("promtool not installed (Debian package `prometheus`)")
    proc = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_oversized_body_refused_before_parsing_and_engine_stays_live(client: TestClient) -> None:
    limit = client.app.state.kv.engine.config.server.max_body_bytes
    huge = b'{"prompt": "' + b"a" * (limit + 10) + b'"}'
    r = client.post("/generate", content=huge, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["detail"]["field"] == "body"

    def chunks():  # no Content-Length: the limit is enforced on the bytes read so far
        yield b'{"prompt": "'
        for _ in range(limit // 65536 + 2):
            yield b"a" * 65536
        yield b'"}'

    r = client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    metrics = client.get("/metrics").text
    assert "kvpilot_http_body_too_large_total 2.0" in metrics
    # a prompt within the body limit but far beyond any tokenization of max_prompt_tokens: 400, not tokenized
    cfg = client.app.state.kv.engine.config.server
    long_prompt = "b" * (cfg.max_prompt_tokens * 64 + 1)
    if len(long_prompt) + 20 < limit:
        r = client.post("/generate", json={"prompt": long_prompt, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["detail"]["field"] == "prompt"
    assert client.get("/health").status_code == 200
    assert client.post("/generate", json={"prompt": "ok", "max_tokens": 2}).status_code == 200
