"""Keeping a vLLM-CPU's model worker alone on its cores: a process group shaped like vLLM's (a parent, a child
that names itself `VLLM::Worker` and binds itself to one core, as vLLM's CPU worker does), real /proc, real
affinities. The real vLLM's own placement is checked in tests/vllm/test_capacity_compare.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from integrations.vllm.placement import group_processes, isolate_worker, worker_cpus

CPUS = sorted(os.sched_getaffinity(0))

_SERVER = """
import os, sys, threading, time
bind = {bind!r}
pid = os.fork()
if pid == 0:  # the model worker: its name, one core
    open("/proc/self/comm", "w").write("VLLM::Worker")
    if bind is not None:
        os.sched_setaffinity(0, {{bind}})
    print("worker", flush=True)
    time.sleep(60)
    os._exit(0)
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()  # a second thread of the API server
time.sleep(60)
"""


def _group(tmp_path: Path, bind: int | None) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVER.format(bind=bind)], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "worker"
    deadline = time.monotonic() + 5
    while len(group_processes(proc.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    return proc


def _affinities(pid: int) -> set[frozenset[int]]:
    return {frozenset(os.sched_getaffinity(int(t.name))) for t in Path(f"/proc/{pid}/task").iterdir()}


@pytest.fixture
def stop_groups():
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        os.killpg(proc.pid, 9)
        proc.wait()


@pytest.mark.skipif(len(CPUS) < 2, reason="keeping a core for the worker needs two")
def test_everything_but_the_worker_leaves_the_workers_core(tmp_path: Path, stop_groups: list) -> None:
    proc = _group(tmp_path, bind=CPUS[0])
    stop_groups.append(proc)
    processes = group_processes(proc.pid)
    assert len(processes) == 2 and "VLLM::Worker" in processes.values()
    worker = next(pid for pid, comm in processes.items() if comm == "VLLM::Worker")
    assert worker_cpus(processes) == {CPUS[0]}
    placement = isolate_worker(proc.pid)
    assert placement is not None and placement.worker_cpus == {CPUS[0]}
    assert placement.other_cpus == frozenset(CPUS[1:]) and placement.moved >= 2  # both of the parent's threads
    assert _affinities(proc.pid) == {frozenset(CPUS[1:])}
    assert _affinities(worker) == {frozenset({CPUS[0]})}  # the worker is not touched
    assert placement.describe() == f"model worker on cores {CPUS[0]}, the rest on {','.join(map(str, CPUS[1:]))}"


def test_a_worker_bound_to_nothing_or_no_worker_leaves_everything_as_it_is(tmp_path: Path, stop_groups: list) -> None:
    unbound = _group(tmp_path, bind=None)  # a GPU build, or VLLM_CPU_OMP_THREADS_BIND=nobind: no core to keep
    stop_groups.append(unbound)
    assert isolate_worker(unbound.pid) is None
    assert _affinities(unbound.pid) == {frozenset(CPUS)}
    loner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        assert worker_cpus(group_processes(loner.pid)) is None and isolate_worker(loner.pid) is None
    finally:
        loner.kill()
        loner.wait()
