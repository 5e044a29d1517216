"""The reference TransformerLM (arch "tiny"): the seed's small from-scratch language model.

Learned positions, RMSNorm, multi-head attention, GELU (tanh) FFN, tied unembedding, no
biases; a character- or byte-level tokenizer (`mlxtoy.io.char_tokenizer`). It is the same
module tree as GPT-2 (`mlxtoy.models.gpt2.LearnedPosTransformer`) with RMSNorm and without
biases, so LoRA, taps, the trainer and generation treat it like any other model.

Sampling runs over a sliding context window: the position table holds `context_length`
positions, and once a KV-cached generation has filled them, each new step re-reads the last
`context_length` tokens at positions 0 .. context_length - 1 (as the seed did), so generation
goes on for as long as asked. Without a cache the model reads at most `context_length`.

    mlxtoy train --method scratch --arch tiny --data assets/corpus/lighthouse.txt --out RUN
    mlxtoy generate --model RUN --prompt "The keeper" --temp 0.8
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlxtoy.errors import UserError
from mlxtoy.model_config import ModelConfig
from mlxtoy.models.gpt2 import LearnedPosTransformer

class TinyLM(LearnedPosTransformer):
    # generation may run past context_length: see the module docstring
    sliding_window = True
    bias = False
    layer_norm = False  # RMSNorm

    def hidden(self, tokens: mx.array, mask: Any = None, cache: list | None = None,
               taps: dict | None = None) -> mx.array:
        """As LlamaModel.hidden; with a cache, positions past the table slide the window.

        The tokens a cache holds are kept on it (`cache[0].window_tokens`) so the window can be
        re-read. When sliding, the result covers the last min(T, context_length) positions.
        """
        if cache is None or cache[0].starts is not None:
            # a batch of rows (mlxtoy.engine) never slides: each row ends at the context
            return super().hidden(tokens, mask, cache, taps)
        ctx = self.config.context_length
        first = cache[0]
        offset = first.offset
        held = getattr(first, "window_tokens", None)
        if offset and (held is None or held.shape[1] < offset or held.shape[0] != tokens.shape[0]):
            raise UserError("this KV cache was filled outside TinyLM; start from an empty cache")
        seen = tokens
        if offset:
            seen = mx.concatenate([held[:, :offset], tokens.astype(held.dtype)], axis=1)
        if offset + tokens.shape[1] <= ctx:
            h = super().hidden(tokens, mask, cache, taps)
        else:
            window = seen[:, -ctx:]
            for c in cache:  # forget everything: the window is re-read from position 0
                c.trim(c.offset)
            h = super().hidden(window, None, cache, taps)
            h = h[:, -min(tokens.shape[1], ctx):]
            seen = window
        first.window_tokens = seen
        return h

def scratch_model_config(vocab_size: int, d_model: int = 128, n_layers: int = 4, n_heads: int = 4,
                         d_ff: int | None = None, context_length: int = 128,
                         norm_eps: float = 1e-5) -> ModelConfig:
    """A TinyLM config: multi-head (no GQA), d_head = d_model / n_heads, tied output."""
    if d_model % n_heads:
        raise UserError(f"tiny: d_model ({d_model}) must be a multiple of n_heads ({n_heads})")
    return ModelConfig(arch="tiny", vocab_size=vocab_size, d_model=d_model, n_layers=n_layers,
                       n_heads=n_heads, n_kv_heads=n_heads, d_head=d_model // n_heads,
                       d_ff=d_ff or 4 * d_model, norm_eps=norm_eps, rope_dims=0,
                       tie_embeddings=True, context_length=context_length)
