"""The Tuning page lists vLLM's tuning beside kvpilot's: a vLLM screen's study (tagged by the tuner as it keeps it)
and a vLLM proposal (written by tuner.vllm.proposal.publish), each named as vLLM's, the proposal diffed against
the vLLM config its study measured and applied as vLLM's `--config` file."""

from __future__ import annotations

from pathlib import Path

import optuna
from optuna.distributions import IntDistribution

from collector.db import make_engine
from integrations.vllm.config import VllmConfig
from tests.dashboard.conftest import no_exception, table_with, texts
from tests.dashboard.seed import Seed
from tuner.storage import open_storage
from tuner.study import tag_study
from tuner.vllm.proposal import publish


def test_vllm_studies_screens_and_proposals_are_listed(seeded: Seed, open_page, tmp_path: Path) -> None:
    storage = open_storage(seeded.url)
    for name, kind in (("screen-1a2b3c4d-sim", "screen"), ("tune-vllm-a-sim", "study")):
        study = optuna.create_study(study_name=name, storage=storage, direction="maximize")
        study.add_trial(
            optuna.trial.create_trial(
                params={"max_num_seqs": 64}, distributions={"max_num_seqs": IntDistribution(8, 256)}, value=900.0
            )
        )
        tag_study(storage, name, engine="vllm", kind=kind)
    storage.engine.dispose()
    base = VllmConfig(model="/models/tiny", max_num_seqs=128)
    db = make_engine(seeded.url)
    made = publish(
        db,
        tmp_path,
        name="tune-vllm-a",
        instance="vllm-a",
        base=base,
        best=base.replace(max_num_seqs=32),
        report_md="## vLLM tuning",
        baseline_metrics={"goodput_tps": 800.0},
        best_metrics={"goodput_tps": 900.0},
    )
    db.dispose()

    at = open_page(seeded.url, "tuning")
    no_exception(at)
    studies = table_with(at, "study", "engine").set_index("study")
    assert tuple(studies.loc["screen-1a2b3c4d-sim", ["engine", "kind"]]) == ("vllm", "screen")
    assert tuple(studies.loc["tune-vllm-a-sim", ["engine", "kind"]]) == ("vllm", "study")
    assert set(studies.drop(index=["screen-1a2b3c4d-sim", "tune-vllm-a-sim"])["engine"]) == {"kvpilot"}
    proposals = table_with(at, "status", "engine").set_index("id")
    assert proposals.loc[made.row.id, "engine"] == "vllm" and set(proposals.drop(index=made.row.id)["engine"]) == {
        "kvpilot"
    }

    at.selectbox(key="proposal_pick").set_value(made.row.id).run()
    no_exception(at)
    said = texts(at)
    assert f"Proposal #{made.row.id} — pending (vLLM)" in said
    assert "Compared with the vLLM config the study measured." in said and "restart vLLM" in said
    assert "kvpilot tune apply" not in said
    changes = table_with(at, "setting", "running", "proposed").set_index("setting")
    assert list(changes.index) == ["max-num-seqs"]
    assert (changes.loc["max-num-seqs", "running"], changes.loc["max-num-seqs", "proposed"]) == ("128", "32")
    assert any("vLLM's `--config` file" in e.label for e in at.expander)
