"""`kvpilot bench vllm-placement`'s plan and figures (the measurement itself needs a real vLLM: run the bench)."""

from __future__ import annotations

import math

import pytest
from typer.testing import CliRunner

from benchmarks.vllm_placement import WAYS, summarize, way_order
from kvpilot.cli import app


def test_rounds_alternate_the_two_ways_in_abba_order() -> None:
    assert way_order(8) == ["isolated", "as started", "as started", "isolated"] * 2
    assert way_order(6).count("isolated") == way_order(6).count("as started") == 3


def test_each_way_gets_its_rounds_ratio_spread_and_within_server_differences() -> None:
    rounds = [
        {"way": "isolated", "a": [10.0, 10.0], "b": [10.0, 10.4], "log_ratio": math.log(10.2 / 10.0)},
        {"way": "as started", "a": [10.0, 14.0], "b": [8.0, 8.0], "log_ratio": math.log(8.0 / 12.0)},
        {"way": "as started", "a": [9.0, 9.0], "b": [12.0, 12.0], "log_ratio": math.log(12.0 / 9.0)},
        {"way": "isolated", "a": [10.0, 10.0], "b": [10.0, 10.0], "log_ratio": 0.0},
    ]
    out = summarize(rounds)
    assert set(out) == set(WAYS)
    iso, loose = out["isolated"], out["as started"]
    assert iso["rounds"] == loose["rounds"] == 2
    assert iso["aa_log_ratio_mean"] == pytest.approx(math.log(1.02) / 2, abs=1e-4)
    assert iso["aa_log_ratio_sd"] == pytest.approx(math.log(1.02) / math.sqrt(2), abs=1e-4)
    assert loose["aa_log_ratio_sd"] == pytest.approx(abs(math.log(8 / 12) - math.log(12 / 9)) / math.sqrt(2), abs=1e-4)
    assert iso["within_server_max"] == pytest.approx(0.4 / 10.2, abs=1e-4) and loose["within_server_max"] == 0.3333
    assert loose["throughput_rps"] == [10.0, 14.0, 8.0, 8.0, 9.0, 9.0, 12.0, 12.0]


def test_too_few_rounds_are_refused_before_anything_starts() -> None:
    res = CliRunner().invoke(app, ["bench", "vllm-placement", "--rounds", "2"])
    assert res.exit_code == 2 and "--rounds: at least 4" in res.output and "Traceback" not in res.output
