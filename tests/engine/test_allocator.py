from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kv.allocator import BuddyAllocator


def test_split_and_coalesce_back_to_one_chunk() -> None:
    a = BuddyAllocator(16, max_order=4)
    starts = [a.allocate(0) for _ in range(16)]
    assert sorted(starts) == list(range(16))
    assert a.allocate(0) is None
    for s in starts:
        a.free(s)
    assert a.free_pages == 16
    assert a.allocate(4) == 0  # fully coalesced


def test_fragmentation_is_free_memory_that_cannot_serve_the_order() -> None:
    a = BuddyAllocator(16, max_order=4)
    small = [a.allocate(0) for _ in range(16)]
    for s in small[::2]:  # free every other page: 8 free pages, no two adjacent
        a.free(s)
    assert a.free_pages == 8
    assert a.fragmentation(0) == 0.0
    assert a.fragmentation(1) == 1.0
    assert a.allocate(1) is None
    assert not a.can_allocate({1: 1})
    assert a.can_allocate({0: 8}) and not a.can_allocate({0: 9})


def test_free_of_unknown_page_is_a_clear_error() -> None:
    a = BuddyAllocator(16, max_order=4)
    with pytest.raises(ValueError, match="not the start of an allocated block"):
        a.free(3)


def test_pool_rounds_down_to_whole_chunks() -> None:
    assert BuddyAllocator(37, max_order=4).num_pages == 32


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 4), st.integers(0, 1000)), max_size=120))
def test_random_alloc_free_keeps_invariants(ops: list[tuple[bool, int, int]]) -> None:
    a = BuddyAllocator(64, max_order=4)
    live: list[int] = []
    for do_alloc, order, pick in ops:
        if do_alloc or not live:
            predicted = a.can_allocate({order: 1})
            start = a.allocate(order)
            assert (start is not None) == predicted
            if start is not None:
                assert start % (1 << order) == 0
                live.append(start)
        else:
            a.free(live.pop(pick % len(live)))
        a.check_invariants()
    for s in live:
        a.free(s)
    assert a.free_pages == 64 and a.allocate(4) is not None
