"""A request inside the engine: its tokens, how many hold KV, where it is, and when each stage began."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(slots=True)
class StageTimes:
    """Monotonic timestamps of each stage; durations derived from them never go negative."""

    arrival: float
    scheduled: float | None = None
    prefill_done: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    swapped_at: float | None = None  # when it last went to the host tier; None while resident
    swap_s: float = 0.0  # total time spent swapped out


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    times: StageTimes
    token_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    run_priority: int = 0  # the aged priority it was admitted with; preemption order uses it
    preemptions: int = 0
    swaps: int = 0
    warmup: bool = False
    finish_reason: str | None = None
    last_scheduled_step: int = -1

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        self.run_priority = self.priority

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """Still computing tokens it already knows (prompt, or everything after a recompute)."""
        return self.num_uncomputed > 1

    def order_key(self) -> tuple[int, float, int]:
        """Best first: (priority, arrival, id). Preemption takes the largest key."""
        return (self.run_priority, self.times.arrival, self.seq_id)
