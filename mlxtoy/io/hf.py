"""Hugging Face model folders (config.json + *.safetensors + tokenizer.json) for llama / qwen2.

Our canonical layout for llama is GGUF's: W_q / W_k rows permuted for GGML's "normal" RoPE
(adjacent pairs, MLX traditional=True). HF llama checkpoints are half-split (NEOX), so we
permute on the way in (as llama.cpp's converter does) and back on the way out; qwen2 is NEOX
in both and is not permuted.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import mlx.core as mx

from mlxtoy.config import LoadedMeta, ModelConfig, metadata_number
from mlxtoy.errors import UserError
from mlxtoy.textio import read_json
from mlxtoy.fsutil import atomic_folder
from mlxtoy.models.shapes import expected_shapes

HF_ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}

# our per-block name -> HF per-block name
BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.q.weight": "self_attn.q_proj.weight",
    "attn.k.weight": "self_attn.k_proj.weight",
    "attn.v.weight": "self_attn.v_proj.weight",
    "attn.q.bias": "self_attn.q_proj.bias",
    "attn.k.bias": "self_attn.k_proj.bias",
    "attn.v.bias": "self_attn.v_proj.bias",
    "attn.o.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn.gate.weight": "mlp.gate_proj.weight",
    "ffn.up.weight": "mlp.up_proj.weight",
    "ffn.down.weight": "mlp.down_proj.weight",
}
GLOBAL_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def param_to_hf(param: str) -> str:
    if param in GLOBAL_NAMES:
        return GLOBAL_NAMES[param]
    _, idx, rest = param.split(".", 2)
    return f"model.layers.{idx}.{BLOCK_NAMES[rest]}"


def neox_to_interleaved(w: mx.array, n_heads: int) -> mx.array:
    """HF half-split rows -> GGML adjacent-pair rows, per head (works for weights and biases)."""
    shape = w.shape
    return w.reshape(n_heads, 2, shape[0] // n_heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def interleaved_to_neox(w: mx.array, n_heads: int) -> mx.array:
    shape = w.shape
    return w.reshape(n_heads, shape[0] // n_heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def config_from_hf(cfg: dict[str, Any], path: str) -> ModelConfig:
    archs = cfg.get("architectures") or []
    arch = next((HF_ARCHS[a] for a in archs if a in HF_ARCHS), None)
    if arch is None:
        arch = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}.get(cfg.get("model_type", ""))
    if arch is None:
        raise UserError(f"{path}/config.json: unknown architecture {archs or cfg.get('model_type')!r} "
                        f"(supported: {', '.join(HF_ARCHS)})")
    def num(key: str, default: Any = None, kind: type = int, minimum: int = 1) -> Any:
        if key not in cfg and default is None:
            raise UserError(f"{path}/config.json: missing key {key}")
        value = cfg.get(key) if cfg.get(key) is not None else default
        return metadata_number(value, f"{path}/config.json: {key}", kind, minimum)

    try:
        d_model = num("hidden_size")
        n_heads = num("num_attention_heads")
        scaling = cfg.get("rope_scaling")
        if scaling is not None and not isinstance(scaling, dict):
            raise UserError(f"{path}/config.json: rope_scaling must be a mapping, got {scaling!r}")
        if scaling:
            kind = scaling.get("rope_type") or scaling.get("type")
            if kind == "default":
                scaling = None
            else:
                scaling = dict(scaling, type=kind)
        return ModelConfig(
            arch=arch,
            vocab_size=num("vocab_size"),
            d_model=d_model,
            n_layers=num("num_hidden_layers"),
            n_heads=n_heads,
            n_kv_heads=num("num_key_value_heads", n_heads),
            d_head=num("head_dim", d_model // n_heads),
            d_ff=num("intermediate_size"),
            norm_eps=num("rms_norm_eps", 1e-6, float),
            rope_base=num("rope_theta", 10000.0, float),
            rope_traditional=(arch == "llama"),
            rope_scaling=scaling,
            qkv_bias=(arch == "qwen2") or bool(cfg.get("attention_bias", False)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", arch == "qwen2")),
            context_length=num("max_position_embeddings", 2048),
        )
    except KeyError as e:
        raise UserError(f"{path}/config.json: missing key {e.args[0]}") from None


def read_hf_config(path: str) -> dict[str, Any]:
    cfg_path = os.path.join(path, "config.json")
    cfg = read_json(cfg_path)
    if not isinstance(cfg, dict):
        raise UserError(f"{cfg_path}: expected a JSON object, got {type(cfg).__name__}")
    return cfg


def read_hf_tensors(path: str, strip_prefix: str = "") -> dict[str, mx.array]:
    """Every *.safetensors tensor of a Hugging Face folder (names with `strip_prefix` removed),
    with one-line errors naming the file."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise UserError(f"{path}: no *.safetensors files")
    tensors: dict[str, mx.array] = {}
    for file in files:
        try:
            for name, value in mx.load(file).items():
                tensors[name.removeprefix(strip_prefix) if strip_prefix else name] = value
        except Exception as e:
            raise UserError(f"{file}: cannot read safetensors ({e})") from None
    return tensors


def load_hf(path: str, dtype: mx.Dtype | None = None):
    """-> (ModelConfig, {param_name: mx.array}, LoadedMeta)."""
    dtype = dtype or mx.float32
    raw_cfg = read_hf_config(path)
    cfg = config_from_hf(raw_cfg, path)
    hf = read_hf_tensors(path)
    if "lm_head.weight" in hf and cfg.tie_embeddings:
        # Some checkpoints store a copy of the tied table; untie only if it differs.
        if not mx.array_equal(hf["lm_head.weight"], hf["model.embed_tokens.weight"]).item():
            cfg.tie_embeddings = False
    if "lm_head.weight" not in hf:
        cfg.tie_embeddings = True
    weights: dict[str, mx.array] = {}
    for param, shape in expected_shapes(cfg).items():
        name = param_to_hf(param)
        if name not in hf:
            raise UserError(f"{path}: missing tensor {name}")
        w = hf.pop(name)
        leaf = param.split(".", 2)[-1]
        if cfg.arch == "llama" and leaf in ("attn.q.weight", "attn.q.bias"):
            w = neox_to_interleaved(w.reshape(-1, *w.shape[1:]), cfg.n_heads)
        elif cfg.arch == "llama" and leaf in ("attn.k.weight", "attn.k.bias"):
            w = neox_to_interleaved(w, cfg.n_kv_heads)
        if w.size != _size(shape):
            raise UserError(f"{path}: tensor {name} has shape {list(w.shape)}, expected {_hf_shape(shape)}")
        weights[param] = w.reshape(shape).astype(dtype)
    mx.eval(weights)
    return cfg, weights, LoadedMeta(source=path, format="hf", metadata={"config": raw_cfg})


def _size(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _hf_shape(shape: tuple[int, ...]) -> list[int]:
    return [shape[0] * shape[1], shape[2]] if len(shape) == 3 else list(shape)


def hf_config(cfg: ModelConfig, tokenizer=None) -> dict[str, Any]:
    arch_name = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[cfg.arch]
    out: dict[str, Any] = {
        "architectures": [arch_name],
        "model_type": cfg.arch,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.d_head,
        "intermediate_size": cfg.d_ff,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_base,
        "max_position_embeddings": cfg.context_length,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": cfg.qkv_bias,
        "torch_dtype": "float32",
    }
    scaling = cfg.rope_scaling
    if scaling:
        kind = scaling.get("type")
        if kind == "freq_factors":
            raise UserError("this model's RoPE frequency factors (a GGUF rope_freqs tensor) have no "
                            "exact Hugging Face config equivalent")
        out["rope_scaling"] = {k: v for k, v in scaling.items() if k != "type"} | {"rope_type": kind}
    return out | special_token_ids(tokenizer)


def special_token_ids(tokenizer) -> dict[str, int]:
    """config.json's bos/eos ids for a tokenizer (none for None)."""
    out = {}
    if tokenizer is not None:
        if tokenizer.bos_id is not None:
            out["bos_token_id"] = tokenizer.bos_id
        if tokenizer.eos_id is not None:
            out["eos_token_id"] = tokenizer.eos_id
    return out


def params_to_hf(cfg: ModelConfig, weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Our flat params -> HF tensor names and layouts (inverse of `load_hf`)."""
    out: dict[str, mx.array] = {}
    for param, w in weights.items():
        leaf = param.split(".", 2)[-1] if param.startswith("layers.") else param
        if len(w.shape) == 3 or leaf.endswith(("q.bias", "k.bias", "v.bias")):
            w = w.reshape(-1, *w.shape[2:])  # per-head (H, Dh, D) -> fused (H*Dh, D)
        if cfg.arch == "llama" and leaf in ("attn.q.weight", "attn.q.bias"):
            w = interleaved_to_neox(w, cfg.n_heads)
        elif cfg.arch == "llama" and leaf in ("attn.k.weight", "attn.k.bias"):
            w = interleaved_to_neox(w, cfg.n_kv_heads)
        out[param_to_hf(param)] = w
    return out


def save_hf(path: str, cfg: ModelConfig, weights: dict[str, mx.array], tokenizer=None,
            dtype: mx.Dtype = mx.float32) -> None:
    """Write a Hugging Face llama / qwen2 folder (config.json, model.safetensors, tokenizer)."""
    write_hf_folder(path, params_to_hf(cfg, weights), hf_config(cfg, tokenizer), tokenizer, dtype)


def write_hf_folder(path: str, tensors: dict[str, mx.array], config: dict[str, Any], tokenizer=None,
                    dtype: mx.Dtype = mx.float32) -> None:
    """Write config.json, model.safetensors and the tokenizer files as one folder, atomically
    (`mlxtoy.fsutil.atomic_folder`: an existing `path` is replaced only once the new one is
    complete)."""
    tensors = {k: mx.contiguous(v.astype(dtype)) for k, v in tensors.items()}
    with atomic_folder(path) as tmp:
        mx.save_safetensors(os.path.join(tmp, "model.safetensors"), tensors, metadata={"format": "pt"})
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        if tokenizer is not None:
            with open(os.path.join(tmp, "tokenizer.json"), "w") as f:
                f.write(tokenizer.to_hf_tokenizer_json())
            tok_cfg = tokenizer.to_hf_tokenizer_config()  # names the tokenizer class too
            with open(os.path.join(tmp, "tokenizer_config.json"), "w") as f:
                json.dump(tok_cfg, f, indent=2)
