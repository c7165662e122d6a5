"""Executors run one scheduled step. Injected (docs/architecture.md, "Engine inside"): `TorchExecutor` runs the
model; the tuner's simulated executor predicts the step's cost and advances a virtual clock instead.

The executor owns the KV memory (hot tensor on the device, cold tensor in host memory) and performs
the swap copies the scheduler planned before running the forward pass.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from engine.config import EngineConfig, ModelConfig
from engine.model import AttentionBatch, DecodeGroup, PrefillSpan
from engine.sampling import sample
from engine.weights import build_model

if TYPE_CHECKING:
    from engine.kv import KVCacheManager
    from engine.scheduler import SchedulerOutput


@dataclass(slots=True)
class ExecuteResult:
    tokens: list[int | None]  # aligned with SchedulerOutput.scheduled; None where nothing was sampled
    forward_s: float  # wall time inside the model forward and sampling


class Executor(Protocol):
    model_cfg: ModelConfig
    device: str

    @property
    def bytes_per_token(self) -> int: ...

    def allocate_cache(self, hot_pages: int, cold_pages: int, page_tokens: int) -> None: ...

    def execute(self, out: SchedulerOutput, kv: KVCacheManager) -> ExecuteResult: ...

    def release(self, seq_ids: Iterable[int]) -> None: ...


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: cuda requested but torch sees no CUDA device")
    return torch.device(name)


def kv_bytes_per_token(cfg: ModelConfig) -> int:
    itemsize = torch.empty((), dtype=getattr(torch, cfg.dtype)).element_size()
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * itemsize


def group_decode_rows(lens: list[int], *, max_groups: int = 4, min_group: int = 4) -> list[list[int]]:
    """Decode rows (indices into `lens`) split into groups of similar context length, longest first.

    A new group starts when a length falls below half the current group's longest (and the group has
    `min_group` rows), so attention does not pad a 50-token context to 2,000. Each group is padded to
    its longest row. The simulator's cost model uses the same grouping (tuner/sim.py).
    """
    order = sorted(range(len(lens)), key=lens.__getitem__, reverse=True)
    groups: list[list[int]] = [[]]
    for i in order:
        if (
            groups[-1]
            and lens[i] * 2 < lens[groups[-1][0]]
            and len(groups) < max_groups
            and len(groups[-1]) >= min_group
        ):
            groups.append([])
        groups[-1].append(i)
    return groups


class _PageTable:
    """Persistent per-sequence page rows on the device, so a decode step indexes one tensor instead of
    rebuilding B x pages Python lists. A row is refreshed incrementally as its sequence grows and
    rebuilt when the KV manager hands the sequence a new page list (swap-in, recompute)."""

    def __init__(self, max_pages: int, device: torch.device) -> None:
        self.max_pages = max_pages
        self.device = device
        self.table = torch.zeros((64, max_pages), dtype=torch.long, device=device)
        self._rows: dict[int, list] = {}  # seq_id -> [row, pages list ref, filled]
        self._free_rows = list(range(63, -1, -1))

    def row(self, seq_id: int, pages: list[int]) -> int:
        entry = self._rows.get(seq_id)
        if entry is None:
            if not self._free_rows:
                self._grow()
            entry = self._rows[seq_id] = [self._free_rows.pop(), pages, 0]
        elif entry[1] is not pages:
            entry[1], entry[2] = pages, 0
        row, _, filled = entry
        if filled < len(pages):
            self.table[row, filled : len(pages)] = torch.tensor(pages[filled:], dtype=torch.long)
            entry[2] = len(pages)
        return row

    def _grow(self) -> None:
        old = self.table.shape[0]
        self.table = torch.cat([self.table, torch.zeros_like(self.table)])
        self._free_rows.extend(range(2 * old - 1, old - 1, -1))

    def release(self, seq_id: int) -> None:
        entry = self._rows.pop(seq_id, None)
        if entry is not None:
            self._free_rows.append(entry[0])


class TorchExecutor:
    def __init__(self, cfg: EngineConfig) -> None:
        self.torch_device = resolve_device(cfg.device)
        self.device = self.torch_device.type
        self.model = build_model(cfg.model, self.torch_device)
        self.model_cfg = self.model.cfg
        self.dtype = getattr(torch, self.model_cfg.dtype)
        self.hot: torch.Tensor | None = None
        self.cold: torch.Tensor | None = None
        self.page_tokens = cfg.cache.page_tokens
        self._pages: _PageTable | None = None

    @property
    def bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.model_cfg)

    def allocate_cache(self, hot_pages: int, cold_pages: int, page_tokens: int) -> None:
        c = self.model_cfg
        shape = (c.n_layers, 2, 0, page_tokens, c.n_kv_heads, c.head_dim)
        self.page_tokens = page_tokens
        # empty + zero_ touches every page now: a calloc'd pool would page-fault inside the first steps.
        self.hot = torch.empty((*shape[:2], hot_pages, *shape[3:]), dtype=self.dtype, device=self.torch_device)
        self.hot.zero_()
        pin = self.torch_device.type == "cuda"
        self.cold = torch.empty((*shape[:2], cold_pages, *shape[3:]), dtype=self.dtype, pin_memory=pin)
        self.cold.zero_()
        self._pages = _PageTable(-(-c.max_position // page_tokens), self.torch_device)

    def _allocated(self) -> tuple[torch.Tensor, torch.Tensor, _PageTable]:
        """The hot and cold tensors and the page table; the engine calls allocate_cache before its first step."""
        if self.hot is None or self.cold is None or self._pages is None:
            raise RuntimeError("allocate_cache has not run")
        return self.hot, self.cold, self._pages

    def release(self, seq_ids: Iterable[int]) -> None:
        page_table = self._allocated()[2]
        for seq_id in seq_ids:
            page_table.release(seq_id)

    def _swap(self, out: SchedulerOutput) -> None:
        hot, cold, _ = self._allocated()
        for plan in out.swap_out:
            for src, dst, n in plan.copies:
                cold[:, :, dst : dst + n].copy_(hot[:, :, src : src + n], non_blocking=True)
        for plan in out.swap_in:
            for src, dst, n in plan.copies:
                hot[:, :, dst : dst + n].copy_(cold[:, :, src : src + n], non_blocking=True)

    def _decode_groups(self, rows: list[int], lens: list[int]) -> list[DecodeGroup]:
        P, dev = self.page_tokens, self.torch_device
        groups = group_decode_rows(lens)
        table = self._allocated()[2].table
        out = []
        for members in groups:
            max_pages = -(-lens[members[0]] // P)
            whole = len(groups) == 1
            idx = None if whole else torch.tensor(members, dtype=torch.long, device=dev)
            row_ids = torch.tensor(rows if whole else [rows[i] for i in members], device=dev)
            group_lens = lens if whole else [lens[i] for i in members]
            mask = None
            if min(group_lens) < max_pages * P:
                span = torch.arange(max_pages * P, device=dev)
                mask = (span[None, :] < torch.tensor(group_lens, device=dev)[:, None])[:, None, None, :]
            out.append(DecodeGroup(idx, table[row_ids, :max_pages], mask))
        return out

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, kv: KVCacheManager) -> ExecuteResult:
        if out.swap_out or out.swap_in:
            self._swap(out)
        if not out.scheduled:
            return ExecuteResult([], 0.0)
        P = self.page_tokens
        dev = self.torch_device
        page_table = self._allocated()[2]
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_at: list[int] = []
        rows: list[int] = []
        lens: list[int] = []
        prefills: list[PrefillSpan] = []
        sample_params = []
        sample_pos = []
        for item in out.scheduled:
            seq, start, n = item.seq, item.start, item.num_new_tokens
            pages = kv.pages(seq.seq_id)
            if n == 1 and item.samples and not prefills and seq.num_output_tokens > 0:  # decode
                ids.append(seq.token_ids[start])
                positions.append(start)
                slots.append(pages[start // P] * P + start % P)
                rows.append(page_table.row(seq.seq_id, pages))
                lens.append(start + 1)
            else:
                t0 = len(ids)
                end = start + n
                ids.extend(seq.token_ids[start:end])
                positions.extend(range(start, end))
                slots.extend([pages[q // P] * P + q % P for q in range(start, end)])
                key_pages = None
                if start > 0:
                    key_pages = torch.tensor(pages[: -(-end // P)], dtype=torch.long).to(dev, non_blocking=True)
                prefills.append(PrefillSpan(t0, n, start, key_pages))
            if item.samples:
                logits_at.append(len(ids) - 1)
                sample_params.append(seq.params)
                sample_pos.append(len(seq.token_ids))
        batch = AttentionBatch(
            write_slots=torch.tensor(slots, dtype=torch.long).to(dev, non_blocking=True),
            num_decode=len(rows),
            decode_groups=self._decode_groups(rows, lens) if rows else [],
            prefills=prefills,
            page_tokens=P,
        )
        input_ids = torch.tensor(ids, dtype=torch.long).to(dev, non_blocking=True)
        pos = torch.tensor(positions, dtype=torch.long).to(dev, non_blocking=True)
        logits_index = torch.tensor(logits_at, dtype=torch.long).to(dev, non_blocking=True)
        t_fwd = time.perf_counter()
        logits = self.model(input_ids, pos, self.hot, batch, logits_index)
        sampled = sample(logits, sample_params, sample_pos)
        forward_s = time.perf_counter() - t_fwd
        it = iter(sampled)
        tokens = [next(it) if item.samples else None for item in out.scheduled]
        return ExecuteResult(tokens, forward_s)
