"""The one percentile definition: nearest rank, as `collector.queries` computes stored figures in SQL.

For n values sorted ascending, the q-quantile (q in [0, 1]) is the k-th smallest with k = ceil(q * n), and
k = 1 when q * n <= 1: always a value that was measured, never an interpolation between two. The p99 of 100
values is the 99th smallest, of 10 values the largest; the p50 of [1, 2, 3, 4] is 2. Benchmarks, the load
tester and the diagnosis figures use this function, so a figure computed here and the same figure read from
the database agree.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def nearest_rank(values: Iterable[float], q: float) -> float | None:
    """The ceil(q * n)-th smallest of `values` (rank 1 at least); None when there are none.

    `q` is a fraction in [0, 1] (0.99 for p99); anything else is a ValueError.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be within [0, 1], got {q}")
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[max(1, math.ceil(q * len(ordered))) - 1]
