"""GPT-2: learned positions, LayerNorm with bias, per-head q/k/v with biases, GELU (tanh) FFN.

Same module vocabulary as `mlxtoy.models.llama` so LoRA, taps, the trainer and generation work
unchanged: `tok_embeddings`, `layers[i].attn_norm` / `attn.{q,k,v,o}` / `ffn_norm` /
`ffn.{up,down}`, final `norm`, optional `output`. Differences from the Llama block:
- positions are a learned table `pos_embeddings` added to the token embeddings (no RoPE);
  with a KV cache the new tokens sit at positions cache[0].offset ...;
- every projection has a bias; the FFN is up -> GELU(tanh) -> down (no gate);
- norms are LayerNorm (weight and bias).

`LearnedPosTransformer` takes the norm and the bias switch as parameters, so the reference
TransformerLM (`mlxtoy.models.tiny`: RMSNorm, no biases) is the same code.

GGUF's fused `attn_qkv` (rows q | k | v, each head-major) and transformers' Conv1D layout
(weights stored (in, out)) are converted in `mlxtoy.io.gpt2_io`; here weights are always ours:
q/k/v (heads, d_head, d_model), Linear (out, in).
"""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

from mlxtoy.config import ModelConfig
from mlxtoy.errors import UserError
from mlxtoy.models.llama import Block as LlamaBlock
from mlxtoy.models.llama import HeadProjection, LlamaModel, explicit_attention

LEARNED_POS_ARCHS = ("gpt2", "tiny")


class Attention(nn.Module):
    """Multi-head attention without RoPE (positions are already in the residual stream)."""

    def __init__(self, cfg: ModelConfig, bias: bool):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.d_head = cfg.n_heads, cfg.n_kv_heads, cfg.d_head
        self.q = HeadProjection(cfg.d_model, cfg.n_heads, cfg.d_head, bias=bias)
        self.k = HeadProjection(cfg.d_model, cfg.n_kv_heads, cfg.d_head, bias=bias)
        self.v = HeadProjection(cfg.d_model, cfg.n_kv_heads, cfg.d_head, bias=bias)
        self.o = nn.Linear(cfg.n_heads * cfg.d_head, cfg.d_model, bias=bias)
        self.scale = cfg.d_head**-0.5

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None,
                 head_taps: dict | None = None) -> mx.array:
        B, T, _ = x.shape
        q = self.q(x).transpose(0, 2, 1, 3)  # (B, H, T, Dh)
        k = self.k(x).transpose(0, 2, 1, 3)
        v = self.v(x).transpose(0, 2, 1, 3)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        if mask is None:
            mask = "causal" if T > 1 else None
        if head_taps is not None:
            heads = explicit_attention(q, k, v, self.scale, mask, head_taps)
        else:
            heads = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o(heads.transpose(0, 2, 1, 3).reshape(B, T, -1))


class FeedForward(nn.Module):
    """up -> GELU (tanh approximation, as GPT-2 and llama.cpp's ggml_gelu) -> down."""

    def __init__(self, cfg: ModelConfig, bias: bool):
        super().__init__()
        self.up = nn.Linear(cfg.d_model, cfg.d_ff, bias=bias)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down(nn.gelu_approx(self.up(x)))


class Block(LlamaBlock):
    """The llama block's pre-norm residual wiring and taps, with its own norms / biases."""

    def __init__(self, cfg: ModelConfig, norm: Callable[[], nn.Module], bias: bool):
        nn.Module.__init__(self)
        self.attn_norm = norm()
        self.attn = Attention(cfg, bias)
        self.ffn_norm = norm()
        self.ffn = FeedForward(cfg, bias)


class LearnedPosTransformer(LlamaModel):
    """Pre-norm decoder with a learned position table; LlamaModel's forward, taps and output,
    with its own blocks and position embeddings."""

    def __init__(self, cfg: ModelConfig, norm: Callable[[], nn.Module], bias: bool):
        nn.Module.__init__(self)
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_embeddings = nn.Embedding(cfg.context_length, cfg.d_model)
        self.layers = [Block(cfg, norm, bias) for _ in range(cfg.n_layers)]
        self.norm = norm()
        if not cfg.tie_embeddings:
            self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def embed(self, tokens: mx.array, offset: int | mx.array = 0) -> mx.array:
        """Token + position embeddings; `offset` may be a traced array (compiled decoding)."""
        T = tokens.shape[1]
        if isinstance(offset, int) and offset + T > self.config.context_length:
            raise UserError(f"{offset + T} positions do not fit this model's learned position "
                            f"table ({self.config.context_length})")
        positions = mx.arange(T) + offset
        return self.tok_embeddings(tokens) + self.pos_embeddings(positions)


class GPT2Model(LearnedPosTransformer):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, norm=lambda: nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps), bias=True)


def learned_pos_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our parameter name -> shape for a learned-position model: GPT-2 (biases everywhere,
    LayerNorm) or the reference TransformerLM (arch "tiny": no biases, RMSNorm)."""
    bias = norm_bias = cfg.arch == "gpt2"
    d, h, kv, dh, ff = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_head, cfg.d_ff
    shapes: dict[str, tuple[int, ...]] = {
        "tok_embeddings.weight": (cfg.vocab_size, d),
        "pos_embeddings.weight": (cfg.context_length, d),
    }
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        shapes[p + "attn_norm.weight"] = (d,)
        if norm_bias:
            shapes[p + "attn_norm.bias"] = (d,)
        shapes.update({p + "attn.q.weight": (h, dh, d), p + "attn.k.weight": (kv, dh, d),
                       p + "attn.v.weight": (kv, dh, d)})
        if bias:
            shapes.update({p + "attn.q.bias": (h, dh), p + "attn.k.bias": (kv, dh),
                           p + "attn.v.bias": (kv, dh)})
        shapes[p + "attn.o.weight"] = (d, h * dh)
        if bias:
            shapes[p + "attn.o.bias"] = (d,)
        shapes[p + "ffn_norm.weight"] = (d,)
        if norm_bias:
            shapes[p + "ffn_norm.bias"] = (d,)
        shapes[p + "ffn.up.weight"] = (ff, d)
        if bias:
            shapes[p + "ffn.up.bias"] = (ff,)
        shapes[p + "ffn.down.weight"] = (d, ff)
        if bias:
            shapes[p + "ffn.down.bias"] = (d,)
    shapes["norm.weight"] = (d,)
    if norm_bias:
        shapes["norm.bias"] = (d,)
    if not cfg.tie_embeddings:
        shapes["output.weight"] = (cfg.vocab_size, d)
    return shapes
