"""Small engine configs so the engine tests run in seconds on 2 cores."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig

TINY_MODEL = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128, "max_position": 1024, "seed": 7}


def tiny_config(**sections: dict) -> EngineConfig:
    base: dict = {"device": "cpu", "model": dict(TINY_MODEL), "warmup": {"requests": 0}}
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    return EngineConfig.from_dict(base)


@pytest.fixture
def tiny() -> EngineConfig:
    return tiny_config()
