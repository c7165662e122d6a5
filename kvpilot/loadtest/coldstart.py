"""Cold start: the first N requests against a fresh engine without warm-up vs one with `warmup.requests`
warm-up requests, same config and same requests. Engines start one after the other, never side by side,
so they do not compete for the CPU. The ratio > 1 is what warm-up saves on the first requests."""

from __future__ import annotations

import asyncio
from pathlib import Path

from kvpilot.loadtest.analysis import summarize
from kvpilot.loadtest.local import merge, start_engine
from kvpilot.loadtest.plan import PlannedRequest
from kvpilot.loadtest.runner import RunOptions, run_load


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def measure_cold_start(
    engine_config: dict,
    plan: list[PlannedRequest],
    opts: RunOptions,
    *,
    requests: int,
    warmup_requests: int,
    workdir: Path,
) -> dict:
    first = [
        PlannedRequest(i, r.arrival_s - plan[0].arrival_s, r.prompt_tokens, r.max_tokens, r.kind)
        for i, r in enumerate(plan[:requests])
    ]
    if not first:
        raise ValueError("cold start needs at least one planned request")
    quiet = RunOptions(
        client=opts.client,
        max_concurrency=opts.max_concurrency,
        progress=False,
        scrape_interval_s=opts.scrape_interval_s,
    )
    sides: dict[str, dict] = {}
    for label, warm in (("without_warmup", 0), ("with_warmup", warmup_requests)):
        cfg = merge(engine_config, {"warmup": {"requests": warm}})
        with start_engine(cfg, workdir=workdir / label, name=f"coldstart-{label}") as engine:
            run = asyncio.run(run_load(engine.url, first, quiet))
        ok = [r for r in run.results if r.outcome == "ok"]
        sides[label] = {
            "warmup_requests": warm,
            "answered": len(ok),
            "not_answered": len(run.results) - len(ok),
            "e2e_s": summarize([r.e2e_s for r in ok]),
            "ttft_s": summarize([r.ttft_s for r in ok]),
        }
    cold, warm = sides["without_warmup"], sides["with_warmup"]
    return {
        "requests": len(first),
        **sides,
        "p50_e2e_ratio": _ratio(cold["e2e_s"]["p50"], warm["e2e_s"]["p50"]),
        "p99_e2e_ratio": _ratio(cold["e2e_s"]["p99"], warm["e2e_s"]["p99"]),
        "p99_ttft_ratio": _ratio(cold["ttft_s"]["p99"], warm["ttft_s"]["p99"]),
        "note": "ratio = without / with warm-up on the first requests",
    }
