"""Where a vLLM-CPU server's processes run: its model worker alone on the cores it bound, the rest beside it.

vLLM's CPU build binds its model worker's threads to a set of cores (`VLLM_CPU_OMP_THREADS_BIND=auto`: on this
project's 2-vCPU machines core 0, with core 1 "reserved") but leaves the API server and the engine core free to
run anywhere, the worker's core included. Wherever the kernel happens to put them decides how often they take the
worker's core. A hand test here, two servers of one config alternating on one fixed load (48 or 96 requests of
200+64 tokens, 16 at a time), four measurements per server and round, the other server stopped:

- left where they are: 831-4,507 tokens/s within one server, and the two servers' ratio 0.60-1.44 across five
  rounds (0.92, 0.70, 0.74, 0.60, 1.44);
- with the API server, the engine core and the load's client on the cores the worker does not use: within 4% in
  each round (1,021-1,095 in one, 3,802-4,091 in another), the servers' ratios 0.98 and 1.02.

`kvpilot bench vllm-placement` repeats the experiment on the tuner's own measurement (docs/benchmarks.md): left as
started, the second-started of two servers measured faster in all 8 rounds. What stays is how fast the machine is
from one minute to the next, which a paired, alternating comparison cancels; what goes is a placement drawn anew
by every server and every few seconds, which nothing cancels. So the tuner, for the servers it starts, keeps
everything but the worker off the worker's cores (`isolate_worker`) and sends its replays from those cores too
(`tuner.vllm.backend`). A server whose worker is bound to nothing (a GPU build, or a CPU build told not to bind)
is left as it is: there is no core to keep free. A server attached rather than started is the operator's and is
never touched.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("kvpilot.vllm.placement")

WORKER_COMM = "VLLM::Worker"  # the model worker's process name (VLLM::Worker, VLLM::Worker_TP1, ...)
PROC = Path("/proc")


@dataclass(frozen=True)
class Placement:
    """What `isolate_worker` did: the cores the worker runs on, where everything else of the server now runs, and
    how many threads it moved there."""

    worker_cpus: frozenset[int]
    other_cpus: frozenset[int]
    moved: int

    def describe(self) -> str:
        return f"model worker on cores {_cpus(self.worker_cpus)}, the rest on {_cpus(self.other_cpus)}"


def group_processes(pgid: int, proc: Path = PROC) -> dict[int, str]:
    """The processes of process group `pgid`, pid -> name (/proc/PID/comm); those gone while read are skipped."""
    found: dict[int, str] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            comm = (entry / "comm").read_text().strip()
        except OSError:  # it exited between the listing and the read
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, ...
        if int(fields[2]) == pgid:
            found[int(entry.name)] = comm
    return found


def worker_cpus(processes: dict[int, str]) -> frozenset[int] | None:
    """The cores the model worker(s) among `processes` may run on; None when there is no worker."""
    cpus: set[int] = set()
    for pid, comm in processes.items():
        if comm.startswith(WORKER_COMM):
            try:
                cpus |= os.sched_getaffinity(pid)
            except OSError:
                continue
    return frozenset(cpus) or None


def isolate_worker(pgid: int, *, proc: Path = PROC) -> Placement | None:
    """Move every thread of the server in process group `pgid` that is not its model worker's onto the cores the
    worker does not use. None (nothing moved) when there is no worker, or it may run on every core there is."""
    processes = group_processes(pgid, proc)
    worker = worker_cpus(processes)
    if worker is None:
        log.warning("vLLM in process group %d: no %s process found; its placement is left as it is", pgid, WORKER_COMM)
        return None
    others = frozenset(os.sched_getaffinity(0)) - worker
    if not others:
        return None  # the worker may run anywhere (no binding): no core to keep for it
    moved = _move((pid for pid, comm in processes.items() if not comm.startswith(WORKER_COMM)), others, proc)
    placement = Placement(worker_cpus=worker, other_cpus=others, moved=moved)
    log.info("vLLM in process group %d: %s (%d threads moved)", pgid, placement.describe(), moved)
    return placement


def _move(pids: Iterable[int], cpus: frozenset[int], proc: Path) -> int:
    """Set the affinity of every thread of `pids` to `cpus`; the number moved (threads that exit meanwhile are
    skipped)."""
    moved = 0
    for pid in pids:
        try:
            tids = [int(t.name) for t in (proc / str(pid) / "task").iterdir()]
        except OSError:
            continue
        for tid in tids:
            try:
                os.sched_setaffinity(tid, cpus)
            except (ProcessLookupError, FileNotFoundError):
                continue
            moved += 1
    return moved


def _cpus(cpus: frozenset[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))
