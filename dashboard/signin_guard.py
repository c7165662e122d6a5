"""How many wrong passwords the dashboard's sign-in evaluates: per client, and for the whole process.

A process-wide lockout (5 wrong guesses from anyone, then nobody for a minute) let one visitor lock
everybody out, the right password included. So the bounds are two:

- per client (its address, else its browser session): `per_client` wrong passwords in `window_s`, then
  that client waits out the window. Everyone else signs in as before.
- for the process: past `overall` wrong passwords in `window_s` from all clients together (many
  addresses, or new sessions), every further check waits its turn, one per `window_s / overall`
  seconds. Guessing is then held to that rate whatever the number of clients, while a right password
  still gets in after the wait. Only when the queue is longer than `max_wait_s` is a check refused
  unevaluated ("try again in N s"): evaluating it would lift the bound.

No Streamlit here (dashboard/auth.py identifies the client); the clock and the sleep are injected.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


class SignInRefused(ValueError):
    """The guess was not evaluated; the message says for how long."""


@dataclass(frozen=True)
class GuardLimits:
    per_client: int = 5
    overall: int = 30
    window_s: float = 60.0
    max_wait_s: float = 10.0
    max_clients: int = 10_000  # clients remembered at once; the stalest are forgotten first


class SignInGuard:
    def __init__(
        self,
        limits: GuardLimits | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.limits = limits or GuardLimits()
        self.clock = clock
        self.sleep = sleep
        self._lock = threading.Lock()
        self._clients: dict[str, deque[float]] = {}
        self._all: deque[float] = deque()
        self._next_turn = 0.0

    def before_check(self, client: str) -> None:
        """Wait for this guess's turn; SignInRefused if the client is locked or the queue is full."""
        limits = self.limits
        with self._lock:
            now = self.clock()
            self._expire(now)
            recent = [t for t in self._clients.get(client, ()) if now - t < limits.window_s]
            if len(recent) >= limits.per_client:
                wait = limits.window_s - (now - recent[0])
                raise SignInRefused(f"too many failed sign-ins from you; try again in {math.ceil(wait)} s")
            wait = 0.0
            if len(self._all) >= limits.overall:
                turn = max(now, self._next_turn)
                wait = turn - now
                if wait > limits.max_wait_s:
                    raise SignInRefused(f"too many failed sign-ins overall; try again in {math.ceil(wait)} s")
                self._next_turn = turn + limits.window_s / limits.overall
        if wait > 0:
            self.sleep(wait)

    def failed(self, client: str) -> None:
        with self._lock:
            now = self.clock()
            self._all.append(now)
            mine = self._clients.pop(client, None) or deque(maxlen=self.limits.per_client)
            mine.append(now)
            self._clients[client] = mine  # re-inserted: the dict stays ordered by last failure
            while len(self._clients) > self.limits.max_clients:
                del self._clients[next(iter(self._clients))]

    def succeeded(self, client: str) -> None:
        with self._lock:
            self._clients.pop(client, None)

    def clear(self) -> None:
        with self._lock:
            self._clients.clear()
            self._all.clear()
            self._next_turn = 0.0

    def _expire(self, now: float) -> None:
        horizon = now - self.limits.window_s
        while self._all and self._all[0] <= horizon:
            self._all.popleft()
        while self._clients:  # ordered by last failure: the stale ones come first
            first = next(iter(self._clients))
            if self._clients[first][-1] > horizon:
                break
            del self._clients[first]
