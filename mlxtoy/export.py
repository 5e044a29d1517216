"""`mlxtoy export`: models and runs out to GGUF (merged or as a llama.cpp LoRA adapter),
Hugging Face folders, mlx-lm adapters and PEFT adapters.

GGUF types: f32, f16 and q8_0 are written by our writer (io.gguf_write); the K-quants and
Q4_0 / Q5_0 by llama.cpp's own quantizer (io.quantize) from an F16 GGUF we write first.

Every LoRA we train is first turned into one neutral form, a standard low-rank update per
weight in our fused layout (GGUF's row order):

    delta W = scale * B @ A,   A (rank, d_in), B (d_out, rank)

A per-head adapter on q/k/v (A_h (r, d_in), B_h (d_head, r) for each head h) converts
exactly: A stacks the heads' A_h (rank heads*r) and B is block-diagonal with B_h on the
diagonal, so head h's rows get B_h @ A_h and nothing else. Where the outside formats fuse
several of our weights into one tensor (Phi-3's qkv_proj, GPT-2's c_attn) the updates of its
parts join the same way: A stacked, B block-diagonal at each part's rows (`outside_updates`).
Each writer then only renames (the spec's name table), re-lays-out (the row's HF transform:
llama's q/k rows are GGML adjacent-pair in GGUF and NEOX in HF / mlx-lm / PEFT) and folds
`scale` into B so that the consumer's own scale convention gives exactly ours:

    llama.cpp:  alpha / rank, rank read from each B    PEFT: lora_alpha / r (rank_pattern)
    mlx-lm:     one `scale` for every adapted layer, one rank (narrower adapters zero-padded)

DoRA adds a magnitude m per row (W' = m * (W + delta W) / ||W + delta W||_row). A row's norm
is of the whole updated row, so m joins by rows too; rows the outside tensor has without an
adapter (a fused part, a padded layer) get m = ||W||_row, which leaves them as they are. PEFT
(`use_dora`, `lora_magnitude_vector`) and mlx-lm (`fine_tune_type: dora`, `.m`) take m in HF
row order; llama.cpp's adapter GGUF has no DoRA (merged exports only).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx
import numpy as np
from safetensors.numpy import save as safetensors_bytes

from mlxtoy.arch.registry import SPECS, expected_shapes, spec_of
from mlxtoy.arch.spec import Tensor, flat_shape
from mlxtoy.errors import UserError
from mlxtoy.fsutil import atomic_folder, atomic_path
from mlxtoy.io.gguf_write import GGUF_DTYPES, gguf_spec, write_gguf, write_lora_gguf
from mlxtoy.io.hf import save_hf
from mlxtoy.io.quantize import QUANT_TYPES, find_quantizer, quantize_gguf
from mlxtoy.loading import load_run_model, load_weights
from mlxtoy.model_config import LoadedMeta, ModelConfig
from mlxtoy.models.lora import LORA_TYPES, LoRAHeadProjection, dense_weight, is_dora, lora_modules, row_norms
from mlxtoy.rundir import is_run_or_checkpoint, locate

FORMAT_HELP = {  # `mlxtoy export --format` and the TUI's export dialog
    "gguf": "llama.cpp model GGUF (LoRA merged)",
    "adapter-gguf": "llama.cpp LoRA adapter GGUF (apply with --lora on the base GGUF)",
    "hf": "Hugging Face folder: config.json + model.safetensors + tokenizer.json",
    "mlx-lm": "mlx-lm adapter folder (adapters.safetensors + adapter_config.json)",
    "peft": "PEFT adapter folder (adapter_model.safetensors + adapter_config.json)",
}
FORMATS = tuple(FORMAT_HELP)
DTYPES = GGUF_DTYPES + tuple(QUANT_TYPES)  # the last ones through llama.cpp's quantizer
FILE_FORMATS = ("gguf", "adapter-gguf")  # one file; the others write a folder


def dtypes_for(fmt: str) -> tuple[str, ...]:
    """The types format `fmt` is written in: every GGUF type and llama.cpp's quantizer types
    for a model GGUF, the GGUF types for an adapter GGUF, f32 and f16 for the folders."""
    if fmt == "gguf":
        return DTYPES
    return GGUF_DTYPES if fmt in FILE_FORMATS else ("f32", "f16")

@dataclass
class LoraUpdate:
    """delta W = scale * B @ A in our fused layout; A (rank, d_in), B (d_out, rank), float32."""

    A: np.ndarray
    B: np.ndarray
    scale: float
    magnitude: np.ndarray | None = None  # DoRA: m (d_out,), our row order

    @property
    def rank(self) -> int:
        return self.A.shape[0]

    def delta(self) -> np.ndarray:
        return self.scale * (self.B.astype(np.float64) @ self.A.astype(np.float64))


@dataclass
class LoraSet:
    """All of a run's adapters: {(layer, target): LoraUpdate}, plus the nominal rank/alpha."""

    updates: dict[tuple[int, str], LoraUpdate]
    rank: int
    alpha: float
    base: str | None = None  # the base MODEL the run was trained on
    dora: bool = False  # every update has a magnitude

    @property
    def nominal_scale(self) -> float:
        return self.alpha / self.rank if self.rank else 1.0


@dataclass
class Source:
    """What `export` works from: merged weights, metadata, tokenizer, and LoRA when a run has it."""

    cfg: ModelConfig
    weights: dict[str, mx.array]
    meta: LoadedMeta | None
    tokenizer: Any
    lora: LoraSet | None = None
    label: str = ""


# --------------------------------------------------------------------------- per-head <-> fused

def per_head_to_fused(A_h: np.ndarray, B_h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-head LoRA (A_h (H, r, d_in), B_h (H, d_head, r)) -> one standard LoRA of rank H*r:
    A stacks the A_h, B is block-diagonal, so B @ A has B_h @ A_h in head h's rows and nothing
    else. Exact (no SVD, no approximation)."""
    H, r, d_in = A_h.shape
    d_head = B_h.shape[1]
    A = A_h.reshape(H * r, d_in)
    B = np.zeros((H * d_head, H * r), dtype=np.float32)
    for h in range(H):
        B[h * d_head:(h + 1) * d_head, h * r:(h + 1) * r] = B_h[h]
    return A, B


# --------------------------------------------------------------------------- layouts

@dataclass
class Adapted:
    """One outside tensor's LoRA: delta = B @ A (scale folded into B), B's rows (and DoRA's m)
    in our (GGUF) order; `row` is the spec's name-table row (GGUF name, HF module, HF transform)."""

    layer: int
    row: Tensor
    A: np.ndarray
    B: np.ndarray
    m: np.ndarray | None = None

    @property
    def rank(self) -> int:
        return self.A.shape[0]

    @property
    def hf_module(self) -> str:
        return self.row.hf.removesuffix(".weight")


def base_row_norms(weights: dict[str, mx.array], layer: int, row: Tensor) -> np.ndarray:
    """||W||_row of an outside tensor from our (unadapted) weights: the DoRA magnitude that
    leaves its rows unchanged."""
    return np.concatenate([np.array(row_norms(weights[f"layers.{layer}.{p}"]).astype(mx.float32)).reshape(-1)
                           for p in row.ours])


def outside_updates(lora: LoraSet, cfg: ModelConfig,
                    weights: dict[str, mx.array] | None = None) -> list[Adapted]:
    """The run's updates per outside tensor, in the name table's order. Updates of weights the
    outside formats fuse (q | k | v, gate | up) join exactly: A stacked, B block-diagonal at
    each part's rows (parts without an adapter get zero rows; with DoRA, m = their row norms
    in `weights`)."""
    spec = spec_of(cfg.arch)
    shapes = expected_shapes(cfg)
    groups: dict[tuple[int, int], dict[int, LoraUpdate]] = {}
    for (layer, target), u in lora.updates.items():
        row, part = spec.tensor_of(spec.lora_targets[target] + ".weight")
        groups.setdefault((layer, spec.tensors.index(row)), {})[part] = u
    out = []
    for (layer, k), parts in sorted(groups.items()):
        row = spec.tensors[k]
        rows = [flat_shape(p, shapes[f"layers.{layer}.{p}"])[0] for p in row.ours]
        A = np.concatenate([parts[i].A for i in sorted(parts)], axis=0).astype(np.float32)
        B = np.zeros((sum(rows), A.shape[0]), dtype=np.float32)
        col = 0
        for i in sorted(parts):
            u, start = parts[i], sum(rows[:i])
            B[start:start + rows[i], col:col + u.rank] = u.B * np.float32(u.scale)
            col += u.rank
        m = None
        if lora.dora:
            m = np.concatenate([parts[i].magnitude if i in parts else
                                base_row_norms(weights, layer, Tensor((p,), None, None))
                                for i, p in enumerate(row.ours)]).astype(np.float32)
        out.append(Adapted(layer, row, A, B, m))
    return out


def _hf_rows(cfg: ModelConfig, row: Tensor, x: np.ndarray) -> np.ndarray:
    """x's rows (a B, or DoRA's m) in Hugging Face order (the row's transform; llama's q/k:
    adjacent-pair -> NEOX)."""
    tf = row.hf_transform
    if tf is None:
        return x
    if not tf.rows:
        raise UserError(f"{cfg.arch}: adapters on {row.hf} have no row-wise HF layout")
    return np.array(tf.to_hf(mx.array(x.reshape(x.shape[0], -1)), cfg)).reshape(x.shape)


def _np_dtype(dtype: str):
    if dtype == "f32":
        return np.float32
    if dtype == "f16":
        return np.float16
    raise UserError(f"--dtype {dtype} is not available for this format (choose f32 or f16)")


# --------------------------------------------------------------------------- writers

def lora_to_llama_cpp(lora: LoraSet, cfg: ModelConfig) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], float]:
    """-> ({GGUF base tensor name: (A, B)}, alpha) such that llama.cpp's alpha/rank gives ours."""
    alpha = float(lora.alpha) if lora.alpha else 0.0
    out = {}
    for a in outside_updates(lora, cfg):
        # llama.cpp scales by alpha / rank (rank = this B's width), or by 1 when alpha is 0
        theirs = alpha / a.rank if alpha else 1.0
        out[f"blk.{a.layer}.{a.row.gguf}"] = (a.A, a.B / np.float32(theirs))
    return out, alpha


def write_adapter_gguf(path: str, src: Source, dtype: str = "f32") -> str:
    if _need_lora(src).dora:
        raise UserError(f"{src.label or 'source'}: llama.cpp's LoRA adapter GGUF has no DoRA (its per-row "
                        "magnitude): export the merged model instead (--format gguf)")
    adapters, alpha = lora_to_llama_cpp(_need_lora(src), src.cfg)
    return write_lora_gguf(path, src.cfg, adapters, alpha, metadata=src.meta.metadata if src.meta else None,
                           dtype=dtype)


def write_mlx_lm(path: str, src: Source, dtype: str = "f32") -> str:
    """adapters.safetensors + adapter_config.json for `mlx_lm.load(..., adapter_path=PATH)`.

    mlx-lm has one rank and one scale for every adapted layer, the same keys in each of the
    last `num_layers` layers: narrower adapters are zero-padded (exact), missing ones are zero
    (DoRA: m = the base's row norms), and each adapter's own scale is folded into its B.
    """
    lora = _need_lora(src)
    cfg = src.cfg
    np_dtype = _np_dtype(dtype)
    items = outside_updates(lora, cfg, src.weights)
    rows = {a.hf_module: a.row for a in items}
    rank = max(a.rank for a in items)
    scale = lora.nominal_scale or 1.0
    by_key = {(a.layer, a.hf_module): a for a in items}
    dims = {a.hf_module: (a.B.shape[0], a.A.shape[1]) for a in items}
    first = min(a.layer for a in items)
    tensors: dict[str, np.ndarray] = {}
    for layer in range(first, cfg.n_layers):
        for module, (d_out, d_in) in dims.items():
            a = np.zeros((d_in, rank), dtype=np.float32)
            b = np.zeros((rank, d_out), dtype=np.float32)
            u = by_key.get((layer, module))
            if u is not None:
                a[:, :u.rank] = u.A.T
                b[:u.rank, :] = (_hf_rows(cfg, u.row, u.B) / np.float32(scale)).T
            name = src_hf_block(cfg, layer) + module
            tensors[f"{name}.lora_a"] = a.astype(np_dtype)
            tensors[f"{name}.lora_b"] = b.astype(np_dtype)
            if lora.dora:
                m = u.m if u is not None else base_row_norms(src.weights, layer, rows[module])
                tensors[f"{name}.m"] = _hf_rows(cfg, rows[module], m).astype(np_dtype)
    config = {
        "fine_tune_type": "dora" if lora.dora else "lora",
        "num_layers": cfg.n_layers - first,
        "lora_parameters": {"rank": rank, "scale": scale, "dropout": 0.0,
                            "keys": list(dims)},
    }
    if lora.base:
        config["model"] = lora.base
    return _write_adapter_folder(path, "adapters.safetensors", tensors, config)


def src_hf_block(cfg: ModelConfig, layer: int) -> str:
    """The HF name prefix of block `layer` ("model.layers.3.")."""
    return spec_of(cfg.arch).hf_block.format(i=layer)


def write_peft(path: str, src: Source, dtype: str = "f32") -> str:
    """adapter_model.safetensors + adapter_config.json for `PeftModel.from_pretrained`.

    PEFT scales each module by lora_alpha / r, with r from `rank_pattern` where a module's rank
    differs from the common one; each adapter's own scale is folded into its B. DoRA:
    `use_dora` and each module's `lora_magnitude_vector`.
    """
    lora = _need_lora(src)
    cfg = src.cfg
    np_dtype = _np_dtype(dtype)
    alpha = float(lora.alpha) if lora.alpha else float(lora.rank)
    items = outside_updates(lora, cfg, src.weights)
    rows = {a.hf_module: a.row for a in items}
    ranks = [a.rank for a in items]
    r = max(set(ranks), key=ranks.count)
    tensors: dict[str, np.ndarray] = {}
    rank_pattern: dict[str, int] = {}
    modules: dict[str, set[int]] = {}
    dims = {a.hf_module: (a.B.shape[0], a.A.shape[1]) for a in items}
    for a in items:
        module = src_hf_block(cfg, a.layer) + a.hf_module
        B = _hf_rows(cfg, a.row, a.B) * np.float32(a.rank / alpha)
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.A.astype(np_dtype)
        tensors[f"base_model.model.{module}.lora_B.weight"] = B.astype(np_dtype)
        if lora.dora:
            mag = _hf_rows(cfg, a.row, a.m)
            tensors[f"base_model.model.{module}.lora_magnitude_vector"] = mag.astype(np_dtype)
        modules.setdefault(a.hf_module.split(".")[-1], set()).add(a.rank)
        if a.rank != r:
            rank_pattern[module] = a.rank
    # one entry per projection when all its layers share a rank (PEFT matches by suffix)
    for short, rs in modules.items():
        if len(rs) == 1 and next(iter(rs)) != r:
            for k in [k for k in rank_pattern if k.endswith("." + short)]:
                del rank_pattern[k]
            rank_pattern[short] = next(iter(rs))
    layers = sorted({layer for layer, _ in lora.updates})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": lora.base,
        "r": r,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "target_modules": sorted(modules),
        "layers_to_transform": None if layers == list(range(cfg.n_layers)) else layers,
        "rank_pattern": rank_pattern,
        "alpha_pattern": {},
        "use_rslora": False,
        "use_dora": lora.dora,
        "inference_mode": True,
        "modules_to_save": None,
        "init_lora_weights": True,
    }
    have = {(a.layer, a.hf_module) for a in items}
    missing = [(layer, m) for layer in layers for m in dims if (layer, m) not in have]
    for layer, m in missing:  # PEFT adapts every target in every listed layer: write zeros
        d_out, d_in = dims[m]
        module = src_hf_block(cfg, layer) + m
        tensors[f"base_model.model.{module}.lora_A.weight"] = np.zeros((r, d_in), np_dtype)
        tensors[f"base_model.model.{module}.lora_B.weight"] = np.zeros((d_out, r), np_dtype)
        if lora.dora:
            mag = _hf_rows(cfg, rows[m], base_row_norms(src.weights, layer, rows[m]))
            tensors[f"base_model.model.{module}.lora_magnitude_vector"] = mag.astype(np_dtype)
    return _write_adapter_folder(path, "adapter_model.safetensors", tensors, config, also_ours=("README.md",))


def write_hf(path: str, src: Source, dtype: str = "f32") -> str:
    mx_dtype = {"f32": mx.float32, "f16": mx.float16}.get(dtype)
    if mx_dtype is None:
        raise UserError(f"--dtype {dtype} is not available for --format hf (choose f32 or f16)")
    _check_replaceable_dir(path, ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                                  "generation_config.json", "special_tokens_map.json"))
    try:
        save_hf(path, src.cfg, src.weights, src.tokenizer, dtype=mx_dtype)
    except OSError as e:
        raise UserError(f"{path}: cannot write ({e.strerror or e})") from None
    return path


def write_model_gguf(path: str, src: Source, dtype: str = "f32",
                     progress: Callable[[int, int], None] | None = None, verbose: bool = False) -> str:
    gguf_spec(src.cfg)  # refuse an architecture llama.cpp cannot run before anything else
    if dtype not in QUANT_TYPES:
        return write_gguf(path, src.cfg, src.weights, gguf_metadata(src), dtype=dtype, progress=progress)
    # llama.cpp quantizes from the F16 GGUF we write beside the target (same filesystem, so
    # the space is checked where it matters); the result lands atomically; the F16 goes away
    find_quantizer(dtype)
    path = os.path.abspath(path)
    if os.path.isdir(path):
        raise UserError(f"{path}: is a folder (give a file path for the output)")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, f16 = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.{os.getpid()}.", suffix=".f16.gguf",
                               dir=os.path.dirname(path))
    os.close(fd)
    try:
        write_gguf(f16, src.cfg, src.weights, gguf_metadata(src), dtype="f16", progress=progress)
        with atomic_path(path) as tmp:
            quantize_gguf(f16, tmp, dtype, verbose=verbose)  # llama.cpp's log: only when verbose
    except OSError as e:
        raise UserError(f"{path}: write failed ({e.strerror or e})") from None
    finally:
        if os.path.exists(f16):
            os.unlink(f16)
    return path


def gguf_metadata(src: Source) -> dict[str, Any]:
    """The key/values to carry: the source GGUF's own (tokenizer keys exactly as they were),
    else what the tokenizer can say about itself in GGUF terms."""
    md: dict[str, Any] = {}
    if src.meta is not None and src.meta.format == "gguf":
        md.update(src.meta.metadata)
    if not any(k.startswith("tokenizer.ggml.") for k in md) and src.tokenizer is not None:
        md.update(src.tokenizer.to_gguf_metadata())
    if "general.name" not in md and src.label:
        md["general.name"] = os.path.basename(os.path.normpath(src.label)) or "mlxtoy"
    return md


# --------------------------------------------------------------------------- sources

def _need_lora(src: Source) -> LoraSet:
    if not spec_of(src.cfg.arch).adapters:
        able = ", ".join(n for n, s in SPECS.items() if s.adapters)
        raise UserError(f"adapter formats support {able} models, not {src.cfg.arch} "
                        "(export the merged model with --format gguf or hf)")
    if src.lora is None or not src.lora.updates:
        raise UserError(f"{src.label or 'source'}: no LoRA adapters to export "
                        "(adapter formats need a LoRA run; use --format gguf or hf for a merged model)")
    return src.lora


def _module(model, path: str):
    m = model
    for part in path.split("."):
        m = m[int(part)] if part.isdigit() else getattr(m, part)
    return m


def merged_weights(model) -> dict[str, mx.array]:
    """Flat parameters of `model` in our plain layout, every LoRA folded in (the model itself is
    not changed) and quantized bases dequantized."""
    out: dict[str, mx.array] = {}
    for param in expected_shapes(model.config):
        path, leaf = param.rsplit(".", 1)
        m = _module(model, path)
        if isinstance(m, LORA_TYPES):
            out[param] = m.merged_weight() if leaf == "weight" else getattr(m.base, leaf)
        else:  # QLoRA bases: export dense weights
            out[param] = dense_weight(m) if leaf == "weight" else getattr(m, leaf)
    mx.eval(out)
    return out


def lora_from_model(model, alpha: float | None = None, base: str | None = None) -> LoraSet | None:
    """The model's LoRA / DoRA wrappers (mlxtoy.models.lora) as standard fused updates, or None."""
    by_path = {p: t for t, p in spec_of(model.config.arch).lora_targets.items()}
    updates: dict[tuple[int, str], LoraUpdate] = {}
    ranks, scales = [], []
    for name, m in lora_modules(model):
        _, idx, rest = name.split(".", 2)
        target = by_path[rest]
        a = np.array(m.lora_a.astype(mx.float32))
        b = np.array(m.lora_b.astype(mx.float32))
        if isinstance(m, LoRAHeadProjection) and m.per_head:
            ranks.append(a.shape[1])
            a, b = per_head_to_fused(a, b)
        else:
            ranks.append(a.shape[0])
        scales.append(float(m.scale))
        mag = np.array(m.magnitude.astype(mx.float32)).reshape(-1) if is_dora(m) else None
        updates[(int(idx), target)] = LoraUpdate(A=a, B=b, scale=float(m.scale), magnitude=mag)
    if not updates:
        return None
    rank = max(set(ranks), key=ranks.count)
    if alpha is None:
        alpha = max(set(scales), key=scales.count) * rank
    dora = all(u.magnitude is not None for u in updates.values())
    return LoraSet(updates=updates, rank=rank, alpha=float(alpha), base=base, dora=dora)


def source_from_model(model, tokenizer, label: str = "", alpha: float | None = None,
                      base: str | None = None) -> Source:
    """An in-memory LlamaModel (LoRA-wrapped or not) and its tokenizer as an export source:
    merged weights for model formats, its adapters for adapter formats."""
    meta = getattr(model, "meta", None)
    return Source(cfg=model.config, weights=merged_weights(model), meta=meta, tokenizer=tokenizer,
                  lora=lora_from_model(model, alpha, base), label=label or (meta.source if meta else ""))


def load_source(source: str, dtype: mx.Dtype | None = None, fmt: str = "gguf") -> Source:
    """SOURCE: a run directory, one of its checkpoints, or a model (.gguf, HF folder, name)."""
    if is_run_or_checkpoint(source):
        return _load_run(source)
    top = source.split("/")[0]
    if "/" in source and not os.path.exists(source) and os.path.isdir(os.path.expanduser(top)):
        # runs/nope: a local path (its folder is here), not a Hugging Face id to go and look for
        raise UserError(f"{source}: no such run, checkpoint or model ({top}/ holds none of that name)")
    if fmt not in ("gguf", "hf"):  # say so before loading a model that cannot have adapters
        raise UserError(f"{source}: a model has no LoRA adapters to export as {fmt} "
                        "(adapter formats need a LoRA run; use --format gguf or hf)")
    cfg, weights, meta, tokenizer = load_weights(source, dtype or mx.float32)
    return Source(cfg=cfg, weights=weights, meta=meta, tokenizer=tokenizer, label=source)


def _load_run(path: str) -> Source:
    """A run (final result, else its newest checkpoint) or one RUN/checkpoints/step_N."""
    model, tokenizer = load_run_model(path, dtype=mx.float32, merge=False)
    run, _ = locate(path)
    cfg, facts = run.read_config()
    lora_info = facts.lora or {}
    src = source_from_model(model, tokenizer, label=path, alpha=lora_info.get("alpha"), base=cfg.model)
    if src.meta is None and cfg.method != "scratch":
        raise UserError(f"{path}: cannot tell the base model's metadata")
    return src


# --------------------------------------------------------------------------- files

def _check_replaceable_dir(path: str, ours: tuple[str, ...]) -> None:
    """An existing output folder is only replaced when it holds nothing but a previous export."""
    if os.path.isfile(path):
        raise UserError(f"{path}: is a file (this format writes a folder)")
    if os.path.isdir(path):
        foreign = [n for n in os.listdir(path) if n not in ours]
        if foreign:
            raise UserError(f"{path}: folder exists and holds other files ({foreign[0]} ...); "
                            "choose a new --out")


def _write_adapter_folder(path: str, weights_name: str, tensors: dict[str, np.ndarray],
                          config: dict[str, Any], also_ours: tuple[str, ...] = ()) -> str:
    """`weights_name` + adapter_config.json as one folder, swapped in whole (mlxtoy.fsutil);
    an existing `path` is replaced only when it holds nothing but a previous export."""
    path = os.path.abspath(path)
    _check_replaceable_dir(path, (weights_name, "adapter_config.json", *also_ours))
    try:
        with atomic_folder(path) as tmp:
            # bytes, then an ordinary file: safetensors' own save_file leaves it 0600
            with open(os.path.join(tmp, weights_name), "wb") as f:
                f.write(safetensors_bytes({k: np.ascontiguousarray(v) for k, v in tensors.items()},
                                          metadata={"format": "pt"}))
            with open(os.path.join(tmp, "adapter_config.json"), "w") as f:
                json.dump(config, f, indent=2)
                f.write("\n")
    except OSError as e:
        raise UserError(f"{path}: cannot write ({e.strerror or e})") from None
    return path


# --------------------------------------------------------------------------- entry points

def check_format(fmt: str, dtype: str | None) -> tuple[str, str]:
    if fmt not in FORMATS:
        raise UserError(f"unknown export format {fmt!r} (choose from {', '.join(FORMATS)})")
    dtype = (dtype or "f32").lower()
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    if dtype not in dtypes_for(fmt):
        if fmt not in FILE_FORMATS:
            raise UserError(f"--dtype {dtype} is not available for --format {fmt} (choose f32 or f16)")
        raise UserError(f"--dtype {dtype} is for --format gguf (adapters: f32, f16 or q8_0)")
    if dtype in QUANT_TYPES:
        find_quantizer(dtype)  # say so before loading anything
    return fmt, dtype


def check_output(out: str, fmt: str) -> None:
    """Fail before any loading when the output cannot be written."""
    path = os.path.abspath(out)
    if fmt in FILE_FORMATS:
        if os.path.isdir(path):
            raise UserError(f"{out}: is a folder (--format {fmt} writes one file)")
    else:
        if os.path.isfile(path):
            raise UserError(f"{out}: is a file (--format {fmt} writes a folder)")
    parent = os.path.dirname(path)
    existing = parent
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise UserError(f"{out}: cannot write here ({existing} is a file, not a folder)")
    if not os.access(existing, os.W_OK):
        raise UserError(f"{out}: cannot write here ({existing} is not writable)")


def export_source(src: Source, out: str, fmt: str = "gguf", dtype: str | None = None,
                  progress: Callable[[int, int], None] | None = None, verbose: bool = False) -> str:
    fmt, dtype = check_format(fmt, dtype)
    if fmt == "gguf":
        return write_model_gguf(out, src, dtype, progress, verbose)
    if fmt == "hf":
        return write_hf(out, src, dtype)
    if fmt == "adapter-gguf":
        return write_adapter_gguf(out, src, dtype)
    if fmt == "mlx-lm":
        return write_mlx_lm(out, src, dtype)
    return write_peft(out, src, dtype)


def export(source: str, out: str, fmt: str = "gguf", dtype: str | None = None,
           progress: Callable[[int, int], None] | None = None) -> str:
    """Export SOURCE (run directory, checkpoint, or model) to `out`. Returns the written path."""
    check_format(fmt, dtype)
    check_output(out, fmt)
    return export_source(load_source(source, fmt=fmt), out, fmt, dtype, progress)


def export_model(model, tokenizer, out: str, fmt: str = "gguf", dtype: str | None = None) -> str:
    """Export an in-memory model: merged for model formats, its LoRA for adapter formats."""
    check_format(fmt, dtype)
    check_output(out, fmt)
    return export_source(source_from_model(model, tokenizer), out, fmt, dtype)

