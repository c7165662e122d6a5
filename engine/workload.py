"""Synthetic workloads shared by the benchmarks, the demo, the load tester and the tuner.

`mixed`: the seed's length mix — 30% short (< 512 prompt tokens), 60% medium (512-2048), 10% long
(> 2048) — with `scale` dividing every length so the same shape fits a CPU. Arrivals are all at once
(offline throughput) or Poisson at `rate` requests/s. `burst` adds +500% load within 2 s.
Prompts are deterministic bytes from the seed, with optional shared prefixes (system prompts).
"""

from __future__ import annotations

import csv
import random
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

SHORT, MEDIUM, LONG = (32, 511), (512, 2048), (2049, 4096)


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    priority: int = 1
    prefix_group: int | None = None
    kind: str = "medium"


def _length(rng: random.Random, bounds: tuple[int, int], scale: float) -> int:
    lo, hi = bounds
    return max(2, int(rng.randint(lo, hi) / scale))


def mixed(
    n: int,
    *,
    seed: int = 0,
    scale: float = 1.0,
    rate: float | None = None,
    output_range: tuple[int, int] = (32, 512),
    output_scale: float = 1.0,
    priorities: tuple[float, float, float] = (0.0, 1.0, 0.0),
    shared_prefix_share: float = 0.0,
) -> list[WorkloadRequest]:
    rng = random.Random(seed)
    out = []
    t = 0.0
    for _ in range(n):
        r = rng.random()
        kind, bounds = ("short", SHORT) if r < 0.3 else ("medium", MEDIUM) if r < 0.9 else ("long", LONG)
        prompt = _length(rng, bounds, scale)
        output = max(1, int(rng.randint(*output_range) / output_scale))
        prio = rng.choices((0, 1, 2), weights=priorities)[0]
        group = rng.randrange(4) if rng.random() < shared_prefix_share else None
        if rate is not None:
            t += rng.expovariate(rate)
        out.append(WorkloadRequest(t, prompt, output, prio, group, kind))
    return out


def burst(
    duration_s: float,
    *,
    base_rate: float,
    burst_at_s: float,
    burst_len_s: float = 2.0,
    factor: float = 6.0,
    seed: int = 0,
    **mix: Any,
) -> list[WorkloadRequest]:
    """Poisson arrivals at `base_rate`, rising to `factor` x (+500%) for `burst_len_s` from `burst_at_s`."""
    rng = random.Random(seed + 1)
    shapes = mixed(int(duration_s * base_rate * factor) + 16, seed=seed, **mix)
    out = []
    t = 0.0
    i = 0
    while i < len(shapes):
        rate = base_rate * (factor if burst_at_s <= t < burst_at_s + burst_len_s else 1.0)
        t += rng.expovariate(rate)
        if t >= duration_s:
            break
        s = shapes[i]
        out.append(WorkloadRequest(t, s.prompt_tokens, s.output_tokens, s.priority, s.prefix_group, s.kind))
        i += 1
    return out


def prompt_ids(req: WorkloadRequest, index: int, *, seed: int = 0, bos: int = 256, prefix_len: int = 64) -> list[int]:
    """Deterministic byte tokens for a request; requests of one prefix group share a leading prefix."""
    rng = random.Random((seed << 20) ^ index)
    body = [rng.randrange(256) for _ in range(req.prompt_tokens - 1)]
    if req.prefix_group is not None:
        prng = random.Random(1_000_003 * (req.prefix_group + 1) + seed)
        n = min(prefix_len, len(body))
        body[:n] = [prng.randrange(256) for _ in range(n)]
    return [bos, *body]


# --- Azure LLM inference traces (TIMESTAMP, ContextTokens, GeneratedTokens) ---------------------------

TRACE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the file and line."""


def _trace_timestamp(raw: str) -> float:
    raw = raw.strip()
    try:
        return float(raw)
    except ValueError:
        pass
    head, dot, frac = raw.partition(".")
    text = f"{head}.{frac[:6]}" if dot else head  # the trace has 7 fractional digits; strptime takes 6
    for fmt in ("%Y-%m-%d %H:%M:%S.%f", "%Y-%m-%d %H:%M:%S", "%Y-%m-%dT%H:%M:%S.%f", "%Y-%m-%dT%H:%M:%S"):
        try:
            return datetime.strptime(text, fmt).replace(tzinfo=UTC).timestamp()
        except ValueError:
            continue
    raise ValueError(f"TIMESTAMP {raw!r} is neither seconds nor a 'YYYY-MM-DD HH:MM:SS[.fff]' datetime")


def read_azure_trace(path: str | Path) -> list[tuple[float, int, int]]:
    """(epoch seconds, context tokens, generated tokens) per row, sorted by time. Timestamps are seconds
    or UTC datetimes as the published traces write them; generated may be 0 (callers clamp)."""
    path = Path(path)
    try:
        fh = path.open(newline="", encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"cannot read {path}: {exc.strerror or exc}") from exc
    rows: list[tuple[float, int, int]] = []
    with fh:
        reader = csv.DictReader(fh)
        missing = [c for c in TRACE_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise TraceError(f"{path}: missing column(s) {', '.join(missing)}; need {', '.join(TRACE_COLUMNS)}")
        for line, row in enumerate(reader, start=2):
            try:
                ts = _trace_timestamp(row["TIMESTAMP"] or "")
                context, generated = int(row["ContextTokens"]), int(row["GeneratedTokens"])
            except (TypeError, ValueError) as exc:
                raise TraceError(f"{path}:{line}: {exc}") from exc
            if context < 1 or generated < 0:
                raise TraceError(f"{path}:{line}: ContextTokens must be >= 1 and GeneratedTokens >= 0")
            rows.append((ts, context, generated))
    if not rows:
        raise TraceError(f"{path}: no requests")
    rows.sort(key=lambda r: r[0])
    return rows
