"""Hugging Face model folders (config.json + *.safetensors + tokenizer.json), any architecture
whose spec (`mlxtoy.arch`) has an HF side.

The spec's name table gives each tensor's HF name and the transform between HF's layout and
ours (GGUF's rows): llama's q/k NEOX permute (as llama.cpp's converter does on the way in),
GPT-2's Conv1D transpose, fused q|k|v split and joined by rows. config.json is the spec's
`hf_in` / `hf_out`.

mlx-lm's quantized folders (`mlx_lm.convert(..., quantize=True)`: config.json's `quantization`,
`<name>.weight` packed uint32 beside `<name>.scales` and `<name>.biases`, MLX's affine layout)
use the same names and layout as Hugging Face's: each packed matrix is kept as it is stored
(a PackedMatrix, its rows permuted or split as the float one's would be) where the QuantPlan
keeps that matrix quantized, else dequantized tensor by tensor to the compute dtype.
"""

from __future__ import annotations

import glob
import json
import math
import os
from types import SimpleNamespace
from typing import Any

import mlx.core as mx

from mlxtoy.arch.registry import SPECS, expected_shapes, spec_for_hf, spec_of
from mlxtoy.arch.spec import ArchSpec, Fields, block0_name, expand, flat_shape, fuse, split
from mlxtoy.errors import UserError
from mlxtoy.model_config import LoadedMeta, ModelConfig
from mlxtoy.models.quant import BITS, PackedMatrix, QuantPlan, quantize_dense
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
    layouts = packed_layouts(raw_cfg, hf, path)
    head, table = "lm_head.weight", spec.tensor_of("tok_embeddings.weight")[0].hf
    # some checkpoints store a copy of the tied table: untie only if it differs
    cfg.tie_embeddings = head not in hf or table not in hf or (
        hf[head].shape == hf[table].shape and layouts.get(head) == layouts.get(table)
        and mx.array_equal(hf[head], hf[table]).item())
    bias = block0_name(spec, "attn.q.bias", "hf")
    cfg.qkv_bias = bias is not None and bias in hf
    if spec.fix_config is not None:
        spec.fix_config(cfg, {t.ours[0]: logical_shape(hf, t.hf, layouts) for t in spec.tensors
                              if not t.block and t.hf in hf})
    return spec, cfg, raw_cfg, hf


# --------------------------------------------------------------------------- mlx-lm's quantized folders

def quantization_of(raw_cfg: dict[str, Any], path: str) -> dict[str, Any] | None:
    """config.json's mlx-lm quantization (`quantization`, or `quantization_config` in the same
    form: group_size, bits, mode, and per-module overrides keyed by module path); None for a
    float folder. Other quantizers' folders (a `quant_method`: GPTQ, AWQ, bitsandbytes, ...)
    are refused in one line."""
    q = raw_cfg.get("quantization")
    if q is None:
        q = raw_cfg.get("quantization_config")
        if isinstance(q, dict) and "quant_method" in q:
            raise UserError(f"{path}: quantized with {q['quant_method']!r}, which mlxtoy does not read "
                            f"(it reads float folders, mlx-lm's quantized folders and GGUF files)")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise UserError(f"{path}/config.json: quantization: expected an object, got {type(q).__name__}")
    return q


def packed_layouts(raw_cfg: dict[str, Any], hf: dict[str, Any], path: str) -> dict[str, tuple[int, int]]:
    """{tensor name `<module>.weight`: (bits, group size)} of the matrices an mlx-lm folder
    holds quantized: those stored with `<module>.scales` beside them (as mlx-lm's loader
    decides), with config.json's `quantization` (its entry for the module where it has one).
    `hf`: name -> anything with a `.shape` (arrays, or shapes read from a header)."""
    packed = [name[: -len(".scales")] for name in hf if name.endswith(".scales")
              and name[: -len(".scales")] + ".weight" in hf]
    if not packed:
        return {}
    q = quantization_of(raw_cfg, path)
    if q is None:
        raise UserError(f"{path}: {packed[0]}.scales, but config.json has no quantization")
    out: dict[str, tuple[int, int]] = {}
    for module in packed:
        own = q.get(module, q)
        if not isinstance(own, dict):  # `false`: mlx-lm left this module unquantized
            raise UserError(f"{path}: {module} is stored quantized, but config.json's quantization "
                            f"says it is not")
        mode = own.get("mode", q.get("mode", "affine"))
        if mode != "affine":
            raise UserError(f"{path}: {module} is quantized in mode {mode!r}; mlxtoy reads mlx-lm's "
                            f"affine quantization (mlx_lm.convert's default)")
        try:
            bits, group = int(own.get("bits", q.get("bits"))), int(own.get("group_size", q.get("group_size")))
        except (TypeError, ValueError):
            raise UserError(f"{path}/config.json: quantization of {module}: needs bits and group_size") from None
        if module + ".biases" not in hf:
            raise UserError(f"{path}: {module}.scales without {module}.biases (not the affine layout)")
        w, scales = hf[module + ".weight"], hf[module + ".scales"]
        if bits not in (2, 3, 4, 5, 6, 8) or group <= 0:
            raise UserError(f"{path}/config.json: quantization of {module}: bits {bits}, group size {group}")
        d_in = w.shape[-1] * 32 // bits
        if len(w.shape) != 2 or tuple(scales.shape) != (w.shape[0], d_in // group) or d_in % group:
            raise UserError(f"{path}: {module}: packed shape {list(w.shape)} and scales {list(scales.shape)} "
                            f"do not fit {bits} bits, group size {group}")
        out[module + ".weight"] = (bits, group)
    return out


def logical_shape(hf: dict[str, Any], name: str, layouts: dict[str, tuple[int, int]]) -> tuple[int, ...]:
    """The shape of tensor `name` as a float matrix (a packed one's rows x inputs)."""
    shape = tuple(hf[name].shape)
    if name in layouts:
        return (shape[0], shape[1] * 32 // layouts[name][0])
    return shape


def read_packed(hf: dict[str, mx.array], name: str, layout: tuple[int, int]) -> PackedMatrix:
    """Tensor `name`'s PackedMatrix as stored (popped from `hf`, with its scales and biases)."""
    module = name[: -len(".weight")]
    bits, group = layout
    return PackedMatrix(hf.pop(name), hf.pop(module + ".scales"), hf.pop(module + ".biases"), group, bits)


def kept_packed(quant: QuantPlan, t, bits: int, param: str, shapes: dict[str, tuple[int, ...]],
                packs: set[str]) -> bool:
    """Whether a matrix stored packed with `bits` stays as stored under `quant`: a 4- or 8-bit
    matrix the plan keeps quantized (the tables too: the file's form is exact), whose HF -> ours
    transform moves whole rows (else it is dequantized, transformed, and quantized by the plan)."""
    return (bits in BITS and (t.hf_transform is None or t.hf_transform.rows)
            and quant.layout(param, shapes[param], packs, bits) is not None)


def dense_of(packed: PackedMatrix) -> mx.array:
    """The float32 matrix (mx.dequantize's values; the kernels' threaded form for 4 and 8 bits)."""
    if packed.bits in BITS:
        return packed.dense(mx.float32)
    return mx.dequantize(packed.weight, packed.scales.astype(mx.float32), packed.biases.astype(mx.float32),
                         packed.group_size, packed.bits)


def _rows_of(packed: PackedMatrix, f) -> PackedMatrix:
    """A row transform applied to the packed words, scales and biases alike."""
    return PackedMatrix(f(packed.weight), f(packed.scales), f(packed.biases), packed.group_size, packed.bits)


def split_packed(packed: PackedMatrix, params: list[str], shapes: dict[str, tuple[int, ...]], name: str,
                 where: str) -> list[PackedMatrix]:
    """`split` for a packed matrix: rows for each of `params` (a per-head one keeps its heads
    flat, as `install_quantized` takes it)."""
    flats = [flat_shape(p, shapes[p]) for p in params]
    want = [sum(f[0] for f in flats), flats[0][-1]]
    if list(packed.shape) != want or any(len(f) != 2 or f[1:] != flats[0][1:] for f in flats):
        raise UserError(f"{where}: tensor {name} has shape {list(packed.shape)}, expected {want}")
    if len(params) == 1:
        return [packed]
    out, start = [], 0
    for f in flats:
        out.append(packed.rows(start, start + f[0]))
        start += f[0]
    return out


def load_hf(path: str, dtype: mx.Dtype | None = None, quant: QuantPlan | None = None):
    """-> (ModelConfig, {param_name: mx.array | PackedMatrix}, LoadedMeta), tensor by tensor
    (safetensors load lazily, so each tensor is read when it is converted). With `quant`, the
    matrices it names are quantized at load (PackedMatrix), their errors in the meta; a matrix
    an mlx-lm folder stores quantized is kept as stored (the tables too), and without `quant`
    dequantized to `dtype`."""
    dtype = dtype or mx.float32
    spec, cfg, raw_cfg, hf = hf_model_config(path)
    layouts = packed_layouts(raw_cfg, hf, path)
    shapes = expected_shapes(cfg)
    packs = quant.matrices(spec, cfg) if quant is not None else set()
    weights: dict[str, mx.array | PackedMatrix] = {}
    errors: dict[str, float] = {}
    for name, params, t in expand(spec, cfg, shapes, "hf"):
        if name not in hf:
            raise UserError(f"{path}: missing tensor {name}")
        if name in layouts:
            packed = read_packed(hf, name, layouts[name])
            if quant is not None and kept_packed(quant, t, packed.bits, params[0], shapes, packs):
                if t.hf_transform is not None:  # row permutes (q/k's NEOX), as for the float rows
                    packed = _checked(lambda: _rows_of(packed, lambda a: t.hf_transform.from_hf(a, cfg)),
                                      path, name, packed.weight)
                for param, part in zip(params, split_packed(packed, params, shapes, name, path)):
                    weights[param] = part
                    mx.eval(part.weight, part.scales, part.biases)
                continue
            w = dense_of(packed)  # this tensor alone, then as a float one
        else:
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


def planned_quantized(path: str, quant: QuantPlan) -> dict[str, PackedMatrix]:
    """{param: PackedMatrix of placeholder arrays} for the matrices `load_hf(path, quant=quant)`
    keeps quantized, in the layout it keeps them in (an mlx-lm folder's own bits, group size and
    scale dtype; the plan's for a float matrix it quantizes at load), from the header alone:
    the lazy zeros are never evaluated (what `loading.planned_model` builds its model from)."""
    spec, cfg, raw_cfg, hf = hf_model_config(path)
    layouts = packed_layouts(raw_cfg, hf, path)
    shapes = expected_shapes(cfg)
    packs = quant.matrices(spec, cfg)
    planned: dict[str, PackedMatrix] = {}
    for name, params, t in expand(spec, cfg, shapes, "hf"):
        stored = layouts.get(name)
        for p in params:
            if stored is not None and kept_packed(quant, t, stored[0], p, shapes, packs):
                (bits, group), dtype = stored, hf[name[: -len(".weight")] + ".scales"].dtype
            elif (layout := quant.layout(p, shapes[p], packs)) is not None:
                (bits, group), dtype = layout, mx.float16  # `quantize_dense`'s scales
            else:
                continue
            rows, d_in = flat_shape(p, shapes[p])
            planned[p] = PackedMatrix(mx.zeros((rows, d_in * bits // 32), mx.uint32),
                                      mx.zeros((rows, d_in // group), dtype),
                                      mx.zeros((rows, d_in // group), dtype), group, bits)
    return planned


def hf_source_size(path: str) -> tuple[int, bool]:
    """(parameters, whether any matrix is stored quantized) of an HF folder from its
    safetensors headers and config.json: a packed matrix counts rows x inputs, its scales and
    biases not at all."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        try:
            with safe_open(file, "numpy") as f:
                shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
        except Exception as e:
            raise UserError(f"{file}: cannot read safetensors ({e})") from None
    headers = {k: SimpleNamespace(shape=v) for k, v in shapes.items()}  # what packed_layouts reads
    layouts = packed_layouts(read_hf_config(path), headers, path)
    extras = {m[: -len(".weight")] + leaf for m in layouts for leaf in (".scales", ".biases")}
    n = sum(math.prod(logical_shape(headers, k, layouts)) for k in shapes if k not in extras)
    return n, bool(layouts)


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
