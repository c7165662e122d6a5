"""Continuous batching: decide what runs this step under a token budget and the KV memory there is.

One step: (1) the recycler may reclaim memory and name idle sequences the scheduler swaps out;
(2) running sequences, best (priority, arrival) first, get their next chunk — when the KV pool cannot
grow, the worst running sequence is preempted (`recompute`: blocks freed, back to waiting; `swap`:
blocks moved to the host tier) until it fits; (3) only if nothing was preempted, swapped sequences
come back, then waiting ones are admitted (prefix-cache hits skip their cached tokens). The result is
a `SchedulerOutput` the executor runs and `update` consumes — state flows forward, never back.

Two options make it schedule as vLLM V1 does (the tuner's simulator of a vLLM): `enable_chunked_prefill=False`
admits a prompt only when all of it (or all of its first `prefill_chunk_tokens`, vLLM's long-prefill threshold
still applies) fits the step's remaining budget, and `chunk_lone_prefill=False` applies `prefill_chunk_tokens`
only while more than one request is running or waiting.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from engine.config import RecyclerConfig, SchedulerConfig
from engine.kv import KVCacheManager, SwapPlan
from engine.recycler import Recycler, RecycleResult
from engine.request_queue import make_queue
from engine.sequence import SeqStatus, Sequence

EOS_REASON, LENGTH_REASON = "stop", "length"


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    start: int  # tokens already holding KV before this step
    num_new_tokens: int
    samples: bool  # this step computes the last known token, so it yields the next one


@dataclass(slots=True)
class SchedulerOutput:
    step: int
    now: float
    scheduled: list[ScheduledSeq] = field(default_factory=list)  # decodes first, then prefills
    swap_out: list[SwapPlan] = field(default_factory=list)
    swap_in: list[SwapPlan] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_oom: int = 0  # failed KV growths that forced a preemption

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.swap_out and not self.swap_in


@dataclass(slots=True)
class UpdateResult:
    new_tokens: list[tuple[Sequence, int]]
    finished: list[Sequence]
    inter_token_s: list[float]


class Scheduler:
    def __init__(
        self,
        cfg: SchedulerConfig,
        recycler_cfg: RecyclerConfig,
        kv: KVCacheManager,
        *,
        eos_token_id: int,
        max_model_len: int,
        num_priorities: int = 3,
    ) -> None:
        self.cfg = cfg
        self.kv = kv
        self.eos_token_id = eos_token_id
        self.max_model_len = max_model_len
        self.waiting = make_queue("priority", num_classes=num_priorities, aging_s=cfg.aging_s)
        self.running: list[Sequence] = []  # sorted best first by Sequence.order_key
        self.swapped: list[Sequence] = []  # sorted best first
        self.recycler = Recycler(recycler_cfg)
        self.step_id = 0
        self.total_preemptions = 0
        self.total_idle_swaps = 0  # sequences the recycler had swapped out while idle

    def reconfigure(self, cfg: SchedulerConfig, recycler_cfg: RecyclerConfig) -> None:
        self.cfg = cfg
        self.waiting.aging_s = cfg.aging_s
        self.recycler.cfg = recycler_cfg

    # ------------------------------------------------------------------ queue
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.add(seq)

    def abort(self, seq: Sequence) -> bool:
        """Remove `seq` wherever it is and free its memory; False if it was not here."""
        if seq.status == SeqStatus.WAITING:
            found = self.waiting.remove(seq)
        elif seq.status == SeqStatus.RUNNING:
            found = self._discard(self.running, seq)
        elif seq.status == SeqStatus.SWAPPED:
            found = self._discard(self.swapped, seq)
        else:
            return False
        if self.kv.has(seq.seq_id):
            self.kv.free(seq.seq_id)
        seq.status = SeqStatus.FINISHED
        return found

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    # ------------------------------------------------------------------ schedule
    def schedule(self, now: float) -> SchedulerOutput:
        self.step_id += 1
        out = SchedulerOutput(self.step_id, now)
        recycled = self.recycler.maybe_run(now, self.kv, self.running, self.step_id)
        self._swap_out_idle(recycled, out)
        budget = self.cfg.max_num_batched_tokens
        chunk = self.cfg.prefill_chunk_tokens
        if not self.cfg.chunk_lone_prefill and self.num_unfinished <= 1:
            chunk = budget
        decodes: list[ScheduledSeq] = []
        prefills: list[ScheduledSeq] = []
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            n = min(seq.num_uncomputed, chunk, budget)
            while not self.kv.append_slots(seq.seq_id, seq.num_computed_tokens + n):
                out.num_oom += 1
                victim = running.pop()
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                self._schedule(seq, n, decodes, prefills, out)
                budget -= n
                i += 1
        if not out.preempted:
            budget = self._resume_swapped(out, budget, decodes, prefills)
            self._admit_waiting(now, out, budget, decodes, prefills, chunk)
        out.scheduled = decodes + prefills
        return out

    def _schedule(
        self,
        seq: Sequence,
        n: int,
        decodes: list[ScheduledSeq],
        prefills: list[ScheduledSeq],
        out: SchedulerOutput,
    ) -> None:
        start = seq.num_computed_tokens
        samples = start + n == len(seq.token_ids)
        item = ScheduledSeq(seq, start, n, samples)
        seq.last_scheduled_step = out.step
        if n == 1 and samples and seq.num_output_tokens > 0:
            decodes.append(item)
            out.num_decode_tokens += 1
        else:
            prefills.append(item)
            out.num_prefill_tokens += n

    def _resume_swapped(
        self, out: SchedulerOutput, budget: int, decodes: list[ScheduledSeq], prefills: list[ScheduledSeq]
    ) -> int:
        while self.swapped and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            seq = self.swapped[0]
            plan = self.kv.swap_in(seq.seq_id)
            if plan is None:
                break
            self.swapped.pop(0)
            out.swap_in.append(plan)
            if seq.times.swapped_at is not None:
                seq.times.swap_s += out.now - seq.times.swapped_at
                seq.times.swapped_at = None
            seq.status = SeqStatus.RUNNING
            bisect.insort(self.running, seq, key=Sequence.order_key)
            n = min(seq.num_uncomputed, self.cfg.prefill_chunk_tokens, budget)
            if self.kv.append_slots(seq.seq_id, seq.num_computed_tokens + n):
                self._schedule(seq, n, decodes, prefills, out)
                budget -= n
        return budget

    def _admit_waiting(
        self,
        now: float,
        out: SchedulerOutput,
        budget: int,
        decodes: list[ScheduledSeq],
        prefills: list[ScheduledSeq],
        chunk: int,
    ) -> None:
        while budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            seq = self.waiting.peek(now)
            if seq is None:
                break
            alloc = self.kv.allocate(seq.seq_id, seq.request_id, seq.token_ids, min(chunk, budget))
            if alloc is None:
                break  # head of line waits for memory; admitting smaller ones would starve it
            wanted = min(len(seq.token_ids) - alloc.cached_tokens, chunk)
            if not self.cfg.enable_chunked_prefill and alloc.num_new_tokens < wanted:
                self.kv.free(seq.seq_id)  # its prompt (or chunk) must fit this step's budget whole: it waits
                break
            self.waiting.pop(now)
            seq.run_priority = self.waiting.effective_priority(seq, now)
            seq.num_computed_tokens = alloc.cached_tokens
            if seq.times.scheduled is None:
                seq.times.scheduled = now
                seq.num_cached_tokens = alloc.cached_tokens
            seq.status = SeqStatus.RUNNING
            bisect.insort(self.running, seq, key=Sequence.order_key)
            self._schedule(seq, alloc.num_new_tokens, decodes, prefills, out)
            budget -= alloc.num_new_tokens

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Preempt `seq` (already removed from `running`): swap it out if asked and possible, else recompute."""
        out.preempted.append(seq)
        seq.preemptions += 1
        self.total_preemptions += 1
        if self.cfg.preemption_mode == "swap":
            plan = self.kv.swap_out(seq.seq_id)
            if plan is not None:
                self._to_swapped(seq, plan, out)
                return
        self.kv.free(seq.seq_id)
        seq.num_computed_tokens = 0
        self.add(seq)

    def _swap_out_idle(self, recycled: RecycleResult, out: SchedulerOutput) -> None:
        """Swap out the recycler's idle victims, worst first, until its page target is met; a victim the cold tier
        cannot take stays running."""
        pages_left = recycled.pages_to_swap
        for seq in recycled.victims:
            if pages_left <= 0:
                break
            pages = len(self.kv.pages(seq.seq_id))
            plan = self.kv.swap_out(seq.seq_id)
            if plan is None:
                continue
            self._discard(self.running, seq)
            self._to_swapped(seq, plan, out)
            self.total_idle_swaps += 1
            pages_left -= pages

    def _to_swapped(self, seq: Sequence, plan: SwapPlan, out: SchedulerOutput) -> None:
        out.swap_out.append(plan)
        seq.swaps += 1
        seq.times.swapped_at = out.now
        seq.status = SeqStatus.SWAPPED
        bisect.insort(self.swapped, seq, key=Sequence.order_key)

    # ------------------------------------------------------------------ update
    def update(self, out: SchedulerOutput, sampled: list[int | None], now: float) -> UpdateResult:
        """Consume the executor's sampled tokens (aligned with `out.scheduled`)."""
        new_tokens: list[tuple[Sequence, int]] = []
        finished: list[Sequence] = []
        itl: list[float] = []
        for item, token in zip(out.scheduled, sampled, strict=True):
            seq = item.seq
            seq.num_computed_tokens = item.start + item.num_new_tokens
            self.kv.commit(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
            if item.samples:
                assert token is not None, "executor returned no token for a sampling sequence"
                seq.token_ids.append(token)
                times = seq.times
                if times.first_token is None or times.last_token is None:  # both are set on the first token
                    times.prefill_done = times.first_token = now
                else:
                    if times.prefill_done is None:
                        times.prefill_done = now
                    itl.append(now - times.last_token)
                times.last_token = now
                new_tokens.append((seq, token))
                reason = self._finish_reason(seq, token)
                if reason is not None:
                    seq.finish_reason = reason
                    finished.append(seq)
        for seq in finished:
            self._discard(self.running, seq)
            self.kv.free(seq.seq_id)
            seq.status = SeqStatus.FINISHED
            seq.times.finished = now
        return UpdateResult(new_tokens, finished, itl)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        if not params.ignore_eos and (token == self.eos_token_id or token in params.stop_token_ids):
            return EOS_REASON
        if seq.num_output_tokens >= params.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return LENGTH_REASON
        return None

    @staticmethod
    def _discard(items: list[Sequence], seq: Sequence) -> bool:
        idx = bisect.bisect_left(items, seq.order_key(), key=Sequence.order_key)
        if idx < len(items) and items[idx] is seq:
            del items[idx]
            return True
        try:
            items.remove(seq)
        except ValueError:
            return False
        return True
