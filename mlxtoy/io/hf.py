"""Hugging Face model folders (config.json + *.safetensors + tokenizer.json), any architecture
whose spec (`mlxtoy.arch`) has an HF side.

The spec's name table gives each tensor's HF name and the transform between HF's layout and
ours (GGUF's rows): llama's q/k NEOX permute (as llama.cpp's converter does on the way in),
GPT-2's Conv1D transpose, fused q|k|v split and joined by rows. config.json is the spec's
`hf_in` / `hf_out`.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import mlx.core as mx

from mlxtoy.arch.registry import SPECS, expected_shapes, spec_for_hf, spec_of
from mlxtoy.arch.spec import ArchSpec, Fields, block0_name, expand, fuse, split
from mlxtoy.config import LoadedMeta, ModelConfig
from mlxtoy.errors import UserError
from mlxtoy.models.quant import PackedMatrix, QuantPlan, quantize_dense
from mlxtoy.textio import read_json
from mlxtoy.fsutil import atomic_folder


def config_from_hf(raw: dict[str, Any], path: str) -> tuple[ArchSpec, ModelConfig]:
    """config.json -> the spec and the config it describes (the tensors settle the rest)."""
    spec = spec_for_hf(raw, f"{path}/config.json")
    fields = Fields(raw, "", f"{path}/config.json", "field")
    return spec, ModelConfig(arch=spec.name, **spec.hf_in(fields, raw))


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


def hf_model_config(path: str) -> tuple[ArchSpec, ModelConfig, dict[str, Any], dict[str, mx.array]]:
    """(spec, the whole config, config.json, the tensors, lazily loaded) of an HF folder: only
    the embedding tables are read (to tell a tied copy from an untied output)."""
    raw_cfg = read_hf_config(path)
    spec, cfg = config_from_hf(raw_cfg, path)
    hf = read_hf_tensors(path)
    if spec.hf_prefix:  # checkpoints saved without the base model's prefix (GPT-2's own)
        hf = {k if k.startswith(spec.hf_prefix) or k == "lm_head.weight" else spec.hf_prefix + k: v
              for k, v in hf.items()}
    head, table = "lm_head.weight", spec.tensor_of("tok_embeddings.weight")[0].hf
    # some checkpoints store a copy of the tied table: untie only if it differs
    cfg.tie_embeddings = head not in hf or table not in hf or (
        hf[head].shape == hf[table].shape and mx.array_equal(hf[head], hf[table]).item())
    bias = block0_name(spec, "attn.q.bias", "hf")
    cfg.qkv_bias = bias is not None and bias in hf
    if spec.fix_config is not None:
        spec.fix_config(cfg, {t.ours[0]: tuple(hf[t.hf].shape) for t in spec.tensors
                              if not t.block and t.hf in hf})
    return spec, cfg, raw_cfg, hf


def load_hf(path: str, dtype: mx.Dtype | None = None, quant: QuantPlan | None = None):
    """-> (ModelConfig, {param_name: mx.array | PackedMatrix}, LoadedMeta), tensor by tensor
    (safetensors load lazily, so each tensor is read when it is converted). With `quant`, the
    matrices it names are quantized at load (PackedMatrix), their errors in the meta."""
    dtype = dtype or mx.float32
    spec, cfg, raw_cfg, hf = hf_model_config(path)
    shapes = expected_shapes(cfg)
    packs = quant.matrices(spec, cfg) if quant is not None else set()
    weights: dict[str, mx.array | PackedMatrix] = {}
    errors: dict[str, float] = {}
    for name, params, t in expand(spec, cfg, shapes, "hf"):
        if name not in hf:
            raise UserError(f"{path}: missing tensor {name}")
        w = hf.pop(name)
        if t.hf_transform is not None:
            w = _checked(lambda: t.hf_transform.from_hf(w, cfg), path, name, w)
        for param, part in zip(params, split(w, params, shapes, name, path)):
            if quant is not None and quant.layout(param, part.shape, packs):
                weights[param], errors[name if len(params) == 1 else f"{name} ({param})"] = quantize_dense(part.reshape(-1, part.shape[-1]), quant)
                mx.eval(weights[param].weight, weights[param].scales, weights[param].biases)
            else:
                weights[param] = part.astype(dtype)
                mx.eval(weights[param])
    return cfg, weights, LoadedMeta(source=path, format="hf", metadata={"config": raw_cfg},
                                    quantization_errors=errors)


def _checked(f, path: str, name: str, w: mx.array) -> mx.array:
    try:
        return f()
    except ValueError:  # a reshape that does not fit: the tensor has the wrong shape
        raise UserError(f"{path}: tensor {name} has an unexpected shape {list(w.shape)}") from None


def hf_config(cfg: ModelConfig, tokenizer=None) -> dict[str, Any]:
    """config.json for `cfg` (the spec's `hf_out`) with the tokenizer's special ids."""
    return hf_spec(cfg).hf_out(cfg) | special_token_ids(tokenizer)


def hf_spec(cfg: ModelConfig) -> ArchSpec:
    """The spec of `cfg`, refusing what transformers cannot run."""
    spec = spec_of(cfg.arch)
    if spec.hf_out is None:
        raise UserError(f"{cfg.arch} models have no Hugging Face equivalent (export "
                        f"{', '.join(n for n, s in SPECS.items() if s.hf_out is not None)})")
    if spec.check_hf is not None:
        spec.check_hf(cfg)
    return spec


def special_token_ids(tokenizer) -> dict[str, int]:
    """config.json's bos/eos ids for a tokenizer (none for None)."""
    out = {}
    if tokenizer is not None:
        if tokenizer.bos_id is not None:
            out["bos_token_id"] = tokenizer.bos_id
        if tokenizer.eos_id is not None:
            out["eos_token_id"] = tokenizer.eos_id
        if getattr(tokenizer, "pad_id", None) is not None:
            out["pad_token_id"] = tokenizer.pad_id
    return out


def params_to_hf(cfg: ModelConfig, weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Our flat params -> HF tensor names and layouts (inverse of `load_hf`)."""
    spec = hf_spec(cfg)
    out: dict[str, mx.array] = {}
    for name, params, t in expand(spec, cfg, {p: tuple(w.shape) for p, w in weights.items()}, "hf"):
        w = fuse([weights[p] for p in params], params)
        out[name] = t.hf_transform.to_hf(w, cfg) if t.hf_transform is not None else w
    return out


def save_hf(path: str, cfg: ModelConfig, weights: dict[str, mx.array], tokenizer=None,
            dtype: mx.Dtype = mx.float32) -> None:
    """Write a Hugging Face folder (config.json, model.safetensors, tokenizer) atomically."""
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
