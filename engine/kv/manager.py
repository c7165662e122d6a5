"""The KV cache manager: per-sequence block tables over a hot (device) and a cold (host) tier.

Bookkeeping only — it never touches tensors. It tells the executor which pages hold which tokens
(`pages`) and which page runs to copy between tiers (`SwapPlan`); the executor owns the memory.
Names follow vLLM's block manager (allocate, append_slots, free, swap_out, swap_in).

Accounting is exact and incremental: `capacity` (token slots allocated to sequences) and `stored`
(slots holding a computed token) give internal waste; the buddy allocators give usage and
external fragmentation. Cached-but-unreferenced prefix blocks still occupy memory until evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from engine.config import CacheConfig
from engine.kv.allocator import BuddyAllocator
from engine.kv.policy import BlockSizePolicy

TraceFn = Callable[[str, "str | None", int, int, str], None]  # op, request_id, blocks, block_size, tier


class KVCacheError(ValueError):
    """Misuse of the manager (unknown sequence, double allocate): a bug in the caller."""


@dataclass(slots=True, eq=False)
class Block:
    start: int
    order: int
    size: int
    ref_count: int = 1
    block_hash: int | None = None
    tokens: tuple[int, ...] | None = None


@dataclass(slots=True)
class SeqKV:
    request_id: str | None
    blocks: list[Block] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    capacity: int = 0
    stored: int = 0
    tier: str = "hot"
    hashed_blocks: int = 0
    last_hash: int = 0


@dataclass(frozen=True, slots=True)
class KVAllocation:
    """Result of a first allocation: how much of the prompt the prefix cache already holds."""

    cached_tokens: int
    num_new_tokens: int


@dataclass(frozen=True, slots=True)
class SwapPlan:
    """Page runs to copy: (source start page, destination start page, pages)."""

    direction: str  # "out" (hot -> cold) or "in" (cold -> hot)
    copies: tuple[tuple[int, int, int], ...]

    @property
    def num_pages(self) -> int:
        return sum(c[2] for c in self.copies)


@dataclass(frozen=True, slots=True)
class KVStats:
    hot_pages_total: int
    hot_pages_used: int
    cached_pages: int
    cold_pages_total: int
    cold_pages_used: int
    usage: float
    occupancy: float
    cold_usage: float
    internal_waste: float
    fragmentation: float
    prefix_queries: int
    prefix_hits: int


def _order(pages: int) -> int:
    return pages.bit_length() - 1


class KVCacheManager:
    def __init__(
        self,
        cfg: CacheConfig,
        *,
        bytes_per_token: int,
        trace: TraceFn | None = None,
        watermark: float = 0.01,
    ) -> None:
        self.page_tokens = cfg.page_tokens
        self.page_bytes = bytes_per_token * cfg.page_tokens
        self.bytes_per_token = bytes_per_token
        max_order = _order(128 // cfg.page_tokens) if cfg.page_tokens <= 128 else 0
        self.hot = BuddyAllocator(cfg.hot_bytes // self.page_bytes, max_order)
        self.cold = BuddyAllocator(cfg.cold_bytes // self.page_bytes, max_order)
        if self.hot.num_pages == 0:
            raise ValueError(
                f"cache.hot_bytes ({cfg.hot_bytes}) is below one 128-token chunk "
                f"({self.page_bytes << max_order} bytes for this model)"
            )
        self.policy = BlockSizePolicy.from_config(cfg)
        self.prefix_caching = cfg.enable_prefix_cache
        self.watermark_pages = int(self.hot.num_pages * watermark)
        self.trace = trace
        self._seqs: dict[int, SeqKV] = {}
        self._cache: dict[int, Block] = {}
        self._evictable: OrderedDict[int, Block] = OrderedDict()  # hash -> block, LRU first
        self.cached_pages = 0
        self.capacity = 0
        self.stored = 0
        self.prefix_queries = 0
        self.prefix_hits = 0

    # ------------------------------------------------------------------ configuration
    def set_policy(self, cfg: CacheConfig) -> None:
        """Hot-reload: new blocks follow the new policy; existing blocks stay as they are."""
        self.policy = BlockSizePolicy.from_config(cfg)
        self.prefix_caching = cfg.enable_prefix_cache
        if not self.prefix_caching:
            self.evict(self.hot.num_pages, op="recycle")

    # ------------------------------------------------------------------ queries
    def has(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def pages(self, seq_id: int) -> list[int]:
        """Hot pages of the sequence in token order (live list: read, never mutate)."""
        return self._seqs[seq_id].pages

    def tier_of(self, seq_id: int) -> str | None:
        kv = self._seqs.get(seq_id)
        return kv.tier if kv else None

    def num_blocks(self, seq_id: int) -> int:
        return len(self._seqs[seq_id].blocks)

    def block_sizes(self, seq_id: int) -> list[int]:
        return [b.size for b in self._seqs[seq_id].blocks]

    def usage(self) -> float:
        """Hot pages held by sequences (memory pressure). Cached prefix blocks nobody references are
        reclaimable on demand, so — as in vLLM's kv_cache_usage — they do not count; see occupancy()."""
        return (self.hot.used_pages - self.cached_pages) / self.hot.num_pages

    def occupancy(self) -> float:
        """Hot pages in use, cached prefix blocks included (what the active recycler trims)."""
        return self.hot.used_pages / self.hot.num_pages

    def pages_needed(self, num_tokens: int) -> int:
        """Pages a fresh sequence of `num_tokens` tokens takes under the current policy."""
        return sum(size for _, size in self.policy.layout(0, num_tokens)) // self.page_tokens

    def stats(self) -> KVStats:
        order = _order(self.policy.max_size() // self.page_tokens)
        return KVStats(
            hot_pages_total=self.hot.num_pages,
            hot_pages_used=self.hot.used_pages,
            cached_pages=self.cached_pages,
            cold_pages_total=self.cold.num_pages,
            cold_pages_used=self.cold.used_pages,
            usage=self.usage(),
            occupancy=self.occupancy(),
            cold_usage=self.cold.used_pages / self.cold.num_pages if self.cold.num_pages else 0.0,
            internal_waste=1.0 - self.stored / self.capacity if self.capacity else 0.0,
            fragmentation=self.hot.fragmentation(order),
            prefix_queries=self.prefix_queries,
            prefix_hits=self.prefix_hits,
        )

    # ------------------------------------------------------------------ allocation
    def allocate(
        self, seq_id: int, request_id: str | None, token_ids: Sequence[int], budget: int
    ) -> KVAllocation | None:
        """First allocation of a waiting sequence: reuse cached prefix blocks, then allocate up to
        `budget` new tokens. None (and nothing changed) when memory is short, keeping a watermark free
        so admitting one sequence does not immediately force a preemption."""
        if seq_id in self._seqs:
            raise KVCacheError(f"sequence {seq_id} already holds KV blocks")
        kv = SeqKV(request_id)
        hits = self._lookup_prefix(token_ids) if self.prefix_caching else []
        cached = 0
        for key, block in hits:
            if block.ref_count == 0:
                del self._evictable[key]
                self.cached_pages -= block.size // self.page_tokens
            block.ref_count += 1
            self._append_block(kv, block)
            kv.last_hash = key
            cached += block.size
        kv.hashed_blocks = len(hits)
        if token_ids:
            self.prefix_queries += 1
            self.prefix_hits += bool(hits)
        num_new = min(len(token_ids) - cached, budget)
        self._seqs[seq_id] = kv
        self.capacity += kv.capacity
        kv.stored = cached
        self.stored += cached
        if not self._grow(kv, cached + num_new, reserve=self.watermark_pages, admission=True):
            self.free(seq_id, trace=False)
            return None
        return KVAllocation(cached, num_new)

    def append_slots(self, seq_id: int, num_tokens: int) -> bool:
        """Make room for the sequence's first `num_tokens` tokens. False (nothing changed) if it cannot."""
        kv = self._seqs.get(seq_id)
        if kv is None or kv.tier != "hot":
            raise KVCacheError(f"sequence {seq_id} has no hot blocks")
        return kv.capacity >= num_tokens or self._grow(kv, num_tokens, reserve=0)

    def commit(self, seq_id: int, token_ids: Sequence[int], num_computed: int) -> None:
        """The first `num_computed` tokens now hold KV: count them and publish newly full blocks."""
        kv = self._seqs[seq_id]
        self.stored += num_computed - kv.stored
        kv.stored = num_computed
        if not self.prefix_caching:
            return
        pos = sum(b.size for b in kv.blocks[: kv.hashed_blocks])
        while kv.hashed_blocks < len(kv.blocks):
            block = kv.blocks[kv.hashed_blocks]
            if pos + block.size > num_computed:
                break
            tokens = tuple(token_ids[pos : pos + block.size])
            key = hash((kv.last_hash, block.size, tokens))
            if block.block_hash is None and key not in self._cache:
                block.block_hash, block.tokens = key, tokens
                self._cache[key] = block
            kv.last_hash = key
            kv.hashed_blocks += 1
            pos += block.size

    def free(self, seq_id: int, *, trace: bool = True) -> None:
        """Release the sequence's blocks, tail first, so the LRU evicts tails before shared prefixes."""
        kv = self._seqs.pop(seq_id, None)
        if kv is None:
            raise KVCacheError(f"sequence {seq_id} holds no KV blocks")
        self.capacity -= kv.capacity
        self.stored -= kv.stored
        allocator = self.hot if kv.tier == "hot" else self.cold
        freed: dict[int, int] = {}
        for block in reversed(kv.blocks):
            block.ref_count -= 1
            if block.ref_count > 0:
                continue
            if kv.tier == "hot" and block.block_hash is not None and self.prefix_caching:
                self._evictable[block.block_hash] = block
                self.cached_pages += block.size // self.page_tokens
            else:
                self._release(allocator, block)
                freed[block.size] = freed.get(block.size, 0) + 1
        if trace:
            for size, count in freed.items():
                self._trace("free", kv.request_id, count, size, kv.tier)

    # ------------------------------------------------------------------ tiers
    def swap_out(self, seq_id: int) -> SwapPlan | None:
        """Move the sequence to the cold tier. None (nothing changed) when the cold tier is full."""
        kv = self._seqs.get(seq_id)
        if kv is None or kv.tier != "hot":
            raise KVCacheError(f"sequence {seq_id} is not in the hot tier")
        return self._move(kv, self.hot, self.cold, "out")

    def swap_in(self, seq_id: int) -> SwapPlan | None:
        """Bring a swapped sequence back to the hot tier. None (nothing changed) when memory is short."""
        kv = self._seqs.get(seq_id)
        if kv is None or kv.tier != "cold":
            raise KVCacheError(f"sequence {seq_id} is not in the cold tier")
        return self._move(kv, self.cold, self.hot, "in")

    def evict(self, max_pages: int, *, op: str = "evict") -> int:
        """Drop least recently used cached prefix blocks holding up to `max_pages` pages."""
        reclaimed = 0
        counts: dict[int, int] = {}
        while self._evictable and reclaimed < max_pages:
            key, block = self._evictable.popitem(last=False)
            del self._cache[key]
            pages = block.size // self.page_tokens
            self.cached_pages -= pages
            reclaimed += pages
            self.hot.free(block.start)
            counts[block.size] = counts.get(block.size, 0) + 1
        for size, count in counts.items():
            self._trace(op, None, count, size, "hot")
        return reclaimed

    def reset_prefix_cache(self) -> int:
        """Drop every cached prefix block nobody holds, so the next request of a replayed workload starts as
        cold as the first time (vLLM's `reset_prefix_cache`); blocks running sequences hold stay cached.
        Returns the pages freed."""
        return self.evict(self.hot.num_pages)

    # ------------------------------------------------------------------ internals
    def _lookup_prefix(self, token_ids: Sequence[int]) -> list[tuple[int, Block]]:
        """The cached blocks of the prompt's longest cached prefix, each with its hash."""
        hits: list[tuple[int, Block]] = []
        parent = 0
        limit = len(token_ids) - 1  # the last prompt token is always computed: its logits are needed
        for pos, size in self.policy.layout(0, limit):
            if pos + size > limit:
                break
            tokens = tuple(token_ids[pos : pos + size])
            key = hash((parent, size, tokens))
            block = self._cache.get(key)
            if block is None or block.tokens != tokens:
                break
            hits.append((key, block))
            parent = key
        return hits

    def _append_block(self, kv: SeqKV, block: Block) -> None:
        kv.blocks.append(block)
        kv.pages.extend(range(block.start, block.start + (block.size // self.page_tokens)))
        kv.capacity += block.size

    def _grow(self, kv: SeqKV, num_tokens: int, *, reserve: int, admission: bool = False) -> bool:
        layout = self.policy.layout(kv.capacity, num_tokens)
        need = sum(size for _, size in layout) // self.page_tokens
        if self.hot.free_pages - need < reserve or not self._fits(layout):
            self._reclaim_for(layout, need + reserve)
            if self.hot.free_pages - need < reserve or not self._fits(layout):
                if not admission:  # a running sequence cannot grow: the scheduler must preempt
                    self._trace("oom", kv.request_id, len(layout), layout[0][1], "hot")
                return False
        added: dict[int, int] = {}
        for _, size in layout:
            start = self.hot.allocate(_order(size // self.page_tokens))
            assert start is not None  # _fits() simulated exactly this sequence of allocations
            self._append_block(kv, Block(start, _order(size // self.page_tokens), size))
            self.capacity += size
            added[size] = added.get(size, 0) + 1
        for size, count in added.items():
            self._trace("alloc", kv.request_id, count, size, "hot")
        return True

    def _fits(self, layout: list[tuple[int, int]]) -> bool:
        orders: dict[int, int] = {}
        for _, size in layout:
            order = _order(size // self.page_tokens)
            orders[order] = orders.get(order, 0) + 1
        return self.hot.can_allocate(orders)

    def _reclaim_for(self, layout: list[tuple[int, int]], pages: int) -> None:
        """Passive recycling: evict cached blocks one at a time until the layout fits (or none left)."""
        while self._evictable and (self.hot.free_pages < pages or not self._fits(layout)):
            self.evict(1)

    def _release(self, allocator: BuddyAllocator, block: Block) -> None:
        if block.block_hash is not None and self._cache.get(block.block_hash) is block:
            del self._cache[block.block_hash]
        allocator.free(block.start)

    def _move(self, kv: SeqKV, src: BuddyAllocator, dst: BuddyAllocator, direction: str) -> SwapPlan | None:
        orders: dict[int, int] = {}
        for block in kv.blocks:
            orders[block.order] = orders.get(block.order, 0) + 1
        if not dst.can_allocate(orders) and dst is self.hot:
            layout = [(0, b.size) for b in kv.blocks]
            self._reclaim_for(layout, kv.capacity // self.page_tokens)
        if not dst.can_allocate(orders):
            return None
        copies = []
        moved: list[Block] = []
        for block in kv.blocks:
            start = dst.allocate(block.order)
            assert start is not None  # can_allocate() simulated exactly these allocations
            copies.append((block.start, start, 1 << block.order))
            moved.append(Block(start, block.order, block.size))
            block.ref_count -= 1
            if block.ref_count == 0:
                if direction == "out" and block.block_hash is not None and self.prefix_caching:
                    self._evictable[block.block_hash] = block
                    self.cached_pages += block.size // self.page_tokens
                else:
                    self._release(src, block)
        kv.blocks, kv.pages = [], []
        capacity, kv.capacity = kv.capacity, 0
        for block in moved:
            self._append_block(kv, block)
        assert kv.capacity == capacity
        kv.tier = "cold" if direction == "out" else "hot"
        kv.hashed_blocks, kv.last_hash = 0, 0
        if direction == "out":
            kv.pages = []
        sizes: dict[int, int] = {}
        for block in moved:
            sizes[block.size] = sizes.get(block.size, 0) + 1
        tier = "cold" if direction == "out" else "hot"
        for size, count in sizes.items():
            self._trace("swap_" + direction, kv.request_id, count, size, tier)
        return SwapPlan(direction, tuple(copies))

    def _trace(self, op: str, request_id: str | None, blocks: int, block_size: int, tier: str) -> None:
        if self.trace is not None:
            self.trace(op, request_id, blocks, block_size, tier)

    def check_invariants(self) -> None:
        """Exact accounting or AssertionError (property tests call this after every operation)."""
        self.hot.check_invariants()
        self.cold.check_invariants()
        owners: dict[tuple[str, int], Block] = {}
        refs: dict[int, int] = {}
        capacity = stored = 0
        for seq_id, kv in self._seqs.items():
            capacity += kv.capacity
            stored += kv.stored
            if kv.stored > kv.capacity:
                raise AssertionError(f"seq {seq_id} stores {kv.stored} tokens in {kv.capacity} slots")
            if sum(b.size for b in kv.blocks) != kv.capacity:
                raise AssertionError(f"seq {seq_id} capacity disagrees with its blocks")
            allocator = self.hot if kv.tier == "hot" else self.cold
            for block in kv.blocks:
                if allocator.order_of(block.start) != block.order:
                    raise AssertionError(f"seq {seq_id} holds page {block.start} not allocated in {kv.tier}")
                prior = owners.setdefault((kv.tier, block.start), block)
                if prior is not block:
                    raise AssertionError(f"page {block.start} ({kv.tier}) owned by two distinct blocks")
                refs[id(block)] = refs.get(id(block), 0) + 1
            if kv.tier == "hot":
                expect = [p for b in kv.blocks for p in range(b.start, b.start + (1 << b.order))]
                if kv.pages != expect:
                    raise AssertionError(f"seq {seq_id} page list disagrees with its blocks")
        for block in owners.values():
            if block.ref_count != refs[id(block)]:
                raise AssertionError(f"block at {block.start}: ref_count {block.ref_count}, {refs[id(block)]} owners")
        cached = 0
        for key, block in self._evictable.items():
            if block.ref_count != 0 or self._cache.get(key) is not block:
                raise AssertionError(f"evictable block {block.start} is referenced or not cached")
            if ("hot", block.start) in owners:
                raise AssertionError(f"evictable block {block.start} is still owned")
            owners[("hot", block.start)] = block
            cached += block.size // self.page_tokens
        hot_owned = sum(1 << b.order for (tier, _), b in owners.items() if tier == "hot")
        cold_owned = sum(1 << b.order for (tier, _), b in owners.items() if tier == "cold")
        if hot_owned != self.hot.used_pages or cold_owned != self.cold.used_pages:
            raise AssertionError(
                f"leak: hot {hot_owned}/{self.hot.used_pages} cold {cold_owned}/{self.cold.used_pages} pages"
            )
        if (capacity, stored, cached) != (self.capacity, self.stored, self.cached_pages):
            raise AssertionError("capacity/stored/cached counters drifted")
