"""The engine's numerics: paged attention against dense attention (Hugging Face's Llama as the
independent reference), checkpoint loading, and generations that stay identical through chunked
prefill, prefix-cache hits, block-size policies, recompute and swap preemption."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sequence import SamplingParams
from engine.sinks import NullSink
from tests.engine.conftest import tiny_config

transformers = pytest.importorskip("transformers", reason="transformers (dev extra) is the dense reference")


def hf_twin(engine: LLMEngine) -> torch.nn.Module:
    m = engine.model_cfg
    cfg = transformers.LlamaConfig(
        vocab_size=m.vocab_size,
        hidden_size=m.dim,
        intermediate_size=m.ffn_dim,
        num_hidden_layers=m.n_layers,
        num_attention_heads=m.n_heads,
        num_key_value_heads=m.n_kv_heads,
        max_position_embeddings=m.max_position,
        rms_norm_eps=m.norm_eps,
        rope_theta=m.rope_theta,
        tie_word_embeddings=False,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=258,
    )
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.load_state_dict(engine.executor.model.state_dict())
    return hf


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        [256, *torch.randint(0, 256, (int(torch.randint(5, 120, (1,), generator=g)),), generator=g).tolist()]
        for _ in range(n)
    ]


def generate(cfg: EngineConfig, ps: list[list[int]], params: SamplingParams, **kw: object) -> list[list[int]]:
    engine = LLMEngine(cfg, sink=NullSink())
    seqs = [engine.add_request(p, params, **kw) for p in ps]
    engine.run_until_done()
    engine.kv.check_invariants()
    return [s.output_token_ids for s in seqs]


GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def test_paged_batched_logits_equal_dense_hf_forward() -> None:
    cfg = tiny_config(cache={"block_policy": "dynamic", "dynamic_thresholds": (32, 64)})
    engine = LLMEngine(cfg, sink=NullSink())
    hf = hf_twin(engine)
    ps = prompts(6)
    seqs = [engine.add_request(p, GREEDY) for p in ps]
    engine.run_until_done()
    with torch.no_grad():
        for s in seqs:
            full = torch.tensor([s.token_ids[:-1]])
            ref = hf(full).logits[0]
            # every generated token is the argmax of the dense model's logits at that position
            want = ref[len(s.prompt_token_ids) - 1 :].argmax(-1).tolist()
            assert s.output_token_ids == want


def test_logits_match_hf_numerically() -> None:
    cfg = tiny_config()
    engine = LLMEngine(cfg, sink=NullSink())
    hf = hf_twin(engine)
    p = prompts(1, seed=3)[0]
    ex = engine.executor
    seq = engine.add_request(p, SamplingParams(max_tokens=1, ignore_eos=True))
    out = engine.scheduler.schedule(0.0)
    captured = {}
    orig = ex.model.forward

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        captured["logits"] = orig(*args, **kwargs)
        return captured["logits"]

    ex.model.forward = spy
    ex.execute(out, engine.kv)
    with torch.no_grad():
        ref = hf(torch.tensor([seq.token_ids])).logits[0, -1]
    torch.testing.assert_close(captured["logits"][0], ref, rtol=1e-4, atol=1e-4)


def test_local_hf_checkpoint_loads_and_generates_like_hf(tmp_path: object) -> None:
    ref_engine = LLMEngine(tiny_config(), sink=NullSink())
    hf = hf_twin(ref_engine)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    cfg = tiny_config(model={"checkpoint": str(tmp_path), "seed": 999})
    engine = LLMEngine(cfg, sink=NullSink())
    p = prompts(1, seed=5)[0]
    ours = engine.generate([p], SamplingParams(max_tokens=12, ignore_eos=True))[0].output_token_ids
    with torch.no_grad():
        theirs = hf.generate(
            torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=258
        )[0, len(p) :].tolist()
    assert ours == theirs


def test_bad_checkpoint_is_a_clear_error(tmp_path: object) -> None:
    from engine.weights import CheckpointError

    with pytest.raises(CheckpointError, match=r"config\.json"):
        LLMEngine(tiny_config(model={"checkpoint": str(tmp_path)}), sink=NullSink())


@pytest.mark.parametrize(
    "variant",
    [
        {"scheduler": {"prefill_chunk_tokens": 16, "max_num_batched_tokens": 40}},
        {"cache": {"block_policy": "fixed", "block_size": 8}},
        {"cache": {"block_policy": "fixed", "block_size": 128}},
        {"cache": {"block_policy": "dynamic", "dynamic_thresholds": (16, 48)}},
        {"scheduler": {"max_num_seqs": 1}},
    ],
    ids=["chunked-prefill", "block-8", "block-128", "dynamic", "one-at-a-time"],
)
def test_generation_is_identical_across_batching_and_block_layouts(variant: dict) -> None:
    ps = prompts(8, seed=1)
    base = generate(tiny_config(), ps, GREEDY)
    assert generate(tiny_config(**variant), ps, GREEDY) == base


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_gives_identical_generations(mode: str) -> None:
    ps = prompts(10, seed=2)
    params = SamplingParams(max_tokens=60, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True)
    base = generate(tiny_config(), ps, params)
    # a hot pool of 4 chunks x 128 tokens cannot hold ten 60-180 token sequences at once
    bpt = 2 * 2 * 2 * 16 * 4
    small = tiny_config(
        cache={"hot_bytes": 4 * 128 * bpt, "cold_bytes": 64 * 128 * bpt, "block_size": 16},
        scheduler={"preemption_mode": mode},
    )
    engine = LLMEngine(small, sink=NullSink())
    seqs = [engine.add_request(p, params) for p in ps]
    engine.run_until_done()
    assert [s.output_token_ids for s in seqs] == base
    assert sum(s.preemptions for s in seqs) > 0
    if mode == "swap":
        assert sum(s.swaps for s in seqs) > 0
    engine.kv.check_invariants()


def test_prefix_cache_hit_changes_nothing_but_the_work() -> None:
    system = [256, *range(64)]
    ps = [system + q[1:] for q in prompts(4, seed=4)]
    base = generate(tiny_config(cache={"enable_prefix_cache": False}), ps, GREEDY)
    engine = LLMEngine(tiny_config(cache={"block_size": 16}), sink=NullSink())
    first = engine.generate(ps[:1], GREEDY)[0]
    rest = engine.generate(ps[1:], GREEDY)
    assert [first.output_token_ids] + [s.output_token_ids for s in rest] == base
    assert all(s.num_cached_tokens >= 64 for s in rest)


def test_sampling_is_seeded_and_top_p_narrows() -> None:
    ps = prompts(2, seed=6)
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.5, seed=3, ignore_eos=True)
    a = generate(tiny_config(), ps, params)
    assert generate(tiny_config(), ps, params) == a
    other = SamplingParams(max_tokens=16, temperature=1.0, top_p=1.0, seed=4, ignore_eos=True)
    assert generate(tiny_config(), ps, other) != a
