"""Building the model: seeded random weights, or a local Hugging Face Llama checkpoint directory.

A checkpoint directory holds `config.json` and `model.safetensors` (or shards listed in
`model.safetensors.index.json`). Nothing is fetched from a hub: the path must exist locally.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.model import LlamaForCausalLM


class CheckpointError(ValueError):
    """The checkpoint directory is missing, not a Llama checkpoint, or its tensors do not fit."""


_HF_KEYS = {
    "vocab_size": "vocab_size",
    "hidden_size": "dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "num_key_value_heads": "n_kv_heads",
    "intermediate_size": "ffn_dim",
    "max_position_embeddings": "max_position",
    "rope_theta": "rope_theta",
    "rms_norm_eps": "norm_eps",
}


def config_from_checkpoint(path: str | Path, base: ModelConfig) -> tuple[ModelConfig, bool]:
    """ModelConfig read from the checkpoint's config.json (dtype/seed kept from `base`), and tie flag."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"model.checkpoint: {cfg_file} not found")
    hf = json.loads(cfg_file.read_text())
    arch = hf.get("model_type")
    if arch not in (None, "llama"):
        raise CheckpointError(f"model.checkpoint: model_type {arch!r} is not llama")
    values = base.model_dump()
    for hf_key, ours in _HF_KEYS.items():
        if hf.get(hf_key) is not None:
            values[ours] = hf[hf_key]
    if hf.get("num_key_value_heads") is None:
        values["n_kv_heads"] = values["n_heads"]
    rope_params = hf.get("rope_parameters") or {}
    if rope_params.get("rope_theta") is not None:
        values["rope_theta"] = rope_params["rope_theta"]
    values["checkpoint"] = str(path)
    return ModelConfig.model_validate(values), bool(hf.get("tie_word_embeddings", False))


def _load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    single = path / "model.safetensors"
    if single.is_file():
        return load_file(str(single))
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        raise CheckpointError(f"model.checkpoint: no model.safetensors or index in {path}")
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(load_file(str(path / shard)))
    return state


def build_model(cfg: ModelConfig, device: torch.device) -> LlamaForCausalLM:
    """The model in eval mode on `device`, in cfg.dtype."""
    dtype = getattr(torch, cfg.dtype)
    if cfg.checkpoint is None:
        model = LlamaForCausalLM(cfg)
        model.init_weights(cfg.seed)
    else:
        path = Path(cfg.checkpoint)
        cfg, tied = config_from_checkpoint(path, cfg)
        model = LlamaForCausalLM(cfg, tie_word_embeddings=tied)
        state = _load_state_dict(path)
        if tied:
            state.pop("lm_head.weight", None)
        state = {k: v for k, v in state.items() if "rotary_emb" not in k}
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [m for m in missing if not (tied and m == "lm_head.weight")]
        if missing or unexpected:
            raise CheckpointError(
                f"model.checkpoint: tensors do not match a Llama of this shape "
                f"(missing {missing[:5]}, unexpected {unexpected[:5]})"
            )
    model = model.to(device=device, dtype=dtype).eval()
    model.fuse()  # after the move: the fused copies live on the device in the serving dtype
    return model
