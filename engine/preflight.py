"""The checks a config must pass before an engine is built from it, beyond what the schema sees alone.

Pool sizes only make sense against the model's shape (KV bytes per token, read from the checkpoint when
there is one): `cache.hot_bytes: 100` is a valid integer but holds no KV page. `kvpilot engine config`
and `kvpilot engine serve` both call `check_engine_config`, so a config that passes one passes the other,
and a failure is one `ConfigError` naming the field instead of a traceback from inside the engine.
The device is not checked here: a config written for a GPU host may be validated on a laptop.
"""

from __future__ import annotations

from pydantic import ValidationError

from engine.config import ConfigError, EngineConfig, ModelConfig, format_validation_error
from engine.kv.manager import KVCacheManager

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def resolved_model(cfg: EngineConfig) -> ModelConfig:
    """The model the engine will run: the checkpoint's shape when `model.checkpoint` is set."""
    if not cfg.model.checkpoint:
        return cfg.model
    from engine.weights import CheckpointError, config_from_checkpoint

    try:
        model, _ = config_from_checkpoint(cfg.model.checkpoint, cfg.model)
    except CheckpointError as exc:
        raise ConfigError(str(exc), "model.checkpoint") from exc
    except ValidationError as exc:
        raise ConfigError(f"model.checkpoint: config.json: {format_validation_error(exc)}", "model.checkpoint") from exc
    except (OSError, ValueError) as exc:  # unreadable, not JSON
        raise ConfigError(f"model.checkpoint: {cfg.model.checkpoint}: {exc}", "model.checkpoint") from exc
    return model


def kv_bytes_per_token(model: ModelConfig) -> int:
    """Keys and values of every layer for one token (what the executor allocates per token slot)."""
    return 2 * model.n_layers * model.n_kv_heads * model.head_dim * DTYPE_BYTES[model.dtype]


def check_engine_config(cfg: EngineConfig) -> None:
    """Raise ConfigError (naming the field) if an engine could not start on `cfg` or serve its warm-up."""
    model = resolved_model(cfg)
    per_token = kv_bytes_per_token(model)
    try:
        kv = KVCacheManager(cfg.cache, bytes_per_token=per_token)
    except ValueError as exc:
        raise ConfigError(str(exc), "cache.hot_bytes") from exc
    warm = cfg.warmup
    if warm.requests == 0:
        return
    tokens = 1 + warm.prompt_tokens + warm.max_tokens  # BOS, prompt, output
    if tokens > model.max_position:
        raise ConfigError(
            f"warmup.prompt_tokens: a warm-up request of {tokens} tokens exceeds the model's "
            f"{model.max_position} positions",
            "warmup.prompt_tokens",
        )
    usable = kv.hot.num_pages - kv.watermark_pages
    if kv.pages_needed(tokens) > usable:
        raise ConfigError(
            f"cache.hot_bytes ({cfg.cache.hot_bytes}) holds {usable * kv.page_tokens} tokens for this model "
            f"({per_token} bytes each); the warm-up request needs {tokens}",
            "cache.hot_bytes",
        )
