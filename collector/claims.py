"""Who owns an instance name, and how many new instances and runs a pusher may create (cardinality).

Owner: whoever claimed the name first, kept in `instance_owners`. A push claims the instances it names
for its identity's name (`collector.identities`: a name outlives its secrets, so rotating a token keeps
the instances); a scrape target claims its instance as `target:<id>`. Then:
- a push may not write into an instance owned by another identity (409; `collector.owners.reassign`
  is the admin's way to move instances, `kvpilot collector tokens reassign`);
- a target may not take an instance owned by another target, or pushed by an identity the admin may not
  pair it with (409, `collector.server.target_routes`);
- a push may write into an instance a target owns: an engine that is also scraped (vLLM: spans and
  iteration lines pushed, /metrics scraped) is one instance, paired by whoever administers targets.

Cardinality: an identity owns at most `max_instances` instances; it may claim at most
`new_instances_per_minute` of them per minute, an instance gain at most `new_runs_per_minute` runs, and
all the instances of one identity together at most `new_runs_per_minute_per_identity` runs (else 100
instances times 100 runs each would pass).
A batch past a bound is refused whole (the check runs inside the batch's transaction, before any row is
written): 429 with Retry-After when waiting helps, 422 when it cannot (the batch alone is past it).
The per-minute windows are this process's (several collectors each allow as much); the totals are the
database's.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field

from sqlalchemy import Connection, func, select, tuple_
from sqlalchemy.dialects import postgresql, sqlite

from collector.errors import CollectorError
from collector.schema import InstanceOwner, Run, ScrapeTarget

TARGET_PREFIX = "target:"
_OWNERS = InstanceOwner.__table__
_RUNS = Run.__table__
_CHUNK = 400  # keys per IN list: far below SQLite's and PostgreSQL's parameter limits


def target_owner(target_id: int) -> str:
    return f"{TARGET_PREFIX}{target_id}"


class InstanceOwnedError(CollectorError):
    """The instance belongs to someone else; `loc` names the field."""

    def __init__(self, message: str, *, loc: str) -> None:
        super().__init__(message)
        self.loc = loc


class CardinalityError(CollectorError):
    """A cardinality bound refused the batch: `retry_after_s` when waiting helps, None when it cannot."""

    def __init__(self, message: str, *, loc: str, reason: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.loc = loc
        self.reason = reason
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class CardinalityLimits:
    max_instances: int = 1000
    new_instances_per_minute: int = 200
    new_runs_per_minute: int = 100
    new_runs_per_minute_per_identity: int = 1000
    window_s: float = 60.0


class RateWindow:
    """How many things each key created in the last `window_s` seconds (thread-safe, pruned as it goes)."""

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self._lock = threading.Lock()
        self._events: dict[str, deque[tuple[float, int]]] = {}

    def _pruned(self, key: str, now: float) -> deque[tuple[float, int]]:
        events = self._events.get(key, deque())
        while events and events[0][0] <= now - self.window_s:
            events.popleft()
        if not events:
            self._events.pop(key, None)
        return events

    def count(self, key: str) -> int:
        with self._lock:
            return sum(n for _, n in self._pruned(key, self.clock()))

    def retry_after(self, key: str, need: int, limit: int) -> float:
        """Seconds until `need` more fit under `limit` (the window's oldest entries expire)."""
        with self._lock:
            now = self.clock()
            events = self._pruned(key, now)
            excess = sum(n for _, n in events) + need - limit
            if excess <= 0:
                return 0.0
            for stamp, n in events:
                excess -= n
                if excess <= 0:
                    return max(0.0, stamp + self.window_s - now)
            return self.window_s

    def add(self, key: str, n: int) -> None:
        if n <= 0:
            return
        with self._lock:
            now = self.clock()
            self._pruned(key, now)
            self._events.setdefault(key, deque()).append((now, n))


@dataclass
class ClaimWindows:
    """The per-minute windows one collector process shares across its requests."""

    limits: CardinalityLimits
    clock: Callable[[], float] = time.monotonic
    instances: RateWindow = field(init=False)
    runs: RateWindow = field(init=False)
    identity_runs: RateWindow = field(init=False)

    def __post_init__(self) -> None:
        self.instances = RateWindow(self.limits.window_s, self.clock)
        self.runs = RateWindow(self.limits.window_s, self.clock)
        self.identity_runs = RateWindow(self.limits.window_s, self.clock)


@dataclass(frozen=True)
class PendingClaims:
    """What a batch creates, counted into the windows once its transaction committed."""

    identity: str
    new_instances: int
    new_runs: dict[str, int]


@dataclass(frozen=True)
class Claims:
    """The claims of one push: `check` inside the batch's transaction, `record` after its commit."""

    identity: str
    windows: ClaimWindows

    def check(self, conn: Connection, rows: dict[str, list[tuple]], now: float) -> PendingClaims:
        limits = self.windows.limits
        runs = {(r[0], r[1]) for kind_rows in rows.values() for r in kind_rows}
        instances = sorted({instance for instance, _ in runs})
        if len(instances) > limits.max_instances:
            raise CardinalityError(
                f"the batch names {len(instances)} instances;"
                f" an ingest identity may own at most {limits.max_instances}",
                loc="events[].instance",
                reason="too_many_instances",
            )
        owners = _owners(conn, instances)
        self._refuse_foreign(owners, instances)
        new_instances = [i for i in instances if i not in owners]
        if new_instances:
            self._check_new_instances(conn, new_instances)
        new_runs = Counter(instance for instance, run_id in runs - _existing_runs(conn, runs))
        for instance, n in sorted(new_runs.items()):
            self._check_new_runs(instance, n)
        if new_runs:
            self._check_identity_runs(sum(new_runs.values()))
        if new_instances:
            _insert_owners(conn, new_instances, self.identity, now)
            self._refuse_foreign(_owners(conn, new_instances), new_instances)  # a concurrent claim won
        return PendingClaims(self.identity, len(new_instances), dict(new_runs))

    def record(self, pending: PendingClaims) -> None:
        self.windows.instances.add(pending.identity, pending.new_instances)
        for instance, n in pending.new_runs.items():
            self.windows.runs.add(instance, n)
        self.windows.identity_runs.add(pending.identity, sum(pending.new_runs.values()))

    def _refuse_foreign(self, owners: dict[str, str], instances: Iterable[str]) -> None:
        for instance in instances:
            owner = owners.get(instance)
            if owner is not None and owner != self.identity and not owner.startswith(TARGET_PREFIX):
                raise InstanceOwnedError(
                    f"instance {instance!r} belongs to another identity; pick another instance name, or have an"
                    " admin move it (kvpilot collector tokens reassign)",
                    loc="events[].instance",
                )

    def _check_new_instances(self, conn: Connection, new: list[str]) -> None:
        limits = self.windows.limits
        owned = conn.execute(select(func.count()).where(_OWNERS.c.owner == self.identity)).scalar_one()
        if owned + len(new) > limits.max_instances:
            raise CardinalityError(
                f"instance {new[0]!r} would be new: this ingest identity owns {owned} instances and may own at most"
                f" {limits.max_instances} (KVPILOT_MAX_INSTANCES_PER_IDENTITY)",
                loc="events[].instance",
                reason="too_many_instances",
            )
        _check_rate(
            self.windows.instances,
            self.identity,
            len(new),
            limits.new_instances_per_minute,
            batch=f"the batch names {len(new)} new instances",
            over=f"instance {new[0]!r} would be new: at most {{n}} new instances a minute"
            " (KVPILOT_MAX_NEW_INSTANCES_PER_MINUTE)",
            loc="events[].instance",
            reason="new_instances_rate",
        )

    def _check_new_runs(self, instance: str, n: int) -> None:
        _check_rate(
            self.windows.runs,
            instance,
            n,
            self.windows.limits.new_runs_per_minute,
            batch=f"the batch starts {n} new runs of instance {instance!r}",
            over=f"instance {instance!r} may start at most {{n}} new runs a minute (KVPILOT_MAX_NEW_RUNS_PER_MINUTE)",
            loc="events[].run_id",
            reason="new_runs_rate",
        )

    def _check_identity_runs(self, n: int) -> None:
        _check_rate(
            self.windows.identity_runs,
            self.identity,
            n,
            self.windows.limits.new_runs_per_minute_per_identity,
            batch=f"the batch starts {n} new runs for one identity",
            over="this identity may start at most {n} new runs a minute across its instances"
            " (KVPILOT_MAX_NEW_RUNS_PER_MINUTE_PER_IDENTITY)",
            loc="events[].run_id",
            reason="new_runs_rate",
        )


def _check_rate(
    window: RateWindow, key: str, n: int, per_minute: int, *, batch: str, over: str, loc: str, reason: str
) -> None:
    """One per-minute cardinality bound: a batch over it alone is a 422 (waiting does not help), a batch that
    would take the last minute's count over it a 429 with the wait that frees enough room."""
    if n > per_minute:
        raise CardinalityError(f"{batch}; at most {per_minute} a minute", loc=loc, reason=reason)
    if window.count(key) + n > per_minute:
        raise CardinalityError(
            over.format(n=per_minute), loc=loc, reason=reason, retry_after_s=window.retry_after(key, n, per_minute)
        )


def sort_known(
    conn: Connection, pushes: Sequence[tuple[Claims, dict[str, list[tuple]]]]
) -> list[bool | CollectorError]:
    """For a group of pushes stored in one transaction (`collector.ingest.store_pushes`), with two reads for all of
    them: True where a push names only instances and runs that exist and its identity may write (it creates
    nothing, so nothing is counted against a bound), False where it would create an instance or a run (it
    goes through `check` alone, where the bounds and the windows see it), or the refusal where an instance
    belongs to another identity (nothing written)."""
    runs_of = [{(r[0], r[1]) for kind_rows in rows.values() for r in kind_rows} for _, rows in pushes]
    every_run: set[tuple[str, str]] = set().union(*runs_of)
    owners = _owners(conn, sorted({instance for instance, _ in every_run}))
    existing = _existing_runs(conn, every_run)
    out: list[bool | CollectorError] = []
    for (claims, _), runs in zip(pushes, runs_of, strict=True):
        instances = sorted({instance for instance, _ in runs})
        if not runs <= existing or any(i not in owners for i in instances):
            out.append(False)
            continue
        try:
            claims._refuse_foreign(owners, instances)
        except InstanceOwnedError as exc:
            out.append(exc)
            continue
        out.append(len(instances) <= claims.windows.limits.max_instances)  # past it: `check` says why
    return out


def _owners(conn: Connection, instances: list[str]) -> dict[str, str]:
    found: dict[str, str] = {}
    for start in range(0, len(instances), _CHUNK):
        chunk = instances[start : start + _CHUNK]
        stmt = select(_OWNERS.c.instance, _OWNERS.c.owner).where(_OWNERS.c.instance.in_(chunk))
        found.update((instance, owner) for instance, owner in conn.execute(stmt))
    return found


def _existing_runs(conn: Connection, runs: set[tuple[str, str]]) -> set[tuple[str, str]]:
    keys = sorted(runs)
    found: set[tuple[str, str]] = set()
    for start in range(0, len(keys), _CHUNK):
        chunk = keys[start : start + _CHUNK]
        stmt = select(_RUNS.c.instance, _RUNS.c.run_id).where(tuple_(_RUNS.c.instance, _RUNS.c.run_id).in_(chunk))
        found.update((i, r) for i, r in conn.execute(stmt))
    return found


def _insert_owners(conn: Connection, instances: list[str], owner: str, now: float) -> None:
    dialect_insert = sqlite.insert if conn.dialect.name == "sqlite" else postgresql.insert
    stmt = dialect_insert(_OWNERS).on_conflict_do_nothing(index_elements=["instance"])
    conn.execute(stmt, [{"instance": i, "owner": owner, "claimed_at": now} for i in instances])


def claim_for_target(conn: Connection, *, instance: str, target_id: int, pushers: Collection[str], now: float) -> None:
    """Claim `instance` for a new target, or refuse: owned by another target, or pushed by an identity not
    in `pushers` (those whose instances the one creating the target may pair with a scrape)."""
    targets = ScrapeTarget.__table__
    other = conn.execute(
        select(targets.c.id).where(targets.c.instance == instance, targets.c.id != target_id).limit(1)
    ).scalar()
    if other is not None:
        raise InstanceOwnedError(f"instance {instance!r} is already scraped by target {other}", loc="instance")
    owner = _owners(conn, [instance]).get(instance)
    if owner is None:
        _insert_owners(conn, [instance], target_owner(target_id), now)
        owner = _owners(conn, [instance])[instance]  # a concurrent claim may have won
        if owner == target_owner(target_id):
            return
    if owner.startswith(TARGET_PREFIX):
        raise InstanceOwnedError(
            f"instance {instance!r} is already scraped by target {owner.removeprefix(TARGET_PREFIX)}", loc="instance"
        )
    if owner not in pushers:
        raise InstanceOwnedError(
            f"instance {instance!r} is pushed by an engine under another identity ({owner}); an admin may move it"
            " first (kvpilot collector tokens reassign)",
            loc="instance",
        )


def release_target(conn: Connection, target_id: int) -> None:
    conn.execute(_OWNERS.delete().where(_OWNERS.c.owner == target_owner(target_id)))
