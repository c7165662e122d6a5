"""Greedy and temperature/top-p sampling.

Sampling is reproducible per request: the random draw for output position p of a request with seed s
comes from a generator seeded by (s, p), so a preempted-and-recomputed request samples exactly what an
uninterrupted run would, whatever else shares its batch.
"""

from __future__ import annotations

import torch

from engine.sequence import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> list[int]:
    """One token per row of `logits` [S, vocab]."""
    if all(p.greedy for p in params):
        return logits.argmax(dim=-1).tolist()
    greedy = logits.argmax(dim=-1).tolist()
    out = []
    for row, p, pos in zip(range(logits.shape[0]), params, positions, strict=True):
        if p.greedy:
            out.append(greedy[row])
            continue
        probs = torch.softmax(logits[row].float() / p.temperature, dim=-1)
        if p.top_p < 1.0:
            probs = _top_p(probs, p.top_p)
        gen = torch.Generator(device="cpu").manual_seed(_seed(p.seed, pos))
        out.append(int(torch.multinomial(probs.cpu(), 1, generator=gen).item()))
    return out


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_probs, idx = probs.sort(descending=True)
    cumulative = sorted_probs.cumsum(-1)
    keep = cumulative - sorted_probs < top_p  # always keeps the most likely token
    sorted_probs = sorted_probs * keep
    filtered = torch.zeros_like(probs).scatter_(0, idx, sorted_probs)
    return filtered / filtered.sum()


def _seed(seed: int | None, position: int) -> int:
    return ((seed if seed is not None else 0) * 1_000_003 + position) & 0x7FFF_FFFF_FFFF_FFFF
