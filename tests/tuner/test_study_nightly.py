"""Metrics read back from the database, Optuna studies, the nightly proposal and proposal review."""

from __future__ import annotations

import logging

import optuna
import pytest
import yaml

from collector.db import make_engine
from collector.queries import goodput
from engine.config import ConfigError, EngineConfig
from engine.events import RequestEvent
from tuner import nightly
from tuner import workloads as WL
from tuner.backends import SimBackend
from tuner.compare import INCONCLUSIVE, Comparison
from tuner.metrics import SLO, store_events, trial_metrics
from tuner.nightly import run_nightly
from tuner.proposals import ProposalError, get_proposal, list_proposals, set_status
from tuner.space import load_space, space_from_dict
from tuner.storage import open_storage, optuna_storage_url
from tuner.study import pareto_front, run_study

from .conftest import SMALL, tiny_profile

SLO_T = SLO(ttft_s=0.3, tpot_s=0.05)


def _req(i: int, **kw) -> RequestEvent:
    base = {
        "instance": "e",
        "run_id": "run-a",
        "ts": 1_700_000_010.0 + i,
        "request_id": f"r{i}",
        "status": "finished",
        "prompt_tokens": 10,
        "output_tokens": 11,
        "queue_s": 0.0,
        "prefill_s": 0.1,
        "ttft_s": 0.1,
        "decode_s": 0.2,
        "e2e_s": 0.3,
    }
    return RequestEvent(**{**base, **kw})


def test_trial_metrics_come_from_the_collector_queries(db_url: str) -> None:
    db = make_engine(db_url)
    events = [
        _req(0),  # good
        _req(1, ttft_s=0.5),  # misses TTFT
        _req(2, decode_s=1.0),  # misses TPOT (0.1 s/token)
        _req(3, status="rejected", output_tokens=0, ttft_s=None, decode_s=0.0),
        _req(4, run_id="other"),  # another trial
    ]
    store_events(db, events, key_prefix="t")
    m = trial_metrics(db, run_id="run-a", start=1_700_000_000.0, end=1_700_000_020.0, slo=SLO_T)
    assert (m.requests, m.finished, m.rejected) == (4, 3, 1)
    assert m.goodput_tps == pytest.approx(11 / 20.0) and m.throughput_tps == pytest.approx(33 / 20.0)
    gp = goodput(
        db, start=1_700_000_000.0, end=1_700_000_020.0, ttft_slo_s=0.3, tpot_slo_s=0.05, group_by="all", run_id="run-a"
    )
    assert m.good_fraction == gp[0].fraction == pytest.approx(0.25)
    assert m.rejection_rate == 0.25
    cons = m.constraints(SLO_T)
    assert cons["rejection"] > 0 and not m.feasible(SLO_T)
    db.dispose()


def _backend(db, profile=None, scenario="mixed"):
    profile = profile or tiny_profile()
    return SimBackend(profile, lambda s: WL.scenario(scenario, 6.0, SMALL, seed=s), db, SLO_T)


SPACE = {
    "params": {
        "scheduler.max_num_seqs": {"choices": [2, 4, 32]},
        "scheduler.max_num_batched_tokens": {"choices": [256, 1024]},
        "block_policy": {"choices": ["fixed-16", "fixed-32", "dynamic-512-2048"]},
    }
}


def test_study_enqueues_the_current_config_and_runs_a_random_baseline(sqlite_url: str) -> None:
    db = make_engine(sqlite_url)
    profile = tiny_profile()
    base = profile.engine_config(None)
    storage = open_storage(sqlite_url)
    assert optuna_storage_url(sqlite_url).endswith("kvpilot-optuna.db")
    result = run_study(
        _backend(db),
        space_from_dict(SPACE, base=base),
        base,
        name="s1",
        trials=6,
        slo=SLO_T,
        storage=storage,
        seed=1,
        progress=False,
    )
    first = result.trials[0]
    assert first.baseline and first.params == {
        "scheduler.max_num_seqs": 32,
        "scheduler.max_num_batched_tokens": 1024,
        "block_policy": "fixed-32",
    }
    assert result.measured == 6 and result.random is not None and result.random.measured == 6
    assert result.random.trials[0].baseline
    assert set(first.constraints) >= {"oom", "rejection", "p99_ttft"}
    assert result.best is not None and result.best.feasible
    assert result.best.goodput >= max(t.goodput for t in result.completed if t.feasible)
    # The study lives in the RDB storage: another worker joins it and tops it up to 8 trials.
    again = run_study(
        _backend(db),
        space_from_dict(SPACE, base=base),
        base,
        name="s1",
        trials=8,
        slo=SLO_T,
        storage=open_storage(sqlite_url),
        random_baseline=False,
        progress=False,
    )
    assert again.measured == 8 and sum(t.baseline for t in again.trials) == 1
    loaded = optuna.load_study(study_name="s1", storage=open_storage(sqlite_url))
    assert sum("duplicate_of" not in t.user_attrs for t in loaded.trials) == 8
    assert all(t.user_attrs["run_id"].startswith("s1-t") for t in loaded.trials)
    db.dispose()


def test_a_repeated_config_is_told_its_stored_result_not_measured_again(sqlite_url: str) -> None:
    db = make_engine(sqlite_url)
    base = tiny_profile().engine_config(None)
    sim = _backend(db)
    measured: list[int] = []

    class Counting:
        name = "counting"

        def evaluate(self, config, *, run_id, seed):
            measured.append(config.scheduler.max_num_seqs)
            return sim.evaluate(config, run_id=run_id, seed=seed)

    # Two configs in all (the base's 32 and 4); a 6-trial budget cannot be spent on new measurements.
    space = space_from_dict({"params": {"scheduler.max_num_seqs": {"choices": [4, 32]}}}, base=base)
    result = run_study(
        Counting(), space, base, name="dups", trials=6, slo=SLO_T, seed=0, random_baseline=False, progress=False
    )
    assert sorted(measured) == [4, 32]  # each config ran the workload once
    assert result.measured == 2 and len(result.best_so_far()) == 2
    dups = [t for t in result.trials if t.duplicate_of is not None]
    # then the study stopped: the space is exhausted after 50 repeats in a row
    assert [t.duplicate_of is not None for t in result.trials[-51:]] == [False] + [True] * 50
    by_number = {t.number: t for t in result.trials}
    for t in dups:
        first = by_number[t.duplicate_of]
        assert t.params == first.params and t.values == first.values and t.metrics == first.metrics
        assert t.constraints == first.constraints and first.duplicate_of is None
    assert any("space exhausted" in n for n in result.notes)
    db.dispose()


def test_multi_objective_reports_a_pareto_front(sqlite_url: str) -> None:
    db = make_engine(sqlite_url)
    profile = tiny_profile()
    base = profile.engine_config(None)
    result = run_study(
        _backend(db),
        space_from_dict(SPACE, base=base),
        base,
        name="mo",
        trials=8,
        slo=SLO_T,
        multi_objective=True,
        random_baseline=False,
        progress=False,
    )
    front = result.pareto
    assert front and all(t.feasible for t in front)
    feasible = [t for t in result.completed if t.feasible]
    for t in feasible:  # nothing feasible dominates a front member
        for f in front:
            assert not (t.values[0] > f.values[0] and t.values[1] < f.values[1])
    assert pareto_front(front) == front
    db.dispose()


def test_failed_trials_are_logged_and_marked(sqlite_url: str, caplog: pytest.LogCaptureFixture) -> None:
    db = make_engine(sqlite_url)
    base = tiny_profile().engine_config(None)

    class Broken:
        name = "broken"

        def evaluate(self, config, *, run_id, seed):
            raise RuntimeError("engine exploded")

    with caplog.at_level(logging.ERROR, logger="kvpilot.tuner.study"):
        result = run_study(
            Broken(),
            space_from_dict(SPACE, base=base),
            base,
            name="b",
            trials=2,
            slo=SLO_T,
            random_baseline=False,
            progress=False,
        )
    assert result.failed == 2 and result.best is None
    assert "engine exploded" in caplog.text
    db.dispose()


def test_nightly_writes_a_proposal_only_when_the_gain_holds(sqlite_url: str, tmp_path, monkeypatch) -> None:
    profile = tiny_profile()
    path = tmp_path / "tiny.json"
    profile.save(path)
    current = profile.engine_config(None).with_tunable({"scheduler": {"max_num_seqs": 2}})
    cfg_path = tmp_path / "current.yaml"
    cfg_path.write_text(current.to_yaml())
    space = tmp_path / "space.yml"
    space.write_text(yaml.safe_dump(SPACE))
    common = {
        "db_url": sqlite_url,
        "trials": 6,
        "profile": str(path),
        "workload": "mixed",
        "options": SMALL,
        "config_path": cfg_path,
        "space_path": space,
        "slo": SLO_T,
        "confirm_seeds": 2,
        "progress": False,
    }
    result = run_nightly(out_dir=tmp_path / "out", **common)
    assert result.proposal is not None, result.decision
    p = result.proposal
    assert p.status == "pending" and p.gain > 0.02
    proposed = EngineConfig.from_yaml(result.files["config"])
    assert proposed.scheduler.max_num_seqs != 2 and proposed.model == current.model  # the file's own model
    assert proposed.tunable() == p.config().tunable()
    report = result.files["report"].read_text()
    assert "## What changed" in report and "random search, same budget" in report and "± " in report
    assert result.files["plot"].read_bytes()[:4] == b"\x89PNG"
    assert get_proposal(make_engine(sqlite_url), p.id).report_md == report
    # the confirmation is the capacity comparison of every engine: ABBA pairs on the 2 new seeds, the whole
    # 90% interval above 1; its record is the proposal's, its table the report's
    conf = p.best_metrics["confirmation"]
    assert conf["objective"] == "slo_capacity" and conf["verdict"] == "proposal" and conf["seeds"] == [1000, 1001]
    assert conf["gain_low"] > 0 and len(conf["pairs"]) == 2 and p.gain == conf["gain"]
    assert p.best_metrics["heldout_capacity_rps"] > p.baseline_metrics["heldout_capacity_rps"] > 0
    assert "## Confirmation: SLO capacity on new workload seeds" in report and conf["sentence"] in report
    assert result.decision == f"propose: {conf['sentence']}"
    # the pipeline's first phase: the running config's capacity on the tuning seed, in the report and the row
    running = result.verdict.running
    assert running.found and p.baseline_metrics["capacity"]["capacity_rps"] == pytest.approx(running.capacity_rps, 1e-3)
    assert f"serves {running.capacity_rps:.3g} req/s within the SLOs" in report
    # The same search, but a comparison that does not say `proposal`: a report, no proposal, no row.
    real = nightly.confirm

    def doubtful(*args, **kwargs) -> Comparison:
        c = real(*args, **kwargs)
        c.verdict = INCONCLUSIVE
        return c

    monkeypatch.setattr(nightly, "confirm", doubtful)
    none = run_nightly(out_dir=tmp_path / "out2", **common)
    assert none.proposal is None and none.confirmation is not None and not none.confirmation["holds"]
    assert none.decision == f"no proposal: {none.confirmation['sentence']}" and "inconclusive" in none.decision
    assert none.files["report"].exists() and not list((tmp_path / "out2").glob("proposal-*.yaml"))
    assert [q.id for q in list_proposals(make_engine(sqlite_url))] == [p.id]


def test_nightly_from_an_empty_collector_is_a_clear_error(sqlite_url: str, tmp_path) -> None:
    path = tmp_path / "tiny.json"
    tiny_profile().save(path)
    with pytest.raises(ValueError, match="at least 2 held-out seeds"):  # one pair has no interval
        run_nightly(db_url=sqlite_url, out_dir=tmp_path / "o", confirm_seeds=1, profile=str(path), progress=False)
    with pytest.raises(WL.WorkloadError, match="holds 0 requests"):
        run_nightly(db_url=sqlite_url, out_dir=tmp_path / "o", trials=2, profile=str(path), progress=False)
    assert not (tmp_path / "o").exists()


def test_proposal_status_transitions(sqlite_url: str) -> None:
    from tuner.proposals import create_proposal

    db = make_engine(sqlite_url)
    p = create_proposal(
        db,
        config_yaml=EngineConfig().to_yaml(),
        report_md="r",
        study_name="s",
        instance=None,
        baseline_metrics={},
        best_metrics={},
    )
    assert set_status(db, p.id, "accepted").status == "accepted"
    with pytest.raises(ProposalError, match="cannot become pending"):
        set_status(db, p.id, "pending")
    assert set_status(db, p.id, "rejected").status == "rejected"
    with pytest.raises(ProposalError, match="rejected; it cannot become applied"):
        set_status(db, p.id, "applied")
    with pytest.raises(ProposalError, match="does not exist"):
        get_proposal(db, 999)
    with pytest.raises(ProposalError, match="status must be one of"):
        list_proposals(db, status="maybe")
    with pytest.raises(ConfigError, match=r"model\.dim"):
        create_proposal(
            db,
            config_yaml="model: {dim: 3}",
            report_md="",
            study_name=None,
            instance=None,
            baseline_metrics={},
            best_metrics={},
        )
    db.dispose()


def test_default_space_study_on_the_shipped_cpu_profile(sqlite_url: str) -> None:
    from tuner.profile import load_profile

    profile = load_profile("cpu-2core")
    base = profile.engine_config(None)
    db = make_engine(sqlite_url)
    be = SimBackend(
        profile,
        lambda s: WL.scenario("burst", 12.0, WL.WorkloadOptions(requests=40), seed=s),
        db,
        SLO(ttft_s=1.0, tpot_s=0.1),
    )
    result = run_study(
        be, load_space(base=base), base, name="cpu", trials=4, slo=SLO(), random_baseline=False, progress=False
    )
    assert len(result.completed) == 4
    db.dispose()


def test_engine_backend_measures_the_torch_engine(sqlite_url: str) -> None:
    from tuner.backends import EngineBackend

    db = make_engine(sqlite_url)
    cfg = tiny_profile().engine_config(None)
    be = EngineBackend(
        lambda s: WL.scenario("mixed", 20.0, WL.WorkloadOptions(requests=8, scale=32.0, output_range=(2, 5)), seed=s),
        db,
        SLO_T,
        warmup=1,
    )
    m = be.evaluate(cfg, run_id="eng-1", seed=0)
    assert m.requests == 8 and m.finished == 8 and m.throughput_tps > 0  # warm-up requests excluded
    db.dispose()


@pytest.mark.parametrize(("workload", "described"), [("stored", "requests=40"), ("fitted", "observed_requests=40")])
def test_nightly_replays_the_stored_traffic(sqlite_url: str, tmp_path, workload: str, described: str) -> None:
    import time

    from tuner.replay import TrialSink, replay
    from tuner.sim import sim_engine

    profile = tiny_profile()
    path = tmp_path / "tiny.json"
    profile.save(path)
    db = make_engine(sqlite_url)
    # "Production" traffic of the last minutes, stored as the engine would have pushed it.
    sink = TrialSink(keep_steps=False)
    data = profile.engine_config(None).model_dump(mode="json")
    data["telemetry"].update({"instance": "prod-7", "run_id": "prod"})
    engine, _ = sim_engine(EngineConfig.from_dict(data), profile, sink=sink, start_wall=time.time() - 300)
    replay(engine, WL.scenario("mixed", 6.0, SMALL, seed=5))
    store_events(db, sink.events, key_prefix="prod")
    result = run_nightly(
        db_url=sqlite_url,
        out_dir=tmp_path / "out",
        trials=4,
        profile=str(path),
        workload=workload,
        options=WL.WorkloadOptions(hours=1.0, requests=40),
        slo=SLO_T,
        instance="prod-7",
        confirm_seeds=2,
        progress=False,
    )
    assert f"kind={workload}" in result.report_md and described in result.report_md
    db.dispose()


@pytest.mark.postgres
def test_parallel_workers_share_one_study_on_postgres(pg_url: str) -> None:
    import threading

    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    storage_url = optuna_storage_url(pg_url)
    assert "_optuna" in make_url(storage_url).query["options"]
    base = tiny_profile().engine_config(None)
    results, errors = [], []

    def worker(seed: int) -> None:
        db = make_engine(pg_url)
        try:
            results.append(
                run_study(
                    _backend(db),
                    space_from_dict(SPACE, base=base),
                    base,
                    name="shared",
                    trials=6,
                    slo=SLO_T,
                    storage=open_storage(pg_url),
                    seed=seed,
                    random_baseline=False,
                    progress=False,
                )
            )
        except Exception as exc:
            errors.append(exc)
        finally:
            db.dispose()

    try:
        threads = [threading.Thread(target=worker, args=(s,)) for s in (1, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        study = optuna.load_study(study_name="shared", storage=open_storage(pg_url))
        measured = [t for t in study.trials if "duplicate_of" not in t.user_attrs]
        assert 6 <= len(measured) <= 7  # each worker asks until the study holds 6 measured (one may overshoot)
        assert sum(bool(t.user_attrs.get("baseline")) for t in study.trials) == 1
        # the kvpilot schema's own Alembic version is untouched by Optuna's
        from collector.db import check_schema_current

        check_schema_current(make_engine(pg_url))
    finally:
        schema = make_url(storage_url).query["options"].split("search_path=")[1]
        admin = create_engine(make_url(pg_url).difference_update_query(["options"]), isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()


def test_trials_can_be_scored_on_several_workload_seeds(sqlite_url: str) -> None:
    db = make_engine(sqlite_url)
    base = tiny_profile().engine_config(None)
    be = _backend(db)
    result = run_study(
        be,
        space_from_dict(SPACE, base=base),
        base,
        name="ms",
        trials=2,
        slo=SLO_T,
        workload_seed=[0, 1],
        random_baseline=False,
        progress=False,
    )
    one = be.evaluate(base, run_id="single-0", seed=0)
    two = be.evaluate(base, run_id="single-1", seed=1)
    combined = result.trials[0].metrics
    assert combined["requests"] == one.requests + two.requests
    assert combined["goodput_tps"] == pytest.approx((one.goodput_tps + two.goodput_tps) / 2)
    assert combined["e2e_p99_s"] == max(one.e2e_p99_s, two.e2e_p99_s)
    db.dispose()
