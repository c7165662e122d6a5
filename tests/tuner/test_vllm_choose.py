"""Which confirmed vLLM config goes to the held-out comparison (`tuner.vllm.tune.choose`)."""

from __future__ import annotations

from typing import Any

import pytest

from integrations.vllm.config import VllmConfig
from tuner.vllm.tune import CONFIRM_LOSS, choose, launch_order

BASE = VllmConfig(model="/m", kv_cache_memory_bytes=16 * 2**20)
SEQS_32 = BASE.model_copy(update={"max_num_seqs": 32})
BLOCK_32 = BASE.model_copy(update={"block_size": 32})


def row(config: VllmConfig, predicted: float, live: float) -> dict[str, Any]:
    return {"config": config, "predicted_capacity_rps": predicted, "live_capacity_rps": live}


def test_a_confirmation_that_lost_its_one_search_is_still_compared() -> None:
    # run 13: predicted 50.3 against 46.1, one search each measured 42.6 against 46.4 (-8%)
    choice = choose(BASE, [row(BASE, 46.1, 46.4), row(BLOCK_32, 50.3, 42.6)])
    assert choice.candidate == BLOCK_32
    assert choice.rivals == (("block_size=32", 42.6),)


def test_the_most_live_capacity_among_those_predicted_above_the_running_config() -> None:
    rows = [row(BASE, 40.0, 40.0), row(SEQS_32, 39.0, 48.0), row(BLOCK_32, 44.0, 41.0)]
    assert choose(BASE, rows).candidate == BLOCK_32  # SEQS_32 measured more, but the simulator put it below
    rows[1]["predicted_capacity_rps"] = 45.0
    assert choose(BASE, rows).candidate == SEQS_32


@pytest.mark.parametrize(
    ("rows", "why"),
    [
        ([row(BASE, 40.0, 40.0)], "no screened config was feasible live"),
        ([row(BASE, 40.0, 40.0), row(BLOCK_32, 40.0, 60.0)], "the simulator found no config with more capacity"),
        (
            [row(BASE, 40.0, 40.0), row(BLOCK_32, 50.0, 40.0 * (1 - CONFIRM_LOSS) - 0.01)],
            "more than 20% below: not worth a held-out comparison",
        ),
    ],
)
def test_no_candidate_says_why(rows: list[dict[str, Any]], why: str) -> None:
    choice = choose(BASE, rows)
    assert choice.candidate is None
    assert why in choice.why_not


def test_a_loss_within_the_bound_is_compared() -> None:
    rows = [row(BASE, 40.0, 40.0), row(BLOCK_32, 50.0, 40.0 * (1 - CONFIRM_LOSS) + 0.01)]
    assert choose(BASE, rows).candidate == BLOCK_32


def test_fresh_servers_start_in_an_order_that_rotates_by_round() -> None:
    """Every side is started first (and second, third) equally often over the rounds: a start's position is not
    a config's property (`launch_order`)."""
    sides = ["running", "candidate", "aa"]
    orders = [launch_order(sides, i) for i in range(6)]
    assert orders[:3] == [
        ["running", "candidate", "aa"],
        ["candidate", "aa", "running"],
        ["aa", "running", "candidate"],
    ]
    assert orders[3:] == orders[:3]
    assert all(sorted(o) == sorted(sides) for o in orders)
    assert [launch_order(["a", "b"], i) for i in range(2)] == [["a", "b"], ["b", "a"]] and launch_order([], 3) == []
