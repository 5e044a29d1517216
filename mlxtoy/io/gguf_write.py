"""Write standard llama.cpp GGUF files (models and LoRA adapters) with gguf-py's GGUFWriter,
for any architecture whose spec (`mlxtoy.arch`) has a GGUF side.

Our per-head weights are already in GGUF's row order (heads concatenated head-major, RoPE rows
as llama.cpp's converter stores them), so writing is the spec's name table: a reshape to
llama.cpp's fused tensors (`blk.N.attn_q.weight` ...) or a row concatenation (GPT-2's
`attn_qkv`), never a permutation. Architecture keys come from the spec's `gguf_out`.

Tensors are converted and written one at a time (header and tensor table first, then the
data), so a model is never held twice in memory. Everything goes to a temporary file in the
target folder that is renamed into place at the end (`mlxtoy.fsutil.atomic_path`): an
interrupted export never leaves a partial file at the target path.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from mlxtoy.arch.registry import SPECS, expected_shapes, spec_of
from mlxtoy.arch.spec import ArchSpec, expand, fuse, rope_kind
from mlxtoy.errors import UserError
from mlxtoy.fsutil import atomic_path
from mlxtoy.io.gguf_file import gguf_lib
from mlxtoy.model_config import ModelConfig
from mlxtoy.models.llama import llama3_rope_freqs

GGUF_DTYPES = ("f32", "f16", "q8_0")


# --------------------------------------------------------------------------- metadata

def _value_types(key: str, value: Any):
    """GGUF (type, sub_type) for a metadata value: llama.cpp checks types strictly, so the
    tokenizer keys get the types llama.cpp's converter writes; anything else is inferred."""
    gguf = gguf_lib()
    T = gguf.GGUFValueType
    known = {
        "tokenizer.ggml.tokens": (T.ARRAY, T.STRING),
        "tokenizer.ggml.merges": (T.ARRAY, T.STRING),
        "tokenizer.ggml.token_type": (T.ARRAY, T.INT32),
        "tokenizer.ggml.scores": (T.ARRAY, T.FLOAT32),
        "tokenizer.ggml.precompiled_charsmap": (T.ARRAY, T.UINT8),
        "tokenizer.ggml.token_type_count": (T.UINT32, None),
        "general.languages": (T.ARRAY, T.STRING),
        "general.tags": (T.ARRAY, T.STRING),
    }
    if key in known:
        return known[key]
    if key.startswith("tokenizer.ggml.") and key.endswith("_token_id"):
        return T.UINT32, None
    return _infer_type(value), _infer_sub_type(value)


def _infer_type(value: Any):
    T = gguf_lib().GGUFValueType
    if isinstance(value, (bool, np.bool_)):
        return T.BOOL
    if isinstance(value, (int, np.integer)):
        return T.UINT32 if 0 <= int(value) < 2**32 else T.INT64
    if isinstance(value, (float, np.floating)):
        return T.FLOAT32
    if isinstance(value, str):
        return T.STRING
    if isinstance(value, (list, tuple, np.ndarray)):
        return T.ARRAY
    raise TypeError(f"cannot store {type(value).__name__} in GGUF metadata")


def _infer_sub_type(value: Any):
    T = gguf_lib().GGUFValueType
    if not isinstance(value, (list, tuple, np.ndarray)):
        return None
    if isinstance(value, np.ndarray):
        return {np.dtype(np.int32): T.INT32, np.dtype(np.uint32): T.UINT32, np.dtype(np.float32): T.FLOAT32,
                np.dtype(np.uint8): T.UINT8, np.dtype(np.int64): T.INT64}.get(value.dtype, T.FLOAT32)
    first = value[0] if len(value) else ""
    if isinstance(first, (bool, np.bool_)):
        return T.BOOL
    if isinstance(first, (int, np.integer)):
        return T.INT32
    if isinstance(first, (float, np.floating)):
        return T.FLOAT32
    return T.STRING


def _plain(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


# Keys we never copy from a source file: the writer re-derives them from the config and the
# tensors it writes (or they describe the source's quantization, not ours).
_SKIP_PREFIXES = ("GGUF.", "split.", "quantize.", "adapter.")
_ARCH_PREFIXES = {s.gguf_arch for s in SPECS.values() if s.gguf_arch}
_SKIP_KEYS = {"general.architecture", "general.type", "general.file_type", "general.quantization_version",
              "general.alignment"}


def carried_metadata(metadata: dict[str, Any] | None, arch: str) -> dict[str, Any]:
    """general.* and tokenizer.* keys (and anything else not architectural) to copy unchanged."""
    out: dict[str, Any] = {}
    for key, value in (metadata or {}).items():
        if key in _SKIP_KEYS or key.startswith(_SKIP_PREFIXES):
            continue
        if key.startswith(f"{arch}.") or key.split(".", 1)[0] in _ARCH_PREFIXES:
            continue
        out[key] = value
    return out


def _add_metadata(writer, metadata: dict[str, Any]) -> None:
    T = gguf_lib().GGUFValueType
    for key, value in metadata.items():
        if value is None:
            continue
        value = _plain(value)
        vtype, sub = _value_types(key, value)
        if vtype == T.ARRAY and len(value) == 0:
            continue  # an empty list carries nothing (and has no element type to write)
        writer.add_key_value(key, list(value) if vtype == T.ARRAY else value, vtype, sub_type=sub)


def rope_freq_factors(cfg: ModelConfig) -> np.ndarray | None:
    """llama.cpp's `rope_freqs` tensor: per-frequency divisors of RoPE's theta, or None.

    llama.cpp rotates by pos * base^(-2i/d) / factor[i]; our RoPE divides positions by
    `freqs` = base^(2i/d) * factor[i], so factor = freqs / base^(2i/d).
    """
    kind = rope_kind(cfg)
    if kind == "longrope" and spec_of(cfg.arch).gguf_extra_out is not None:
        return None  # the spec's own tensors (Phi-3's rope_factors_long / _short)
    if kind not in ("llama3", "freq_factors"):
        if kind not in (None, "linear"):
            raise UserError(f"RoPE scaling {kind!r} has no llama.cpp GGUF equivalent here "
                            "(supported: linear, llama3, GGUF rope_freqs)")
        return None
    dims = cfg.rope_dims or cfg.d_head
    if kind == "freq_factors":
        factors = np.asarray(cfg.rope_scaling["factors"], dtype=np.float32)
    else:
        freqs = np.array(llama3_rope_freqs(dims, cfg.rope_base, cfg.rope_scaling), dtype=np.float64)
        base = cfg.rope_base ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
        factors = (freqs / base).astype(np.float32)
    if factors.shape != (dims // 2,):
        raise UserError(f"RoPE frequency factors: expected {dims // 2} values, got {factors.shape[0]}")
    if not spec_of(cfg.arch).rope_freqs:
        raise UserError(f"{cfg.arch} GGUFs have no rope_freqs tensor; cannot export this RoPE scaling")
    return factors


# --------------------------------------------------------------------------- tensors

def to_numpy(w: mx.array) -> np.ndarray:
    """float32 numpy copy (bf16 has no numpy dtype, so everything goes through float32)."""
    if w.dtype != mx.float32:
        w = w.astype(mx.float32)
    return np.array(w, copy=True)


def gguf_spec(cfg: ModelConfig) -> ArchSpec:
    """The spec of `cfg`, refusing what llama.cpp cannot run."""
    spec = spec_of(cfg.arch)
    if spec.gguf_arch is None:
        raise UserError(spec.no_gguf or f"{cfg.arch} models have no llama.cpp GGUF equivalent")
    if spec.check_gguf is not None:
        spec.check_gguf(cfg)
    return spec


def arch_tensors(cfg: ModelConfig, weights: dict[str, mx.array]
                 ) -> list[tuple[str, Callable[[], np.ndarray], tuple[int, ...]]]:
    """(GGUF name, lazy float32 array in GGUF numpy shape, shape) for every tensor, in
    llama.cpp's converter order (rope_freqs first)."""
    spec = gguf_spec(cfg)
    shapes = expected_shapes(cfg)
    missing = [p for p in shapes if p not in weights]
    if missing:
        raise UserError(f"cannot export: missing parameter {missing[0]}"
                        + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    for param, shape in shapes.items():
        if tuple(weights[param].shape) != shape:
            raise UserError(f"cannot export: parameter {param} has shape "
                            f"{list(weights[param].shape)}, expected {list(shape)}")
    out: list[tuple[str, Callable[[], np.ndarray], tuple[int, ...]]] = []
    factors = rope_freq_factors(cfg)
    if factors is not None:
        out.append(("rope_freqs.weight", lambda f=factors: f, factors.shape))
    for name, arr in (spec.gguf_extra_out(cfg) if spec.gguf_extra_out else {}).items():
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        out.append((name, lambda a=arr: a, arr.shape))
    for name, params, _ in expand(spec, cfg, shapes, "gguf"):
        parts = [weights[p] for p in params]
        shape = tuple(int(n) for n in fuse(parts, params).shape)  # lazy: shapes only, nothing computed
        # built anew when written, not kept
        out.append((name, lambda parts=parts, params=params: to_numpy(fuse(parts, params)), shape))
    return out


def _tensor_type(name: str, shape: tuple[int, ...], dtype: str):
    """GGML type for one tensor: 1-D tensors (norms, biases, rope_freqs) and learned positions
    stay F32 as in llama.cpp's converter; Q8_0 rows must be a multiple of 32 wide, otherwise
    F16 (as its converter does)."""
    Q = gguf_lib().GGMLQuantizationType
    if dtype == "f32" or len(shape) < 2 or name.endswith("_norm.weight") or name == "position_embd.weight":
        return Q.F32
    if dtype == "q8_0" and shape[-1] % 32 == 0:
        return Q.Q8_0
    return Q.F16


def _encode(arr: np.ndarray, qtype) -> np.ndarray:
    gguf = gguf_lib()
    Q = gguf.GGMLQuantizationType
    if qtype == Q.F32:
        return np.ascontiguousarray(arr, dtype=np.float32)
    if qtype == Q.F16:
        return np.ascontiguousarray(arr.astype(np.float16))
    return gguf.quants.quantize(np.ascontiguousarray(arr, dtype=np.float32), qtype)


def _nbytes(shape: tuple[int, ...], qtype) -> int:
    gguf = gguf_lib()
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return math.prod(shape) // block * size


FILE_TYPES = {"f32": 0, "f16": 1, "q8_0": 7}  # llama_ftype: ALL_F32, MOSTLY_F16, MOSTLY_Q8_0


def _check_dtype(dtype: str) -> str:
    d = (dtype or "f32").lower()
    if d not in GGUF_DTYPES:
        raise UserError(f"unknown GGUF dtype {dtype!r} (choose from {', '.join(GGUF_DTYPES)})")
    return d


def _write(path: str, arch: str, kv: Callable[[Any], None], tensors, dtype: str,
           progress: Callable[[int, int], None] | None) -> str:
    gguf = gguf_lib()
    if os.path.isdir(path):
        raise UserError(f"{os.path.abspath(path)}: is a folder (give a file path for the output)")
    with contextlib.ExitStack() as stack:
        try:
            tmp = stack.enter_context(atomic_path(path))
        except OSError as e:
            raise UserError(f"{os.path.abspath(path)}: cannot write here ({e.strerror or e})") from None
        writer = gguf.GGUFWriter(tmp, arch)
        try:
            kv(writer)
            types = []
            for name, _, shape in tensors:
                qtype = _tensor_type(name, shape, dtype)
                types.append(qtype)
                writer.add_tensor_info(name, shape, np.dtype(np.float32), _nbytes(shape, qtype), raw_dtype=qtype)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for n, ((name, load, shape), qtype) in enumerate(zip(tensors, types)):
                data = _encode(load(), qtype)
                writer.write_tensor_data(data)
                del data
                if progress:
                    progress(n + 1, len(tensors))
            writer.flush()
        except OSError as e:
            raise UserError(f"{path}: write failed ({e.strerror or e})") from None
        finally:
            writer.close()
    return path


def write_gguf(path: str, cfg: ModelConfig, weights: dict[str, mx.array], metadata: dict[str, Any] | None = None,
               dtype: str = "f32", name: str | None = None,
               progress: Callable[[int, int], None] | None = None) -> str:
    """Write a llama.cpp model GGUF.

    metadata: GGUF key/values to carry over (the source file's, or `tokenizer.to_gguf_metadata()`
    plus general.*): every tokenizer.* and general.* key is copied unchanged, architecture keys
    are re-derived from `cfg`. dtype: f32 (lossless), f16 or q8_0 (norms and 1-D tensors F32).
    """
    dtype = _check_dtype(dtype)
    gguf = gguf_lib()
    spec = gguf_spec(cfg)
    carried = carried_metadata(metadata, spec.gguf_arch)
    if "tokenizer.ggml.model" not in carried:
        raise UserError("cannot export a GGUF without tokenizer metadata (tokenizer.ggml.*)")
    tensors = arch_tensors(cfg, weights)

    def kv(writer) -> None:
        writer.add_type(gguf.GGUFType.MODEL)
        if name and "general.name" not in carried:
            carried["general.name"] = name
        _add_metadata(writer, {f"{spec.gguf_arch}.{k}": v for k, v in spec.gguf_out(cfg).items()})
        writer.add_file_type(FILE_TYPES[dtype])
        if dtype == "q8_0":
            writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        _add_metadata(writer, carried)

    return _write(path, spec.gguf_arch, kv, tensors, dtype, progress)


def write_lora_gguf(path: str, cfg: ModelConfig, adapters: dict[str, tuple[np.ndarray, np.ndarray]],
                    alpha: float, metadata: dict[str, Any] | None = None, dtype: str = "f32") -> str:
    """Write a llama.cpp LoRA adapter GGUF (what `llama-cli --lora` / `Llama(lora_path=)` load).

    adapters: base GGUF tensor name ('blk.0.attn_q.weight') -> (A (rank, d_in), B (d_out, rank))
    in the base GGUF's row layout. llama.cpp adds (alpha / rank) * B @ A to the base weight,
    rank read from each B; alpha 0 means a scale of exactly 1.
    """
    dtype = _check_dtype(dtype)
    gguf = gguf_lib()
    if not adapters:
        raise UserError("nothing to export: the run has no LoRA adapters")
    tensors = []
    for base, (a, b) in adapters.items():
        a = np.ascontiguousarray(a, dtype=np.float32)
        b = np.ascontiguousarray(b, dtype=np.float32)
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise UserError(f"LoRA pair for {base}: A {list(a.shape)} and B {list(b.shape)} do not chain")
        tensors.append((base + ".lora_a", lambda x=a: x, a.shape))
        tensors.append((base + ".lora_b", lambda x=b: x, b.shape))
    arch = gguf_spec(cfg).gguf_arch
    general = {k: v for k, v in carried_metadata(metadata, arch).items() if k.startswith("general.")}

    def kv(writer) -> None:
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))
        writer.add_file_type(FILE_TYPES[dtype])
        if dtype == "q8_0":
            writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        _add_metadata(writer, general)

    return _write(path, arch, kv, tensors, dtype, None)
