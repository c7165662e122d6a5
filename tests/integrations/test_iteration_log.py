"""vLLM's iteration log lines as step events, on a log captured from a real vLLM 0.32 (CPU) run.

The fixture `vllm_0.32_cpu_iterations.log` is that run's whole output (paths made relative): six concurrent
completions on the checkpoint of `kvpilot model init`, `--kv-cache-memory-bytes 16777216` (64 blocks of 128
tokens), `--enable-logging-iteration-details`. The live path is tested against a running vLLM in tests/vllm.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import itertools
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from collector.db import make_engine
from collector.server import start_subprocess
from collector.settings import CollectorSettings
from engine.http_sink import HttpSink
from engine.sinks import MemorySink
from integrations.vllm.iteration_log import (
    LOG_TIME_PREFIX,
    MAX_LINE_CHARS,
    KvCapacity,
    StepPlacer,
    VllmLogError,
    VllmLogParser,
)
from integrations.vllm.tail import STATE_FILE, LogTail, tail_file

FIXTURE = Path(__file__).parent / "fixtures" / "vllm_0.32_cpu_iterations.log"
LINES = FIXTURE.read_text(encoding="utf-8").splitlines()
ITERATION_LINES = [line for line in LINES if "Iteration(" in line]
# vLLM's format string (loggers.py `_log_iteration_details`) with the dummy marker and another engine: a
# single-engine CPU run never logs dummy steps (only idle data-parallel ranks do), so these two are made up.
DUMMY = (
    "(APIServer pid=7) INFO 12-03 15:02:41 [loggers.py:199] Engine 001: Iteration(9): 0 context requests, "
    "0 context tokens, 0 generation requests, 0 generation tokens, iteration elapsed time: 0.41 ms (dummy), "
    "GPU KV cache usage: 0.0%"
)


def parse(lines: list[str], **kw: Any) -> tuple[VllmLogParser, list]:
    parser = VllmLogParser(instance="vllm-a", run_id="r1", **kw)
    return parser, [e for line in lines if (e := parser.feed(line)) is not None]


def test_every_iteration_line_of_a_real_run_is_one_step() -> None:
    parser, steps = parse(LINES)
    assert len(ITERATION_LINES) == 33
    assert (parser.stats.iteration_lines, parser.stats.steps, parser.stats.unparsable) == (33, 33, 0)
    assert parser.stats.lines == len(LINES) and parser.stats.truncated == 0
    assert [s.step for s in steps] == list(range(33))
    first, second, last = steps[0], steps[1], steps[-1]
    assert (first.num_seqs, first.prefill_tokens, first.decode_tokens) == (3, 424, 0)
    assert first.duration_s == first.forward_s == first.busy_s == pytest.approx(0.03398)
    assert (second.num_seqs, second.prefill_tokens, second.decode_tokens) == (6, 603, 3)
    assert (last.num_seqs, last.decode_tokens) == (1, 1)
    assert all(s.queue_depth == 0 and not s.warmup and s.instance == "vllm-a" and s.run_id == "r1" for s in steps)
    # the total prompt tokens of the six requests (21 + 81 + 141 + 202 + 261 + 321) were all prefilled
    assert sum(s.prefill_tokens for s in steps) == 1027


def test_kv_capacity_from_the_log_in_tokens_or_in_blocks_when_the_block_size_is_known() -> None:
    parser, steps = parse(LINES)
    assert parser.capacity == KvCapacity(tokens=8192)  # "CPU KV cache size: 8,192 tokens"
    assert (steps[1].kv_blocks_used, steps[1].kv_blocks_total) == (1556, 8192)  # 19.0%
    # what the launcher reads from vllm:cache_config_info on /metrics: 64 blocks of 128 tokens
    parser = VllmLogParser(instance="vllm-a", run_id="r1")
    for line in LINES[:40]:
        parser.feed(line)
    parser.set_capacity(blocks=64, block_size=128)
    steps = [e for line in LINES[40:] if (e := parser.feed(line)) is not None]
    assert (steps[1].kv_blocks_used, steps[1].kv_blocks_total) == (12, 64)  # 12 blocks held by six requests
    assert steps[-1].kv_blocks_used == 0
    # --block-size on vLLM's command line shows in its "non-default args" line
    args = LINES[next(i for i, line in enumerate(LINES) if "non-default args" in line)]
    _, steps = parse([args.replace("'dtype':", "'block_size': 32, 'dtype':"), *LINES])
    assert steps[1].kv_blocks_total == 256


def test_before_any_capacity_line_usage_is_kept_in_tenths_of_a_percent() -> None:
    _, steps = parse(ITERATION_LINES[:3])
    assert (steps[1].kv_blocks_used, steps[1].kv_blocks_total) == (190, 1000)


def test_dummy_steps_are_warmup_and_other_engines_get_their_own_instance() -> None:
    _, (step,) = parse([DUMMY])
    assert step.warmup and step.instance == "vllm-a/dp1" and step.step == 9 and step.num_seqs == 0


def test_timestamps_from_the_log_or_the_clock() -> None:
    line = ITERATION_LINES[0]  # INFO 12-03 15:02:41
    noon = dt.datetime(2026, 12, 3, 16, 0, 0).timestamp()
    _, (live,) = parse([line], clock=lambda: noon)
    assert live.ts == noon
    _, (logged,) = parse([line], clock=lambda: noon, ts_from_log=True)
    assert logged.ts == dt.datetime(2026, 12, 3, 15, 2, 42).timestamp()  # logged before 15:02:41's end
    new_year = dt.datetime(2027, 1, 2, 9, 0, 0).timestamp()
    _, (last_year,) = parse([line], clock=lambda: new_year, ts_from_log=True)
    assert dt.datetime.fromtimestamp(last_year.ts).year == 2026


def test_the_time_vllm_put_on_the_line_wins_over_the_log_time_and_the_read_time() -> None:
    prefix = LOG_TIME_PREFIX % {"created": 1796310161.123456}  # what vLLM's formatter makes of it
    line = prefix + ITERATION_LINES[0]
    for kw in ({}, {"ts_from_log": True}):
        _, (step,) = parse([line], clock=lambda: 0.0, **kw)
        assert step.ts == 1796310161.123456
    parser = VllmLogParser(instance="vllm-a", run_id="r1", clock=lambda: 5.0)
    read_at, clocked = parser.feed(ITERATION_LINES[0], read_ts=7.25), parser.feed(ITERATION_LINES[1])
    assert read_at is not None and read_at.ts == 7.25
    assert clocked is not None and clocked.ts == 5.0


def _steps(stamps: list[float], durations: list[float], instance: str = "vllm-a") -> list:
    line = ITERATION_LINES[0]
    out = []
    for i, (ts, d) in enumerate(zip(stamps, durations, strict=True)):
        (step,) = parse([line], clock=lambda ts=ts: ts)[1]
        out.append(dataclasses.replace(step, step=i, ts=ts, duration_s=d, instance=instance))
    return out


def test_a_burst_of_lines_is_placed_back_to_back_before_its_last_line() -> None:
    placer = StepPlacer(hold_s=2.0)
    # a quiet step, then five lines read in one burst at t=10 (each step took 0.1 s), then a quiet one
    steps = _steps([1.0, 10.0, 10.0, 10.0, 10.0, 10.0, 15.0], [0.05, 0.1, 0.1, 0.1, 0.1, 0.1, 0.05])
    out = []
    for step in steps:
        out += placer.push(step)
    assert [s.step for s in out] == [0, 1, 2, 3, 4, 5]  # the last one waits for its hold
    assert placer.release(16.9) == [] and [s.step for s in placer.release(17.0)] == [6]
    assert [s.ts for s in out] == pytest.approx([1.0, 9.6, 9.7, 9.8, 9.9, 10.0])
    assert placer.moved == 4


def test_placement_never_overlaps_released_steps_and_keeps_engines_apart() -> None:
    placer = StepPlacer(hold_s=1.0)
    first = placer.push(_steps([5.0], [0.2])[0]) + placer.flush()
    assert [s.ts for s in first] == [5.0]
    # a step read 0.1 s later lasted 0.2 s: it cannot end before 5.2, and its bound (5.1) is a fact that wins
    (late,) = placer.push(_steps([5.1], [0.2])[0]) + placer.flush()
    assert late.ts == 5.1
    # the next one ends at least its duration after the last end
    (nxt,) = placer.push(_steps([9.0], [0.3])[0]) + placer.flush()
    assert nxt.ts == 9.0
    other = _steps([9.0, 9.0], [0.5, 0.5], instance="vllm-a/dp1")
    placed = [s for step in other for s in placer.push(step)] + placer.flush()
    assert [s.ts for s in placed] == pytest.approx([8.5, 9.0])  # dp1 is its own engine


def test_placing_a_real_log_by_its_second_stamps_makes_steps_that_never_overlap() -> None:
    _, steps = parse(LINES, ts_from_log=True)
    placer = StepPlacer()
    placed = [s for step in steps for s in placer.push(step)] + placer.flush()
    assert [s.step for s in placed] == list(range(33))
    for before, after in itertools.pairwise(placed):
        assert after.ts - before.ts >= after.duration_s - 1e-6  # epoch seconds: ~2e-7 s apart
    for step, bound in zip(placed, steps, strict=True):
        assert step.ts <= bound.ts


def test_lines_that_look_like_iterations_but_do_not_parse_are_counted() -> None:
    bad = [
        "INFO 12-03 15:02:41 [loggers.py:199] Engine 000: Iteration(4): 2 context requests, garbage",
        ITERATION_LINES[2].replace("19.0%", "190.0%"),
        ITERATION_LINES[2].replace("context tokens", "prompt tokens"),
    ]
    long_line = ITERATION_LINES[3] + " " + "x" * (2 * MAX_LINE_CHARS)
    parser, steps = parse([*bad, long_line, "Iteration is a word in a prompt", "Avg prompt throughput: 1.0"])
    assert parser.stats.unparsable == 3 and parser.stats.truncated == 1
    assert len(steps) == 1 and steps[0].step == 3  # the long line still parses: its head is the step


def test_instance_and_run_id_bounds() -> None:
    with pytest.raises(VllmLogError, match="instance"):
        VllmLogParser(instance="x" * 191, run_id="r")
    with pytest.raises(VllmLogError, match="run id"):
        VllmLogParser(instance="i", run_id="")


def test_tail_resumes_at_its_offset_and_rereads_a_replaced_file(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    half = LINES.index(ITERATION_LINES[15])
    log.write_text("\n".join(LINES[:half]) + "\n" + LINES[half][:30], encoding="utf-8")  # ends mid-line
    state = tmp_path / "state"
    sink = MemorySink()
    first = LogTail(log, instance="vllm-a", sink=sink, state_dir=state).run(follow=False)
    n_first = first.steps
    assert 0 < n_first < 33
    with log.open("a", encoding="utf-8") as fh:  # the rest of the line, and the rest of the log
        fh.write(LINES[half][30:] + "\n" + "\n".join(LINES[half + 1 :]) + "\n")
    again = LogTail(log, instance="vllm-a", sink=sink, state_dir=state)
    assert again.parser.capacity.tokens == 8192  # remembered: the capacity line was before the offset
    again.run(follow=False)
    steps = sink.of_type("step")
    assert [s.step for s in steps] == list(range(33)) and len({s.run_id for s in steps}) == 1
    assert LogTail(log, instance="vllm-a", sink=sink, state_dir=state).run(follow=False).steps == 0
    log.unlink()  # rotated: a new file under the same name is read from its start
    log.write_text("\n".join(ITERATION_LINES[:2]) + "\n", encoding="utf-8")
    assert LogTail(log, instance="vllm-a", sink=sink, state_dir=state).run(follow=False).steps == 2
    assert (state / STATE_FILE).is_file()


def test_tail_ships_to_a_real_collector_through_the_spool(tmp_path: Path, sqlite_url: str) -> None:
    log = tmp_path / "vllm.log"
    log.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    settings = CollectorSettings(db_url=sqlite_url, ingest_token="t", port=0, scrape_enabled=False, log_level="warning")
    spool = tmp_path / "spool"
    # the collector is down: every step waits in the disk spool, and the offset still advances
    down = "http://127.0.0.1:9"
    stats, sink = tail_file(
        log,
        instance="vllm-a",
        sink_factory=lambda d: HttpSink(down, token="t", spool_dir=d),
        state_dir=spool,
        follow=False,
        block_size=128,
    )
    assert stats.steps == 33 and isinstance(sink, HttpSink) and sink.spooled == 33
    proc = start_subprocess(settings)
    try:
        stats, sink = tail_file(
            log,
            instance="vllm-a",
            sink_factory=lambda d: HttpSink(proc.url, token="t", spool_dir=d),
            state_dir=spool,
            follow=False,
        )
        assert stats.steps == 0 and isinstance(sink, HttpSink) and sink.sent == 33 and len(sink.spool) == 0
    finally:
        proc.stop()
    engine = make_engine(sqlite_url)
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT step, kv_blocks_used, kv_blocks_total, instance FROM steps ORDER BY step"))
        rows = rows.all()
    engine.dispose()
    assert [r.step for r in rows] == list(range(33))
    assert (rows[1].kv_blocks_used, rows[1].kv_blocks_total, rows[1].instance) == (12, 64, "vllm-a")


def test_tail_command(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from kvpilot.cli import app

    args = ["collector", "tail", "--file", str(FIXTURE), "--instance", "vllm-a", "--spool-dir", str(tmp_path)]
    down = ["--collector", "http://127.0.0.1:9"]
    result = CliRunner().invoke(app, [*args, *down])
    assert result.exit_code == 0, result.output
    assert (
        "33 iteration lines, 33 steps, 0 unparsable; 0 acknowledged, 1 batch(es) waiting in the spool" in result.output
    )
    again = CliRunner().invoke(app, [*args, *down])
    assert "0 steps" in again.output  # the offset was kept: nothing is read twice
    missing = CliRunner().invoke(app, [*args[:2], "--file", str(tmp_path / "nope.log"), "--instance", "x"])
    assert missing.exit_code == 2 and "does not exist" in missing.output


def test_tail_follow_picks_up_appended_lines_and_a_rotated_file(tmp_path: Path) -> None:
    import threading
    import time

    log = tmp_path / "vllm.log"
    log.write_text("\n".join(LINES[:60]) + "\n", encoding="utf-8")  # start-up, no steps yet
    sink, stop = MemorySink(), threading.Event()
    tail = LogTail(log, instance="vllm-a", sink=sink, state_dir=tmp_path / "state")
    runner = threading.Thread(target=tail.run, kwargs={"follow": True, "stop": stop, "poll_s": 0.05})
    runner.start()

    def wait_for(n: int) -> None:
        deadline = time.monotonic() + 10
        while len(sink.of_type("step")) < n and time.monotonic() < deadline:
            time.sleep(0.02)

    try:
        with log.open("a", encoding="utf-8") as fh:
            fh.write("\n".join(ITERATION_LINES[:5]) + "\n")
        wait_for(5)
        log.rename(tmp_path / "vllm.log.1")  # logrotate: move, then a new file
        log.write_text("\n".join(ITERATION_LINES[5:8]) + "\n", encoding="utf-8")
        wait_for(8)
    finally:
        stop.set()
        runner.join(timeout=10)
    assert [s.step for s in sink.of_type("step")] == list(range(8))
    assert not runner.is_alive()
