"""Memory recycling between steps.

`passive`: nothing here — the KV manager reclaims cached prefix blocks only when an allocation fails.
`active`: every `recycle_interval_ms`, when hot-tier occupancy exceeds `threshold`, evict least recently
used cached prefix blocks down to the threshold, so admissions do not pay for eviction later.
`aggressive`: also swap out the lowest-priority idle running sequences (not scheduled last step).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from engine.config import RecyclerConfig

if TYPE_CHECKING:
    from engine.scheduler import Scheduler, SchedulerOutput


class Recycler:
    def __init__(self, cfg: RecyclerConfig) -> None:
        self.cfg = cfg
        self._last_run = -math.inf
        self.runs = 0
        self.pages_recycled = 0
        self.seqs_swapped = 0

    def maybe_run(self, now: float, scheduler: Scheduler, out: SchedulerOutput) -> None:
        cfg = self.cfg
        if cfg.mode == "passive" or (now - self._last_run) * 1000.0 < cfg.recycle_interval_ms:
            return
        self._last_run = now
        self.runs += 1
        kv = scheduler.kv
        excess = kv.hot.used_pages - int(cfg.threshold * kv.hot.num_pages)
        if excess <= 0:
            return
        reclaimed = kv.evict(excess, op="recycle")
        self.pages_recycled += reclaimed
        excess -= reclaimed
        if cfg.mode != "aggressive" or excess <= 0:
            return
        idle = [s for s in scheduler.running if s.last_scheduled_step < scheduler.step_id - 1]
        for seq in reversed(idle):  # running is sorted best first: worst idle first
            if excess <= 0:
                break
            pages = len(kv.pages(seq.seq_id))
            if scheduler.swap_out_idle(seq, out):
                self.seqs_swapped += 1
                excess -= pages
