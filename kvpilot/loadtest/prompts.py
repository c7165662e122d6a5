"""Prompts of the planned length in the target's own tokens.

A text prompt is exact only for a byte-level tokenizer (kvpilot's engine): `prompt_text(N)` is N tokens
there, but a BPE tokenizer merges its letters, and vLLM's tokenizer made 24% fewer tokens of the same text
than were planned. Where the OpenAI server tokenizes on request (vLLM's `POST /tokenize`) the load tester
asks it once for a pool of its own token ids and sends every prompt as a list of ids (`/v1/completions`
takes `prompt: list[int]`, with no BOS added), so the server sees exactly the planned number of tokens.
Prompts are windows of the pool at offsets fixed by seed and index, so two prompts share no prefix (a
prefix cache would otherwise serve them) and a plan is sent the same way twice. A server without
`/tokenize` gets text prompts, and the report says that their lengths are approximate.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence

import httpx

from kvpilot.loadtest.plan import PlannedRequest, prompt_text

log = logging.getLogger(__name__)

POOL_MARGIN_TOKENS = 256  # the pool is longer than the longest prompt, so windows start at many offsets


async def fetch_token_pool(
    client: httpx.AsyncClient, base_url: str, plan: Sequence[PlannedRequest], *, model: str | None, seed: int
) -> tuple[tuple[int, ...] | None, str]:
    """(the server's token ids of a random text at least as long as the longest prompt, why) or (None, why not)."""
    longest = max((r.prompt_tokens for r in plan), default=1)
    body: dict = {
        "prompt": prompt_text(2 * longest + POOL_MARGIN_TOKENS, index=0, seed=seed),
        "add_special_tokens": False,
    }
    if model:
        body["model"] = model
    try:
        resp = await client.post(f"{base_url}/tokenize", json=body, timeout=30.0)
    except httpx.HTTPError as exc:
        log.warning("loadtest: %s/tokenize failed (%s); sending text prompts", base_url, type(exc).__name__)
        return None, f"text (POST /tokenize failed: {type(exc).__name__}; prompt lengths approximate)"
    tokens = _tokens(resp)
    if tokens is None:
        return None, f"text (no token ids from POST /tokenize: HTTP {resp.status_code}; prompt lengths approximate)"
    return tokens, "token_ids (from the server's POST /tokenize)"


def _tokens(resp: httpx.Response) -> tuple[int, ...] | None:
    if resp.status_code != 200:
        return None
    try:
        tokens = resp.json().get("tokens")
    except (ValueError, AttributeError):
        return None
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, int) and t >= 0 for t in tokens):
        return None
    return tuple(tokens)


def prompt_ids(pool: Sequence[int], tokens: int, index: int, seed: int = 0) -> list[int]:
    """`tokens` ids from `pool`, starting at an offset fixed by (seed, index), wrapping round if need be."""
    offset = random.Random((seed << 24) ^ (index * 2654435761) ^ 0x5EED).randrange(len(pool))
    return [pool[(offset + k) % len(pool)] for k in range(max(1, tokens))]
