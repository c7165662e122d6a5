"""vLLM's engine log as a step source: `--enable-logging-iteration-details` lines become `IterationStep`s.

vLLM 0.32 logs one INFO line per engine iteration (vllm/v1/metrics/loggers.py `_log_iteration_details`):

    (APIServer pid=5795) INFO 12-03 15:02:41 [loggers.py:199] Engine 000: Iteration(1): 3 context requests,
    603 context tokens, 3 generation requests, 3 generation tokens, iteration elapsed time: 36.58 ms,
    CPU KV cache usage: 19.0%

(one line), and at start-up `CPU KV cache size: 8,192 tokens, ...` (`GPU` on CUDA). An `IterationStep` holds
the fields of a step event (`step_event` builds it for the engine's sinks), so a vLLM line is stored as the same
row a kvpilot engine's step event makes (docs/architecture.md):

- `step`: the iteration index; `duration_s`, `forward_s` and `busy_s`: the elapsed time (vLLM measures the
  step as one span, so the three are equal); `num_seqs`: context + generation requests; `prefill_tokens`:
  context tokens; `decode_tokens`: generation tokens.
- `kv_blocks_used` / `kv_blocks_total`: the usage (logged to 0.1%) times the capacity. The capacity is counted
  in vLLM blocks when the block size is known (given by the caller, who can read `vllm:cache_config_info`
  from /metrics, or from `'block_size'` in vLLM's "non-default args" line), else in tokens (blocks of one
  token) from the capacity line, else, before any capacity was seen, in tenths of a percent (total 1000), so
  used / total is the logged usage in every case.
- `queue_depth`: 0. The line does not say how many requests wait; the scraped `vllm:num_requests_waiting`
  series has it.
- `warmup`: dummy iterations (data-parallel ranks with nothing to do). vLLM's own warm-up (profiling and
  compile runs) bypasses the scheduler and logs no iteration lines.
- Engines other than 000 (data-parallel ranks) get the instance `<instance>/dp<N>`.

When a step ran: vLLM logs a step's line after the step, in its API server, once that server has taken
the step's output; when the server falls behind, hundreds of lines come out in one burst. So a line's time
is only a bound (the step ended before it), and `StepPlacer` places each step at the latest end that every
bound allows with consecutive steps of one engine not overlapping (each lasted its elapsed time). The bound
is, best first: the time vLLM put on the line — `LOG_TIME_PREFIX` (`%(created).6f`, the log record's
creation time to the microsecond) set as `VLLM_LOGGING_PREFIX`, which vLLM's formatter expands (`kvpilot
vllm serve` sets it; set it on a vLLM whose file `kvpilot collector tail` reads); with `ts_from_log`, the
line's own time (whole seconds, so the bound is the end of that second); else the time the reader read it
(`read_ts`, taken the moment the line arrived, from an unbuffered child read line by line).

Other lines are skipped; a line that looks like an iteration line but does not parse is counted in
`stats.unparsable` (a changed vLLM format shows up there instead of as silently missing steps). Lines are
cut at `MAX_LINE_CHARS` before matching, so a pathological line costs bounded time.
"""

from __future__ import annotations

import datetime as dt
import re
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

from engine.events import StepEvent

LOG_TIME_PREFIX = "%(created).6f "  # VLLM_LOGGING_PREFIX: vLLM's formatter expands it on every line
MAX_LINE_CHARS = 16_384
MAX_INSTANCE_CHARS = 190  # room for the `/dpN` suffix within the event's 200
PERMILLE = 1000

_ITERATION_MARK = re.compile(r"Iteration\(\d{1,20}\): ")
_ITERATION = re.compile(
    r"(?:Engine (?P<engine>\d{1,6}): )?Iteration\((?P<index>\d{1,18})\): "
    r"(?P<ctx_reqs>\d{1,9}) context requests, (?P<ctx_tokens>\d{1,12}) context tokens, "
    r"(?P<gen_reqs>\d{1,9}) generation requests, (?P<gen_tokens>\d{1,12}) generation tokens, "
    r"iteration elapsed time: (?P<ms>\d{1,12}(?:\.\d{1,9})?) ms(?P<dummy> \(dummy\))?, "
    r"[A-Za-z]{1,16} KV cache usage: (?P<usage>\d{1,3}(?:\.\d{1,6})?)%"
)
_CAPACITY = re.compile(r"[A-Za-z]{1,16}(?: \+ host)? KV cache size: (?P<tokens>\d{1,3}(?:,\d{3}){0,6}|\d{1,20}) tokens")
_BLOCK_SIZE_ARG = re.compile(r"non-default args: \{.{0,8000}?'block_size': (?P<n>\d{1,7})[,}]")
_PRECISE_TIME = re.compile(r"^(?P<epoch>\d{9,11}\.\d{1,9}) ")
_LOG_TIME = re.compile(r"\b(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) (?P<mon>\d\d)-(?P<day>\d\d) (?P<hms>\d\d:\d\d:\d\d) ")


class VllmLogError(ValueError):
    """The parser was given an instance or run id no step event can carry."""


@dataclass
class VllmLogStats:
    lines: int = 0
    iteration_lines: int = 0  # lines that look like iteration lines (parsed or not)
    steps: int = 0  # steps made
    unparsable: int = 0
    truncated: int = 0  # lines longer than MAX_LINE_CHARS (matched on their head only)


@dataclass(frozen=True)
class KvCapacity:
    """What the parser knows about the KV cache: `blocks` when the block size is known, `tokens` from the log."""

    tokens: int | None = None
    block_size: int | None = None
    blocks: int | None = None

    def total(self) -> int:
        if self.blocks:
            return self.blocks
        if self.tokens and self.block_size:
            return max(1, self.tokens // self.block_size)
        return self.tokens or PERMILLE


@dataclass(frozen=True, slots=True)
class IterationStep:
    """One engine iteration as vLLM logged it, in the fields of a step event (module docstring)."""

    instance: str
    run_id: str
    ts: float
    step: int
    duration_s: float
    forward_s: float
    num_seqs: int
    prefill_tokens: int
    decode_tokens: int
    kv_blocks_used: int
    kv_blocks_total: int
    queue_depth: int
    busy_s: float
    warmup: bool


def step_event(step: IterationStep) -> StepEvent:
    """The wire event of one placed step, for the engine's sinks (validated as any event)."""
    return StepEvent(**asdict(step))


class VllmLogParser:
    """Feed it vLLM's log lines in order; it returns an `IterationStep` for each iteration line.

    Each step's `ts` is the bound its line gives (module docstring): the time vLLM prefixed it with, else
    with `ts_from_log` the end of the line's own second (local time, the year guessed from the clock) —
    for a log file read after the fact — else `read_ts`, the time the caller read the line (the clock
    when not given). `StepPlacer` turns these bounds into step times.
    """

    def __init__(
        self,
        *,
        instance: str,
        run_id: str,
        capacity: KvCapacity | None = None,
        ts_from_log: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not 1 <= len(instance) <= MAX_INSTANCE_CHARS:
            raise VllmLogError(f"instance must be 1-{MAX_INSTANCE_CHARS} characters, got {len(instance)}")
        if not 1 <= len(run_id) <= 200:
            raise VllmLogError(f"run id must be 1-200 characters, got {len(run_id)}")
        self.instance = instance
        self.run_id = run_id
        self.capacity = capacity or KvCapacity()
        self.ts_from_log = ts_from_log
        self.clock = clock
        self.stats = VllmLogStats()

    def set_capacity(self, *, blocks: int | None = None, block_size: int | None = None) -> None:
        """What the caller learnt elsewhere (e.g. `vllm:cache_config_info` on /metrics) wins over the log."""
        self.capacity = KvCapacity(
            tokens=self.capacity.tokens,
            block_size=block_size or self.capacity.block_size,
            blocks=blocks or self.capacity.blocks,
        )

    def feed(self, line: str, *, read_ts: float | None = None) -> IterationStep | None:
        self.stats.lines += 1
        if len(line) > MAX_LINE_CHARS:
            self.stats.truncated += 1
            line = line[:MAX_LINE_CHARS]
        if _ITERATION_MARK.search(line) is None:
            self._startup_line(line)
            return None
        self.stats.iteration_lines += 1
        m = _ITERATION.search(line)
        if m is None:
            self.stats.unparsable += 1
            return None
        usage = float(m["usage"]) / 100.0
        if usage > 1.0:
            self.stats.unparsable += 1
            return None
        elapsed_s = float(m["ms"]) / 1000.0
        total = self.capacity.total()
        engine = int(m["engine"] or 0)
        step = IterationStep(
            instance=self.instance if engine == 0 else f"{self.instance}/dp{engine}",
            run_id=self.run_id,
            ts=self._timestamp(line, read_ts),
            step=int(m["index"]),
            duration_s=elapsed_s,
            forward_s=elapsed_s,
            num_seqs=int(m["ctx_reqs"]) + int(m["gen_reqs"]),
            prefill_tokens=int(m["ctx_tokens"]),
            decode_tokens=int(m["gen_tokens"]),
            kv_blocks_used=min(total, round(usage * total)),
            kv_blocks_total=total,
            queue_depth=0,
            busy_s=elapsed_s,
            warmup=m["dummy"] is not None,
        )
        self.stats.steps += 1
        return step

    def _startup_line(self, line: str) -> None:
        if "KV cache size" in line and (m := _CAPACITY.search(line)):
            self.capacity = KvCapacity(
                tokens=int(m["tokens"].replace(",", "")), block_size=self.capacity.block_size, blocks=None
            )
        elif "non-default args" in line and (m := _BLOCK_SIZE_ARG.search(line)):
            self.capacity = KvCapacity(tokens=self.capacity.tokens, block_size=int(m["n"]), blocks=None)

    def _timestamp(self, line: str, read_ts: float | None) -> float:
        now = self.clock() if read_ts is None else read_ts
        if (m := _PRECISE_TIME.match(line)) is not None:
            return float(m["epoch"])
        if not self.ts_from_log or (m := _LOG_TIME.search(line)) is None:
            return now
        year = dt.datetime.fromtimestamp(now).year
        try:
            stamp = dt.datetime.strptime(f"{year}-{m['mon']}-{m['day']} {m['hms']}", "%Y-%m-%d %H:%M:%S")
            if stamp.timestamp() > now + 86400:  # a December line read in January
                stamp = stamp.replace(year=year - 1)
        except ValueError:  # 02-29 of another year, or a mangled field
            return now
        return stamp.timestamp() + 1.0  # logged within that second: the bound is its end


class StepPlacer:
    """Steps at the times they ran, from the bounds their lines give (module docstring).

    Steps are held until the clock (`release(now)`) is `hold_s` past their bound, since a later line of
    the same burst moves them earlier; then, per engine (instance), each step ends at
    min(its bound, the next step's end - the next step's duration), and not before the previous step's
    end plus its own duration (unless its bound says otherwise: a bound is a fact, a duration sum is
    not). `flush()` releases everything (at the end of a read, at exit).
    """

    def __init__(self, *, hold_s: float = 2.0, max_pending: int = 50_000) -> None:
        self.hold_s = hold_s
        self.max_pending = max_pending
        self._pending: dict[str, deque[IterationStep]] = {}
        self._last_end: dict[str, float] = {}
        self.moved = 0  # steps placed before their bound (lines that came out in a burst)

    def push(self, step: IterationStep) -> list[IterationStep]:
        """Hold `step`; return the steps its bound releases."""
        self._pending.setdefault(step.instance, deque()).append(step)
        return self.release(step.ts)

    def release(self, now: float) -> list[IterationStep]:
        return self._release(lambda e: e.ts <= now - self.hold_s)

    def flush(self) -> list[IterationStep]:
        return self._release(lambda _e: True)

    def _release(self, ready: Callable[[IterationStep], bool]) -> list[IterationStep]:
        out: list[IterationStep] = []
        for instance, pending in self._pending.items():
            count = 0
            while count < len(pending) and (ready(pending[count]) or len(pending) - count > self.max_pending):
                count += 1
            if count:
                out.extend(self._place(instance, pending, count))
        return out

    def _place(self, instance: str, pending: deque[IterationStep], count: int) -> list[IterationStep]:
        steps = list(pending)
        ends = [e.ts for e in steps]
        for k in range(len(steps) - 2, -1, -1):
            ends[k] = min(ends[k], ends[k + 1] - steps[k + 1].duration_s)
        placed = []
        last = self._last_end.get(instance)
        for k in range(count):
            step = pending.popleft()
            end = ends[k] if last is None else min(step.ts, max(ends[k], last + step.duration_s))
            if end < step.ts:
                self.moved += 1
                step = replace(step, ts=end)
            placed.append(step)
            last = end
        if last is not None:  # None only when nothing was placed
            self._last_end[instance] = last
        return placed
