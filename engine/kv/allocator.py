"""A buddy allocator over the pages of one KV tier.

Blocks of different sizes (8..128 tokens) share one pool, so a block of 2^k pages must be contiguous
for the attention kernel to address it by (start page, length). A buddy system gives that with O(log)
alloc/free and coalescing, and makes external fragmentation exact to measure: free pages that sit in
free runs smaller than the block size being asked for cannot serve that allocation.
"""

from __future__ import annotations


class BuddyAllocator:
    """Pages [0, num_pages) handed out as aligned runs of 2**order pages."""

    def __init__(self, num_pages: int, max_order: int) -> None:
        if max_order < 0:
            raise ValueError(f"max_order must be >= 0, got {max_order}")
        chunk = 1 << max_order
        self.max_order = max_order
        self.num_pages = (num_pages // chunk) * chunk
        self._free: list[set[int]] = [set() for _ in range(max_order + 1)]
        self._free[max_order].update(range(0, self.num_pages, chunk))
        self._allocated: dict[int, int] = {}
        self.free_pages = self.num_pages

    @property
    def used_pages(self) -> int:
        return self.num_pages - self.free_pages

    def allocate(self, order: int) -> int | None:
        """Start page of a free aligned run of 2**order pages, or None when no run is big enough."""
        if not 0 <= order <= self.max_order:
            raise ValueError(f"order {order} outside 0..{self.max_order}")
        found = order
        while found <= self.max_order and not self._free[found]:
            found += 1
        if found > self.max_order:
            return None
        start = self._free[found].pop()
        while found > order:  # split, keeping the lower half, freeing the upper buddy
            found -= 1
            self._free[found].add(start + (1 << found))
        self._allocated[start] = order
        self.free_pages -= 1 << order
        return start

    def free(self, start: int) -> int:
        """Return the run starting at `start`; coalesces with free buddies. Returns its order."""
        order = self._allocated.pop(start, None)
        if order is None:
            raise ValueError(f"page {start} is not the start of an allocated block")
        self.free_pages += 1 << order
        while order < self.max_order:
            buddy = start ^ (1 << order)
            if buddy not in self._free[order]:
                break
            self._free[order].remove(buddy)
            start = min(start, buddy)
            order += 1
        self._free[order].add(start)
        return order

    def order_of(self, start: int) -> int | None:
        return self._allocated.get(start)

    def can_allocate(self, orders: dict[int, int]) -> bool:
        """Whether `orders` ({order: count}) could all be allocated now, without allocating.

        Simulates the buddy splits on free-run counts, largest requests first, so the answer is exact.
        """
        counts = [len(s) for s in self._free]
        for order in sorted(orders, reverse=True):
            for _ in range(orders[order]):
                found = order
                while found <= self.max_order and counts[found] == 0:
                    found += 1
                if found > self.max_order:
                    return False
                counts[found] -= 1
                while found > order:
                    found -= 1
                    counts[found] += 1
        return True

    def free_pages_serving(self, order: int) -> int:
        """Free pages inside free runs of at least 2**order pages (usable by such an allocation)."""
        return sum(len(self._free[k]) << k for k in range(order, self.max_order + 1))

    def fragmentation(self, order: int) -> float:
        """Share of free memory that cannot serve an allocation of 2**order pages."""
        if self.free_pages == 0:
            return 0.0
        return 1.0 - self.free_pages_serving(order) / self.free_pages

    def check_invariants(self) -> None:
        """Raise AssertionError if runs overlap or counts disagree (used by property tests)."""
        covered: list[tuple[int, int]] = [(s, 1 << o) for s, o in self._allocated.items()]
        for order, starts in enumerate(self._free):
            covered.extend((s, 1 << order) for s in starts)
            for s in starts:
                if s % (1 << order):
                    raise AssertionError(f"free run {s} of order {order} misaligned")
        covered.sort()
        pos = 0
        for start, length in covered:
            if start != pos:
                raise AssertionError(f"gap or overlap at page {pos} (next run starts at {start})")
            pos = start + length
        if pos != self.num_pages:
            raise AssertionError(f"runs cover {pos} of {self.num_pages} pages")
        free = sum(len(s) << o for o, s in enumerate(self._free))
        if free != self.free_pages:
            raise AssertionError(f"free page count {self.free_pages} != {free}")
