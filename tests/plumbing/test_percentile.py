"""The one percentile definition: nearest rank, the ceil(q * n)-th smallest value, rank 1 at least."""

from __future__ import annotations

import pytest

from plumbing.percentile import nearest_rank


def test_nearest_rank_on_small_examples() -> None:
    assert nearest_rank([3, 1, 2, 4], 0.5) == 2  # ceil(2.0) = 2nd smallest; no averaging of 2 and 3
    assert nearest_rank([3, 1, 2, 4], 0.51) == 3  # ceil(2.04) = 3rd
    assert nearest_rank([5, 1, 4, 2, 3], 0.5) == 3
    assert nearest_rank(range(1, 101), 0.99) == 99  # the 99th of 100
    assert nearest_rank(range(1, 11), 0.99) == 10  # ceil(9.9): the largest of 10
    assert nearest_rank([7, 9], 0.0) == 7  # rank 1 at least
    assert nearest_rank([7, 9], 1.0) == 9
    assert nearest_rank([0.25], 0.99) == 0.25


def test_always_a_measured_value() -> None:
    values = [0.1, 0.2, 10.0]
    assert {nearest_rank(values, q / 100) for q in range(101)} <= set(values)


def test_no_values_is_none() -> None:
    assert nearest_rank([], 0.5) is None


@pytest.mark.parametrize("q", [-0.01, 1.01, 99])
def test_quantile_outside_zero_one_is_refused(q: float) -> None:
    with pytest.raises(ValueError, match=r"within \[0, 1\]"):
        nearest_rank([1.0, 2.0], q)
