"""plumbing.sched.outrank, in a child process (it changes how the calling process is scheduled)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

CHILD = """
import json, os, threading
from plumbing.sched import outrank
said = outrank()
seen = {}
t = threading.Thread(target=lambda: seen.update(policy=os.sched_getscheduler(0)))
t.start(); t.join()
print(json.dumps({"said": said, "main": os.sched_getscheduler(0), "thread": seen["policy"],
                  "nice": os.getpriority(os.PRIO_PROCESS, 0), "sid": os.getsid(0) == os.getpid()}))
"""


def test_outrank_takes_the_real_time_class_where_granted_and_threads_started_after_inherit_it() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60, check=True)
    got = json.loads(out.stdout)
    assert got["sid"]  # a session (and scheduling group) of its own
    if os.geteuid() == 0:  # root here and in CI
        assert got["said"] == "rr 1"
        assert got["main"] == got["thread"] == os.SCHED_RR
        assert got["nice"] == -10
    else:  # refused: it says the niceness it has, and the threads run as ordinary ones
        assert got["said"] == f"nice {got['nice']}"
        assert got["main"] == got["thread"] == os.SCHED_OTHER
