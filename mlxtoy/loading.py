"""`load(MODEL, adapter=None) -> (model, tokenizer)`: the one way in for every front end."""

from __future__ import annotations

import os

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from mlxtoy import backend
from mlxtoy.config import LoadedMeta, ModelConfig
from mlxtoy.errors import UserError
from mlxtoy.io.registry import resolve_model
from mlxtoy.models.llama import LlamaModel


def model_class(arch: str):
    """The module class that implements `arch` (all share LlamaModel's call signature)."""
    if arch == "gpt2":
        from mlxtoy.models.gpt2 import GPT2Model

        return GPT2Model
    if arch == "tiny":
        from mlxtoy.models.tiny import TinyLM

        return TinyLM
    return LlamaModel


def build_model(cfg: ModelConfig, weights: dict[str, mx.array] | None = None) -> LlamaModel:
    model = model_class(cfg.arch)(cfg)
    if weights is not None:
        model.update(tree_unflatten(list(weights.items())))
    mx.eval(model.parameters())
    return model


def load_weights(model_arg: str, dtype: mx.Dtype | None = None):
    """-> (ModelConfig, weights, LoadedMeta, Tokenizer) without building the model."""
    kind, path = resolve_model(model_arg)
    dtype = dtype or backend.compute_dtype()
    if kind == "gguf":
        from mlxtoy.io.gguf_read import load_gguf

        cfg, weights, meta = load_gguf(path, dtype)
        from mlxtoy.io.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_gguf_metadata(meta.metadata, source=path)
    else:
        from mlxtoy.io.gpt2_io import is_gpt2_hf_folder, load_gpt2_hf
        from mlxtoy.io.hf import load_hf

        load_folder = load_gpt2_hf if is_gpt2_hf_folder(path) else load_hf
        cfg, weights, meta = load_folder(path, dtype)
        from mlxtoy.io.tokenizer import Tokenizer

        if not os.path.exists(os.path.join(path, "tokenizer.json")):
            raise UserError(f"{path}: no tokenizer.json")
        tokenizer = Tokenizer.from_hf_folder(path)
    return cfg, weights, meta, tokenizer


def load(model: str, adapter: str | None = None, dtype: mx.Dtype | None = None):
    """MODEL (.gguf, HF folder or built-in name) -> (model, tokenizer).

    `adapter`: a run directory; its adapters (LoRA) or weights (full / scratch) are applied.
    """
    if adapter is not None:
        from mlxtoy.train.checkpoint import load_run_model

        return load_run_model(adapter, base=model, dtype=dtype)
    if os.path.isfile(os.path.join(model, "config.yaml")):  # a training run as MODEL
        from mlxtoy.train.checkpoint import load_run_model

        return load_run_model(model, dtype=dtype)
    cfg, weights, meta, tokenizer = load_weights(model, dtype)
    m = build_model(cfg, weights)
    m.meta = meta
    return m, tokenizer


def describe(model: LlamaModel, tokenizer, meta: LoadedMeta) -> dict:
    from collections import Counter

    cfg = model.config
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    return {
        "source": meta.source,
        "format": meta.format,
        "architecture": cfg.arch,
        "config": cfg.to_dict() | ({"rope_scaling": {"type": cfg.rope_scaling.get("type")}} if cfg.rope_scaling else {}),
        "parameters": n_params,
        "tensor_types": dict(Counter(meta.tensor_types.values())),
        "tokenizer": tokenizer.describe() if hasattr(tokenizer, "describe") else {},
        "chat_template": bool(tokenizer.chat_template),
        "backend": backend.INFO.describe(),
    }
