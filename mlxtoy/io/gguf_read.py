"""Read llama / qwen2 GGUF files into our per-head layout, exactly; `load_gguf` reads any GGUF
we support (gpt2 files go to `mlxtoy.io.gpt2_io`).

Each tensor is dequantized on its own (`mlxtoy.io.gguf_file`) and handed to MLX, so the
weights are never held twice. `mx.load` is not used for the weights: it returns BF16 and
K-quants as float16, which loses range (BF16 values can overflow float16).
"""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx

from mlxtoy.config import SUPPORTED_ARCHS, LoadedMeta, ModelConfig, metadata_number
from mlxtoy.errors import UserError
from mlxtoy.io.gguf_file import dequantize_tensor, open_gguf, read_metadata
from mlxtoy.io.gpt2_io import load_gpt2_gguf
from mlxtoy.models.shapes import expected_shapes


def config_from_metadata(md: dict[str, Any], path: str) -> ModelConfig:
    arch = md.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise UserError(f"{path}: unknown architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})")

    def get(key: str, default: Any = None, required: bool = True) -> Any:
        full = f"{arch}.{key}"
        if full in md:
            return md[full]
        if required and default is None:
            raise UserError(f"{path}: missing metadata key {full}")
        return default

    def num(key: str, default: Any = None, kind: type = int, minimum: int = 1) -> Any:
        return metadata_number(get(key, default), f"{path}: metadata {arch}.{key}", kind, minimum)

    d_model = num("embedding_length")
    n_heads = num("attention.head_count")
    n_kv = num("attention.head_count_kv", n_heads)
    d_head = num("attention.key_length", d_model // n_heads)
    vocab = get("vocab_size", None, required=False)
    if vocab is None:
        vocab = len(md.get("tokenizer.ggml.tokens", [])) or None
    if vocab is None:
        raise UserError(f"{path}: cannot tell the vocabulary size (no {arch}.vocab_size, no tokens)")
    scaling = None
    kind = get("rope.scaling.type", "none", required=False)
    if kind == "linear":
        scaling = {"type": "linear", "factor": num("rope.scaling.factor", kind=float)}
    elif kind not in ("none", None):
        raise UserError(f"{path}: unsupported rope scaling type {kind!r}")
    return ModelConfig(
        arch=arch,
        vocab_size=metadata_number(vocab, f"{path}: vocabulary size"),
        d_model=d_model,
        n_layers=num("block_count"),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        d_head=d_head,
        d_ff=num("feed_forward_length"),
        norm_eps=num("attention.layer_norm_rms_epsilon", 1e-5, float),
        rope_base=num("rope.freq_base", 10000.0, float),
        rope_dims=num("rope.dimension_count", d_head, int, 0),
        rope_traditional=(arch == "llama"),
        rope_scaling=scaling,
        qkv_bias=False,  # set by the loader when the bias tensors are present
        tie_embeddings=True,  # set by the loader when output.weight is present
        context_length=num("context_length", 2048),
    )



# GGUF tensor name (per block, without "blk.N.") -> (our parameter path, reshape kind)
BLOCK_TENSORS = {
    "attn_norm.weight": "attn_norm.weight",
    "attn_q.weight": "attn.q.weight",
    "attn_k.weight": "attn.k.weight",
    "attn_v.weight": "attn.v.weight",
    "attn_q.bias": "attn.q.bias",
    "attn_k.bias": "attn.k.bias",
    "attn_v.bias": "attn.v.bias",
    "attn_output.weight": "attn.o.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "ffn_gate.weight": "ffn.gate.weight",
    "ffn_up.weight": "ffn.up.weight",
    "ffn_down.weight": "ffn.down.weight",
}
GLOBAL_TENSORS = {
    "token_embd.weight": "tok_embeddings.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "output.weight",
}


def gguf_to_param_name(name: str) -> str | None:
    if name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[name]
    if name.startswith("blk."):
        _, idx, rest = name.split(".", 2)
        if rest in BLOCK_TENSORS:
            return f"layers.{idx}.{BLOCK_TENSORS[rest]}"
    return None


def load_gguf(path: str, dtype: mx.Dtype | None = None,
              progress: Callable[[int, int], None] | None = None):
    """-> (ModelConfig, {param_name: mx.array}, LoadedMeta). Weights in `dtype` (default float32)."""
    dtype = dtype or mx.float32
    reader = open_gguf(path)
    md = read_metadata(reader)
    if md.get("general.architecture") == "gpt2":  # learned positions, fused QKV: own reader
        return load_gpt2_gguf(reader, md, path, dtype, progress)
    cfg = config_from_metadata(md, path)
    tensors = {t.name: t for t in reader.tensors}
    cfg.tie_embeddings = "output.weight" not in tensors
    cfg.qkv_bias = "blk.0.attn_q.bias" in tensors
    if "rope_freqs.weight" in tensors:
        factors = dequantize_tensor(tensors["rope_freqs.weight"], path).reshape(-1)
        cfg.rope_scaling = {"type": "freq_factors", "factors": [float(f) for f in factors]}
    shapes = expected_shapes(cfg)
    weights: dict[str, mx.array] = {}
    types: dict[str, str] = {}
    by_param = {}
    for name, t in tensors.items():
        param = gguf_to_param_name(name)
        if param is not None:
            by_param[param] = t
    missing = [p for p in shapes if p not in by_param]
    if missing:
        gname = _param_to_gguf_name(missing[0])
        raise UserError(f"{path}: missing tensor {gname}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    for n, (param, shape) in enumerate(shapes.items()):
        t = by_param[param]
        arr = dequantize_tensor(t, path)
        fused = _gguf_numpy_shape(shape) if not param.endswith(".bias") else (shape[0] * shape[1],)
        if tuple(arr.shape) != fused:
            raise UserError(f"{path}: tensor {t.name} has shape {list(arr.shape)}, expected "
                            f"{list(fused)}")
        weights[param] = mx.array(arr.reshape(shape)).astype(dtype)
        mx.eval(weights[param])
        types[t.name] = t.tensor_type.name
        del arr
        if progress:
            progress(n + 1, len(shapes))
    for name, t in tensors.items():
        types.setdefault(name, t.tensor_type.name)
    return cfg, weights, LoadedMeta(source=path, format="gguf", tensor_types=types, metadata=md)


def _gguf_numpy_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Our per-head shapes (H, Dh, D) / (H, Dh) are GGUF's fused (H*Dh, D) / (H*Dh,)."""
    if len(shape) == 3:
        return (shape[0] * shape[1], shape[2])
    return shape


def _param_to_gguf_name(param: str) -> str:
    for g, p in GLOBAL_TENSORS.items():
        if p == param:
            return g
    _, idx, rest = param.split(".", 2)
    for g, p in BLOCK_TENSORS.items():
        if p == rest:
            return f"blk.{idx}.{g}"
    return param
