"""The open-loop run: every planned request is sent at its arrival offset whether or not earlier ones
have finished (as vLLM's benchmark_serving and k6's arrival-rate executors do), so a slow target sees a
growing queue rather than a politely slowed client. `max_concurrency` optionally caps requests in flight
(arrivals then wait for a slot, and `late_starts` counts them). The timing is `plumbing.openloop`'s; the
wire (httpx, streaming) is `client.py`'s.

While the load runs, /metrics is scraped and results are published to the collector if one is given.
Every request ends within its timeout and the run ends within `duration + timeout + drain`, so a run
always stops by itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

import httpx

from kvpilot.loadtest.client import ClientOptions, RequestResult, send
from kvpilot.loadtest.plan import PlannedRequest
from kvpilot.loadtest.prompts import fetch_token_pool
from kvpilot.loadtest.publish import Publisher
from kvpilot.loadtest.scrape import MetricsSample, Scraper
from plumbing.openloop import open_loop

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RunOptions:
    client: ClientOptions = field(default_factory=ClientOptions)
    max_concurrency: int | None = None
    scrape_interval_s: float = 0.5
    collector_url: str | None = None
    collector_token: str | None = None
    publish_drain_s: float = 30.0
    progress: bool = True
    slow_share: float = 0.0
    slow_read_delay_s: float = 0.0


@dataclass(frozen=True, slots=True)
class TimedAction:
    """Something a fault does at `at_s` into the run (kill a collector, bring a receiver back)."""

    at_s: float
    name: str
    action: Callable[[], Awaitable[None]]


@dataclass
class RunResult:
    results: list[RequestResult]
    samples: list[MetricsSample]
    started_wall: float
    wall_s: float
    send_span_s: float
    late_starts: int = 0
    scrape_failures: int = 0
    published: dict | None = None
    actions: list[dict] = field(default_factory=list)
    prompt_form: str = "text"


class TargetUnreachableError(RuntimeError):
    """Nothing answers at the target: the run would only count failures."""


def check_target(base_url: str, *, timeout_s: float = 5.0) -> None:
    """Fail at once with the cause when the target cannot be reached (any HTTP answer will do), rather
    than sending a whole run of requests that all fail the same way."""
    url = base_url.rstrip("/")
    try:
        httpx.get(f"{url}/health", timeout=timeout_s)
    except httpx.TimeoutException:
        raise TargetUnreachableError(f"no answer from {url} within {timeout_s:g} s") from None
    except httpx.HTTPError as exc:
        raise TargetUnreachableError(f"cannot connect to {url}: {_root_cause(exc)}") from None


def _root_cause(exc: BaseException) -> str:
    """The OS's words for the innermost error (`connection refused`, `Name or service not known`)."""
    while (inner := exc.__cause__ or exc.__context__) is not None:
        exc = inner
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower() if isinstance(exc, ConnectionError) else exc.strerror
    return str(exc) or type(exc).__name__


def _is_slow(index: int, share: float) -> bool:
    """Deterministic: every 1/share-th request reads slowly."""
    if share <= 0:
        return False
    step = max(1, round(1 / share))
    return index % step == step - 1


async def run_load(
    base_url: str,
    plan: list[PlannedRequest],
    opts: RunOptions,
    *,
    actions: list[TimedAction] | None = None,
) -> RunResult:
    base_url = base_url.rstrip("/")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    timeout = httpx.Timeout(opts.client.timeout_s, connect=min(10.0, opts.client.timeout_s))
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client, httpx.AsyncClient(timeout=10.0) as side:
        opts, prompt_form = await with_prompts(side, base_url, plan, opts)
        scraper = Scraper(side, base_url, time.perf_counter(), interval_s=opts.scrape_interval_s)
        await scraper.scrape_once()  # the baseline that counters are differenced against
        # the plan's clock starts after that scrape (on a busy target it takes tens of ms): the first requests
        # are then sent when planned, and their lateness is the client's, not its set-up's
        t0 = scraper.t0 = time.perf_counter()
        wall_t0 = time.time()
        publisher = None
        stop_publish = asyncio.Event()
        background = [asyncio.create_task(scraper.run())]
        if opts.collector_url:
            publisher = Publisher(side, opts.collector_url, opts.client.run_id, wall_t0, token=opts.collector_token)
            background.append(asyncio.create_task(publisher.run(stop_publish)))
        done_log: list[dict] = []
        action_errors: list[dict] = []
        timed = sorted(actions or [], key=lambda a: a.at_s)

        async def act(k: int) -> None:
            started = time.perf_counter() - t0
            try:
                await timed[k].action()
            except Exception as exc:  # logged after the requests, with the actions' outcome
                action_errors.append({"action": "error", "error": repr(exc)})
                return
            took = time.perf_counter() - t0 - started
            done_log.append({"action": timed[k].name, "at_s": round(started, 3), "took_s": round(took, 3)})

        acting = asyncio.create_task(open_loop([a.at_s for a in timed], act, t0=t0)) if timed else None
        bar = _progress(len(plan), opts.progress)
        results: list[RequestResult] = []

        async def one(k: int) -> RequestResult:
            req = plan[k]
            delay = opts.slow_read_delay_s if _is_slow(req.index, opts.slow_share) else 0.0
            res = await send(client, base_url, req, opts.client, t0=t0, read_delay_s=delay)
            results.append(res)
            if publisher is not None:
                publisher.add(res)
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(_postfix(results), refresh=False)
            return res

        # the client's own lateness is the open loop's: a loop busy elsewhere (a slow or overloaded client)
        # sends late, and then the target is measured under another load than the plan's (a
        # --max-concurrency wait for a slot comes after it, and is counted in late_starts instead)
        fired = await open_loop([r.arrival_s for r in plan], one, t0=t0, max_in_flight=opts.max_concurrency)
        for res, late in zip(fired.results, fired.late_s, strict=True):
            res.lateness_s = late
        if acting is not None:  # actions are bounded; a hung one is cancelled rather than waited for
            _, pending = await asyncio.wait([acting], timeout=opts.client.timeout_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            done_log.extend(action_errors)
        await scraper.scrape_once()
        scraper.stop()
        published = None
        if publisher is not None:
            stop_publish.set()
            await asyncio.gather(*background, return_exceptions=True)
            drained = await publisher.drain(opts.publish_drain_s)
            published = {
                "collector_url": opts.collector_url,
                "instance": publisher.instance,
                "run_id": publisher.run_id,
                "events": len(results),
                "acknowledged": publisher.acknowledged,
                "unsent": publisher.unsent,
                "duplicate_batches": publisher.duplicates,
                "retries": publisher.retries,
                "drained": drained,
                "last_error": publisher.last_error,
            }
        else:
            await asyncio.gather(*background, return_exceptions=True)
        if bar is not None:
            bar.close()
        results.sort(key=lambda r: r.index)
        return RunResult(
            results,
            scraper.samples,
            wall_t0,
            time.perf_counter() - t0,
            fired.span_s,
            fired.queued,
            scraper.failures,
            published,
            done_log,
            prompt_form,
        )


async def with_prompts(
    client: httpx.AsyncClient, base_url: str, plan: list[PlannedRequest], opts: RunOptions
) -> tuple[RunOptions, str]:
    """`opts` with the server's token pool for OpenAI prompts where it has one (prompts.py); and what the
    prompts are. `/generate` (kvpilot's engine, a byte-level tokenizer) takes text of exactly the planned length."""
    if opts.client.api != "openai":
        return opts, "text (byte-level tokenizer: exact)"
    if opts.client.token_pool is not None:
        return opts, "token_ids"
    pool, form = await fetch_token_pool(client, base_url, plan, model=opts.client.model, seed=opts.client.seed)
    return replace(opts, client=replace(opts.client, token_pool=pool)), form


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="req", desc="loadtest", leave=False, dynamic_ncols=True)


def _postfix(results: list[RequestResult]) -> str:
    ok = sum(r.outcome == "ok" for r in results)
    refused = sum(r.outcome == "refused" for r in results)
    bad = len(results) - ok - refused
    return f"ok={ok} 429={refused} err={bad}"
