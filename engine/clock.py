"""Injected clocks: the real one serves traffic; a virtual one lets the simulator run faster than time."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Monotonic seconds (stage timings, intervals)."""

    def wall(self) -> float:
        """Epoch seconds, UTC (event timestamps)."""


class RealClock:
    def __init__(self) -> None:
        self._offset = time.time() - time.perf_counter()

    def now(self) -> float:
        return time.perf_counter()

    def wall(self) -> float:
        return self._offset + time.perf_counter()


class VirtualClock:
    """Time moves only when told to (by the simulated executor's cost model)."""

    def __init__(self, start_wall: float = 1_700_000_000.0) -> None:
        self._t = 0.0
        self._wall0 = start_wall

    def now(self) -> float:
        return self._t

    def wall(self) -> float:
        return self._wall0 + self._t

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"cannot move a clock backwards ({seconds} s)")
        self._t += seconds

    def advance_to(self, t: float) -> None:
        self._t = max(self._t, t)
