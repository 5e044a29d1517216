"""GGUF files, any architecture: open one, read its key/values, dequantize one tensor exactly.

The reader (`mlxtoy.io.gguf_read`) and the writer (`mlxtoy.io.gguf_write`), which loop over an
architecture's spec (`mlxtoy.arch`), stand on this; it knows no layout of ours.

gguf-py memory-maps the file; each tensor is dequantized on its own (to float32, exactly as
GGML's reference dequantizers do), so a reader never holds the weights twice.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from mlxtoy.errors import UserError

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def gguf_lib():
    """The gguf-py package, imported on first use: only GGUF files need it."""
    import gguf

    return gguf


def open_gguf(path: str):
    if not os.path.exists(path):
        raise UserError(f"{path}: no such file")
    if os.path.isdir(path):
        raise UserError(f"{path}: is a folder, not a GGUF file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise UserError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
    try:
        return gguf_lib().GGUFReader(path, "r")
    except Exception as e:  # gguf-py raises ValueError/IndexError/etc on corrupt files
        raise UserError(f"{path}: corrupt or truncated GGUF ({type(e).__name__}: {e})") from None


def read_metadata(reader) -> dict[str, Any]:
    """GGUF key/values as plain Python (str, int, float, bool, lists)."""
    out: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        try:
            value = field.contents()
        except Exception:
            continue
        if isinstance(value, np.generic):
            value = value.item()
        out[name] = value
    return out


def dequantize_tensor(tensor, path: str) -> np.ndarray:
    """One GGUF tensor -> float32 numpy array with numpy shape (reversed ne)."""
    gguf = gguf_lib()
    qtype = tensor.tensor_type
    if qtype.name not in SUPPORTED_TYPES:
        raise UserError(f"{path}: tensor {tensor.name} has unsupported type {qtype.name} "
                        f"(supported: {', '.join(SUPPORTED_TYPES)})")
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    try:
        if qtype == gguf.GGMLQuantizationType.F32:
            arr = np.asarray(tensor.data, dtype=np.float32)
        elif qtype == gguf.GGMLQuantizationType.BF16:
            raw = np.asarray(tensor.data).view(np.uint16).astype(np.uint32) << 16
            arr = raw.view(np.float32)
        else:
            arr = gguf.quants.dequantize(tensor.data, qtype)
        return arr.reshape(shape)
    except UserError:
        raise
    except Exception as e:
        raise UserError(f"{path}: cannot read tensor {tensor.name} ({type(e).__name__}: {e})") from None
