"""`kvpilot model init`: a small random-weight Llama checkpoint that kvpilot's engine, transformers and vLLM load."""

from __future__ import annotations

from pathlib import Path

import typer
from pydantic import ValidationError

from kvpilot.cli_extras import require_extras

model_app = typer.Typer(no_args_is_help=True, add_completion=False)


@model_app.command("init")
def init_cmd(
    ctx: typer.Context,
    directory: Path = typer.Argument(..., help="where to write the checkpoint (created if missing)"),
    vocab_size: int = typer.Option(
        2048, min=259, max=262_144, help="vocabulary (ids past what the corpus fills are reserved)"
    ),
    dim: int = typer.Option(256, min=16, max=16_384, help="hidden size"),
    layers: int = typer.Option(4, min=1, max=128, help="decoder layers"),
    heads: int = typer.Option(8, min=1, max=256, help="attention heads (head size = dim / heads)"),
    kv_heads: int = typer.Option(2, min=1, max=256, help="key/value heads (grouped-query attention)"),
    ffn_dim: int = typer.Option(688, min=16, max=65_536, help="MLP intermediate size"),
    max_position: int = typer.Option(2048, min=64, max=1_048_576, help="max_position_embeddings"),
    dtype: str = typer.Option("float32", help="float32 | bfloat16 (vLLM's CPU build takes both)"),
    seed: int = typer.Option(0, min=0, max=2**63 - 1, help="weights seed (an engine with model.seed S has the same)"),
    corpus: Path | None = typer.Option(
        None, exists=True, dir_okay=False, help="UTF-8 text to train the tokenizer on (default: a built-in corpus)"
    ),
    force: bool = typer.Option(False, "--force", help="replace the checkpoint files already in DIRECTORY"),
) -> None:
    """Write config.json, model.safetensors, generation_config.json and a locally trained BPE tokenizer."""
    require_extras(ctx, "engine")
    from engine.checkpoint import VLLM_CPU_HEAD_SIZES, CheckpointInitError, init_checkpoint
    from engine.config import ModelConfig
    from engine.tokenizer_train import MAX_CORPUS_BYTES, TokenizerTrainError, builtin_corpus

    if dtype not in ("float32", "bfloat16"):
        raise _fail(f"--dtype must be float32 or bfloat16, got {dtype!r}")
    try:
        model = ModelConfig(
            vocab_size=vocab_size,
            dim=dim,
            n_layers=layers,
            n_heads=heads,
            n_kv_heads=kv_heads,
            ffn_dim=ffn_dim,
            max_position=max_position,
            seed=seed,
            dtype=dtype,
        )
    except ValidationError as exc:
        raise _fail("; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())) from None
    if corpus is not None:
        if corpus.stat().st_size > MAX_CORPUS_BYTES:
            raise _fail(f"--corpus {corpus} is larger than {MAX_CORPUS_BYTES // 2**20} MiB")
        try:
            text = corpus.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise _fail(f"--corpus {corpus} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    else:
        text = builtin_corpus()
    try:
        info = init_checkpoint(directory, model, corpus=text, overwrite=force)
    except (CheckpointInitError, TokenizerTrainError, OSError) as exc:
        raise _fail(str(exc)) from None
    typer.echo(
        f"wrote {info.path}: Llama {model.n_layers} layers, dim {model.dim}, {model.n_heads} heads "
        f"({model.n_kv_heads} KV, head size {model.head_dim}), vocab {model.vocab_size} "
        f"({info.learned_tokens} learned), {info.parameters:,} parameters in {model.dtype} "
        f"({info.bytes / 2**20:.1f} MiB)"
    )
    if model.head_dim not in VLLM_CPU_HEAD_SIZES:
        typer.echo(f"note: vLLM's CPU attention takes head sizes {list(VLLM_CPU_HEAD_SIZES)}", err=True)


def _fail(message: str) -> typer.Exit:
    typer.echo(f"kvpilot: {message}", err=True)
    return typer.Exit(2)
