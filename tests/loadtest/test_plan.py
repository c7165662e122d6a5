from __future__ import annotations

from pathlib import Path

import pytest

from engine.tokenizer import ByteTokenizer
from kvpilot.loadtest.plan import PlanError, PlanOptions, burst_window, plan_burst, plan_mixed, prompt_text
from kvpilot.loadtest.report import _header
from kvpilot.loadtest.session import LoadTestSpec, _rate, make_plan
from kvpilot.loadtest.trace import load_trace


@pytest.mark.parametrize("tokens", [2, 3, 17, 512])
def test_prompt_text_has_exact_token_count(tokens: int) -> None:
    assert len(ByteTokenizer().encode(prompt_text(tokens, index=7, seed=3))) == tokens


def test_mixed_shares_and_determinism() -> None:
    opts = PlanOptions(duration_s=400.0, rate=10.0, seed=1)
    plan = plan_mixed(opts)
    assert plan == plan_mixed(opts)
    assert 3600 < len(plan) < 4400
    assert all(0 <= r.arrival_s < 400 for r in plan)
    shares = {k: sum(r.kind == k for r in plan) / len(plan) for k in ("short", "medium", "long")}
    assert shares["short"] == pytest.approx(0.3, abs=0.03)
    assert shares["medium"] == pytest.approx(0.6, abs=0.03)
    assert shares["long"] == pytest.approx(0.1, abs=0.02)
    assert all(r.prompt_tokens < 512 for r in plan if r.kind == "short")
    assert all(r.prompt_tokens > 2048 for r in plan if r.kind == "long")


def test_burst_is_six_times_base_in_the_middle() -> None:
    opts = PlanOptions(duration_s=200.0, rate=5.0, seed=2, burst_len_s=20.0)
    plan = plan_burst(opts)
    start, end = burst_window(opts)
    assert (start, end) == (90.0, 110.0)
    inside = sum(start <= r.arrival_s < end for r in plan) / (end - start)
    outside = sum(not start <= r.arrival_s < end for r in plan) / (200.0 - (end - start))
    assert inside / outside == pytest.approx(6.0, rel=0.25)


def test_lengths_scale_and_clip() -> None:
    plan = plan_mixed(PlanOptions(duration_s=50.0, rate=10.0, length_scale=8.0, output_scale=8.0, max_total_tokens=300))
    assert all(r.prompt_tokens + r.max_tokens <= 300 for r in plan)
    assert max(r.prompt_tokens for r in plan) <= 300


@pytest.mark.parametrize(
    ("field", "opts"),
    [
        ("--duration", PlanOptions(duration_s=0.0, rate=1.0)),
        ("--rate", PlanOptions(duration_s=5.0, rate=-1.0)),
        ("--duration", PlanOptions(duration_s=3.0, rate=1.0, burst_len_s=2.0)),
    ],
)
def test_bad_plans_name_the_option(field: str, opts: PlanOptions) -> None:
    with pytest.raises(PlanError) as err:
        plan_burst(opts)
    assert err.value.option == field


def test_azure_trace_with_scaling(tmp_path: Path) -> None:
    csv = tmp_path / "azure.csv"
    csv.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.6805900,396,109\n"
        "2023-11-16 18:15:47.6805900,879,45\n"
        "2023-11-16 18:16:06.6805900,3000,10\n"
    )
    plan = load_trace(csv, time_scale=2.0, length_scale=2.0)
    assert [r.arrival_s for r in plan] == pytest.approx([0.0, 0.5, 2.0, 10.0])
    assert [(r.prompt_tokens, r.max_tokens) for r in plan] == [(187, 44), (440, 45), (198, 109), (1500, 10)]
    scaled = load_trace(csv, time_scale=2.0, length_scale=2.0, output_scale=4.0)  # --output-scale, as in mixed
    assert [r.max_tokens for r in scaled] == [11, 11, 27, 2]
    assert [r.kind for r in plan] == ["short", "medium", "short", "long"]
    assert len(load_trace(csv, time_scale=2.0, duration_s=5.0)) == 3


def test_trace_in_seconds_and_errors(tmp_path: Path) -> None:
    ok = tmp_path / "s.csv"
    ok.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n10.0,100,5\n12.5,50,5\n")
    assert [r.arrival_s for r in load_trace(ok)] == [0.0, 2.5]
    missing = tmp_path / "m.csv"
    missing.write_text("TIMESTAMP,ContextTokens\n1,2\n")
    with pytest.raises(PlanError, match="GeneratedTokens") as err:
        load_trace(missing)
    assert err.value.option == "--trace"
    bad = tmp_path / "b.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n1,2,3\nyesterday,4,5\n")
    with pytest.raises(PlanError, match=r"b.csv:3"):
        load_trace(bad)


def test_the_report_header_gives_the_rate_a_trace_is_replayed_at(tmp_path: Path) -> None:
    """A trace sets its own arrivals: the header gives their rate (here 3 gaps in 3 s after the 2x speed-up),
    not --rate's default, which a trace does not use."""
    csv = tmp_path / "azure.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0,100,10\n2,100,10\n4,100,10\n6,100,10\n")
    spec = LoadTestSpec(scenario="trace", trace=csv, trace_time_scale=2.0, rate=4.0, output_scale=2.0)
    plan = make_plan(spec, spec.rate)
    assert [r.max_tokens for r in plan] == [5] * 4  # --output-scale divides a trace's outputs too
    rate = _rate(spec, plan, spec.rate, None)
    assert rate == {"rate_per_s": 1.0, "rate_basis": "the trace's own at --trace-time-scale 2"}
    assert _header({**rate, "scenario": "trace", "duration_s": 60.0}).startswith("trace @ 1.0 req/s (the trace's own")
    mixed = LoadTestSpec(scenario="mixed", rate=3.0)
    assert _rate(mixed, make_plan(mixed, 3.0), 3.0, None)["rate_basis"] == "--rate"
