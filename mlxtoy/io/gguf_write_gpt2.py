"""Write llama.cpp `gpt2` GGUFs: the GPT-2 branch of `mlxtoy.io.gguf_write.write_gguf`.

Same file discipline as the llama writer (tensors streamed one at a time into a temporary
file renamed into place; 1-D tensors F32; f16 / q8_0 for matrices) and the same metadata
carrying (tokenizer.* and general.* copied unchanged); what differs is the architecture keys
(LayerNorm epsilon, no RoPE) and the tensors: q/k/v fused into `blk.N.attn_qkv`, every bias,
and the learned `position_embd` table (see `mlxtoy.io.gpt2_io.gguf_tensor_items`).
"""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx

from mlxtoy.config import ModelConfig
from mlxtoy.errors import UserError


def write_gpt2_gguf(path: str, cfg: ModelConfig, weights: dict[str, mx.array],
                    metadata: dict[str, Any] | None = None, dtype: str = "f32",
                    name: str | None = None,
                    progress: Callable[[int, int], None] | None = None) -> str:
    """Write a llama.cpp gpt2 GGUF (arguments as `mlxtoy.io.gguf_write.write_gguf`)."""
    import gguf

    from mlxtoy.io import gguf_write as gw
    from mlxtoy.io.gpt2_io import gguf_tensor_items

    if cfg.arch != "gpt2":
        raise UserError(f"write_gpt2_gguf writes gpt2 models, not {cfg.arch}")
    if cfg.n_kv_heads != cfg.n_heads or cfg.n_heads * cfg.d_head != cfg.d_model:
        raise UserError("llama.cpp's gpt2 needs n_heads * d_head == d_model and n_kv_heads == n_heads")
    dtype = gw._check_dtype(dtype)
    carried = gw.carried_metadata(metadata, cfg.arch)
    if "tokenizer.ggml.model" not in carried:
        raise UserError("cannot export a GGUF without tokenizer metadata (tokenizer.ggml.*)")
    tensors = []
    for gname, load in gguf_tensor_items(cfg, weights):
        shape = tuple(int(s) for s in load().shape)  # lazy arrays: shapes only, nothing computed
        tensors.append((gname, lambda f=load: gw.to_numpy(f()), shape))

    def kv(writer) -> None:
        writer.add_type(gguf.GGUFType.MODEL)
        if name and "general.name" not in carried:
            carried["general.name"] = name
        writer.add_context_length(int(cfg.context_length))
        writer.add_embedding_length(int(cfg.d_model))
        writer.add_block_count(int(cfg.n_layers))
        writer.add_feed_forward_length(int(cfg.d_ff))
        writer.add_head_count(int(cfg.n_heads))
        writer.add_layer_norm_eps(float(cfg.norm_eps))
        writer.add_vocab_size(int(cfg.vocab_size))
        writer.add_file_type(gw.FILE_TYPES[dtype])
        if dtype == "q8_0":
            writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        gw._add_metadata(writer, carried)

    return gw._write(path, cfg.arch, kv, tensors, dtype, progress)
