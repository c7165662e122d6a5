"""`kvpilot status`: the Overview's figures in a terminal, checked against values computed from the seed."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from collector.db import upgrade
from kvpilot.cli import app
from plumbing.percentile import nearest_rank
from tests.dashboard.seed import seed_database

runner = CliRunner()


@pytest.fixture(scope="module")
def seeded(tmp_path_factory: pytest.TempPathFactory):
    url = f"sqlite:///{tmp_path_factory.mktemp('status') / 'kv.db'}"
    upgrade(url)
    return seed_database(url, with_study=False)


def _status(*args: str) -> dict:
    result = runner.invoke(app, ["status", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_json_has_the_overview_figures_of_a_run(seeded) -> None:
    out = _status("--db-url", seeded.url, "--run", "r1")
    finished = seeded.finished()
    assert out["requests"] == len(finished)  # answered: the two failed requests are not
    assert math.isclose(out["ttft_p99_s"], nearest_rank([r["ttft_s"] for r in finished], 0.99), rel_tol=1e-9)
    assert math.isclose(out["ttft_p50_s"], nearest_rank([r["ttft_s"] for r in finished], 0.5), rel_tol=1e-9)
    assert math.isclose(out["e2e_p99_s"], nearest_rank([r["e2e_s"] for r in finished], 0.99), rel_tol=1e-9)
    assert out["ttft_source"]
    # over every instance the highest figure wins, and says it was sampled when a scrape holds it
    assert out["kv_usage_peak"] is not None and out["kv_usage_source"]
    e0 = _status("--db-url", seeded.url, "--run", "r1", "--instance", "e0")  # kvpilot's engine: every step
    steps = [s for s in seeded.steps if s["instance"] == "e0"]
    assert math.isclose(e0["kv_usage_peak"], max(s["kv_blocks_used"] / s["kv_blocks_total"] for s in steps))
    assert e0["kv_usage_source"] == "kvpilot engine steps (every step)"
    assert e0["running_peak"] == max(s["num_seqs"] for s in steps)
    firing = {(a["alertname"], a["instance"]) for a in out["alerts_firing"]}
    assert firing == {("KvCacheNearlyFull", "e0")}  # the pending HighTTFT is not firing
    assert set(out["traps"]) == {"mixed_lengths", "bursts", "swap_thrashing", "cold_start", "memory_wall"}
    assert set(out["traps"].values()) <= {"present", "not seen", "not enough data"}


def test_one_instance_narrows_every_figure(seeded) -> None:
    out = _status("--db-url", seeded.url, "--run", "r1", "--instance", "e1")
    assert out["requests"] == len(seeded.finished("e1"))
    ttfts = [r["ttft_s"] for r in seeded.finished("e1")]
    assert math.isclose(out["ttft_p99_s"], nearest_rank(ttfts, 0.99), rel_tol=1e-9)
    assert out["alerts_firing"] == []  # the firing alert is e0's


def test_human_output_names_the_sources(seeded) -> None:
    result = runner.invoke(app, ["status", "--db-url", seeded.url, "--run", "r1"])
    assert result.exit_code == 0, result.output
    assert "TTFT" in result.output and "KV usage peak" in result.output
    assert "KvCacheNearlyFull on e0" in result.output


def test_an_empty_window_says_so_without_failing(seeded) -> None:
    out = _status("--db-url", seeded.url, "--since", "5m")  # the seed lies long before now
    assert out["requests"] == 0 and out["ttft_p99_s"] is None


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["--since", "ten minutes"], "--since"),
        (["--since", "90d"], "--since"),
        (["--since", "1h", "--run", "r1"], "--since and --run"),
        (["--run", "nope"], "--run"),
    ],
)
def test_bad_input_names_the_option(seeded, args: list[str], field: str) -> None:
    result = runner.invoke(app, ["status", "--db-url", seeded.url, *args])
    assert result.exit_code == 2
    assert field in result.output
    assert "Traceback" not in result.output


def test_a_missing_database_is_a_clear_error(tmp_path) -> None:
    result = runner.invoke(app, ["status", "--db-url", f"sqlite:///{tmp_path / 'absent' / 'kv.db'}"])
    assert result.exit_code == 2
    assert "--db-url" in result.output and "Traceback" not in result.output
