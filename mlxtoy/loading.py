"""The assembly layer: models from a model path, a Hugging Face id (io.registry resolves
MODEL), a run or a checkpoint; tokenizers; lens donors.

`load(MODEL, adapter=None) -> (model, tokenizer)` is the one way in for every front end;
`load_run_model(RUN)` builds a run's model (the final result, else its newest checkpoint; RUN
may be one `checkpoints/step_N`); `adapter_weights(RUN)` gives exporters the adapter tensors
and their layout. Models stay pure: what to read and how to put it together lives here.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from mlxtoy import backend
from mlxtoy.errors import UserError
from mlxtoy.io.char_tokenizer import CharTokenizer
from mlxtoy.arch.registry import build_module, expected_shapes, spec_of
from mlxtoy.arch.spec import expand, flat_shape
from mlxtoy.io.gguf_file import affine_bits
from mlxtoy.io.gguf_read import dequantize_tensor, gguf_model_config, load_gguf, open_gguf
from mlxtoy.io.hf import hf_model_config, hf_source_size, load_hf, planned_quantized
from mlxtoy.io.registry import resolve_model
from mlxtoy.io.tokenizer import Tokenizer
from mlxtoy.model_config import LoadedMeta, ModelConfig
from mlxtoy.models.fastmath import kernels_on
from mlxtoy.models.lens import apply_lens, fold_lens
from mlxtoy.models.llama import LlamaModel
from mlxtoy.models.lora import apply_lora, merge_lora
from mlxtoy.models.quant import PackedMatrix, QuantPlan, install_quantized
from mlxtoy.rundir import (ADAPTER_CONFIG, ADAPTERS, CKPT_STATE, CKPT_TRAINABLE, MODEL_WEIGHTS, RunDir,
                           is_run_or_checkpoint, locate)

QUANT_MODES = ("auto", "on", "off")  # train's --qlora and the front ends' --quantized
# --qlora / --quantized auto on a CPU: keep the base quantized when its float32 weights would
# take more than this share of the memory budget (below, a float32 base keeps the kernels' paths
# that take dense weights: the fused loss, packed decoding)
CPU_QLORA_SHARE = 0.6
# Parameters from which a quantized base decodes faster than the dense model on a CPU with the
# kernels: there the products' bytes dominate a token (4.5 bits a weight against 6-32); below,
# the dense model's one fused kernel call a block wins on the calls between products
# (docs/performance.md, "Decoding from a quantized base").
QUANTIZED_DECODE_PARAMS = 500_000_000


def model_class(arch: str):
    """The module class that implements `arch` (all share LlamaModel's call signature)."""
    return spec_of(arch).model


def build_model(cfg: ModelConfig, weights: dict[str, Any] | None = None) -> LlamaModel:
    """The model of `cfg` holding `weights` (arrays, and PackedMatrix for a quantized base)."""
    model = build_module(cfg)
    if weights is not None:
        model.update(tree_unflatten(list(install_quantized(model, weights).items())))
    mx.eval(model.parameters())
    return model


def load_weights(model_arg: str, dtype: mx.Dtype | None = None, quant: QuantPlan | None = None):
    """-> (ModelConfig, weights, LoadedMeta, Tokenizer) without building the model; with `quant`
    the base's projections come as PackedMatrix (QLoRA), never whole in a higher precision."""
    kind, path = resolve_model(model_arg)
    dtype = dtype or backend.compute_dtype()
    if kind == "gguf":
        cfg, weights, meta = load_gguf(path, dtype, quant=quant)
        tokenizer = Tokenizer.from_gguf_metadata(meta.metadata, source=path)
    else:
        cfg, weights, meta = load_hf(path, dtype, quant=quant)
        if not os.path.exists(os.path.join(path, "tokenizer.json")):
            raise UserError(f"{path}: no tokenizer.json")
        tokenizer = Tokenizer.from_hf_folder(path)
    return cfg, weights, meta, tokenizer


def load(model: str, adapter: str | None = None, dtype: mx.Dtype | None = None,
         quant: QuantPlan | None = None):
    """MODEL (.gguf, HF folder, Hugging Face id or built-in name) -> (model, tokenizer).

    `adapter`: a run directory; its adapters (LoRA) or weights (full / scratch) are applied.
    `quant`: None, every weight dense (adapters merged in); a QuantPlan, the base's projections
    kept quantized as QLoRA keeps them (never whole in float32; a LoRA run's adapters stay
    unmerged on top (`quant_plan` decides which).
    """
    if adapter is not None:
        return load_run_model(adapter, base=model, dtype=dtype, quant=quant)
    if is_run_or_checkpoint(model):  # a training run (or one of its checkpoints, RUN/best) as MODEL
        return load_run_model(model, dtype=dtype, quant=quant)
    cfg, weights, meta, tokenizer = load_weights(model, dtype, quant=quant)
    m = build_model(cfg, weights)
    del weights
    m.meta = meta
    return m, tokenizer


def describe(model: LlamaModel, tokenizer, meta: LoadedMeta) -> dict:
    cfg = model.config
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    return {
        "source": meta.source,
        "format": meta.format,
        "architecture": cfg.arch,
        "config": cfg.to_dict() | ({"rope_scaling": {"type": cfg.rope_scaling.get("type")}} if cfg.rope_scaling else {}),
        "parameters": n_params,
        "tensor_types": dict(Counter(meta.tensor_types.values())),
        "tokenizer": tokenizer.describe(),
        "chat_template": bool(tokenizer.chat_template),
        "backend": backend.INFO.describe(),
    }


def load_partial(model, weights: dict[str, mx.array], source: str) -> None:
    """Put `weights` (a subset: adapters, trainable weights) into `model`, refusing any name
    the model does not have and any shape that differs (MLX's non-strict load checks neither)."""
    have = dict(tree_flatten(model.parameters()))
    for name, value in weights.items():
        if name not in have:
            raise UserError(f"{source}: holds {name}, which the model does not have")
        if tuple(value.shape) != tuple(have[name].shape):
            raise UserError(f"{source}: {name} has shape {list(value.shape)}, the model's is "
                            f"{list(have[name].shape)}")
    model.load_weights(list(weights.items()), strict=False)


def source_size(model_arg: str) -> tuple[int, bool]:
    """(parameters, whether they are stored quantized) of MODEL, from its header alone (GGUF
    tensor table, safetensors headers): what the memory guard and `--qlora auto` need before
    anything is loaded."""
    kind, path = resolve_model(model_arg)
    if kind == "gguf":
        tensors = open_gguf(path).tensors
        n = sum(math.prod(t.shape) for t in tensors)
        return n, any(in_blocks(t.tensor_type.name) for t in tensors)
    return hf_source_size(path)  # an mlx-lm quantized folder counts as quantized


def kept_exactly(model_arg: str) -> bool:
    """Whether MODEL's quantized matrices all load as they are stored (a GGUF's Q4_0 / Q4_1 /
    Q8_0 blocks, an mlx-lm folder's packed matrices), the embedding and output tables aside
    (kept as the file holds them), with at least one such matrix: keeping the base quantized
    then changes no value. From the header alone."""
    kind, path = resolve_model(model_arg)
    if kind != "gguf":
        return hf_source_size(path)[1]
    blocks = [t for t in open_gguf(path).tensors if in_blocks(t.tensor_type.name)
              and t.name not in ("token_embd.weight", "output.weight")]
    return bool(blocks) and all(affine_bits(t.tensor_type.name) is not None for t in blocks)


def in_blocks(type_name: str) -> bool:
    """Whether a GGML tensor type stores its values quantized in blocks (Q*, IQ*)."""
    return type_name.startswith(("Q", "IQ"))


def planned_model(model_arg: str, dtype: mx.Dtype, quant: QuantPlan | None = None) -> LlamaModel:
    """The model `load_weights(model_arg, dtype, quant)` would give, built from the header alone
    with lazy placeholder arrays of the same shapes and dtypes (nothing is read or allocated):
    what the memory guard estimates from before a large model is loaded."""
    kind, path = resolve_model(model_arg)
    if kind == "gguf":
        file = open_gguf(path)
        spec, cfg = gguf_model_config(file)
        types = {t.name: t.tensor_type.name for t in file.tensors}
    else:
        spec, cfg, _, _ = hf_model_config(path)
        types = {}
    model = build_module(cfg)
    if dtype != mx.float32:
        model.set_dtype(dtype)
    if quant is None:
        return model
    if kind != "gguf":  # an mlx-lm folder's packed matrices in their own layout, the rest as planned
        install_quantized(model, planned_quantized(path, quant))
        return model
    shapes = expected_shapes(cfg)
    packs = quant.matrices(spec, cfg)
    planned: dict[str, PackedMatrix] = {}
    for name, params, _ in expand(spec, cfg, shapes, "gguf"):
        for p in params:
            layout = quant.layout(p, shapes[p], packs, affine_bits(types.get(name, "")))
            if layout is None:
                continue
            rows, d_in = flat_shape(p, shapes[p])
            bits, group = layout
            planned[p] = PackedMatrix(mx.zeros((rows, d_in * bits // 32), mx.uint32),
                                      mx.zeros((rows, d_in // group), mx.float16),
                                      mx.zeros((rows, d_in // group), mx.float16), group, bits)
    install_quantized(model, planned)
    return model


def load_tokenizer(model_arg: str):
    """Just the tokenizer of MODEL (GGUF metadata or an HF folder); no weights read."""
    kind, path = resolve_model(model_arg)
    if kind == "gguf":
        return Tokenizer.from_gguf_metadata(open_gguf(path).metadata, source=path)
    return Tokenizer.from_hf_folder(path)


def load_donor(model_arg: str) -> tuple[mx.array, Any]:
    """MODEL (.gguf, HF folder, Hugging Face id or built-in name) -> (its token embedding table (vocab, d_in)
    in float32, its tokenizer). Only that one tensor is read from a GGUF."""
    kind, path = resolve_model(model_arg)
    if kind == "gguf":
        file = open_gguf(path)
        md = file.metadata
        t = next((t for t in file.tensors if t.name == "token_embd.weight"), None)
        if t is None:
            raise UserError(f"{path}: no token_embd.weight tensor to use as a donor table")
        table = mx.array(np.ascontiguousarray(dequantize_tensor(t, path), dtype=np.float32))
        return table, Tokenizer.from_gguf_metadata(md, source=path)
    _, weights, _, tokenizer = load_weights(model_arg, mx.float32)
    return weights["tok_embeddings.weight"], tokenizer


def attach_lens(model, donor_source: str, tokenizer=None, seed: int = 0,
                init: str = "pca") -> dict[str, Any]:
    """Load the donor table of `donor_source` and put a projection lens on `model`; -> facts
    to record (so a run reloads the same lens: `attach_lens(model, info["donor"], ...)`)."""
    donor, _ = load_donor(donor_source)
    apply_lens(model, donor, tokenizer, init=init, seed=seed, source=donor_source)
    return {"donor": donor_source, "d_in": int(donor.shape[1]), "init": init}


def run_weights(run: RunDir, cfg, ckpt: str | None) -> tuple[dict[str, mx.array], str]:
    """The tensors to apply: the final result when there is one, else the newest checkpoint."""
    final = run.join(ADAPTERS if cfg.adapters else MODEL_WEIGHTS)
    if ckpt is None and os.path.exists(final):
        return mx.load(final), final
    ckpt = ckpt or run.latest_checkpoint()
    if ckpt is None:
        raise UserError(f"{run.path}: the run has no result and no checkpoint yet")
    return mx.load(os.path.join(ckpt, CKPT_TRAINABLE)), ckpt


def run_quant_plan(run_dir: str) -> QuantPlan | None:
    """How a LoRA / DoRA run's base was kept while it trained: its QuantPlan for a QLoRA run
    (config.yaml's qlora_bits / qlora_group_size; a GGUF's Q4_0 / Q4_1 / Q8_0 blocks keep their
    own), None for a dense base or a run without adapters."""
    run, _ = locate(run_dir)
    cfg, facts = run.read_config()
    if not (cfg.adapters and facts.qlora):
        return None
    return QuantPlan.of(cfg)


def quant_plan(base: str, mode: str = "auto", *, plan: QuantPlan | None = None, run: str | None = None,
               inference: bool = False) -> QuantPlan | None:
    """How `base`'s projections are kept when it is loaded: None dense (a run's adapters merged
    in), a QuantPlan quantized as QLoRA keeps them (adapters unmerged on top). The one policy
    that training (`--qlora`), generate, chat, serve, taps and the TUI (`--quantized`) ask; read
    from the file's header and the run's config, nothing loaded.

    `run`: a run applied to the base (its own, or `base` standing in for it); a full / scratch
    run holds dense weights of its own (None). `plan`: the bits and group size to quantize with
    (default 4-bit, group 32; a run that trained quantized keeps its own). `mode`:
    - off: dense;
    - on: quantized;
    - auto: as a QLoRA `run` trained; else on Metal / CUDA (a native quantized matmul) when the
      file is quantized; on a CPU when the float32 base would take more than CPU_QLORA_SHARE of
      the memory budget; and, for `inference`, on a CPU with the kernels for a base of
      QUANTIZED_DECODE_PARAMS+ whose blocks load as they are (its own blocks, `QuantPlan()`: the
      same weights, a fraction of the bytes a token).
    `inference`: a dense base whose weights alone exceed the memory budget is refused
    (UserError) here, before anything is read (training's own memory check covers training)."""
    if mode not in QUANT_MODES:
        raise UserError(f"--quantized {mode}: choose from {', '.join(QUANT_MODES)}")
    if run is not None and not locate(run)[0].read_config()[0].adapters:
        return None  # full / scratch runs hold dense weights of their own
    trained = run_quant_plan(run) if run is not None else None
    plan = trained or plan or QuantPlan()
    if mode == "on" or mode == "auto" and trained is not None:
        return plan
    params, quantized = source_size(base)
    if mode == "auto":
        if backend.INFO.native_quantized_matmul:
            keep = quantized  # MLX multiplies the file's blocks as they are
        else:
            available = backend.INFO.memory_budget()[0]
            keep = bool(available) and params * 4 > CPU_QLORA_SHARE * available
        if keep:
            return plan
        if inference and kernels_on() and params >= QUANTIZED_DECODE_PARAMS and kept_exactly(base):
            return QuantPlan()
    if inference:
        available, what = backend.INFO.memory_budget()
        weights = params * backend.compute_dtype().size
        if available and weights > available:
            raise UserError(f"{base}: its weights take {weights / 1e9:.1f} GB dense, more than the {what} "
                            f"({available / 1e9:.1f} GB); --quantized on keeps the base quantized")
    return None


def load_run_model(run_dir: str, base: str | None = None, dtype: mx.Dtype | None = None,
                   merge: bool = True, quant: QuantPlan | None = None):
    """A run's model -> (model, tokenizer), in eval mode.

    lora / dora: the base (`base`, else the run's model) with the adapters (merged by default).
    full: the run's full weights (the base supplies the tokenizer). scratch: the run's model.
    quant (lora / dora only): a QuantPlan keeps the base's projections quantized (`quant_plan`
    decides; a QLoRA run's own is `run_quant_plan`); the adapters then stay unmerged on top
    (merging would need the dense base). None: a dense base.
    """
    run, ckpt = locate(run_dir)
    cfg, facts = run.read_config()
    weights, source = run_weights(run, cfg, ckpt)
    dtype = dtype or backend.compute_dtype()
    plan = quant if cfg.adapters else None
    if cfg.method == "scratch":
        if not facts.model_config:
            raise UserError(f"{run.path}: config.yaml records no model_config")
        mcfg = ModelConfig.from_dict(facts.model_config)
        model = build_model(mcfg)
        if facts.char_tokenizer:  # character / byte vocabulary, kept in config.yaml
            tokenizer = CharTokenizer.from_dict(facts.char_tokenizer)
        elif os.path.exists(run.join("tokenizer.json")):
            tokenizer = Tokenizer.from_hf_folder(run.path)
        else:
            tokenizer = load_tokenizer(base or cfg.tokenizer or cfg.model)
        if facts.lens:  # projection lens: the donor table is read from its source again
            attach_lens(model, facts.lens["donor"], tokenizer)
        meta = None
    else:
        mcfg, base_weights, meta, tokenizer = load_weights(base or cfg.model, dtype, quant=plan)
        model = build_model(mcfg, base_weights)
        del base_weights
        if cfg.adapters:
            lora = facts.lora or {}
            apply_lora(model, lora.get("targets", cfg.lora_targets), lora.get("rank", cfg.lora_rank),
                       lora.get("alpha", cfg.lora_alpha), 0.0, lora.get("per_head_q", cfg.lora_per_head_q),
                       lora.get("layers", cfg.lora_layers), paths=spec_of(mcfg.arch).lora_targets,
                       dora=cfg.method == "dora")
    load_partial(model, weights, source)
    if cfg.adapters and merge and plan is None:
        merge_lora(model)
    if merge:  # a projection lens becomes the plain embedding table it equals
        fold_lens(model)
    if dtype != mx.float32:
        model.set_dtype(dtype)
    model.freeze()
    model.eval()
    mx.eval(model.parameters())
    model.meta = meta
    model.run_source = source
    return model, tokenizer


def adapter_weights(run_dir: str) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """(adapter tensors named like `layers.0.attn.q.lora_a`, LoRA layout) for exporters.

    Layout keys: method (lora, dora), targets, rank, alpha, scale, dropout, per_head_q, layers,
    base_model, base_model_path, model_config, step. Shapes: q/k/v standard A (r, D), B (H*Dh, r);
    per-head q A (H, r, D), B (H, Dh, r); o/gate/up/down A (r, in), B (out, r). Delta W = scale *
    B @ A, in our (GGML adjacent-pair RoPE) row order for q/k. DoRA adds `...magnitude` (out,)
    per module (q/k/v: H*Dh, head-major): W' = m * (W + delta W) / ||W + delta W||_row.
    """
    run, ckpt = locate(run_dir)
    cfg, facts = run.read_config()
    if not cfg.adapters:
        raise UserError(f"{run.path}: a {cfg.method} run has no adapters (it has full weights)")
    weights, source = run_weights(run, cfg, ckpt)
    info = dict(facts.lora or {})
    info.update(method=cfg.method, base_model=cfg.model, base_model_path=facts.model_path,
                model_config=facts.model_config, source=source)
    if source.endswith(ADAPTERS) and os.path.exists(run.join(ADAPTER_CONFIG)):
        with open(run.join(ADAPTER_CONFIG)) as f:
            info["step"] = json.load(f).get("step")
    else:
        with open(os.path.join(source, CKPT_STATE)) as f:
            info["step"] = json.load(f)["step"]
    return weights, info
