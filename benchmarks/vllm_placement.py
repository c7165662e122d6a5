"""`kvpilot bench vllm-placement`: how much of a vLLM-CPU's measured speed is where the kernel put its processes.

An A/A experiment on the machine it runs on, the two ways the tuner can start a server: `isolated` (the API
server, the engine core and the replay's sender moved off the cores vLLM bound its model worker to,
`integrations.vllm.placement`) and `as started` (left where the kernel puts them). Each round starts two fresh
servers of one config (the tuning bench's running config) and measures each twice in A B B A order, the idle
one paused: a measurement is the offline throughput of the tuning bench's anchor (96 requests of the `sustained`
scenario sent at once; answered requests over the time to the last answer). Rounds alternate the two ways
(isolated, as started, as started, isolated, ...), so a drift of the machine falls on both.

Per way: every round's log ratio of the two servers (mean of B over mean of A; an A/A, so 0 but for noise), its
mean (`aa_log_ratio_mean`: B is always the second started, so this is what the start's order is worth; the
tuner rotates its order by round, `tuner.vllm.tune.launch_order`), its sd over the rounds (`aa_log_ratio_sd`:
what a paired comparison on fresh servers has to beat), and each server's
two measurements' relative difference (`within_server`: one server measured twice). A comparison's pairs differ
by both; the way with the smaller figures needs fewer pairs to tell the same difference.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.tune_vllm_bench import KV_BYTES, MODEL, SLO_PLAN
from engine import workload as W
from integrations.vllm import find_vllm_python
from integrations.vllm.config import VllmConfig
from kvpilot.vllm.workbench import workbench
from tuner import workloads as WL
from tuner.metrics import SLO
from tuner.vllm.backend import VllmBackend

WAYS = ("isolated", "as started")
ANCHOR_REQUESTS = 96  # the tuning bench's offline anchor: the `sustained` mix, all at once
WORKLOAD = WL.WorkloadOptions(requests=ANCHOR_REQUESTS, scale=8.0, output_range=(16, 128), max_total_tokens=512)


def way_order(rounds: int) -> list[str]:
    """The way of each round: isolated, as started, as started, isolated, ... (ABBA over the rounds)."""
    return [WAYS[(r + (r // 2) % 2) % 2] for r in range(rounds)]


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per way: the rounds' log ratios, their sd, and the servers' within-server differences."""
    out: dict[str, Any] = {}
    for way in WAYS:
        mine = [r for r in rounds if r["way"] == way]
        ratios = [r["log_ratio"] for r in mine]
        within = [abs(a - b) / ((a + b) / 2) for r in mine for a, b in (r["a"], r["b"])]
        out[way] = {
            "rounds": len(mine),
            "log_ratios": [round(x, 4) for x in ratios],
            "aa_log_ratio_sd": round(statistics.stdev(ratios), 4) if len(ratios) >= 2 else None,
            # signed: B is always started second, so a mean away from 0 is what the start's order is worth
            "aa_log_ratio_mean": round(statistics.fmean(ratios), 4) if ratios else None,
            "aa_log_ratio_mean_abs": round(statistics.fmean(abs(x) for x in ratios), 4) if ratios else None,
            "within_server_median": round(statistics.median(within), 4) if within else None,
            "within_server_max": round(max(within), 4) if within else None,
            "throughput_rps": [x for r in mine for x in (*r["a"], *r["b"])],
        }
    return out


def run_placement_bench(
    *,
    rounds: int = 8,
    python: str | None = None,
    out_dir: Path | None = None,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    if rounds < 4:
        raise ValueError(f"--rounds: at least 4 (two of each way, for an sd each), got {rounds}")
    t0 = time.time()
    python = find_vllm_python(python)
    work = (out_dir or Path("kvpilot-data/bench-vllm-placement")) / time.strftime("%Y%m%dT%H%M%S")
    done: list[dict[str, Any]] = []
    with workbench(work) as wb:
        base = VllmConfig(model=str(wb.checkpoint), served_model_name=MODEL, kv_cache_memory_bytes=KV_BYTES)
        reqs = WL.scenario("sustained", 1.0, WORKLOAD, seed=0)
        for r, way in enumerate(way_order(rounds)):
            backend = VllmBackend(
                workload=lambda seed: reqs,
                db=wb.db,
                slo=SLO(**SLO_PLAN),
                python=python,
                collector_url=wb.collector_url,
                admin_token=wb.admin_token,
                log_dir=work / "vllm-logs",
                isolate=way == "isolated",
            )
            try:
                done.append(_round(backend, base, reqs, r, way))
            finally:
                backend.close()
            last = done[-1]
            say(
                f"[{time.time() - t0:6.0f}s] round {r + 1}/{rounds} ({way}): A {last['a']} B {last['b']} req/s, "
                f"log ratio {last['log_ratio']:+.3f}"
            )
    return {
        "rounds": done,
        "ways": summarize(done),
        "requests_per_measurement": ANCHOR_REQUESTS,
        "cpus": sorted(os.sched_getaffinity(0)),
        "wall_s": round(time.time() - t0, 1),
        "work_dir": str(work),
    }


def _round(backend: VllmBackend, base: VllmConfig, reqs: list[W.WorkloadRequest], r: int, way: str) -> dict:
    """Two fresh servers of `base`, measured A B B A, the idle one paused."""
    backend.renew([(base, "a", f"placement-r{r + 1}-a"), (base, "b", f"placement-r{r + 1}-b")])
    values: dict[str, list[float]] = {"a": [], "b": []}
    for slot in ("a", "b", "b", "a"):
        backend.pause(base, "b" if slot == "a" else "a")
        values[slot].append(round(backend.capacity_rps(base, reqs, run_id="", slot=slot), 3))
    placements = {x.run_id: x.placement.describe() if x.placement else None for x in backend.launches}
    return {
        "way": way,
        "a": values["a"],
        "b": values["b"],
        "log_ratio": math.log(statistics.fmean(values["b"]) / statistics.fmean(values["a"])),
        "placement": placements,
        "load_average": round(os.getloadavg()[0], 2),
    }
