"""GPT-2 weights in and out: llama.cpp's `gpt2` GGUFs and transformers' GPT-2 folders.

Our layout (mlxtoy.models.gpt2): q/k/v per head (heads, d_head, d_model) with biases
(heads, d_head); Linear weights (out, in). The two outside layouts:
- GGUF: one fused `blk.N.attn_qkv` tensor, rows q | k | v, each head-major (numpy shape
  (3 * d_model, d_model)); other names below. An `output.weight` equal to `token_embd` (what
  llama.cpp's converter writes for GPT-2's tied head) is read as a tied table.
- transformers: Conv1D modules store weights (in, out), so every matrix is transposed;
  `c_attn` is the fused q | k | v projection with columns head-major.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from mlxtoy.config import LoadedMeta, ModelConfig
from mlxtoy.errors import UserError
from mlxtoy.textio import read_json
from mlxtoy.io.gguf_file import dequantize_tensor
from mlxtoy.io.hf import read_hf_config, read_hf_tensors, special_token_ids, write_hf_folder
from mlxtoy.models.shapes import expected_shapes

# GGUF per-block name -> ours (attn_qkv is split separately)
GGUF_BLOCK = {
    "attn_norm.weight": "attn_norm.weight",
    "attn_norm.bias": "attn_norm.bias",
    "attn_output.weight": "attn.o.weight",
    "attn_output.bias": "attn.o.bias",
    "ffn_norm.weight": "ffn_norm.weight",
    "ffn_norm.bias": "ffn_norm.bias",
    "ffn_up.weight": "ffn.up.weight",
    "ffn_up.bias": "ffn.up.bias",
    "ffn_down.weight": "ffn.down.weight",
    "ffn_down.bias": "ffn.down.bias",
}
GGUF_GLOBAL = {
    "token_embd.weight": "tok_embeddings.weight",
    "position_embd.weight": "pos_embeddings.weight",
    "output_norm.weight": "norm.weight",
    "output_norm.bias": "norm.bias",
    "output.weight": "output.weight",
}

# transformers per-block name (after "h.N.") -> ours; Conv1D weights are transposed
HF_BLOCK = {
    "ln_1.weight": "attn_norm.weight",
    "ln_1.bias": "attn_norm.bias",
    "attn.c_proj.weight": "attn.o.weight",
    "attn.c_proj.bias": "attn.o.bias",
    "ln_2.weight": "ffn_norm.weight",
    "ln_2.bias": "ffn_norm.bias",
    "mlp.c_fc.weight": "ffn.up.weight",
    "mlp.c_fc.bias": "ffn.up.bias",
    "mlp.c_proj.weight": "ffn.down.weight",
    "mlp.c_proj.bias": "ffn.down.bias",
}
HF_GLOBAL = {"wte.weight": "tok_embeddings.weight", "wpe.weight": "pos_embeddings.weight",
             "ln_f.weight": "norm.weight", "ln_f.bias": "norm.bias"}
HF_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def split_qkv(w: np.ndarray | mx.array, cfg: ModelConfig, name: str, path: str) -> tuple:
    """Fused rows q | k | v (weight (n, d_model) or bias (n,)) -> per-head q, k, v."""
    h, kv, dh = cfg.n_heads, cfg.n_kv_heads, cfg.d_head
    rows = (h + 2 * kv) * dh
    if w.shape[0] != rows or (w.ndim == 2 and w.shape[1] != cfg.d_model):
        want = [rows, cfg.d_model] if w.ndim == 2 else [rows]
        raise UserError(f"{path}: tensor {name} has shape {list(w.shape)}, expected {want}")
    q, k, v = w[: h * dh], w[h * dh: (h + kv) * dh], w[(h + kv) * dh:]
    tail = w.shape[1:]
    return q.reshape(h, dh, *tail), k.reshape(kv, dh, *tail), v.reshape(kv, dh, *tail)


def fuse_qkv(q: mx.array, k: mx.array, v: mx.array) -> mx.array:
    """Per-head q, k, v -> fused rows q | k | v ((n, d_model) or (n,))."""
    return mx.concatenate([t.reshape(-1, *t.shape[2:]) for t in (q, k, v)], axis=0)


# --------------------------------------------------------------------------- GGUF


def config_from_gguf_metadata(md: dict[str, Any], path: str) -> ModelConfig:
    def get(key: str, default: Any = None) -> Any:
        full = f"gpt2.{key}"
        if full in md:
            return md[full]
        if default is None:
            raise UserError(f"{path}: missing metadata key {full}")
        return default

    d_model = int(get("embedding_length"))
    n_heads = int(get("attention.head_count"))
    vocab = get("vocab_size", len(md.get("tokenizer.ggml.tokens", [])) or None)
    if vocab is None:
        raise UserError(f"{path}: cannot tell the vocabulary size (no gpt2.vocab_size, no tokens)")
    return ModelConfig(
        arch="gpt2", vocab_size=int(vocab), d_model=d_model, n_layers=int(get("block_count")),
        n_heads=n_heads, n_kv_heads=n_heads, d_head=d_model // n_heads,
        d_ff=int(get("feed_forward_length", 4 * d_model)),
        norm_eps=float(get("attention.layer_norm_epsilon", 1e-5)),
        rope_dims=0, qkv_bias=True, tie_embeddings=True,
        context_length=int(get("context_length")))


def load_gpt2_gguf(reader, md: dict[str, Any], path: str, dtype: mx.Dtype | None = None,
                   progress: Callable[[int, int], None] | None = None):
    """An opened gpt2 GGUF -> (ModelConfig, {param: mx.array}, LoadedMeta)."""
    dtype = dtype or mx.float32
    cfg = config_from_gguf_metadata(md, path)
    tensors = {t.name: t for t in reader.tensors}
    types = {name: t.tensor_type.name for name, t in tensors.items()}

    def read(name: str) -> np.ndarray:
        if name not in tensors:
            raise UserError(f"{path}: missing tensor {name}")
        return dequantize_tensor(tensors[name], path)

    raw: dict[str, np.ndarray] = {}
    for name, param in GGUF_GLOBAL.items():
        if name == "output.weight":
            continue
        raw[param] = read(name)
    if "output.weight" in tensors:
        out = read("output.weight")
        table = raw["tok_embeddings.weight"]
        if out.shape == table.shape and np.array_equal(out, table):
            cfg.tie_embeddings = True  # the converter's copy of GPT-2's tied table
        else:
            cfg.tie_embeddings = False
            raw["output.weight"] = out
    # the learned position table fixes the context, whatever the metadata says
    cfg.context_length = int(raw["pos_embeddings.weight"].shape[0])
    shapes = expected_shapes(cfg)
    weights: dict[str, mx.array] = {}

    def put(param: str, arr, gname: str) -> None:
        want = shapes[param]
        if tuple(arr.shape) != want:
            raise UserError(f"{path}: tensor {gname} has shape {list(arr.shape)}, expected {list(want)}")
        weights[param] = mx.array(np.ascontiguousarray(arr)).reshape(want).astype(dtype)
        mx.eval(weights[param])

    for param, arr in raw.items():
        gname = next(g for g, p in GGUF_GLOBAL.items() if p == param)
        put(param, arr, gname)
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        for leaf in ("weight", "bias"):
            gname = f"blk.{i}.attn_qkv.{leaf}"
            q, k, v = split_qkv(read(gname), cfg, gname, path)
            for proj, arr in zip("qkv", (q, k, v)):
                put(p + f"attn.{proj}.{leaf}", arr, gname)
        for gleaf, ours in GGUF_BLOCK.items():
            put(p + ours, read(f"blk.{i}.{gleaf}"), f"blk.{i}.{gleaf}")
        if progress:
            progress(i + 1, cfg.n_layers)
    missing = [p for p in shapes if p not in weights]
    if missing:  # cannot happen unless the maps above are wrong; say so plainly
        raise UserError(f"{path}: no tensor for parameter {missing[0]}")
    return cfg, weights, LoadedMeta(source=path, format="gguf", tensor_types=types, metadata=md)


def gguf_tensor_items(cfg: ModelConfig, weights: dict[str, mx.array]
                      ) -> list[tuple[str, Callable[[], mx.array]]]:
    """(GGUF name, lazy array in GGUF numpy shape) for a gpt2 model, in llama.cpp's order."""
    shapes = expected_shapes(cfg)
    missing = [p for p in shapes if p not in weights]
    if missing:
        raise UserError(f"cannot export: missing parameter {missing[0]}"
                        + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    for param, shape in shapes.items():
        if tuple(weights[param].shape) != shape:
            raise UserError(f"cannot export: parameter {param} has shape "
                            f"{list(weights[param].shape)}, expected {list(shape)}")
    out: list[tuple[str, Callable[[], mx.array]]] = []
    w = weights
    out.append(("token_embd.weight", lambda: w["tok_embeddings.weight"]))
    out.append(("position_embd.weight", lambda: w["pos_embeddings.weight"]))
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        out.append((f"blk.{i}.attn_norm.weight", lambda p=p: w[p + "attn_norm.weight"]))
        out.append((f"blk.{i}.attn_norm.bias", lambda p=p: w[p + "attn_norm.bias"]))
        for leaf in ("weight", "bias"):
            out.append((f"blk.{i}.attn_qkv.{leaf}", lambda p=p, leaf=leaf: fuse_qkv(
                w[p + f"attn.q.{leaf}"], w[p + f"attn.k.{leaf}"], w[p + f"attn.v.{leaf}"])))
        for gleaf, ours in GGUF_BLOCK.items():
            if not gleaf.startswith("attn_norm"):
                out.append((f"blk.{i}.{gleaf}", lambda p=p, ours=ours: w[p + ours]))
    out.append(("output_norm.weight", lambda: w["norm.weight"]))
    out.append(("output_norm.bias", lambda: w["norm.bias"]))
    if not cfg.tie_embeddings:
        out.append(("output.weight", lambda: w["output.weight"]))
    return out


# --------------------------------------------------------------------------- transformers


def is_gpt2_hf_folder(path: str) -> bool:
    try:
        cfg = read_json(os.path.join(path, "config.json"))
    except UserError:
        return False  # the loader reads it again and says what is wrong
    if not isinstance(cfg, dict):
        return False
    return cfg.get("model_type") == "gpt2" or "GPT2LMHeadModel" in (cfg.get("architectures") or [])


def config_from_hf(raw: dict[str, Any], path: str) -> ModelConfig:
    act = raw.get("activation_function", "gelu_new")
    if act not in HF_TANH_GELUS:
        raise UserError(f"{path}/config.json: activation_function {act!r} is not supported "
                        f"(GPT-2 uses the tanh GELU: {', '.join(HF_TANH_GELUS)})")
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if raw.get(flag):
            raise UserError(f"{path}/config.json: {flag} is not supported")
    if raw.get("scale_attn_weights") is False:
        raise UserError(f"{path}/config.json: scale_attn_weights=false is not supported")
    try:
        d_model = int(raw["n_embd"])
        n_heads = int(raw["n_head"])
        return ModelConfig(
            arch="gpt2", vocab_size=int(raw["vocab_size"]), d_model=d_model,
            n_layers=int(raw["n_layer"]), n_heads=n_heads, n_kv_heads=n_heads,
            d_head=d_model // n_heads, d_ff=int(raw.get("n_inner") or 4 * d_model),
            norm_eps=float(raw.get("layer_norm_epsilon", 1e-5)), rope_dims=0, qkv_bias=True,
            tie_embeddings=bool(raw.get("tie_word_embeddings", True)),
            context_length=int(raw.get("n_positions", raw.get("n_ctx", 1024))))
    except KeyError as e:
        raise UserError(f"{path}/config.json: missing key {e.args[0]}") from None


def load_gpt2_hf(path: str, dtype: mx.Dtype | None = None):
    """A transformers GPT-2 folder -> (ModelConfig, {param: mx.array}, LoadedMeta)."""
    dtype = dtype or mx.float32
    raw_cfg = read_hf_config(path)
    cfg = config_from_hf(raw_cfg, path)
    hf = read_hf_tensors(path, strip_prefix="transformer.")
    if "lm_head.weight" in hf and "wte.weight" in hf:
        cfg.tie_embeddings = bool(mx.array_equal(hf["lm_head.weight"], hf["wte.weight"]).item())
    else:
        cfg.tie_embeddings = True
    shapes = expected_shapes(cfg)

    def take(name: str) -> mx.array:
        if name not in hf:
            raise UserError(f"{path}: missing tensor {name}")
        return hf[name]

    weights: dict[str, mx.array] = {}

    def put(param: str, w: mx.array, name: str) -> None:
        if w.size != int(np.prod(shapes[param])):
            raise UserError(f"{path}: tensor {name} has shape {list(w.shape)}, expected "
                            f"{list(shapes[param])}")
        weights[param] = w.reshape(shapes[param]).astype(dtype)

    for name, param in HF_GLOBAL.items():
        put(param, take(name), name)
    if not cfg.tie_embeddings:
        put("output.weight", take("lm_head.weight"), "lm_head.weight")
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        w = take(f"h.{i}.attn.c_attn.weight")  # Conv1D (d_model, 3 * d_model)
        for proj, arr in zip("qkv", split_qkv(w.T, cfg, f"h.{i}.attn.c_attn.weight", path)):
            weights[p + f"attn.{proj}.weight"] = arr.astype(dtype)
        b = take(f"h.{i}.attn.c_attn.bias")
        for proj, arr in zip("qkv", split_qkv(b, cfg, f"h.{i}.attn.c_attn.bias", path)):
            weights[p + f"attn.{proj}.bias"] = arr.astype(dtype)
        for name, ours in HF_BLOCK.items():
            t = take(f"h.{i}.{name}")
            put(p + ours, t.T if name.endswith("weight") and t.ndim == 2 else t, f"h.{i}.{name}")
    mx.eval(weights)
    return cfg, weights, LoadedMeta(source=path, format="hf", metadata={"config": raw_cfg})


def hf_config(cfg: ModelConfig, tokenizer=None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": cfg.vocab_size, "n_embd": cfg.d_model, "n_layer": cfg.n_layers,
        "n_head": cfg.n_heads, "n_inner": cfg.d_ff, "n_positions": cfg.context_length,
        "n_ctx": cfg.context_length, "layer_norm_epsilon": cfg.norm_eps,
        "activation_function": "gelu_new", "tie_word_embeddings": cfg.tie_embeddings,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "torch_dtype": "float32",
    }
    return out | special_token_ids(tokenizer)


def params_to_hf(cfg: ModelConfig, weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Our flat params -> transformers GPT-2 names and Conv1D layouts (inverse of load)."""
    if cfg.d_head * cfg.n_heads != cfg.d_model or cfg.n_kv_heads != cfg.n_heads:
        raise UserError("transformers' GPT-2 needs n_heads * d_head == d_model and no GQA")
    out: dict[str, mx.array] = {}
    inv_global = {v: k for k, v in HF_GLOBAL.items()}
    for param, name in inv_global.items():
        out["transformer." + name] = weights[param]
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = weights["output.weight"]
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        out[f"transformer.h.{i}.attn.c_attn.weight"] = fuse_qkv(
            weights[p + "attn.q.weight"], weights[p + "attn.k.weight"], weights[p + "attn.v.weight"]).T
        out[f"transformer.h.{i}.attn.c_attn.bias"] = fuse_qkv(
            weights[p + "attn.q.bias"], weights[p + "attn.k.bias"], weights[p + "attn.v.bias"])
        for name, ours in HF_BLOCK.items():
            w = weights[p + ours]
            out[f"transformer.h.{i}.{name}"] = w.T if w.ndim == 2 else w
    return out


def save_gpt2_hf(path: str, cfg: ModelConfig, weights: dict[str, mx.array], tokenizer=None,
                 dtype: mx.Dtype = mx.float32) -> None:
    """Write a transformers GPT-2 folder (config.json, model.safetensors, tokenizer) atomically."""
    write_hf_folder(path, params_to_hf(cfg, weights), hf_config(cfg, tokenizer), tokenizer, dtype)