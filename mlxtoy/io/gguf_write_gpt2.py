"""Write llama.cpp `gpt2` GGUFs: `mlxtoy.io.gguf_write.write_gguf` with GPT-2's own checks.

The writing is the llama writer's (tensors streamed one at a time into a temporary file renamed
into place; 1-D tensors F32; f16 / q8_0 for matrices; tokenizer.* and general.* carried
unchanged); its gpt2 branch writes the architecture keys (LayerNorm epsilon, no RoPE) and the
tensors: q/k/v fused into `blk.N.attn_qkv`, every bias, and the learned `position_embd` table
(see `mlxtoy.io.gpt2_io.gguf_tensor_items`).
"""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx

from mlxtoy.config import ModelConfig
from mlxtoy.errors import UserError
from mlxtoy.io.gguf_write import write_gguf


def write_gpt2_gguf(path: str, cfg: ModelConfig, weights: dict[str, mx.array],
                    metadata: dict[str, Any] | None = None, dtype: str = "f32",
                    name: str | None = None,
                    progress: Callable[[int, int], None] | None = None) -> str:
    """Write a llama.cpp gpt2 GGUF (arguments as `mlxtoy.io.gguf_write.write_gguf`)."""
    if cfg.arch != "gpt2":
        raise UserError(f"write_gpt2_gguf writes gpt2 models, not {cfg.arch}")
    if cfg.n_kv_heads != cfg.n_heads or cfg.n_heads * cfg.d_head != cfg.d_model:
        raise UserError("llama.cpp's gpt2 needs n_heads * d_head == d_model and n_kv_heads == n_heads")
    return write_gguf(path, cfg, weights, metadata, dtype, name, progress)
