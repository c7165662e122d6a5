"""Writing a small random-weight Llama checkpoint in Hugging Face's layout (`kvpilot model init`).

No weights can be fetched on a machine without a model hub, yet the tests and operators need one model
that kvpilot's engine, transformers and vLLM all load. This writes it: `config.json` (LlamaForCausalLM),
`model.safetensors` (the engine's own seeded init, so `--seed S` gives the weights of an engine built with
`model.seed: S`), `generation_config.json`, and a byte-level BPE tokenizer trained here (`tokenizer.json`,
`tokenizer_config.json`, `special_tokens_map.json`). The weights are random: the text is nonsense, but the
same prompt gives the same tokens on every machine, which is what telemetry and tuning tests need.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.model import LlamaForCausalLM
from engine.tokenizer_train import BOS, BOS_ID, EOS, EOS_ID, UNK, learned_size, train_bpe

CHECKPOINT_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)
# vLLM's CPU attention kernels take these head sizes (vllm/v1/attention/backends/cpu_attn.py, 0.32).
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


class CheckpointInitError(ValueError):
    """The directory or the shape cannot hold a new checkpoint."""


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    model: ModelConfig
    parameters: int
    bytes: int
    learned_tokens: int  # ids that are bytes, merges or specials; the rest of the vocabulary is reserved


def hf_config(m: ModelConfig) -> dict:
    """The `config.json` of a Llama of shape `m` (both the 4.x and the 5.x spellings of dtype and rope)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": m.vocab_size,
        "hidden_size": m.dim,
        "intermediate_size": m.ffn_dim,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_kv_heads,
        "head_dim": m.head_dim,
        "max_position_embeddings": m.max_position,
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "use_cache": True,
        "torch_dtype": m.dtype,
        "dtype": m.dtype,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
    }


def _tokenizer_config(max_position: int) -> dict:
    # transformers builds a fast tokenizer straight from tokenizer.json; BOS comes from its post-processor.
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "pad_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_position,
    }


def init_checkpoint(
    directory: str | Path, model: ModelConfig, *, corpus: str, overwrite: bool = False
) -> CheckpointInfo:
    """Write a checkpoint of shape `model` (weights from `model.seed`, stored in `model.dtype`) into `directory`.

    Refuses a directory that already holds checkpoint files unless `overwrite`; other files are left alone.
    """
    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise CheckpointInitError(f"{path} exists and is not a directory")
    present = [name for name in CHECKPOINT_FILES if (path / name).exists()]
    if present and not overwrite:
        raise CheckpointInitError(
            f"{path} already holds a checkpoint ({', '.join(present)}); pass --force to replace it"
        )
    tok = train_bpe(model.vocab_size, corpus)
    weights = LlamaForCausalLM(model)
    weights.init_weights(model.seed)
    dtype = getattr(torch, model.dtype)
    state = {name: t.detach().to(dtype).contiguous() for name, t in weights.state_dict().items()}

    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "model.safetensors").chmod(0o644)  # save_file makes it private, unlike the JSON files beside it
    _write_json(path / "config.json", hf_config(model))
    _write_json(
        path / "generation_config.json",
        {"_from_model_config": True, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID},
    )
    tok.save(str(path / "tokenizer.json"))
    _write_json(path / "tokenizer_config.json", _tokenizer_config(model.max_position))
    _write_json(path / "special_tokens_map.json", {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK})
    return CheckpointInfo(
        path=path,
        model=model,
        parameters=sum(t.numel() for t in state.values()),
        bytes=(path / "model.safetensors").stat().st_size,
        learned_tokens=min(learned_size(tok), model.vocab_size),
    )


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
