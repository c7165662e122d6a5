"""Alembic is the only way the schema changes: head matches the models, and the collector checks it."""

from __future__ import annotations

import pytest
from alembic import command
from sqlalchemy import text

from collector.db import alembic_config, check_schema_current, current_revision, head_revision, make_engine, upgrade
from collector.errors import SchemaOutdatedError


def test_alembic_check_finds_no_drift(db_url: str) -> None:
    """`alembic check`: autogenerate against a database at head yields no operations."""
    command.check(alembic_config(db_url))


def test_upgrade_is_idempotent_and_reaches_head(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'x.db'}"
    upgrade(url)
    upgrade(url)
    engine = make_engine(url)
    assert current_revision(engine) == head_revision()
    check_schema_current(engine)
    mode = engine.connect().exec_driver_sql("PRAGMA journal_mode").scalar()
    assert mode == "wal"
    engine.dispose()


def test_unmigrated_database_is_refused_with_the_command_to_run(tmp_path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'empty.db'}")
    with pytest.raises(SchemaOutdatedError, match="kvpilot db upgrade"):
        check_schema_current(engine)
    engine.dispose()


def test_outdated_database_is_refused(sqlite_url: str) -> None:
    engine = make_engine(sqlite_url)
    with engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = 'deadbeef0000'"))
    with pytest.raises(SchemaOutdatedError, match="does not know"):
        check_schema_current(engine)
    engine.dispose()


def test_downgrade_to_base_and_back(sqlite_url: str) -> None:
    command.downgrade(alembic_config(sqlite_url), "base")
    engine = make_engine(sqlite_url)
    assert current_revision(engine) is None
    upgrade(sqlite_url)
    assert current_revision(engine) == head_revision()
    engine.dispose()


def test_swap_seconds_revision_gives_existing_requests_zero(db_url: str) -> None:
    """Rows stored before `requests.swap_s` existed read 0 after the upgrade (the column's server default)."""
    command.downgrade(alembic_config(db_url), "d4a1e7c2b9f0")
    engine = make_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO requests (instance, run_id, ts, request_id, status, priority, prompt_tokens,"
                    " output_tokens, queue_s, prefill_s, decode_s, e2e_s, preemptions, swaps, cached_tokens, warmup)"
                    " VALUES ('e0', 'r1', 1.0, 'q0', 'finished', 1, 10, 2, 0.1, 0.2, 0.3, 0.6, 0, 1, 0, false)"
                )
            )
        upgrade(db_url)
        assert current_revision(engine) == head_revision()
        with engine.connect() as conn:
            assert conn.execute(text("SELECT swap_s FROM requests")).scalar_one() == 0.0
    finally:
        upgrade(db_url)
        engine.dispose()


def test_instance_owners_revision_gives_existing_targets_their_instances(db_url: str) -> None:
    """Targets stored before `instance_owners` existed own their instances after the upgrade (the oldest)."""
    command.downgrade(alembic_config(db_url), "b5f2a9d03c41")
    engine = make_engine(db_url)
    try:
        with engine.begin() as conn:
            for url, instance, created in (
                ("http://a/m", "gpu-0", 1.0),
                ("http://b/m", "gpu-0", 2.0),
                ("http://c/m", "gpu-1", 3.0),
            ):
                conn.execute(
                    text(
                        "INSERT INTO scrape_targets (url, job, instance, interval_s, enabled, created_at)"
                        " VALUES (:url, 'x', :instance, 15.0, true, :created)"
                    ),
                    {"url": url, "instance": instance, "created": created},
                )
            ids = dict(conn.execute(text("SELECT url, id FROM scrape_targets")).all())
        upgrade(db_url)
        with engine.connect() as conn:
            owners = conn.execute(
                text("SELECT instance, owner, claimed_at FROM instance_owners ORDER BY instance")
            ).all()
        assert [tuple(row) for row in owners] == [
            ("gpu-0", f"target:{ids['http://a/m']}", 1.0),
            ("gpu-1", f"target:{ids['http://c/m']}", 3.0),
        ]
    finally:
        upgrade(db_url)
        engine.dispose()


def test_owner_names_revision_gives_token_less_pushes_to_the_ingest_identity(db_url: str) -> None:
    """`anonymous` (pushed to a collector without a token) becomes `ingest`, KVPILOT_INGEST_TOKEN's identity:
    setting a token keeps those instances. Fingerprints and targets stay (adopted at the collector's start)."""
    command.downgrade(alembic_config(db_url), "35c582cf7d65")
    engine = make_engine(db_url)
    rows = [("a", "anonymous"), ("b", "token:0123456789abcdef"), ("c", "target:7")]
    try:
        with engine.begin() as conn:
            for instance, owner in rows:
                conn.execute(
                    text("INSERT INTO instance_owners (instance, owner, claimed_at) VALUES (:i, :o, 1.0)"),
                    {"i": instance, "o": owner},
                )
        upgrade(db_url)
        with engine.connect() as conn:
            owners = conn.execute(text("SELECT instance, owner FROM instance_owners ORDER BY instance")).all()
        assert [tuple(r) for r in owners] == [("a", "ingest"), ("b", "token:0123456789abcdef"), ("c", "target:7")]
        command.downgrade(alembic_config(db_url), "35c582cf7d65")
        with engine.connect() as conn:
            kept = conn.execute(text("SELECT instance, owner FROM instance_owners")).all()
        assert [tuple(r) for r in kept] == [("c", "target:7")]  # the older code re-claims pushed ones
    finally:
        upgrade(db_url)
        engine.dispose()
