"""Telemetry: every event the engine emits is a valid wire event; stage timings are consistent;
the JSONL sink round-trips; warm-up is marked."""

from __future__ import annotations

import json
from pathlib import Path

from engine.events import parse_event
from engine.llm_engine import LLMEngine
from engine.sequence import SamplingParams
from engine.sinks import JsonlSink, MemorySink
from tests.engine.conftest import tiny_config


def _pressured_engine(sink: object) -> LLMEngine:
    bpt = 2 * 2 * 2 * 16 * 4
    cfg = tiny_config(
        cache={"hot_bytes": 4 * 128 * bpt, "cold_bytes": 32 * 128 * bpt, "block_size": 16},
        scheduler={"preemption_mode": "swap"},
        telemetry={"instance": "test-0", "run_id": "run-1", "sample_interval_s": 0.0001},
        warmup={"requests": 2, "prompt_tokens": 8, "max_tokens": 2},
    )
    return LLMEngine(cfg, sink=sink)


def test_every_emitted_event_validates_against_the_wire_schema() -> None:
    sink = MemorySink()
    engine = _pressured_engine(sink)
    engine.warmup()
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    seqs = [engine.add_request([256, *range(i, i + 60)], params) for i in range(8)]
    engine.run_until_done()
    kinds = {}
    for event in sink.events:
        parsed = parse_event(event.model_dump(mode="json"))  # raises on any schema violation
        assert parsed == event
        assert parsed.instance == "test-0" and parsed.run_id == "run-1"
        kinds[parsed.type] = kinds.get(parsed.type, 0) + 1
    assert set(kinds) == {"request", "step", "alloc", "sample"}
    ops = {e.op for e in sink.of_type("alloc")}
    assert {"alloc", "free", "swap_out", "swap_in", "oom"} <= ops
    requests = [e for e in sink.of_type("request") if not e.warmup]
    assert len(requests) == len(seqs) and all(r.output_tokens == 50 for r in requests)
    assert sum(r.swaps for r in requests) == sum(s.swaps for s in seqs) > 0
    assert all(r.swap_s > 0 for r in requests if r.swaps) and all(r.swap_s == 0 for r in requests if not r.swaps)
    for r in requests:
        assert r.e2e_s >= r.ttft_s >= r.queue_s
        assert abs(r.queue_s + r.prefill_s + r.decode_s - r.e2e_s) < 1e-6
    warm = [e for e in sink.of_type("request") if e.warmup]
    assert len(warm) == 2 and any(e.warmup for e in sink.of_type("step"))
    steps = sink.of_type("step")
    assert sum(s.decode_tokens for s in steps) > 0 and all(s.forward_s <= s.duration_s for s in steps)
    samples = sink.of_type("sample")
    assert samples and all(0 <= s.kv_usage <= 1 and 0 <= s.utilization <= 1 for s in samples)


def test_jsonl_sink_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    sink = JsonlSink(path, flush_every=3)
    engine = _pressured_engine(sink)
    engine.generate([[256, 1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
    sink.close()
    lines = path.read_text().splitlines()
    assert lines
    events = [parse_event(json.loads(line)) for line in lines]
    assert any(e.type == "request" for e in events)
