"""Replay a workload (requests with arrival times) on an engine, the simulator's or the real one.

Requests whose arrival has passed are added between steps with their true arrival time (so queueing
is measured from arrival); when the engine is idle the clock jumps to the next arrival. The real
engine runs on `SkipClock`: real time while it computes, idle gaps skipped, so a replay takes as long
as the engine is busy, not as long as the trace.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from engine import workload as W
from engine.llm_engine import InvalidRequestError, LLMEngine, QueueFullError
from engine.sequence import SamplingParams
from engine.sinks import AnyEvent
from engine.stats import FinishedRequest, IterationStats

log = logging.getLogger("kvpilot.tuner.replay")


class ReplayError(RuntimeError):
    """The replay could not finish (the engine stalled with work left)."""


class SkipClock:
    """Real monotonic time, plus an offset that grows whenever the replay skips an idle gap."""

    def __init__(self) -> None:
        self._offset = 0.0
        self._wall0 = time.time() - time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() + self._offset

    def wall(self) -> float:
        return self._wall0 + self.now()

    def advance_to(self, t: float) -> None:
        gap = t - self.now()
        if gap > 0:
            self._offset += gap


class TrialSink:
    """Keeps the events a trial's objective needs: requests, samples, the KV `oom` records and, if
    `keep_steps`, step events. Other alloc records are dropped here; storing the full trace (and one
    step row per simulated step) would cost more than simulating."""

    def __init__(self, *, keep_steps: bool = True) -> None:
        self.events: list[AnyEvent] = []
        self.keep_steps = keep_steps
        self.dropped = 0

    def emit(self, event: AnyEvent) -> None:
        if (event.type == "alloc" and event.op != "oom") or (event.type == "step" and not self.keep_steps):
            self.dropped += 1
            return
        self.events.append(event)

    def flush(self) -> None:
        return None

    def close(self) -> None:
        return None


class _StepCounter:
    """A StatLogger that notices whether `step()` ran anything and keeps finished requests."""

    def __init__(self) -> None:
        self.steps = 0
        self.finished: list[FinishedRequest] = []
        self.rejected: list[FinishedRequest] = []
        self.preemptions = 0
        self.oom = 0
        self.busy_s = 0.0

    def record(self, stats: IterationStats) -> None:
        self.steps += 1
        self.busy_s += stats.duration_s
        self.preemptions += stats.preemptions
        self.oom += stats.oom_events
        if not stats.warmup:
            self.finished.extend(stats.finished)

    def record_rejected(self, request: FinishedRequest) -> None:
        self.rejected.append(request)


@dataclass
class ReplayResult:
    submitted: int
    rejected: int
    invalid: int
    steps: int
    start: float  # engine clock
    end: float
    wall_start: float  # epoch seconds of the engine's clock: the trial's window in the database
    wall_end: float
    finished: list[FinishedRequest] = field(default_factory=list)
    preemptions: int = 0
    oom: int = 0
    stalled: int = 0
    busy_s: float = 0.0  # the engine's own step time: what the cost model predicts (idle waits excluded)

    @property
    def duration_s(self) -> float:
        return self.end - self.start


def prepare_prompts(requests: Sequence[W.WorkloadRequest], seed: int) -> list[list[int]]:
    """Token ids of every request, made before the clock starts (generation is not engine time)."""
    return [W.prompt_ids(r, i, seed=seed) for i, r in enumerate(requests)]


Prepared = tuple[list[W.WorkloadRequest], list[list[int]]]


def prepared_workload(
    cache: dict[int, Prepared], workload: Callable[[int], list[W.WorkloadRequest]], seed: int
) -> Prepared:
    """A backend's requests for `seed` and their prompts' token ids, made once and kept in `cache`."""
    if seed not in cache:
        reqs = workload(seed)
        if not reqs:
            raise ValueError(f"workload for seed {seed} has no requests")
        cache[seed] = (reqs, prepare_prompts(reqs, seed))
    return cache[seed]


def replay(
    engine: LLMEngine,
    requests: Sequence[W.WorkloadRequest],
    *,
    seed: int = 0,
    prompts: list[list[int]] | None = None,
    on_progress: Callable[[int], None] | None = None,
    max_stall_steps: int = 1000,
) -> ReplayResult:
    """Run `requests` (arrival_s relative to now) to completion on `engine` (whose clock must be a
    VirtualClock or SkipClock). Rejections by admission control are counted, not raised."""
    clock = engine.clock
    if not hasattr(clock, "advance_to"):
        raise TypeError("replay needs a clock with advance_to (VirtualClock or SkipClock)")
    counter = _StepCounter()
    engine.loggers.append(counter)
    prompts = prompts if prompts is not None else prepare_prompts(requests, seed)
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    t0, wall0 = clock.now(), clock.wall()
    nxt = submitted = invalid = rejected = stalled = 0
    idle_steps = 0
    try:
        while nxt < len(order) or engine.has_unfinished():
            now = clock.now()
            while nxt < len(order) and t0 + requests[order[nxt]].arrival_s <= now:
                i = order[nxt]
                req = requests[i]
                nxt += 1
                params = SamplingParams(max_tokens=req.output_tokens, ignore_eos=True)
                try:
                    engine.add_request(
                        prompts[i], params, priority=req.priority, request_id=f"w{i}", arrival=t0 + req.arrival_s
                    )
                    submitted += 1
                except QueueFullError:
                    rejected += 1
                except InvalidRequestError as exc:
                    invalid += 1
                    log.warning("replay: request w%d skipped: %s", i, exc)
            if engine.has_unfinished():
                before = counter.steps
                engine.step()
                if counter.steps == before:  # nothing could be scheduled
                    idle_steps += 1
                    if nxt < len(order):
                        clock.advance_to(t0 + requests[order[nxt]].arrival_s)
                        idle_steps = 0
                    elif idle_steps >= max_stall_steps:
                        stalled = _abort_all(engine, [f"w{i}" for i in order[:nxt]])
                        log.error("replay: engine stalled with %d requests left; aborted them", stalled)
                        break
                else:
                    idle_steps = 0
                    if on_progress is not None and counter.finished:
                        on_progress(len(counter.finished))
            elif nxt < len(order):
                clock.advance_to(t0 + requests[order[nxt]].arrival_s)
    finally:
        engine.loggers.remove(counter)
    engine.events.maybe_sample(queue_depth=0, running=0, force=True)
    return ReplayResult(
        submitted=submitted,
        rejected=rejected,
        invalid=invalid,
        steps=counter.steps,
        start=t0,
        end=clock.now(),
        wall_start=wall0,
        wall_end=clock.wall(),
        finished=counter.finished,
        preemptions=counter.preemptions,
        oom=counter.oom,
        stalled=stalled,
        busy_s=counter.busy_s,
    )


def _abort_all(engine: LLMEngine, request_ids: Sequence[str]) -> int:
    left = [rid for rid in request_ids if engine.get_request(rid) is not None]
    for rid in left:
        engine.abort(rid)
    return len(left)
