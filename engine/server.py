"""The engine's HTTP API (FastAPI): /generate, /v1/completions (OpenAI subset), /metrics, /health,
/admin/config. Handlers are thin: validate, submit to the loop thread, stream tokens back.

Errors: pydantic validation -> 422 naming the field; requests the engine can never serve -> 400 with
`{"detail": {"field", "message"}}`; queue full -> 429 with Retry-After; admin without/with a wrong
bearer token -> 401/403. The engine keeps serving after any of them.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, HTTPException, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from pydantic import BaseModel, ConfigDict, Field, field_validator

from engine.async_engine import AsyncEngine, RequestHandle
from engine.config import PRIORITY_CLASSES, ConfigError, ModelConfig
from engine.llm_engine import InvalidRequestError, LLMEngine, QueueFullError
from engine.sequence import SamplingParams
from plumbing.body_limit import BodyLimitMiddleware

log = logging.getLogger("kvpilot.engine.server")
MAX_CHARS_PER_TOKEN = 64


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: Annotated[str, Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] = 64
    priority: str | int = "normal"
    stream: bool = False
    temperature: Annotated[float, Field(ge=0.0, le=5.0)] = 0.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    request_id: Annotated[str, Field(min_length=1, max_length=200)] | None = None

    @field_validator("priority", mode="before")
    @classmethod
    def _known_priority(cls, v: object) -> str | int:
        """One clear error for both spellings (a name or a class number), not a union's two."""
        if isinstance(v, str) and v in PRIORITY_CLASSES:
            return v
        if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < len(PRIORITY_CLASSES):
            return v
        raise ValueError(f"priority must be one of {list(PRIORITY_CLASSES)} or 0..{len(PRIORITY_CLASSES) - 1}")


class CompletionRequest(BaseModel):
    """OpenAI /v1/completions, the subset a single-model engine can honour."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=1)]
    )
    max_tokens: Annotated[int, Field(ge=1)] = 16
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    n: Annotated[int, Field(ge=1, le=1)] = 1
    stream: bool = False
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None


def weights_note(model: ModelConfig) -> dict[str, str]:
    """What the weights are, said on /health and in every /generate answer: without `model.checkpoint`
    the weights are random, so the text is noise however well the engine serves it."""
    if model.checkpoint:
        return {"weights": "checkpoint", "checkpoint": model.checkpoint}
    return {
        "weights": "random",
        "note": f"random weights (seed {model.seed}): the text is noise; "
        "set model.checkpoint: DIR to load a Hugging Face Llama checkpoint",
    }


class ServerState:
    def __init__(self, engine: LLMEngine, registry: CollectorRegistry, model_name: str) -> None:
        self.engine = engine
        self.loop = AsyncEngine(engine)
        self.registry = registry
        self.model_name = model_name
        self.weights = weights_note(engine.model_cfg)
        self.started = time.time()


def get_state(request: Request) -> ServerState:
    return request.app.state.kv


StateDep = Annotated[ServerState, Depends(get_state)]


def require_admin(state: StateDep, authorization: Annotated[str | None, Header()] = None) -> None:
    token = state.engine.config.server.admin_token
    if not token:
        raise HTTPException(403, "admin API disabled: set server.admin_token")
    if not authorization or not authorization.startswith("Bearer "):
        raise HTTPException(401, "missing bearer token", headers={"WWW-Authenticate": "Bearer"})
    if not hmac.compare_digest(authorization[7:].encode(), token.encode()):
        raise HTTPException(403, "wrong bearer token")


AdminDep = Annotated[None, Depends(require_admin)]


def create_app(engine: LLMEngine, registry: CollectorRegistry, *, model_name: str = "kvpilot-llama") -> FastAPI:
    state = ServerState(engine, registry, model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.loop.start()
        yield
        state.loop.stop()

    app = FastAPI(title="kvpilot engine", version="1", lifespan=lifespan)
    app.state.kv = state
    refused = Counter(
        "kvpilot_http_body_too_large", "requests refused (413) for a body over server.max_body_bytes", registry=registry
    )
    app.add_middleware(BodyLimitMiddleware, max_bytes=engine.config.server.max_body_bytes, on_refused=refused.inc)

    async def admit(
        state: ServerState, prompt: str, params: SamplingParams, priority: str | int, request_id: str | None
    ) -> RequestHandle:
        # No tokenizer needs more than MAX_CHARS_PER_TOKEN characters for one token: a prompt longer than
        # that many per allowed token can never fit, and is refused before tokenizing it.
        limit = state.engine.config.server.max_prompt_tokens
        if len(prompt) > limit * MAX_CHARS_PER_TOKEN:
            raise HTTPException(
                400, {"field": "prompt", "message": f"prompt of {len(prompt)} characters exceeds {limit} tokens"}
            )
        # Tokenizing a long prompt takes a while: off the event loop, so /health and streams stay live.
        ids = await asyncio.to_thread(state.engine.tokenizer.encode, prompt)
        try:
            return await state.loop.submit(ids, params, priority, request_id)
        except QueueFullError as exc:
            raise HTTPException(429, str(exc), headers={"Retry-After": "1"}) from exc
        except InvalidRequestError as exc:
            raise HTTPException(400, {"field": exc.field, "message": str(exc)}) from exc

    @app.post("/generate")
    async def generate(body: GenerateRequest, state: StateDep, request: Request) -> Any:
        params = SamplingParams(
            max_tokens=body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            seed=body.seed,
            ignore_eos=body.ignore_eos,
        )
        handle = await admit(state, body.prompt, params, body.priority, body.request_id)
        seq = handle.admitted_seq
        decoder = state.engine.tokenizer.stream_decoder()
        if body.stream:

            async def events() -> AsyncIterator[str]:
                try:
                    async for ids in handle.stream():
                        text = "".join(decoder.push(t) for t in ids)
                        yield _sse({"request_id": seq.request_id, "text": text, "token_ids": ids})
                    yield _sse(_generate_result(state, seq, None))
                finally:
                    if seq.finish_reason is None:
                        state.loop.abort(seq.request_id)

            return StreamingResponse(events(), media_type="text/event-stream")
        text = await _collect(handle, decoder, request, state)
        return _generate_result(state, seq, text)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, state: StateDep, request: Request) -> Any:
        prompt = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        params = SamplingParams(
            max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p, seed=body.seed
        )
        handle = await admit(state, prompt, params, "normal", None)
        seq = handle.admitted_seq
        cid = f"cmpl-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        decoder = state.engine.tokenizer.stream_decoder()
        if body.stream:

            async def chunks() -> AsyncIterator[str]:
                text = ""
                try:
                    async for ids in handle.stream():
                        piece = "".join(decoder.push(t) for t in ids)
                        text, piece, stopped = _apply_stop(text, piece, stops)
                        if piece:
                            yield _sse(_completion_chunk(cid, created, state.model_name, piece, None))
                        if stopped:
                            seq.finish_reason = "stop"
                            state.loop.abort(seq.request_id)
                            break
                    yield _sse(_completion_chunk(cid, created, state.model_name, "", seq.finish_reason or "length"))
                    yield "data: [DONE]\n\n"
                finally:
                    if seq.finish_reason is None:
                        state.loop.abort(seq.request_id)

            return StreamingResponse(chunks(), media_type="text/event-stream")
        text = await _collect(handle, decoder, request, state, stops)
        return {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": state.model_name,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": seq.finish_reason or "length"}],
            "usage": {
                "prompt_tokens": seq.num_prompt_tokens,
                "completion_tokens": seq.num_output_tokens,
                "total_tokens": seq.num_prompt_tokens + seq.num_output_tokens,
            },
        }

    @app.get("/metrics")
    async def metrics(state: StateDep) -> PlainTextResponse:
        return PlainTextResponse(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health(state: StateDep) -> JSONResponse:
        sched = state.engine.scheduler
        body = {
            "status": "ok" if state.loop.alive else "down",
            "device": state.engine.executor.device,
            "model": state.model_name,
            **state.weights,
            "running": len(sched.running),
            "waiting": len(sched.waiting),
            "swapped": len(sched.swapped),
            "kv_usage": round(state.engine.kv.usage(), 4),
            "run_id": state.engine.run_id,
            "uptime_s": round(time.time() - state.started, 1),
        }
        return JSONResponse(body, status_code=200 if state.loop.alive else 503)

    @app.get("/admin/config")
    async def get_config(state: StateDep, _: AdminDep) -> dict:
        cfg = state.engine.config
        return {"tunable": cfg.tunable(), "config": cfg.model_dump(mode="json", exclude={"server": {"admin_token"}})}

    @app.put("/admin/config")
    async def put_config(state: StateDep, _: AdminDep, request: Request) -> dict:
        try:
            patch = await request.json()
        except json.JSONDecodeError as exc:
            raise HTTPException(400, {"field": "body", "message": f"not JSON: {exc}"}) from exc
        if isinstance(patch, dict) and "tunable" in patch and len(patch) == 1:
            patch = patch["tunable"]
        try:
            new = await state.loop.call(lambda eng: eng.reconfigure(patch))
        except ConfigError as exc:
            raise HTTPException(422, {"field": exc.field, "message": str(exc)}) from exc
        log.info("admin: config patched %s", patch)
        return {"tunable": new.tunable()}

    return app


async def _collect(
    handle: RequestHandle, decoder: Any, request: Request, state: ServerState, stops: list[str] | None = None
) -> str:
    """Gather the whole output; abort the request if the client goes away or a stop string appears."""
    text = ""
    seq = handle.admitted_seq
    try:
        async for ids in handle.stream():
            piece = "".join(decoder.push(t) for t in ids)
            if stops:
                text, piece, stopped = _apply_stop(text, piece, stops)
                if stopped:
                    seq.finish_reason = "stop"
                    state.loop.abort(seq.request_id)
                    return text
            else:
                text += piece
    except asyncio.CancelledError:
        state.loop.abort(seq.request_id)
        raise
    return text


def _apply_stop(text: str, piece: str, stops: list[str]) -> tuple[str, str, bool]:
    """Append `piece`; if a stop string now occurs, cut at it. Returns (text, emitted piece, stopped)."""
    combined = text + piece
    for stop in stops:
        idx = combined.find(stop, max(0, len(text) - len(stop) + 1))
        if idx != -1:
            return combined[:idx], combined[len(text) : idx], True
    return combined, piece, False


def _generate_result(state: ServerState, seq: Any, text: str | None) -> dict:
    rec = state.engine.request_record(seq, "finished")
    body = {
        "request_id": seq.request_id,
        "model": state.model_name,
        "weights": state.weights["weights"],
        "prompt_tokens": seq.num_prompt_tokens,
        "output_tokens": seq.num_output_tokens,
        "finish_reason": seq.finish_reason,
        "timings": {
            "queue_s": rec.queue_s,
            "prefill_s": rec.prefill_s,
            "ttft_s": rec.ttft_s,
            "decode_s": rec.decode_s,
            "e2e_s": rec.e2e_s,
            "preemptions": rec.preemptions,
            "swaps": rec.swaps,
            "swap_s": rec.swap_s,
        },
        "finished": True,
    }
    if text is not None:
        body["text"] = text
    return body


def _completion_chunk(cid: str, created: int, model: str, text: str, finish: str | None) -> dict:
    return {
        "id": cid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
    }


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
