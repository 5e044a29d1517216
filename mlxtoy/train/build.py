"""Building the trainable model for a method: LoRA or DoRA on a loaded base, full fine-tuning of a
loaded model, or a new model from scratch (scaled normal init), plus gradient checkpointing
and the mixed-precision policy. Returns the facts config.yaml records (`RunFacts`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

import mlxtoy
from mlxtoy import backend
from mlxtoy.arch.registry import spec_of
from mlxtoy.config import TrainConfig
from mlxtoy.errors import UserError
from mlxtoy.io.char_tokenizer import CharTokenizer
from mlxtoy.io.registry import resolve_model
from mlxtoy.loading import attach_lens, build_model as build_module, load_tokenizer, load_weights
from mlxtoy.models.init import init_scratch
from mlxtoy.models.lora import apply_lora, lora_config_dict
from mlxtoy.models.quant import QuantPlan, describe_quantized, quantization_report
from mlxtoy.rundir import RunFacts
from mlxtoy.train.records import DataOptions, read_data

CHAR_TOKENIZERS = ("char", "byte")  # tokenizer specs a scratch run may name instead of a model


def set_trainable(model: nn.Module, cfg: TrainConfig) -> None:
    """full: every block weight, plus the opt-in embeddings / final norm / output."""
    if cfg.method == "scratch":
        model.unfreeze()
        return
    model.freeze()
    for layer in model.layers:
        layer.unfreeze()
    if cfg.train_embeddings:
        model.tok_embeddings.unfreeze()
    if cfg.train_norm:
        model.norm.unfreeze()
    if cfg.train_output:
        if "output" in model:
            model.output.unfreeze()
        else:  # tied: the output is the embedding table
            model.tok_embeddings.unfreeze()


def enable_grad_checkpoint(model: nn.Module) -> None:
    """Recompute each block's activations in the backward pass (memory for compute).

    Each block's class is swapped for a subclass whose call goes through `mx.checkpoint`;
    parameter names do not change, and other models are untouched.
    """
    for layer in model.layers:
        base_cls = type(layer)
        if getattr(base_cls, "_checkpointed", False):
            continue

        def checkpointed_call(self, x, mask=None, cache=None, taps=None, _base=base_cls):
            if cache is not None or taps is not None or isinstance(mask, str):
                return _base.__call__(self, x, mask, cache, taps)

            def inner(params, x, *mask_arg):
                self.update(params)
                return _base.__call__(self, x, mask_arg[0] if mask_arg else None)

            args = (x,) if mask is None else (x, mask)
            return mx.checkpoint(inner)(self.trainable_parameters(), *args)

        layer.__class__ = type(f"Checkpointed{base_cls.__name__}", (base_cls,),
                               {"__call__": checkpointed_call, "_checkpointed": True})


def make_trainable(model: nn.Module, cfg: TrainConfig) -> None:
    """LoRA / DoRA: the adapters on the frozen (maybe quantized) base; full: the chosen weights."""
    if cfg.adapters:
        apply_lora(model, cfg.lora_targets, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout,
                   cfg.lora_per_head_q, cfg.lora_layers, paths=spec_of(model.config.arch).lora_targets,
                   dora=cfg.method == "dora")
    else:
        set_trainable(model, cfg)


def load_dtype(cfg: TrainConfig) -> mx.Dtype:
    """The dtype the base is loaded in: trainable weights stay float32 (master copies); a LoRA
    base may be lower precision."""
    return train_dtype(cfg) if cfg.adapters else mx.float32


def train_dtype(cfg: TrainConfig) -> mx.Dtype:
    return backend.compute_dtype() if cfg.dtype == "auto" else getattr(mx, cfg.dtype)


def build_model(cfg: TrainConfig, char_tokenizer: dict[str, Any] | None = None,
                quant: QuantPlan | None = None) -> tuple[nn.Module, Any, RunFacts]:
    """-> (model ready to train, tokenizer, resolved facts for config.yaml).

    quant: load the base's projections quantized (QLoRA; `loading.quant_plan` decides).

    char_tokenizer: a resumed scratch run's character vocabulary (rebuilding it from data
    that changed would shift every id past the embedding table)."""
    mx.random.seed(cfg.seed)
    facts = RunFacts(mlxtoy_version=mlxtoy.__version__, backend=backend.INFO.describe())
    if cfg.method == "scratch":
        source = cfg.tokenizer or spec_of(cfg.arch).tokenizer or cfg.model
        if source in CHAR_TOKENIZERS:  # character / byte vocabulary (the reference LM's)
            tokenizer = (CharTokenizer.from_dict(char_tokenizer) if char_tokenizer
                         else char_tokenizer_for(source, cfg.data, DataOptions.of(cfg)))
            facts.char_tokenizer = tokenizer.to_dict()
        else:
            tokenizer = load_tokenizer(source)
            facts.tokenizer_path = resolve_model(source)[1]
        # the fields the architecture fixes (RoPE layout, q/k norm, ...), so it exports as itself
        mcfg = replace(cfg.model_config(tokenizer.vocab_size), **(spec_of(cfg.arch).scratch or {}))
        model = init_scratch(build_module(mcfg), cfg.seed, cfg.init_scale)
        if cfg.lens:  # projection lens: frozen donor table, trainable W_proj (models.lens)
            facts.lens = attach_lens(model, cfg.lens, tokenizer, seed=cfg.seed)
    else:
        mcfg, weights, meta, tokenizer = load_weights(cfg.model, load_dtype(cfg), quant=quant if cfg.adapters else None)
        model = build_module(mcfg, weights)
        model.meta = meta
        del weights
        facts.model_path = meta.source
        make_trainable(model, cfg)
        if cfg.adapters:
            facts.lora = lora_config_dict(cfg.lora_targets, cfg.lora_rank, cfg.lora_alpha,
                                          cfg.lora_dropout, cfg.lora_per_head_q,
                                          cfg.lora_layers, mcfg.n_layers, method=cfg.method)
        if quant is not None and cfg.adapters:
            facts.qlora = True
            facts.quantized = describe_quantized(model)
            facts.quantization_error = quantization_report(meta.quantization_errors) or None
    if not cfg.adapters and train_dtype(cfg) != mx.float32:
        # mixed precision: trainable weights stay float32 (master copies, cast per step in the
        # loss); frozen ones are simply stored in the compute dtype
        frozen = {k: v for k, v in tree_flatten(model.parameters())}
        for k, _ in tree_flatten(model.trainable_parameters()):
            frozen.pop(k, None)
        model.load_weights([(k, v.astype(train_dtype(cfg))) for k, v in frozen.items()], strict=False)
        facts.mixed_precision = str(train_dtype(cfg)).replace("mlx.core.", "")
    facts.model_config = mcfg.to_dict()
    if cfg.grad_checkpoint:
        enable_grad_checkpoint(model)
    mx.eval(model.parameters())
    return model, tokenizer, facts


def char_tokenizer_for(spec: str, data_path: str | None = None, opts: DataOptions | None = None):
    """`char` (vocabulary = the characters of the training text) or `byte` -> CharTokenizer."""
    if spec == "byte":
        return CharTokenizer("byte")
    if spec != "char":
        raise UserError(f"unknown character tokenizer {spec!r} (choose from {', '.join(CHAR_TOKENIZERS)})")
    if not data_path:
        raise UserError("a char tokenizer is built from the training text: give --data")
    return CharTokenizer.from_text(corpus_text(data_path, opts), "char")


def corpus_text(path: str, opts: DataOptions | None = None) -> str:
    """Every string in the data (any format read_data reads) joined, for a char vocabulary."""
    raw = read_data(path, opts)
    parts: list[str] = []
    for rec in raw.train + (raw.valid or []) + raw.test:
        v = rec.value
        if isinstance(v, str):
            parts.append(v)
        elif isinstance(v, (tuple, list)):
            for item in v:
                parts.append(item["content"] if isinstance(item, dict) else str(item))
    return "".join(parts)
