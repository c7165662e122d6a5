"""Replay of Azure LLM inference traces (AzurePublicDataset: TIMESTAMP, ContextTokens, GeneratedTokens).

TIMESTAMP is either a datetime (`2023-11-16 18:15:46.6805900`, the published files; 7 fractional digits
are cut to microseconds) or plain seconds. Arrivals are offsets from the first row, divided by
`time_scale` (2.0 replays twice as fast); token counts are divided by `length_scale` and clipped to
`max_total_tokens`. Rows past `duration_s` (after scaling) are not sent.
"""

from __future__ import annotations

import csv
from datetime import datetime
from pathlib import Path

from kvpilot.loadtest.plan import PlanError, PlannedRequest, _clip

COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def _timestamp(raw: str) -> float:
    raw = raw.strip()
    try:
        return float(raw)
    except ValueError:
        pass
    head, dot, frac = raw.partition(".")
    text = f"{head}.{frac[:6]}" if dot else head
    for fmt in ("%Y-%m-%d %H:%M:%S.%f", "%Y-%m-%d %H:%M:%S", "%Y-%m-%dT%H:%M:%S.%f", "%Y-%m-%dT%H:%M:%S"):
        try:
            return datetime.strptime(text, fmt).timestamp()
        except ValueError:
            continue
    raise ValueError(f"unrecognised TIMESTAMP {raw!r}")


def load_trace(
    path: Path,
    *,
    duration_s: float | None = None,
    time_scale: float = 1.0,
    length_scale: float = 1.0,
    max_total_tokens: int | None = None,
    max_requests: int | None = None,
) -> list[PlannedRequest]:
    if not time_scale > 0:
        raise PlanError("--trace-time-scale", f"must be positive, got {time_scale}")
    if not length_scale > 0:
        raise PlanError("--length-scale", f"must be positive, got {length_scale}")
    try:
        fh = path.open(newline="", encoding="utf-8")
    except OSError as exc:
        raise PlanError("--trace", f"cannot read {path}: {exc.strerror or exc}") from exc
    rows: list[tuple[float, int, int]] = []
    with fh:
        reader = csv.DictReader(fh)
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise PlanError("--trace", f"{path}: missing column(s) {', '.join(missing)}; need {', '.join(COLUMNS)}")
        for line, row in enumerate(reader, start=2):
            try:
                ts = _timestamp(row["TIMESTAMP"])
                context, generated = int(row["ContextTokens"]), int(row["GeneratedTokens"])
            except (TypeError, ValueError) as exc:
                raise PlanError("--trace", f"{path}:{line}: {exc}") from exc
            if context < 1 or generated < 0:
                raise PlanError("--trace", f"{path}:{line}: token counts must be positive")
            rows.append((ts, context, generated))
    if not rows:
        raise PlanError("--trace", f"{path}: no requests")
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    out: list[PlannedRequest] = []
    for ts, context, generated in rows:
        arrival = (ts - t0) / time_scale
        if duration_s is not None and arrival >= duration_s:
            break
        if max_requests is not None and len(out) >= max_requests:
            break
        prompt = max(2, round(context / length_scale))
        output = max(1, round(generated / length_scale))
        prompt, output = _clip(prompt, output, max_total_tokens)
        kind = "short" if context < 512 else "medium" if context <= 2048 else "long"
        out.append(PlannedRequest(len(out), arrival, prompt, output, kind))
    return out
