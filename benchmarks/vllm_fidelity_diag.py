"""Why the simulator in vLLM's mode misses a real vLLM: one vLLM replays a fixed workload at a few load levels,
then the calibrated simulator replays the same traffic, and the two are compared step by step.

    python -m benchmarks.vllm_fidelity_diag record DIR [--loads 0.5,1.0,1.5] [--duration 8]
    python -m benchmarks.vllm_fidelity_diag analyze DIR [--json out.json]

`record` (slow: one vLLM start, a capacity run and one replay per load) keeps everything in DIR: the SQLite
database the collector filled (step rows from the iteration lines, request rows from the spans), vLLM's log and
`record.json` (capacity, each replay's run id, seed, load and window). `analyze` (seconds, repeatable as the
model changes) fits the cost model from the stored steps as `tune-vllm` does, simulates each replay and prints,
per replay: steps, prefill and decode tokens per step, summed elapsed (busy) time, the window, the cycle between
back-to-back steps, and the requests' time outside the engine (e2e - queue - prefill - decode) and queue time,
real vs simulated; how late the client posted and how late vLLM stamped each arrival against the plan; and the
throughput and busy-time errors of the simulator fed the planned arrivals, the client's send times (`as_sent`,
what `tuner.vllm.fidelity` compares), vLLM's arrival stamps, and those stamps plus the time outside the engine.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from collector.db import make_engine, upgrade
from collector.queries import StoredStep, slowest_requests, stored_steps
from engine import workload as W
from engine.config import ModelConfig
from integrations.vllm import find_vllm_python
from integrations.vllm.config import VllmConfig
from kvpilot.vllm.workbench import workbench
from plumbing.percentile import nearest_rank
from tuner import workloads as WL
from tuner.metrics import SLO
from tuner.vllm.backend import VllmBackend
from tuner.vllm.calibrate import VllmProfile, fit_profile, step_shape
from tuner.vllm.fidelity import as_sent
from tuner.vllm.sim import VllmSimBackend

KV_BYTES = 16 * 2**20
SLO_PLAN = SLO(ttft_s=1.0, tpot_s=0.1, p99_ttft_s=10.0, max_rejection_rate=0.01)


def _opts(duration_s: float) -> WL.WorkloadOptions:
    return WL.WorkloadOptions(load=1.0, duration_s=duration_s, scale=8.0, output_range=(16, 128), max_total_tokens=512)


def _workload(rec: dict[str, Any]):
    opts = _opts(rec["duration_s"])
    rate = {}  # read when a replay asks: `record` fills rec["replays"] after measuring the capacity

    def workload(seed: int) -> list:
        if not rate:
            rate.update({r["seed"]: r["rate_rps"] for r in rec["replays"]})
        return WL.scenario("sustained", rate[seed], opts, seed=seed)

    return workload


def _config(checkpoint: Path) -> VllmConfig:
    return VllmConfig(model=str(checkpoint), served_model_name="bench", kv_cache_memory_bytes=KV_BYTES)


def _model(checkpoint: Path) -> ModelConfig:
    from engine.weights import config_from_checkpoint

    return config_from_checkpoint(checkpoint, ModelConfig(dtype="float32"))[0]


def _timed_posts(sent: list[dict[str, Any]]) -> None:
    """Record when the replay client starts and ends each completion POST, and vLLM's id for it."""
    import httpx

    plain = httpx.AsyncClient.post

    async def post(self: httpx.AsyncClient, url: Any, *args: Any, **kwargs: Any) -> httpx.Response:
        t = time.time()
        resp = await plain(self, url, *args, **kwargs)
        if str(url).endswith("/v1/completions"):
            rid = None
            with contextlib.suppress(ValueError, KeyError, TypeError):
                rid = resp.json()["id"]
            sent.append({"id": rid, "post": t, "answer": time.time()})
        return resp

    httpx.AsyncClient.post = post  # type: ignore[method-assign]  # stamps every request the benchmark sends


def record(work: Path, *, loads: list[float], duration_s: float) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    sent: list[dict[str, Any]] = []
    _timed_posts(sent)
    with workbench(work) as wb:
        rec: dict[str, Any] = {"duration_s": duration_s, "started": time.time(), "replays": []}
        cfg = _config(wb.checkpoint)
        backend = VllmBackend(
            workload=_workload(rec),
            db=wb.db,
            slo=SLO_PLAN,
            python=find_vllm_python(None),
            collector_url=wb.collector_url,
            admin_token=wb.admin_token,
            log_dir=work / "vllm-logs",
        )
        try:
            opts = _opts(duration_s)
            capacity = backend.capacity_rps(cfg, WL.offline_mix(opts), run_id=f"diag-{uuid.uuid4().hex[:6]}")
            rec["capacity_rps"] = capacity
            print(f"capacity {capacity:.2f} req/s  loadavg {_loadavg()}", file=sys.stderr, flush=True)
            rec["replays"] = [{"seed": i, "load": load, "rate_rps": load * capacity} for i, load in enumerate(loads)]
            for r in rec["replays"]:
                r["loadavg_before"] = _loadavg()
                sent.clear()
                backend.evaluate(cfg, run_id="diag", seed=r["seed"])
                r["posts"] = list(sent)
                ev = backend.evaluations[-1]
                r.update(run_id=ev["run_id"], start=ev["start"], end=ev["end"], loadavg_after=_loadavg())
                r["sent_at"] = ev.get("sent_at")
                r["client_max_send_lag_s"] = backend.last_client.max_send_lag_s if backend.last_client else None
                print(
                    f"load {r['load']}: replay {ev['end'] - ev['start']:.1f} s  loadavg {_loadavg()}", file=sys.stderr
                )
        finally:
            backend.close()
            rec["ended"] = time.time()
            (work / "record.json").write_text(json.dumps(rec, indent=2) + "\n")
    return rec


def _loadavg() -> str:
    return Path("/proc/loadavg").read_text().split(" ", 3)[:3].__str__()


# ---------------------------------------------------------------------------------------------- analysis
def step_stats(steps: list[StoredStep], profile: VllmProfile, window_s: float) -> dict[str, Any]:
    """What a replay's steps look like: how many, how big, how long, and the time between them."""
    if not steps:
        return {"steps": 0}
    busy = sum(s.duration_s for s in steps)
    pred = [profile.elapsed.predict(step_shape(s, profile.block_size)) for s in steps]
    cycles = [
        b.ts - a.ts
        for a, b in itertools.pairwise(steps)
        if b.step == a.step + 1 and b.decode_tokens > 0 and a.num_seqs > 0
    ]
    with_prefill = [s for s in steps if s.prefill_tokens > 0]
    return {
        "steps": len(steps),
        "window_s": round(window_s, 3),
        "busy_s": round(busy, 3),
        "busy_fraction": round(busy / window_s, 3) if window_s > 0 else None,
        "predicted_busy_s": round(sum(pred), 3),
        "seqs_per_step": round(statistics.mean(s.num_seqs for s in steps), 2),
        "decode_tokens": sum(s.decode_tokens for s in steps),
        "prefill_tokens": sum(s.prefill_tokens for s in steps),
        "steps_with_prefill": len(with_prefill),
        "prefill_tokens_per_prefill_step": round(statistics.mean(s.prefill_tokens for s in with_prefill), 1)
        if with_prefill
        else 0,
        "elapsed_ms_median": round(1000 * statistics.median(s.duration_s for s in steps), 2),
        "cycle_ms_median": round(1000 * statistics.median(cycles), 2) if cycles else None,
        "cycle_minus_elapsed_ms_mean": round(
            1000 * statistics.mean(c - s.duration_s for c, s in zip(cycles, steps[1:], strict=False)), 2
        )
        if cycles
        else None,
        "back_to_back": len(cycles),
        "span_s": round(steps[-1].ts - steps[0].ts + steps[0].duration_s, 3),
    }


def request_stats(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per request: pre-queue (arrival to queued, plus what follows the last token) = e2e - queue - prefill -
    decode; queue; TTFT; e2e."""
    if not rows:
        return {"requests": 0}
    pre = [r["e2e_s"] - r["queue_s"] - r["prefill_s"] - r["decode_s"] for r in rows]
    out: dict[str, Any] = {"requests": len(rows), "output_tokens": sum(int(r["output_tokens"]) for r in rows)}
    for name, vals in (
        ("outside_engine_ms", pre),
        ("queue_ms", [r["queue_s"] for r in rows]),
        ("ttft_ms", [r["ttft_s"] for r in rows if r["ttft_s"] is not None]),
        ("e2e_ms", [r["e2e_s"] for r in rows]),
    ):
        out[name] = {
            "mean": round(1000 * statistics.mean(vals), 1),
            "p50": round(1000 * (nearest_rank(vals, 0.5) or 0), 1),
            "p99": round(1000 * (nearest_rank(vals, 0.99) or 0), 1),
        }
    return out


def arrival_lag(rows: list[dict[str, Any]], planned: list[float]) -> dict[str, Any]:
    """The API server's arrival stamp (span start = ts - e2e) against the client's planned send times, both
    sorted (requests are sent in arrival order; the k-th stamp is matched with the k-th send)."""
    stamps = sorted(float(r["ts"]) - float(r["e2e_s"]) for r in rows)
    if len(stamps) != len(planned) or not stamps:
        return {"matched": False, "stamps": len(stamps), "planned": len(planned)}
    lag = [a - p for a, p in zip(stamps, sorted(planned), strict=True)]
    return {
        "matched": True,
        "mean_ms": round(1000 * statistics.mean(lag), 1),
        "p50_ms": round(1000 * (nearest_rank(lag, 0.5) or 0), 1),
        "p90_ms": round(1000 * (nearest_rank(lag, 0.9) or 0), 1),
        "max_ms": round(1000 * max(lag), 1),
    }


def observed_arrivals(
    reqs: list[W.WorkloadRequest], rows: list[dict[str, Any]], start: float, *, to_queue: bool
) -> list[W.WorkloadRequest] | None:
    """The planned requests with the arrival vLLM saw instead: its API server's stamp (span start), or that plus
    the time outside the engine (`to_queue`: about when the engine core queued it). Each planned request is
    matched, in arrival order, with the earliest unmatched row of its prompt and completion lengths."""
    pool: dict[tuple[int, int], list[float]] = {}
    for r in sorted(rows, key=lambda r: float(r["ts"]) - float(r["e2e_s"])):
        at = float(r["ts"]) - float(r["e2e_s"]) - start
        if to_queue:
            at += max(0.0, r["e2e_s"] - r["queue_s"] - r["prefill_s"] - r["decode_s"])
        pool.setdefault((int(r["prompt_tokens"]), int(r["output_tokens"])), []).append(at)
    out = list(reqs)
    for i in sorted(range(len(reqs)), key=lambda i: reqs[i].arrival_s):
        q = reqs[i]
        left = pool.get((q.prompt_tokens, q.output_tokens))
        if not left:
            return None
        out[i] = dataclasses.replace(q, arrival_s=max(0.0, left.pop(0)))
    return out


def lag_breakdown(rec_replay: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Per request matched by vLLM's id: the client's POST against its planned send time (the client's own
    lag), and vLLM's arrival stamp against the POST (connection, HTTP parsing and the API server's loop)."""
    posts = {p["id"]: p for p in rec_replay.get("posts", []) if p["id"]}
    if not posts:
        return None
    client, server = [], []
    planned = sorted(p["post"] for p in posts.values())
    first = planned[0]
    for r in rows:
        p = posts.get(r["request_id"]) or posts.get(str(r["request_id"]).rsplit("-", 1)[0])
        if p is None:
            continue
        server.append(float(r["ts"]) - float(r["e2e_s"]) - p["post"])
        client.append(p["post"] - first)
    if not server:
        return {"matched": 0, "example_row_id": rows[0]["request_id"] if rows else None}
    return {
        "matched": len(server),
        "post_to_stamp_ms": {
            "mean": round(1000 * statistics.mean(server), 1),
            "p50": round(1000 * (nearest_rank(server, 0.5) or 0), 1),
            "p90": round(1000 * (nearest_rank(server, 0.9) or 0), 1),
            "max": round(1000 * max(server), 1),
        },
    }


def analyze(work: Path, *, jitter: bool = False, overhead: str = "fit") -> dict[str, Any]:
    rec = json.loads((work / "record.json").read_text())
    db = make_engine(f"sqlite:///{work / 'kvpilot.db'}")
    checkpoint = work / "checkpoint"
    cfg = _config(checkpoint)
    runs = sorted({r["run_id"] for r in rec["replays"]} | {"capacity"})
    all_steps = stored_steps(db, start=rec["started"], end=rec["ended"] + 60, instances=["tuner-vllm"])
    sim_path = work / "sim.db"  # the simulator's rows, apart from what the collector stored
    sim_path.unlink(missing_ok=True)
    upgrade(f"sqlite:///{sim_path}")
    sim_db = make_engine(f"sqlite:///{sim_path}")
    profile = fit_profile(all_steps, model=_model(checkpoint), block_size=cfg.block_size)
    if overhead != "fit":  # what-if: the cycle's overhead without the per-sequence slope
        a = float(overhead) / 1000 if overhead != "const" else profile.overhead_s + 8 * profile.overhead_per_seq_s
        profile = profile.model_copy(update={"overhead_s": a, "overhead_per_seq_s": 0.0})
    workload = _workload(rec)
    sim = VllmSimBackend(
        profile, workload, sim_db, SLO_PLAN, instance="tuner-vllm-diag", jitter=jitter, keep_steps=True
    )
    out: dict[str, Any] = {
        "profile": {
            "steps": profile.source["steps"],
            "r2": profile.fit.r2,
            "mape": profile.fit.mape,
            "elapsed": profile.elapsed.model_dump(),
            "overhead_ms": round(1000 * profile.overhead_s, 3),
            "overhead_per_seq_ms": round(1000 * profile.overhead_per_seq_s, 4),
            "runs": runs,
        },
        "capacity_rps": rec["capacity_rps"],
        "replays": [],
    }
    for r in rec["replays"]:
        reqs = workload(r["seed"])
        real_steps = stored_steps(db, start=r["start"], end=r["end"], run_ids=[r["run_id"]])
        real_rows = slowest_requests(db, start=r["start"], end=r["end"], limit=100_000, run_id=r["run_id"])
        sim_run = f"diag-sim-{uuid.uuid4().hex[:8]}"
        m = sim.evaluate(cfg, run_id=sim_run, seed=r["seed"])
        rr = sim.last_replay
        assert rr is not None
        sim_steps = stored_steps(sim_db, start=rr.wall_start, end=rr.wall_end + 1, run_ids=[sim_run])
        sim_rows = slowest_requests(sim_db, start=rr.wall_start, end=rr.wall_end + 1, limit=100_000, run_id=sim_run)
        real_window = r["end"] - r["start"]
        real_tokens = sum(int(x["output_tokens"]) for x in real_rows)
        out["replays"].append(
            {
                "load": r["load"],
                "rate_rps": round(r["rate_rps"], 2),
                "requests": len(reqs),
                "loadavg": [r.get("loadavg_before"), r.get("loadavg_after")],
                "throughput": {"real": round(real_tokens / real_window, 1), "sim": round(m.throughput_tps, 1)},
                "real_steps": step_stats(real_steps, profile, real_window),
                "sim_steps": step_stats(sim_steps, profile, rr.wall_end - rr.wall_start),
                "real_requests": request_stats(real_rows),
                "sim_requests": request_stats(sim_rows),
                "arrival_lag": arrival_lag(real_rows, [r["start"] + q.arrival_s for q in reqs]),
                "client_post_lag": arrival_lag(
                    [{"ts": p["post"], "e2e_s": 0.0} for p in r.get("posts", [])],
                    [r["start"] + q.arrival_s for q in reqs],
                ),
                "lag_breakdown": lag_breakdown(r, real_rows),
            }
        )
        row = out["replays"][-1]
        real_busy = sum(s.duration_s for s in real_steps)
        row["error"] = {"planned": _errors(m.throughput_tps, sim.last_busy_s, real_tokens / real_window, real_busy)}
        variants = [("stamped", False), ("queued", True)]
        if r.get("sent_at"):
            variants.insert(0, ("as_sent", None))
        for name, to_queue in variants:
            if to_queue is None:
                seen = as_sent(reqs, r["sent_at"], r["start"])
            else:
                seen = observed_arrivals(reqs, real_rows, r["start"], to_queue=to_queue)
            if seen is None:
                row["error"][name] = "unmatched"
                continue
            obs = VllmSimBackend(profile, lambda _s, seen=seen: seen, sim_db, SLO_PLAN, instance="tuner-vllm-diag")
            mo = obs.evaluate(cfg, run_id=f"diag-obs-{uuid.uuid4().hex[:8]}", seed=r["seed"])
            row["error"][name] = _errors(mo.throughput_tps, obs.last_busy_s, real_tokens / real_window, real_busy)
            row["error"][name]["sim_steps"] = obs.last_replay.steps if obs.last_replay else None
    db.dispose()
    sim_db.dispose()
    return out


def _errors(sim_tps: float, sim_busy: float, real_tps: float, real_busy: float) -> dict[str, Any]:
    return {
        "throughput": round((sim_tps - real_tps) / real_tps, 3),
        "busy": round((sim_busy - real_busy) / real_busy, 3),
        "sim_busy_s": round(sim_busy, 3),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vllm_fidelity_diag")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("dir", type=Path)
    r.add_argument("--loads", default="0.5,1.0,1.5")
    r.add_argument("--duration", type=float, default=8.0)
    a = sub.add_parser("analyze")
    a.add_argument("dir", type=Path)
    a.add_argument("--json", type=Path)
    a.add_argument("--jitter", action="store_true")
    a.add_argument("--overhead", default="fit", help="fit, const, or milliseconds per step")
    args = p.parse_args(argv)
    if args.cmd == "record":
        rec = record(args.dir, loads=[float(x) for x in args.loads.split(",")], duration_s=args.duration)
        print(json.dumps(rec, indent=2))
        return 0
    out = analyze(args.dir, jitter=args.jitter, overhead=args.overhead)
    text = json.dumps(out, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
