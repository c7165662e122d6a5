"""The waiting queue behind a small interface with a factory (after vLLM's request_queue.py).

`fcfs`: arrival order. `priority`: priority classes, FCFS inside a class, with aging — every
`aging_s` seconds of waiting raises a request one class, so a low-priority request is never starved
by a steady stream of high-priority ones. Only class heads can be the best candidate (inside a class
the head has waited longest), so pop/peek cost O(classes), not O(queue).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Literal, Protocol, overload

from engine.sequence import Sequence


class RequestQueue(Protocol):
    def add(self, seq: Sequence) -> None: ...
    def add_front(self, seq: Sequence) -> None: ...
    def peek(self, now: float) -> Sequence | None: ...
    def pop(self, now: float) -> Sequence: ...
    def remove(self, seq: Sequence) -> bool: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Sequence]: ...


class FCFSQueue:
    def __init__(self) -> None:
        self._q: deque[Sequence] = deque()

    def add(self, seq: Sequence) -> None:
        self._q.append(seq)

    def add_front(self, seq: Sequence) -> None:
        self._q.appendleft(seq)

    def peek(self, now: float) -> Sequence | None:
        return self._q[0] if self._q else None

    def pop(self, now: float) -> Sequence:
        return self._q.popleft()

    def remove(self, seq: Sequence) -> bool:
        try:
            self._q.remove(seq)
        except ValueError:
            return False
        return True

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._q)


class PriorityAgingQueue:
    def __init__(self, num_classes: int, aging_s: float) -> None:
        self._classes: list[deque[Sequence]] = [deque() for _ in range(num_classes)]
        self.aging_s = aging_s
        self._len = 0

    def effective_priority(self, seq: Sequence, now: float) -> int:
        return max(0, seq.priority - int((now - seq.times.arrival) / self.aging_s))

    def add(self, seq: Sequence) -> None:
        """Append in arrival order inside the class (a preempted request re-enters by arrival)."""
        q = self._classes[seq.priority]
        if q and q[-1].times.arrival > seq.times.arrival:
            idx = len(q)
            while idx > 0 and q[idx - 1].times.arrival > seq.times.arrival:
                idx -= 1
            q.insert(idx, seq)
        else:
            q.append(seq)
        self._len += 1

    def add_front(self, seq: Sequence) -> None:
        self._classes[seq.priority].appendleft(seq)
        self._len += 1

    def _best(self, now: float) -> deque[Sequence] | None:
        best_q, best_key = None, None
        for q in self._classes:
            if q:
                head = q[0]
                key = (self.effective_priority(head, now), head.times.arrival, head.seq_id)
                if best_key is None or key < best_key:
                    best_q, best_key = q, key
        return best_q

    def peek(self, now: float) -> Sequence | None:
        q = self._best(now)
        return q[0] if q else None

    def pop(self, now: float) -> Sequence:
        q = self._best(now)
        if q is None:
            raise IndexError("pop from an empty queue")
        self._len -= 1
        return q.popleft()

    def remove(self, seq: Sequence) -> bool:
        try:
            self._classes[seq.priority].remove(seq)
        except ValueError:
            return False
        self._len -= 1
        return True

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Sequence]:
        for q in self._classes:
            yield from q


@overload
def make_queue(policy: Literal["priority"], *, num_classes: int, aging_s: float) -> PriorityAgingQueue: ...
@overload
def make_queue(policy: str, *, num_classes: int, aging_s: float) -> RequestQueue: ...
def make_queue(policy: str, *, num_classes: int, aging_s: float) -> RequestQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityAgingQueue(num_classes, aging_s)
    raise ValueError(f"unknown scheduling policy {policy!r} (fcfs, priority)")
