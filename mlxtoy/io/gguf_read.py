"""Read GGUF files of any architecture we support into our per-head layout, exactly.

The architecture's spec (`mlxtoy.arch`) says which metadata keys make the config and what each
tensor is called; this module loops over it. Each tensor is dequantized on its own
(`mlxtoy.io.gguf_file`) and handed to MLX, so the weights are never held twice. `mx.load` is not
used for the weights: it returns BF16 and K-quants as float16, which loses range.
"""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx
import numpy as np

from mlxtoy.arch.registry import expected_shapes, spec_for_gguf
from mlxtoy.arch.spec import ArchSpec, Fields, block0_name, expand, flat_shape, split
from mlxtoy.errors import UserError
from mlxtoy.io.gguf_file import (SYMMETRIC_BLOCKS, GGUFFile, affine_bits, affine_blocks, dequantize_tensor,
                                 open_gguf)
from mlxtoy.model_config import LoadedMeta, ModelConfig
from mlxtoy.models.quant import PackedMatrix, QuantPlan, quantize_dense

__all__ = ["config_from_metadata", "dequantize_tensor", "gguf_model_config", "load_gguf", "open_gguf"]


def config_from_metadata(md: dict[str, Any], path: str) -> tuple[ArchSpec, ModelConfig]:
    """The spec for the file's architecture and the config its metadata describes (the
    tensors settle the rest: see `load_gguf`)."""
    spec = spec_for_gguf(md, path)
    fields = Fields(md, f"{spec.gguf_arch}.", path, "metadata key")
    return spec, ModelConfig(arch=spec.name, **spec.gguf_in(fields, md))


def gguf_model_config(file: GGUFFile) -> tuple[ArchSpec, ModelConfig]:
    """The spec and the whole config of an open GGUF, from its metadata and tensor table (and
    the few small tensors that carry config: rope_freqs, an architecture's extras); no matrix
    is dequantized."""
    path, md = file.path, file.metadata
    spec, cfg = config_from_metadata(md, path)
    tensors = {t.name: t for t in file.tensors}
    # what the tensors say: QKV biases, an untied output (a copy of the table reads as tied)
    bias = block0_name(spec, "attn.q.bias", "gguf")
    cfg.qkv_bias = cfg.qkv_bias or (bias is not None and bias in tensors)
    cfg.tie_embeddings = True
    if "output.weight" in tensors:
        out, table = tensors["output.weight"], tensors["token_embd.weight"]
        if out.tensor_type == table.tensor_type:  # equal bytes, equal values: no float32 copies
            # the first rows settle an untied pair without reading both tables whole (twice per
            # start: the memory preflight plans from this too)
            cfg.tie_embeddings = (out.data.shape == table.data.shape and np.array_equal(out.data[:1], table.data[:1])
                                  and np.array_equal(out.data, table.data))
        else:
            a, b = dequantize_tensor(out, path), dequantize_tensor(table, path)
            cfg.tie_embeddings = a.shape == b.shape and np.array_equal(a, b)
    if "rope_freqs.weight" in tensors:
        factors = dequantize_tensor(tensors["rope_freqs.weight"], path).reshape(-1)
        cfg.rope_scaling = {"type": "freq_factors", "factors": [float(f) for f in factors]}
    if spec.gguf_extra_in is not None:
        spec.gguf_extra_in(cfg, lambda n: dequantize_tensor(tensors[n], path) if n in tensors else None)
    if spec.fix_config is not None:
        single = {t.ours[0]: tuple(reversed(tensors[t.gguf].shape))
                  for t in spec.tensors if not t.block and t.gguf in tensors}
        spec.fix_config(cfg, single)
    return spec, cfg


def load_gguf(path: str, dtype: mx.Dtype | None = None,
              progress: Callable[[int, int], None] | None = None, quant: QuantPlan | None = None):
    """-> (ModelConfig, {param_name: mx.array | PackedMatrix}, LoadedMeta). Weights in `dtype`
    (default float32), built tensor by tensor from the mapped file (each tensor's pages are
    released once it is built). With `quant`, the matrices it names stay quantized
    (PackedMatrix): Q4_0 / Q4_1 / Q8_0 blocks as they are, other types quantized at load."""
    dtype = dtype or mx.float32
    file = open_gguf(path)
    md = file.metadata
    spec, cfg = gguf_model_config(file)
    tensors = {t.name: t for t in file.tensors}

    def read(name: str) -> np.ndarray:
        return dequantize_tensor(tensors[name], path)

    shapes = expected_shapes(cfg)
    items = expand(spec, cfg, shapes, "gguf")
    missing = [name for name, _, _ in items if name not in tensors]
    if missing:
        raise UserError(f"{path}: missing tensor {missing[0]}"
                        + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    packs = quant.matrices(spec, cfg) if quant is not None else set()
    weights: dict[str, mx.array | PackedMatrix] = {}
    errors: dict[str, float] = {}
    for n, (name, params, _) in enumerate(items):
        exact = affine_bits(tensors[name].tensor_type.name)
        if quant is not None and quant.layout(params[0], shapes[params[0]], packs, exact):
            for param, packed in zip(params, read_packed(tensors[name], params, shapes, quant, errors, path)):
                weights[param] = packed
        else:
            for param, arr in zip(params, split(read(name), params, shapes, name, path)):
                weights[param] = mx.array(np.ascontiguousarray(arr)).astype(dtype)
                mx.eval(weights[param])
        file.release(tensors[name])
        if progress:
            progress(n + 1, len(items))
    types = {name: t.tensor_type.name for name, t in tensors.items()}
    meta = LoadedMeta(source=path, format="gguf", tensor_types=types, metadata=md)
    meta.quantization_errors = errors
    return cfg, weights, meta


def read_packed(tensor, params: list[str], shapes: dict[str, tuple[int, ...]], quant: QuantPlan,
                errors: dict[str, float], path: str) -> list[PackedMatrix]:
    """One GGUF matrix -> our parameters as PackedMatrix: the file's own blocks where they are
    MLX's affine layout, else dequantized to float32 and quantized as `quant` says (its
    relative error recorded in `errors`)."""
    flats = [flat_shape(p, shapes[p]) for p in params]
    rows = sum(f[0] for f in flats)
    want = (rows, flats[0][1])
    have = tuple(reversed(tensor.shape))
    if have != want:
        raise UserError(f"{path}: tensor {tensor.name} has shape {list(have)}, expected {list(want)}")
    blocks = affine_blocks(tensor)
    if blocks is not None:
        w, scales, biases, bits = blocks
        whole = PackedMatrix(w, scales, biases, 32, bits,
                             symmetric=tensor.tensor_type.name in SYMMETRIC_BLOCKS)
    else:
        whole, errors[tensor.name] = quantize_dense(mx.array(dequantize_tensor(tensor, path)), quant)
    mx.eval(whole.weight, whole.scales, whole.biases)
    out, start = [], 0
    for f in flats:
        out.append(whole.rows(start, start + f[0]) if len(flats) > 1 else whole)
        start += f[0]
    return out
