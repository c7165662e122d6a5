"""One request against the target, timed from the client side.

Outcomes: `ok` (200 and a complete answer), `refused` (a clean 429), `error` (any other status, a broken
stream, a connection failure) and `timeout` (no complete answer within the request timeout). TTFT is the
first streamed token as the client saw it; without streaming it is the server's own `ttft_s`.

Token counts are the server's: `/generate`'s final chunk, and on the OpenAI API the `usage` that a stream
carries in its last chunk when asked (`stream_options.include_usage`). Counting streamed chunks with text
instead came out 11% low against vLLM: a token whose text its detokenizer holds back arrives with a later
one, in one chunk. The chunk count is kept only for a server that sends no usage (`server_counted`).
Planned output lengths are sent as they are (`ignore_eos`, on both APIs), so a replay generates what its
trace says.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Literal

import httpx

from kvpilot.loadtest.plan import PlannedRequest, prompt_text
from kvpilot.loadtest.prompts import prompt_ids

Api = Literal["generate", "openai"]
Outcome = Literal["ok", "refused", "error", "timeout"]


@dataclass(frozen=True, slots=True)
class ClientOptions:
    api: Api = "generate"
    stream: bool = True
    timeout_s: float = 60.0
    seed: int = 0
    run_id: str = "loadtest"
    model: str | None = None
    ignore_eos: bool = True
    token_pool: tuple[int, ...] | None = None  # the server's token ids: OpenAI prompts as ids (prompts.py)


@dataclass(slots=True)
class RequestResult:
    index: int
    request_id: str
    kind: str
    prompt_tokens: int
    max_tokens: int
    scheduled_s: float
    start_s: float = 0.0
    end_s: float = 0.0
    outcome: Outcome = "error"
    http_status: int | None = None
    output_tokens: int = 0
    ttft_s: float | None = None
    server: dict = field(default_factory=dict)
    error: str | None = None
    slow: bool = False
    served_prompt_tokens: int | None = None  # the server's own count (usage), when it gave one
    server_counted: bool = False  # output_tokens is the server's count, not the client's count of chunks
    lateness_s: float = 0.0  # how long after its planned arrival the client began sending it

    @property
    def e2e_s(self) -> float:
        return max(0.0, self.end_s - self.start_s)

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (vLLM's TPOT)."""
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return max(0.0, self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def _body(req: PlannedRequest, opts: ClientOptions, request_id: str) -> dict:
    if opts.api == "openai":
        prompt: str | list[int] = (
            prompt_ids(opts.token_pool, req.prompt_tokens, req.index, opts.seed)
            if opts.token_pool
            else prompt_text(req.prompt_tokens, req.index, opts.seed)
        )
        body: dict = {
            "prompt": prompt,
            "max_tokens": req.max_tokens,
            "temperature": 0.0,
            "stream": opts.stream,
            "ignore_eos": opts.ignore_eos,
        }
        if opts.stream:
            body["stream_options"] = {"include_usage": True}
        if opts.model:
            body["model"] = opts.model
        return body
    return {
        "prompt": prompt_text(req.prompt_tokens, req.index, opts.seed),
        "max_tokens": req.max_tokens,
        "stream": opts.stream,
        "ignore_eos": opts.ignore_eos,
        "temperature": 0.0,
        "request_id": request_id,
    }


async def send(
    client: httpx.AsyncClient,
    base_url: str,
    req: PlannedRequest,
    opts: ClientOptions,
    *,
    t0: float,
    read_delay_s: float = 0.0,
) -> RequestResult:
    """Send `req` and wait (bounded by `opts.timeout_s`) for the full answer; never raises for HTTP trouble."""
    request_id = f"{opts.run_id}-{req.index}"
    res = RequestResult(
        req.index, request_id, req.kind, req.prompt_tokens, req.max_tokens, req.arrival_s, slow=read_delay_s > 0
    )
    path = "/v1/completions" if opts.api == "openai" else "/generate"
    res.start_s = time.perf_counter() - t0
    try:
        async with asyncio.timeout(opts.timeout_s):
            await _exchange(client, base_url + path, _body(req, opts, request_id), opts, res, t0, read_delay_s)
    except TimeoutError:
        res.outcome, res.error = "timeout", f"no complete answer within {opts.timeout_s}s"
    except httpx.HTTPError as exc:
        res.outcome, res.error = "error", f"{type(exc).__name__}: {exc}"[:300]
    except (ValueError, KeyError) as exc:
        res.outcome, res.error = "error", f"bad response: {exc}"[:300]
    res.end_s = time.perf_counter() - t0
    return res


async def _exchange(
    client: httpx.AsyncClient,
    url: str,
    body: dict,
    opts: ClientOptions,
    res: RequestResult,
    t0: float,
    read_delay_s: float,
) -> None:
    async with client.stream("POST", url, json=body) as resp:
        res.http_status = resp.status_code
        if resp.status_code == 429:
            await resp.aread()
            res.outcome = "refused"
            return
        if resp.status_code != 200:
            text = (await resp.aread()).decode("utf-8", "replace")
            res.outcome, res.error = "error", f"HTTP {resp.status_code}: {text[:200]}"
            return
        if not opts.stream:
            data = json.loads(await resp.aread())
            _non_stream(data, opts, res)
            return
        finished = False
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if read_delay_s:
                await asyncio.sleep(read_delay_s)
            if payload == "[DONE]":
                finished = True
                break
            chunk = json.loads(payload)
            finished = _stream_chunk(chunk, opts, res, t0) or finished
        if not finished:
            res.outcome, res.error = "error", "stream ended before the final chunk"
            return
        res.outcome = "ok"


def _stream_chunk(chunk: dict, opts: ClientOptions, res: RequestResult, t0: float) -> bool:
    """Account one SSE chunk; True when it is the final /generate chunk."""
    if opts.api == "openai":
        if chunk.get("usage"):  # the last chunk, with stream_options.include_usage (its choices are empty)
            _usage(chunk["usage"], res)
        choices = chunk.get("choices") or []
        if choices and choices[0].get("text"):
            if not res.server_counted:
                res.output_tokens += 1  # at least one token per chunk: the fallback count, low
            if res.ttft_s is None:
                res.ttft_s = time.perf_counter() - t0 - res.start_s
        return False
    if chunk.get("finished"):
        res.output_tokens = int(chunk["output_tokens"])
        res.server_counted = True
        res.server = chunk.get("timings") or {}
        return True
    if chunk.get("token_ids") and res.ttft_s is None:
        res.ttft_s = time.perf_counter() - t0 - res.start_s
    return False


def _non_stream(data: dict, opts: ClientOptions, res: RequestResult) -> None:
    if opts.api == "openai":
        _usage(data["usage"], res)
    else:
        res.output_tokens = int(data["output_tokens"])
        res.server_counted = True
        res.server = data.get("timings") or {}
        ttft = res.server.get("ttft_s")
        res.ttft_s = float(ttft) if ttft is not None else None
    res.outcome = "ok"


def _usage(usage: dict, res: RequestResult) -> None:
    """The OpenAI `usage` object: the server's own prompt and completion token counts."""
    res.output_tokens = int(usage["completion_tokens"])
    res.server_counted = True
    if usage.get("prompt_tokens") is not None:
        res.served_prompt_tokens = int(usage["prompt_tokens"])
