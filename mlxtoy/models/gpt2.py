"""GPT-2 and the learned-position decoders: learned positions, LayerNorm with bias, per-head
q/k/v with biases, GELU (tanh) FFN.

The shared decoder (`mlxtoy.models.llama`) with its own norm, FFN and position table, so LoRA,
taps, the trainer and generation work unchanged: `tok_embeddings`, `pos_embeddings`,
`layers[i].attn_norm` / `attn.{q,k,v,o}` / `ffn_norm` / `ffn.{up,down}`, final `norm`, optional
`output`. No RoPE: positions are a learned table added to the token embeddings;
with a KV cache the new tokens sit at positions cache[0].offset ...

`LearnedPosTransformer` takes the norm and the bias switch as class attributes, so the reference
TransformerLM (`mlxtoy.models.tiny`: RMSNorm, no biases) is the same code. GGUF's fused
`attn_qkv` and transformers' Conv1D layout are name-table transforms (`mlxtoy.arch.gpt2`).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlxtoy.errors import UserError
from mlxtoy.model_config import ModelConfig
from mlxtoy.models.llama import Block, LlamaModel


class FeedForward(nn.Module):
    """up -> GELU (tanh approximation, as GPT-2 and llama.cpp's ggml_gelu) -> down."""

    def __init__(self, cfg: ModelConfig, bias: bool):
        super().__init__()
        self.up = nn.Linear(cfg.d_model, cfg.d_ff, bias=bias)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down(nn.gelu_approx(self.up(x)))


class LearnedPosTransformer(LlamaModel):
    """Pre-norm decoder with a learned position table; LlamaModel's forward, taps and output."""

    bias = True
    layer_norm = True  # LayerNorm (weight and bias); else RMSNorm

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.pos_embeddings = nn.Embedding(cfg.context_length, cfg.d_model)

    def make_norm(self, cfg: ModelConfig) -> nn.Module:
        if self.layer_norm:
            return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        return nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)

    def make_block(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return Block(cfg, layer, norm=lambda: self.make_norm(cfg), bias=self.bias,
                     ffn=FeedForward(cfg, self.bias), rope=False)

    def embed(self, tokens: mx.array, offset: int | mx.array = 0) -> mx.array:
        """Token + position embeddings; `offset` may be a traced array (compiled decoding)."""
        T = tokens.shape[1]
        if isinstance(offset, int) and offset + T > self.config.context_length:
            raise UserError(f"{offset + T} positions do not fit this model's learned position "
                            f"table ({self.config.context_length})")
        # (the padding columns of a left-padded batch's prefill have negative positions: they
        # read position 0, and no real column attends to them)
        positions = mx.maximum(mx.arange(T) + offset, 0)
        return self.tok_embeddings(tokens) + self.pos_embeddings(positions)


class GPT2Model(LearnedPosTransformer):
    pass
