"""The served collector's GC settings (`collector.server.run.tune_gc`): the start-up heap frozen, the young
generation's threshold raised; 0 leaves Python's own. Each case restores the test process's GC."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from collector.server.run import tune_gc
from collector.settings import CollectorSettings


@pytest.fixture
def restored_gc() -> Iterator[None]:
    threshold = gc.get_threshold()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


def test_the_start_up_heap_is_frozen_and_young_collections_come_less_often(restored_gc: None) -> None:
    _, middle, old = gc.get_threshold()
    assert gc.get_freeze_count() == 0
    tune_gc(50_000)
    assert gc.get_threshold() == (50_000, middle, old)
    assert gc.get_freeze_count() > 10_000  # this process's modules, pytest's and the collector's


def test_zero_keeps_pythons_settings(restored_gc: None) -> None:
    before = gc.get_threshold()
    tune_gc(0)
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0


def test_the_setting_defaults_to_tuned_and_refuses_a_negative(monkeypatch: pytest.MonkeyPatch) -> None:
    assert CollectorSettings().gc_young_threshold == 50_000
    monkeypatch.setenv("KVPILOT_GC_YOUNG_THRESHOLD", "-1")
    with pytest.raises(ValueError, match="gc_young_threshold"):
        CollectorSettings()
