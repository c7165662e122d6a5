"""A proposal changes only what was measured to matter: `tuner.prune.drop_noise_knobs` and its use in the nightly job
(its use in the screened vLLM search: tests/tuner/test_vllm_config_space.py)."""

from __future__ import annotations

import yaml

from engine.config import EngineConfig
from tuner.metrics import SLO
from tuner.nightly import run_nightly
from tuner.prune import drop_noise_knobs

from .conftest import SMALL, tiny_profile

CURRENT = {"a": 1, "b": 1, "c": 1, "d": 1}
BEST = {"a": 2, "b": 2, "c": 2, "d": 1}


def _measure(effects: dict[str, list[float]], infeasible_without: str | None = None):
    """Goodput on two seeds: 100 plus what each changed knob adds on that seed."""
    calls: list[dict] = []

    def measure(params: dict) -> list[tuple[float, bool]]:
        calls.append(dict(params))
        out = []
        for seed in range(2):
            goodput = 100.0 + sum(effects[k][seed] for k, v in params.items() if v != CURRENT[k])
            feasible = infeasible_without is None or params[infeasible_without] != CURRENT[infeasible_without]
            out.append((goodput, feasible))
        return out

    measure.calls = calls  # type: ignore[attr-defined]  # the test reads the calls off the function
    return measure


def test_changes_inside_the_noise_are_dropped() -> None:
    # a: +10% on both seeds (matters); b: +0.3% (under min_effect); c: +3% on one seed, -1% on the other.
    measure = _measure({"a": [10.0, 10.0], "b": [0.3, 0.3], "c": [3.0, -1.0], "d": [0.0, 0.0]})
    kept, records = drop_noise_knobs(CURRENT, BEST, measure, min_effect=0.01)
    assert kept == {"a": 2, "b": 1, "c": 1, "d": 1}
    assert [(r["knob"], r["kept"]) for r in records] == [("a", True), ("b", False), ("c", False)]
    assert records[0]["effect"] > 0.08 and abs(records[1]["effect"]) < 0.01
    assert len(measure.calls) == 4  # the best, then each changed knob reverted once (d never changed)


def test_a_change_that_keeps_the_slos_is_kept_whatever_its_goodput() -> None:
    measure = _measure({"a": [0.0, 0.0], "b": [0.0, 0.0], "c": [0.0, 0.0], "d": [0.0, 0.0]}, infeasible_without="b")
    kept, records = drop_noise_knobs(CURRENT, BEST, measure, min_effect=0.01)
    assert kept == {"a": 1, "b": 2, "c": 1, "d": 1}
    assert next(r for r in records if r["knob"] == "b")["slo"] is True


def test_nothing_to_keep_gives_the_current_params() -> None:
    measure = _measure({k: [0.0, 0.0] for k in CURRENT})
    kept, records = drop_noise_knobs(CURRENT, BEST, measure, min_effect=0.01)
    assert kept == CURRENT and not any(r["kept"] for r in records)


def test_the_nightly_proposal_holds_only_the_kept_changes(sqlite_url: str, tmp_path) -> None:
    profile = tiny_profile()
    path = tmp_path / "tiny.json"
    profile.save(path)
    current = profile.engine_config(None).with_tunable({"scheduler": {"max_num_seqs": 2}})
    cfg_path = tmp_path / "current.yaml"
    cfg_path.write_text(current.to_yaml())
    space = tmp_path / "space.yml"
    space.write_text(
        yaml.safe_dump(
            {
                "params": {
                    "scheduler.max_num_seqs": {"choices": [2, 8, 16]},
                    "scheduler.aging_s": {"choices": [5.0, 6.0, 7.0]},  # no effect on a one-class workload
                }
            }
        )
    )
    result = run_nightly(
        db_url=sqlite_url,
        out_dir=tmp_path / "out",
        trials=8,
        profile=str(path),
        workload="mixed",
        options=SMALL,
        config_path=cfg_path,
        space_path=space,
        slo=SLO(ttft_s=0.3, tpot_s=0.05),
        confirm_seeds=2,
        progress=False,
    )
    assert result.pruning is not None, result.decision
    knobs = {k["knob"]: k for k in result.pruning["knobs"]}
    assert knobs["scheduler.max_num_seqs"]["kept"], knobs
    assert "scheduler.aging_s" not in knobs or not knobs["scheduler.aging_s"]["kept"]
    assert result.proposal is not None, result.decision
    proposed = EngineConfig.from_yaml(result.files["config"])
    assert proposed.scheduler.max_num_seqs != 2 and proposed.scheduler.aging_s == current.scheduler.aging_s
    assert result.proposal.best_metrics["patch"] == {"scheduler": {"max_num_seqs": proposed.scheduler.max_num_seqs}}
    report = result.files["report"].read_text()
    assert "goodput lost when reverted" in report
    assert "scheduler.aging_s" not in knobs or "| 5 (dropped) |" in report
