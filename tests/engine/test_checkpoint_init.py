"""`kvpilot model init`: the checkpoint kvpilot's engine, transformers and vLLM all load.

kvpilot's greedy tokens must equal Hugging Face's on the same files (the tokenizer included), so the
checkpoint is the same model everywhere; the vLLM side of that check is in tests/vllm.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from engine.llm_engine import LLMEngine
from engine.sequence import SamplingParams
from engine.sinks import NullSink
from kvpilot.cli import app
from tests.engine.conftest import tiny_config

transformers = pytest.importorskip("transformers", reason="transformers (dev extra) is the reference loader")

runner = CliRunner()
PROMPT = "The KV cache is full, so the scheduler preempts a request."


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "tiny-llama"
    result = runner.invoke(app, ["model", "init", str(path), "--seed", "3"])
    assert result.exit_code == 0, result.output
    assert "head size 32" in result.output and "vocab 2048" in result.output
    return path


def test_files_and_config(checkpoint: Path) -> None:
    names = {p.name for p in checkpoint.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= names
    assert {"tokenizer_config.json", "special_tokens_map.json"} <= names
    cfg = json.loads((checkpoint / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["torch_dtype"]) == (1, 2, "float32")
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]) == (256, 4, 8)
    assert (cfg["num_key_value_heads"], cfg["head_dim"], cfg["vocab_size"]) == (2, 32, 2048)


def test_tokenizers_agree_and_cover_the_vocabulary(checkpoint: Path) -> None:
    engine = LLMEngine(tiny_config(model={"checkpoint": str(checkpoint)}), sink=NullSink())
    hf_tok = transformers.AutoTokenizer.from_pretrained(checkpoint)
    ours = engine.tokenizer.encode(PROMPT)
    assert ours[0] == 1 and ours == hf_tok(PROMPT).input_ids  # both prepend BOS, nothing else
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id) == (1, 2)
    assert engine.tokenizer.vocab_size == len(hf_tok) == 2048
    assert engine.tokenizer.decode(ours) == hf_tok.decode(ours, skip_special_tokens=True) == PROMPT
    assert None not in hf_tok.convert_ids_to_tokens(list(range(2048)))  # every id a model can sample is a token


def test_engine_generates_what_hf_generates(checkpoint: Path) -> None:
    engine = LLMEngine(tiny_config(model={"checkpoint": str(checkpoint)}), sink=NullSink())
    assert (engine.model_cfg.dim, engine.model_cfg.n_layers, engine.model_cfg.vocab_size) == (256, 4, 2048)
    prompt = engine.tokenizer.encode(PROMPT)
    ours = engine.generate([PROMPT], SamplingParams(max_tokens=16, ignore_eos=True))[0].output_token_ids
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    assert hf.dtype == torch.float32
    with torch.no_grad():
        theirs = hf.generate(
            torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=2
        )[0, len(prompt) :].tolist()
    assert ours == theirs


def test_same_seed_same_files_and_weights_of_the_seeded_engine(tmp_path: Path, checkpoint: Path) -> None:
    again = tmp_path / "again"
    assert runner.invoke(app, ["model", "init", str(again), "--seed", "3"]).exit_code == 0
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        digest = [hashlib.sha256((d / name).read_bytes()).hexdigest() for d in (checkpoint, again)]
        assert digest[0] == digest[1], name
    # --seed S writes the weights of an engine built with model.seed S and the same shape
    shape = {"vocab_size": 2048, "dim": 256, "n_layers": 4, "n_heads": 8, "n_kv_heads": 2, "ffn_dim": 688, "seed": 3}
    seeded = LLMEngine(tiny_config(model=shape), sink=NullSink()).executor.model.state_dict()
    loaded = LLMEngine(tiny_config(model={"checkpoint": str(checkpoint)}), sink=NullSink()).executor.model.state_dict()
    assert torch.equal(seeded["model.layers.3.mlp.down_proj.weight"], loaded["model.layers.3.mlp.down_proj.weight"])


def test_bfloat16_and_a_custom_corpus(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("queue depth and block tables\n" * 50)
    out = tmp_path / "bf16"
    args = ["model", "init", str(out), "--dtype", "bfloat16", "--dim", "128", "--heads", "2", "--kv-heads", "1"]
    result = runner.invoke(app, [*args, "--layers", "1", "--vocab-size", "300", "--corpus", str(corpus)])
    assert result.exit_code == 0, result.output
    assert "head size 64" in result.output and "vocab 300" in result.output
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert len(hf_tok) == 300 and hf_tok.decode(hf_tok("block tables").input_ids, skip_special_tokens=True) == (
        "block tables"
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert next(hf.parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--dim", "100", "--heads", "3"], "divisible by model.n_heads"),
        (["--heads", "8", "--kv-heads", "3"], "divisible by model.n_kv_heads"),
        (["--dtype", "float16"], "--dtype must be float32 or bfloat16"),
        (["--vocab-size", "12"], "vocab-size"),
    ],
)
def test_bad_shapes_are_clear_errors(tmp_path: Path, extra: list[str], needle: str) -> None:
    result = runner.invoke(app, ["model", "init", str(tmp_path / "m"), *extra])
    assert result.exit_code == 2 and needle in result.output, result.output
    assert "Traceback" not in result.output and not (tmp_path / "m").exists()


def test_refuses_to_overwrite_without_force_and_bad_corpus(tmp_path: Path) -> None:
    out = tmp_path / "m"
    small = ["--dim", "64", "--heads", "2", "--layers", "1", "--kv-heads", "1"]
    assert runner.invoke(app, ["model", "init", str(out), *small]).exit_code == 0
    again = runner.invoke(app, ["model", "init", str(out), *small])
    assert again.exit_code == 2 and "--force" in again.output
    assert runner.invoke(app, ["model", "init", str(out), *small, "--force"]).exit_code == 0
    binary = tmp_path / "corpus.bin"
    binary.write_bytes(b"\xff\xfe\x00bad")
    result = runner.invoke(app, ["model", "init", str(tmp_path / "n"), *small, "--corpus", str(binary)])
    assert result.exit_code == 2 and "not UTF-8" in result.output
    afile = tmp_path / "file"
    afile.write_text("x")
    result = runner.invoke(app, ["model", "init", str(afile), *small])
    assert result.exit_code == 2 and "not a directory" in result.output
