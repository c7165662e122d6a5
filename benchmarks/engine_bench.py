"""`kvpilot bench engine`: kvpilot's engine vs Hugging Face `generate` (static batching) and vLLM's server.

One checkpoint (`kvpilot model init` of the bench's shape into a temp dir: head size 32, which vLLM's CPU
attention takes), the same requests (the mixed workload, lengths scaled for CPU, all at t=0), one run:
throughput ratios, latency percentiles, time-averaged internal KV waste per block policy, and the share of
engine wall time spent outside the model forward. vLLM (when an interpreter with it is found) serves the
checkpoint with the engine's limits (max sequences, batched tokens, KV bytes, no prefix cache) and gets the
prompts as token ids through /v1/completions with `ignore_eos`; its start-up (model compile) is reported
apart and excluded from its throughput, and it is paused while the other two run.

Threads: vLLM's CPU build runs its model on all cores but one (the last is its API server's), one thread
per core. kvpilot's engine and HF run in this process with as many torch threads as vLLM's model has, so
the three get the same compute; on a shared 2-core machine that is one thread, which also spares the
in-process engines the spin-waiting of a 2-thread OpenMP team on oversubscribed cores (10x slower there,
measured). Without vLLM the torch default stays.
"""

from __future__ import annotations

import gc
import re
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.vllm_server import PlainVllm, server_args, sigterm_as_exit, vllm_python_or_reason
from benchmarks.vllm_server import send_burst as vllm_burst
from engine import workload as W
from engine.checkpoint import VLLM_CPU_HEAD_SIZES, init_checkpoint
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sequence import SamplingParams
from engine.sinks import NullSink
from engine.stats import FinishedRequest, IterationStats
from plumbing.percentile import nearest_rank
from plumbing.process import free_port

POLICIES = {
    "fixed-16": {"block_policy": "fixed", "block_size": 16},
    "fixed-32": {"block_policy": "fixed", "block_size": 32},
    "fixed-64": {"block_policy": "fixed", "block_size": 64},
    "dynamic": {"block_policy": "dynamic"},
}


class _Recorder:
    """StatLogger keeping what the benchmark needs: step durations, waste, finished requests."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, float, float, int]] = []  # duration, forward, waste, seqs
        self.finished: list[FinishedRequest] = []

    def record(self, stats: IterationStats) -> None:
        self.steps.append((stats.duration_s, stats.forward_s, stats.kv.internal_waste, stats.num_seqs))
        self.finished.extend(stats.finished)

    def record_rejected(self, request: FinishedRequest) -> None:
        return None


def bench_config(quick: bool) -> EngineConfig:
    return EngineConfig.from_dict(
        {
            "device": "cpu",
            "model": {"dim": 256, "n_layers": 4, "n_heads": 8, "n_kv_heads": 2, "ffn_dim": 688, "seed": 0},
            "cache": {"hot_bytes": 256 * 2**20, "cold_bytes": 64 * 2**20, "enable_prefix_cache": False},
            "scheduler": {"max_num_seqs": 32, "max_num_batched_tokens": 2048, "queue_limit": 100_000},
            "telemetry": {"sink": "none", "trace_alloc": False},
        }
    )


def bench_workload(quick: bool) -> list[W.WorkloadRequest]:
    if quick:
        return W.mixed(64, seed=1, scale=8, output_range=(16, 128))
    return W.mixed(192, seed=1, scale=4, output_range=(16, 256))


def run_kvpilot(cfg: EngineConfig, reqs: list[W.WorkloadRequest]) -> dict:
    rec = _Recorder()
    engine = LLMEngine(cfg, sink=NullSink(), stat_loggers=[rec])
    # Warm-up on the workload's own shapes (oneDNN builds kernels per shape on first use).
    for i, r in enumerate(reqs[:16]):
        engine.add_request(W.prompt_ids(r, i), SamplingParams(max_tokens=min(8, r.output_tokens), ignore_eos=True))
    engine.run_until_done()
    rec.steps.clear()
    rec.finished.clear()
    for i, r in enumerate(reqs):
        engine.add_request(W.prompt_ids(r, i), SamplingParams(max_tokens=r.output_tokens, ignore_eos=True))
    t0 = time.perf_counter()
    engine.run_until_done()
    wall = time.perf_counter() - t0
    tokens = sum(f.output_tokens for f in rec.finished)
    step_time = sum(s[0] for s in rec.steps)
    forward = sum(s[1] for s in rec.steps)
    waste = sum(s[0] * s[2] for s in rec.steps) / step_time if step_time else 0.0
    full = [s for s in rec.steps if s[3] >= cfg.scheduler.max_num_seqs]
    full_time = sum(s[0] for s in full)
    return {
        "tokens_per_s": tokens / wall,
        "wall_s": wall,
        "tokens": tokens,
        "e2e": [f.e2e_s for f in rec.finished],
        "ttft": [f.ttft_s for f in rec.finished if f.ttft_s is not None],
        "waste": waste,
        "outside_forward_share": 1.0 - forward / wall,
        "outside_forward_share_full_batch": 1.0 - sum(s[1] for s in full) / full_time if full_time else None,
        "steps": len(rec.steps),
        "engine": engine,
    }


def make_checkpoint(cfg: EngineConfig, directory: Path) -> EngineConfig:
    """`kvpilot model init` of the bench's shape into `directory`; the config that loads it."""
    from engine.tokenizer_train import builtin_corpus

    init_checkpoint(directory, cfg.model, corpus=builtin_corpus())
    return EngineConfig.from_dict(
        {**cfg.model_dump(), "model": {**cfg.model.model_dump(), "checkpoint": str(directory)}}
    )


def run_hf(checkpoint: str, reqs: list[W.WorkloadRequest], batch: int) -> dict:
    """Static batching: arrival-order batches, left padding, every row decodes to the batch's longest."""
    from transformers import LlamaForCausalLM as HFLlama
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = HFLlama.from_pretrained(checkpoint, dtype=torch.float32).eval()
    pad = 258  # a byte-token id the prompts never use at the left edge
    with torch.inference_mode():  # warm-up batch, as the kvpilot run gets
        warm = [W.prompt_ids(r, i) for i, r in enumerate(reqs[:batch])]
        width = max(len(x) for x in warm)
        inp = torch.full((len(warm), width), pad, dtype=torch.long)
        model.generate(
            input_ids=inp,
            attention_mask=torch.ones_like(inp),
            max_new_tokens=4,
            min_new_tokens=4,
            do_sample=False,
            pad_token_id=pad,
        )
    useful = 0
    latencies: list[float] = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for b in range(0, len(reqs), batch):
            group = reqs[b : b + batch]
            ids = [W.prompt_ids(r, b + i) for i, r in enumerate(group)]
            width = max(len(x) for x in ids)
            inp = torch.full((len(ids), width), pad, dtype=torch.long)
            att = torch.zeros((len(ids), width), dtype=torch.long)
            for i, x in enumerate(ids):
                inp[i, width - len(x) :] = torch.tensor(x)
                att[i, width - len(x) :] = 1
            longest = max(r.output_tokens for r in group)
            model.generate(
                input_ids=inp,
                attention_mask=att,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=pad,
            )
            useful += sum(r.output_tokens for r in group)
            latencies.extend([time.perf_counter() - t0] * len(group))
    wall = time.perf_counter() - t0
    return {"tokens_per_s": useful / wall, "wall_s": wall, "e2e": latencies}


def start_vllm(python: str, cfg: EngineConfig, reqs: list[W.WorkloadRequest], workdir: Path) -> PlainVllm:
    """vLLM on the checkpoint with the engine's limits, warmed up like the engine (16 requests, 8 tokens)."""
    assert cfg.model.checkpoint is not None
    port = free_port()
    longest = max(r.prompt_tokens + r.output_tokens for r in reqs)
    args = server_args(
        Path(cfg.model.checkpoint),
        port=port,
        max_model_len=max(512, 1 << (longest - 1).bit_length()),
        kv_cache_bytes=cfg.cache.hot_bytes,
        max_num_seqs=cfg.scheduler.max_num_seqs,
        max_num_batched_tokens=cfg.scheduler.max_num_batched_tokens,
    )
    server = PlainVllm(python, args, port, workdir / "vllm.log").start()
    try:
        warm = reqs[:16]
        prompts = [W.prompt_ids(r, i) for i, r in enumerate(warm)]
        vllm_burst(server.url, prompts, [min(8, r.output_tokens) for r in warm])
    except BaseException:
        server.stop()
        raise
    return server


def run_vllm(server: PlainVllm, reqs: list[W.WorkloadRequest]) -> dict:
    server.resume()
    try:
        prompts = [W.prompt_ids(r, i) for i, r in enumerate(reqs)]
        burst = vllm_burst(server.url, prompts, [r.output_tokens for r in reqs])
    finally:
        server.pause()
    return {"tokens_per_s": burst.tokens_per_s, "wall_s": burst.wall_s, "e2e": burst.e2e_s}


def _vllm_facts(server: PlainVllm) -> dict:
    """vLLM's version and the cores its model threads were bound to, from its own log."""
    text = server.log_path.read_text(errors="replace")
    version = re.search(r"LLM engine \(v([^)]+)\)", text)
    cores = re.search(r"core ids=\[([\d, ]*)\]", text)
    return {
        "version": version[1] if version else None,
        "model_cores": [int(c) for c in cores[1].split(",") if c.strip()] if cores else None,
        "startup_s": round(server.startup_s or 0.0, 1),
    }


def run_engine_bench(
    quick: bool = False,
    progress: Callable[[str], None] | None = None,
    *,
    vllm: bool = True,
    vllm_python: str | None = None,
) -> dict:
    say = progress or (lambda msg: print(msg, file=sys.stderr, flush=True))
    with sigterm_as_exit(), tempfile.TemporaryDirectory(prefix="kvpilot-bench-engine-") as tmp:
        return _run(quick, say, Path(tmp), vllm=vllm, vllm_python=vllm_python)


def _run(quick: bool, say: Callable[[str], None], tmp: Path, *, vllm: bool, vllm_python: str | None) -> dict:
    torch.manual_seed(0)
    cfg = make_checkpoint(bench_config(quick), tmp / "checkpoint")
    reqs = bench_workload(quick)
    reps = 2
    server: PlainVllm | None = None
    skipped = None if vllm else "--no-vllm"
    if vllm and cfg.model.head_dim not in VLLM_CPU_HEAD_SIZES:
        skipped = f"head size {cfg.model.head_dim} is not one vLLM's CPU attention takes ({VLLM_CPU_HEAD_SIZES})"
    python = None
    if skipped is None:
        python, skipped = vllm_python_or_reason(vllm_python)
    threads = previous = torch.get_num_threads()
    if python is not None:
        say("[0/2] starting vLLM on the same checkpoint (compiles the model; excluded from its throughput)")
        server = start_vllm(python, cfg, reqs, tmp)
        server.pause()
        threads = len(_vllm_facts(server)["model_cores"] or [None])
        say(f"      vLLM served after {server.startup_s:.0f} s; its model has {threads} thread(s), so do the others")
    elif skipped:
        say(f"      vLLM left out: {skipped}")
    torch.set_num_threads(threads)
    try:
        return _measure(cfg, reqs, reps, server, skipped, quick, say)
    finally:
        torch.set_num_threads(previous)
        if server is not None:
            server.stop()


def _measure(
    cfg: EngineConfig,
    reqs: list[W.WorkloadRequest],
    reps: int,
    server: PlainVllm | None,
    skipped: str | None,
    quick: bool,
    say: Callable[[str], None],
) -> dict:
    others = "Hugging Face generate" + (" and vLLM" if server is not None else "")
    say(
        f"[1/2] kvpilot engine vs {others} (static batches of {cfg.scheduler.max_num_seqs} for HF): "
        f"{len(reqs)} requests, {sum(r.prompt_tokens for r in reqs)} prompt tokens, {reps} interleaved reps"
    )
    # Interleaved repetitions, best of each: a noisy 2-core machine slows whichever run it hits.
    main: dict | None = None
    hf: dict | None = None
    best_vllm: dict | None = None
    assert cfg.model.checkpoint is not None
    for rep in range(1, reps + 1):
        ours = run_kvpilot(cfg, reqs)
        del ours["engine"]
        say(f"      rep {rep}/{reps} kvpilot: {ours['tokens_per_s']:.0f} tokens/s in {ours['wall_s']:.1f} s")
        theirs = run_hf(cfg.model.checkpoint, reqs, cfg.scheduler.max_num_seqs)
        say(f"      rep {rep}/{reps} hf:      {theirs['tokens_per_s']:.0f} tokens/s in {theirs['wall_s']:.1f} s")
        if main is None or ours["tokens_per_s"] > main["tokens_per_s"]:
            main = ours
        if hf is None or theirs["tokens_per_s"] > hf["tokens_per_s"]:
            hf = theirs
        gc.collect()
        if server is not None:
            served = run_vllm(server, reqs)
            say(f"      rep {rep}/{reps} vllm:    {served['tokens_per_s']:.0f} tokens/s in {served['wall_s']:.1f} s")
            if best_vllm is None or served["tokens_per_s"] > best_vllm["tokens_per_s"]:
                best_vllm = served
    assert main is not None and hf is not None
    say("[2/2] internal waste per block policy")
    waste = {}
    per_policy_tps = {}
    for i, (name, patch) in enumerate(POLICIES.items(), 1):
        if name == "fixed-32":
            res = main
        else:
            pcfg = EngineConfig.from_dict({**cfg.model_dump(), "cache": {**cfg.cache.model_dump(), **patch}})
            res = run_kvpilot(pcfg, reqs)
            res.pop("engine")
        waste[name] = round(res["waste"], 4)
        per_policy_tps[name] = round(res["tokens_per_s"], 1)
        say(f"      {i}/{len(POLICIES)} {name}: waste {res['waste']:.3f}, {res['tokens_per_s']:.0f} tokens/s")
    return {
        "benchmark": "engine",
        "quick": quick,
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "requests": len(reqs),
        "prompt_tokens": sum(r.prompt_tokens for r in reqs),
        "output_tokens": main["tokens"],
        "kvpilot_tokens_per_s": round(main["tokens_per_s"], 1),
        "hf_tokens_per_s": round(hf["tokens_per_s"], 1),
        "ratio": round(main["tokens_per_s"] / hf["tokens_per_s"], 3),
        **_vllm_figures(main, best_vllm, server, skipped),
        "p50_s": round(nearest_rank(main["e2e"], 0.5), 4),
        "p99_s": round(nearest_rank(main["e2e"], 0.99), 4),
        "ttft_p50_s": round(nearest_rank(main["ttft"], 0.5), 4),
        "hf_p50_s": round(nearest_rank(hf["e2e"], 0.5), 4),
        "hf_p99_s": round(nearest_rank(hf["e2e"], 0.99), 4),
        "waste": waste,
        "tokens_per_s_by_policy": per_policy_tps,
        "outside_forward_share": round(main["outside_forward_share"], 4),
        "outside_forward_share_full_batch": (
            round(main["outside_forward_share_full_batch"], 4)
            if main["outside_forward_share_full_batch"] is not None
            else None
        ),
        "max_num_seqs": cfg.scheduler.max_num_seqs,
        "steps": main["steps"],
        "repetitions": reps,
        "checkpoint": {
            "shape": {k: getattr(cfg.model, k) for k in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads")},
            "head_dim": cfg.model.head_dim,
            "loaded_by": ["kvpilot", "hf"] + (["vllm"] if server is not None else []),
        },
    }


def _vllm_figures(main: dict, served: dict | None, server: PlainVllm | None, skipped: str | None) -> dict:
    if served is None or server is None:
        return {"vllm_tokens_per_s": None, "ratio_vs_vllm": None, "vllm_skipped": skipped}
    return {
        "vllm_tokens_per_s": round(served["tokens_per_s"], 1),
        "ratio_vs_vllm": round(main["tokens_per_s"] / served["tokens_per_s"], 3),
        "vllm_p50_s": round(nearest_rank(served["e2e"], 0.5), 4),
        "vllm_p99_s": round(nearest_rank(served["e2e"], 0.99), 4),
        "vllm": _vllm_facts(server),
    }
