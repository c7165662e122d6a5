"""Memory recycling between steps.

`passive`: nothing here — the KV manager reclaims cached prefix blocks only when an allocation fails.
`active`: every `recycle_interval_ms`, when hot-tier occupancy exceeds `threshold`, evict least recently
used cached prefix blocks down to the threshold, so admissions do not pay for eviction later.
`aggressive`: also name the lowest-priority idle running sequences (not scheduled last step) as swap victims.

The recycler decides; the scheduler, which owns the running and swapped lists, does the swapping from the
`RecycleResult` it gets back (state flows forward: this module does not know the scheduler).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.config import RecyclerConfig
from engine.kv import KVCacheManager
from engine.sequence import Sequence


@dataclass(frozen=True, slots=True)
class RecycleResult:
    """One recycler pass: the idle sequences to swap out, worst first, until `pages_to_swap` hot pages are free.

    A swap can fail (cold tier full), so the victims are candidates: the scheduler tries them in order and
    stops once it has freed `pages_to_swap`, exactly as the recycler would if it swapped them itself.
    """

    victims: tuple[Sequence, ...] = ()
    pages_to_swap: int = 0


NOTHING = RecycleResult()


class Recycler:
    def __init__(self, cfg: RecyclerConfig) -> None:
        self.cfg = cfg
        self._last_run = -math.inf
        self.runs = 0
        self.pages_recycled = 0

    def maybe_run(self, now: float, kv: KVCacheManager, running: list[Sequence], step_id: int) -> RecycleResult:
        """Evict cached blocks above the threshold; in `aggressive` mode return the idle sequences of `running`
        (sorted best first) to swap out for what eviction could not reclaim."""
        cfg = self.cfg
        if cfg.mode == "passive" or (now - self._last_run) * 1000.0 < cfg.recycle_interval_ms:
            return NOTHING
        self._last_run = now
        self.runs += 1
        excess = kv.hot.used_pages - int(cfg.threshold * kv.hot.num_pages)
        if excess <= 0:
            return NOTHING
        reclaimed = kv.evict(excess, op="recycle")
        self.pages_recycled += reclaimed
        excess -= reclaimed
        if cfg.mode != "aggressive" or excess <= 0:
            return NOTHING
        idle = [s for s in running if s.last_scheduled_step < step_id - 1]
        return RecycleResult(tuple(reversed(idle)), excess)  # running is sorted best first: worst idle first
