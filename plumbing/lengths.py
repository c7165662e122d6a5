"""Clipping a request's prompt and output lengths to a context limit (a small model's, a trace's replay).

A workload written for one model (prompts of thousands of tokens) must fit a target with a shorter context.
The rule keeps every request's shape recognisable and never makes a request longer than it was.
"""

from __future__ import annotations


def clip_lengths(prompt: int, output: int, limit: int | None) -> tuple[int, int]:
    """`(prompt, output)` tokens fitted under `limit` (prompt + output); unchanged when they fit or no limit.

    Over the limit, the output is capped at a quarter of it (at least 1 token) and the prompt at what is left
    (at least 2 tokens: the tokenizer's BOS and one more). Both are caps: neither length ever grows, so
    50 + 80 under a limit of 100 becomes 50 + 25, not 75 + 25.
    """
    if limit is None or prompt + output <= limit:
        return prompt, output
    output = min(output, max(1, limit // 4))
    return min(prompt, max(2, limit - output)), output
