"""Nightly proposals are measured against the config the engine actually runs and keep only the knobs that
mattered (item 7 of "Tune a real vLLM")."""

from __future__ import annotations

import yaml

from engine.config import EngineConfig
from tuner import nightly
from tuner.metrics import SLO

from .conftest import SMALL, tiny_profile


def test_nightly_baseline_is_the_running_engines_config_and_the_proposal_is_pruned(
    sqlite_url: str, tmp_path, monkeypatch
) -> None:
    profile = tiny_profile()
    path = tmp_path / "tiny.json"
    profile.save(path)
    file_cfg = profile.engine_config(None)  # the file says 32 sequences ...
    cfg_path = tmp_path / "current.yaml"
    cfg_path.write_text(file_cfg.to_yaml())
    running = file_cfg.with_tunable({"scheduler": {"max_num_seqs": 2}}).tunable()  # ... the engine runs 2
    asked = []

    def fake_running(url: str, token: str | None) -> tuple[dict, str]:
        asked.append((url, token))
        return running, "engine-7"

    monkeypatch.setattr(nightly, "running_tunables", fake_running)
    space = tmp_path / "space.yml"
    space.write_text(
        yaml.safe_dump(
            {
                "params": {
                    "scheduler.max_num_seqs": {"choices": [2, 32]},
                    "scheduler.aging_s": {"choices": [5.0, 9.0]},  # never matters on this workload
                }
            }
        )
    )
    result = nightly.run_nightly(
        db_url=sqlite_url,
        out_dir=tmp_path / "out",
        trials=4,
        profile=str(path),
        workload="mixed",
        options=SMALL,
        config_path=cfg_path,
        space_path=space,
        slo=SLO(ttft_s=0.3, tpot_s=0.05),
        confirm_seeds=2,
        progress=False,
        engine_url="http://engine:8000",
        admin_token="t",
    )
    assert asked == [("http://engine:8000", "t")]
    assert result.study.baseline.params["scheduler.max_num_seqs"] == 2  # measured against what runs
    assert any("the tunables running on http://engine:8000 (instance engine-7)" in n for n in result.study.notes)
    assert result.proposal is not None, result.decision
    assert result.study.best.params["scheduler.aging_s"] == 9.0  # found with a change that does not matter ...
    dropped = {k["knob"] for k in result.pruning["knobs"] if not k["kept"]}
    assert dropped == {"scheduler.aging_s"}  # ... and dropped: undoing it cost nothing
    proposed = EngineConfig.from_yaml(result.files["config"])
    assert proposed.scheduler.max_num_seqs == 32 and proposed.scheduler.aging_s == 5.0  # aging put back
    changed = result.proposal.best_metrics["params"]
    assert changed == {"scheduler.max_num_seqs": 32, "scheduler.aging_s": 5.0}
    # the report shows each change of the best trial, whether it was kept and what undoing it cost
    assert "| `scheduler.aging_s` | 5 | 9 | 5 (dropped) |" in result.report_md
    assert "| `scheduler.max_num_seqs` | 2 | 32 | 32 |" in result.report_md
