"""A small Llama-style decoder over a paged KV cache.

RMSNorm, rotary positions (precomputed once, HF's rotate-half layout), grouped-query attention and
SwiGLU, with parameter names matching Hugging Face's LlamaForCausalLM so a local checkpoint loads
as is. One forward runs a whole continuous batch: all tokens of all sequences flattened into one
[T, dim] matrix for the dense layers; attention reads keys and values through per-sequence page
tables (`AttentionBatch`), decodes batched together, prefill chunks one by one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig


@dataclass(slots=True)
class PrefillSpan:
    token_start: int  # offset of this chunk's tokens in the flattened batch
    num_tokens: int
    context_start: int  # tokens of this sequence already in the cache before this chunk
    key_pages: torch.Tensor | None  # pages covering [0, context_start + num_tokens); None if context_start == 0


@dataclass(slots=True)
class DecodeGroup:
    """Decode rows of similar context length, so padding to the longest costs little."""

    rows: torch.Tensor | None  # [g] indices into the decode rows; None when the group is all of them
    pages: torch.Tensor  # [g, max_pages]
    mask: torch.Tensor | None  # [g, 1, 1, max_pages * page_tokens]; None when no row is padded


@dataclass(slots=True)
class AttentionBatch:
    """Where each token's K/V goes and which cached keys each query reads."""

    write_slots: torch.Tensor  # [T] flat slot index (page * page_tokens + offset)
    num_decode: int  # the first num_decode tokens are one-token decodes
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillSpan]
    page_tokens: int


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotary_tables(cfg: ModelConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
    t = torch.arange(cfg.max_position, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device), emb.sin().to(device)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def _gather_pages(cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """[B, n_pages] page ids -> [B, n_pages * page_tokens, kv_heads, head_dim] keys or values.

    index_select on a 2-D view is several times faster than advanced indexing on CPU.
    """
    n_pages, page_tokens, kv_heads, head_dim = cache.shape
    flat = cache.view(n_pages, -1).index_select(0, pages.reshape(-1))
    return flat.view(pages.shape[0], pages.shape[1] * page_tokens, kv_heads, head_dim)


def _fuse_rows(layers: tuple[nn.Linear, ...]) -> torch.Tensor:
    """Concatenate the layers' weights and make each layer's weight a view of its rows, so the fused
    matrix costs no extra memory and the HF-named parameters still read (and load) as before."""
    with torch.no_grad():
        fused = torch.cat([layer.weight for layer in layers]).contiguous()
        offset = 0
        for layer in layers:
            rows = layer.weight.shape[0]
            layer.weight.data = fused[offset : offset + rows]
            offset += rows
    return fused


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.gqa = cfg.n_heads != cfg.n_kv_heads
        self.qkv_weight: torch.Tensor | None = None  # fused by fuse(); None: three separate projections

    def fuse(self) -> None:
        """One [q; k; v] matmul instead of three (vLLM's QKVParallelLinear): fewer, larger GEMMs."""
        projections = (self.q_proj, self.k_proj, self.v_proj)
        self.qkv_weight = _fuse_rows(projections)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        batch: AttentionBatch,
    ) -> torch.Tensor:
        T = x.shape[0]
        if self.qkv_weight is not None:
            q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
            q, k, v = F.linear(x, self.qkv_weight).split([q_size, kv_size, kv_size], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = apply_rotary(q.reshape(T, self.n_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.reshape(T, self.n_kv_heads, self.head_dim), cos, sin)
        v = v.reshape(T, self.n_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache[0], kv_cache[1]  # [pages, page_tokens, kv_heads, head_dim]
        k_flat = k_cache.view(-1, self.n_kv_heads, self.head_dim)
        v_flat = v_cache.view(-1, self.n_kv_heads, self.head_dim)
        k_flat.index_copy_(0, batch.write_slots, k.to(k_flat.dtype))
        v_flat.index_copy_(0, batch.write_slots, v.to(v_flat.dtype))

        outs: list[torch.Tensor] = []
        nd = batch.num_decode
        if nd:
            # The query heads sharing a KV head attend as one group of `n_heads / n_kv_heads` query rows, so
            # each cached key is read once per KV head rather than once per query head (head h uses KV head
            # h // group, as HF's repeat_kv and SDPA's enable_gqa pair them).
            qd_all = q[:nd].view(nd, self.n_kv_heads, self.n_heads // self.n_kv_heads, self.head_dim)
            dec_out: torch.Tensor | None = None
            for group in batch.decode_groups:
                keys = _gather_pages(k_cache, group.pages).transpose(1, 2)  # [g, kvh, L, hd]
                values = _gather_pages(v_cache, group.pages).transpose(1, 2)
                qd = qd_all if group.rows is None else qd_all.index_select(0, group.rows)
                o = F.scaled_dot_product_attention(
                    qd, keys.to(q.dtype), values.to(q.dtype), attn_mask=group.mask
                ).reshape(qd.shape[0], -1)
                if group.rows is None:
                    dec_out = o
                else:
                    if dec_out is None:
                        dec_out = o.new_empty((nd, o.shape[1]))
                    dec_out.index_copy_(0, group.rows, o)
            if dec_out is not None:  # every decode row is in a group: set unless decode_groups is empty
                outs.append(dec_out)
        for span in batch.prefills:
            s, n = span.token_start, span.num_tokens
            qp = q[s : s + n].transpose(0, 1).unsqueeze(0)  # [1, heads, n, hd]
            if span.key_pages is None:
                kp = k[s : s + n].transpose(0, 1).unsqueeze(0)
                vp = v[s : s + n].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=self.gqa)
            else:
                length = span.context_start + n
                kp = _gather_pages(k_cache, span.key_pages[None])[0, :length].transpose(0, 1).unsqueeze(0)
                vp = _gather_pages(v_cache, span.key_pages[None])[0, :length].transpose(0, 1).unsqueeze(0)
                q_pos = torch.arange(span.context_start, length, device=x.device)
                mask = torch.arange(length, device=x.device)[None, :] <= q_pos[:, None]
                o = F.scaled_dot_product_attention(
                    qp, kp.to(q.dtype), vp.to(q.dtype), attn_mask=mask, enable_gqa=self.gqa
                )
            outs.append(o.squeeze(0).transpose(0, 1).reshape(n, -1))
        attn = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
        return self.o_proj(attn)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.gate_up_weight: torch.Tensor | None = None

    def fuse(self) -> None:
        """One [gate; up] matmul instead of two (vLLM's MergedColumnParallelLinear)."""
        self.gate_up_weight = _fuse_rows((self.gate_proj, self.up_proj))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is not None:
            gate, up = F.linear(x, self.gate_up_weight).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBackbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)


class LlamaForCausalLM(nn.Module):
    """Parameter names as HF's (`model.layers.0.self_attn.q_proj.weight`, `lm_head.weight`)."""

    def __init__(self, cfg: ModelConfig, *, tie_word_embeddings: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = LlamaBackbone(cfg)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None

    def init_weights(self, seed: int) -> None:
        """Deterministic init from `seed` (same seed, same weights, on any device)."""
        gen = torch.Generator().manual_seed(seed)
        out_scale = 1.0 / math.sqrt(2 * self.cfg.n_layers)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name.endswith("layernorm.weight") or name == "model.norm.weight":
                    param.fill_(1.0)
                    continue
                std = 0.02 * (out_scale if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0)
                param.copy_(torch.randn(param.shape, generator=gen) * std)

    def fuse(self) -> None:
        """Build the fused projection weights; call again after the weights change (load, init)."""
        for module in self.model.layers:
            layer = cast(DecoderLayer, module)  # nn.ModuleList yields plain Modules
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def rope(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rope is None or self._rope[0].device != device:
            self._rope = rotary_tables(self.cfg, device)
        return self._rope

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: torch.Tensor,
        batch: AttentionBatch,
        logits_index: torch.Tensor,
    ) -> torch.Tensor:
        """Logits [len(logits_index), vocab] for the selected token positions."""
        cos_table, sin_table = self.rope(input_ids.device)
        cos, sin = cos_table[positions], sin_table[positions]
        x = self.model.embed_tokens(input_ids)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, kv_caches[i], batch)
        x = self.model.norm(x[logits_index])
        return self.lm_head(x).float()
