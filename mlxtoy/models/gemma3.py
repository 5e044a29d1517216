"""Gemma 3 (text): the shared block with norms after attention and after the FFN (`post_norms`),
GeGLU with the tanh GELU, q/k RMSNorm, embeddings scaled by sqrt(d_model), tied output.

Norm weights are stored as the full multiplier (HF's 1 + w, what llama.cpp's converter writes),
so every norm is a plain RMSNorm here. Sliding-window layers with their own RoPE base, and the
attention scale from `query_pre_attn_scalar`, are `ModelConfig` options the shared Attention
reads (`sliding_window`, `layer_types`, `rope_local_base`, `attn_scale`).
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from mlxtoy.model_config import ModelConfig
from mlxtoy.models.llama import Block, FeedForward, LlamaModel


class Gemma3Model(LlamaModel):
    def make_block(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return Block(cfg, layer, ffn=FeedForward(cfg, act=nn.gelu_approx), post_norms=True)

    def embed(self, tokens: mx.array, offset: int | mx.array = 0) -> mx.array:
        h = self.tok_embeddings(tokens)
        return h * mx.array(math.sqrt(self.config.d_model), dtype=h.dtype)
