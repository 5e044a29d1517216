"""GGUF files, any architecture: open one, read its key/values, dequantize one tensor exactly.

The reader (`mlxtoy.io.gguf_read`) and the writer (`mlxtoy.io.gguf_write`), which loop over an
architecture's spec (`mlxtoy.arch`), stand on this; it knows no layout of ours.

gguf-py memory-maps the file; each tensor is dequantized on its own (to float32, exactly as
GGML's reference dequantizers do), so a reader never holds the weights twice.
"""

from __future__ import annotations

import mmap
import os
import struct
from typing import Any

import numpy as np

from mlxtoy.errors import UserError

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


# GGUF value types -> byte size (strings and arrays are walked)
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 4


class _Walker:
    """Reads the header of a GGUF file, checking every count and length against the bytes
    that are really there before trusting it (a crafted file cannot make us allocate)."""

    def __init__(self, buf, path: str):
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

    def fail(self, what: str) -> UserError:
        return UserError(f"{self.path}: corrupt GGUF header ({what})")

    def take(self, n: int, what: str) -> int:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"{what} runs past the end of the file at byte {self.pos}")
        start = self.pos
        self.pos += n
        return start

    def u32(self, what: str) -> int:
        return struct.unpack_from("<I", self.buf, self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack_from("<Q", self.buf, self.take(8, what))[0]

    def string(self, what: str) -> str:
        n = self.u64(f"length of {what}")
        start = self.take(n, what)
        return bytes(self.buf[start:start + n]).decode("utf-8", errors="replace")

    def value(self, vtype: int, key: str, depth: int = 0) -> Any:
        if vtype in _SCALAR_SIZES:
            start = self.take(_SCALAR_SIZES[vtype], key)
            return self.buf[start:start + _SCALAR_SIZES[vtype]]
        if vtype == _STRING:
            return self.string(key)
        if vtype == _ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                raise self.fail(f"{key}: arrays nested deeper than {MAX_ARRAY_DEPTH}")
            item = self.u32(f"{key} item type")
            count = self.u64(f"{key} length")
            least = _SCALAR_SIZES.get(item, 8)  # a string or array item takes >= 8 bytes
            if count * least > self.size - self.pos:
                raise self.fail(f"{key}: array of {count} items is longer than the file")
            if item in _SCALAR_SIZES:
                self.take(count * least, key)
            elif item == _STRING:  # vocabularies: 100k+ strings, so a tight loop
                pos, buf, size, unpack = self.pos, self.buf, self.size, struct.unpack_from
                for _ in range(count):
                    if pos + 8 > size:
                        break
                    pos += 8 + unpack("<Q", buf, pos)[0]
                    if pos > size:
                        break
                else:
                    self.pos = pos
                    return None
                raise self.fail(f"{key}: a string runs past the end of the file")
            else:
                for _ in range(count):
                    self.value(item, key, depth + 1)
            return None
        raise self.fail(f"{key}: unknown value type {vtype}")


def check_structure(path: str) -> None:
    """Walk the header (key/values, tensor table) and the tensors' data ranges of a GGUF,
    bounding every count and length by the file size; raise UserError naming the key."""
    size = os.path.getsize(path)
    if size < 24:
        raise UserError(f"{path}: truncated GGUF ({size} bytes)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        w = _Walker(buf, path)
        w.take(4, "magic")
        version = w.u32("version")
        if version not in (2, 3):
            raise w.fail(f"version {version}; mlxtoy reads GGUF v2 and v3")
        n_tensors, n_kv = w.u64("tensor count"), w.u64("key count")
        if n_kv * 13 > size or n_tensors * 24 > size:  # the smallest possible entries
            raise w.fail(f"{n_kv} keys and {n_tensors} tensors cannot fit in {size} bytes")
        alignment = 32
        for _ in range(n_kv):
            key = w.string("a key name")
            raw = w.value(w.u32(f"{key} type"), key)
            if key == "general.alignment" and raw is not None and len(raw) == 4:
                alignment = struct.unpack("<I", raw)[0]
        if alignment == 0 or alignment & (alignment - 1):
            raise w.fail(f"general.alignment {alignment} is not a power of two")
        tensors = []
        for _ in range(n_tensors):
            name = w.string("a tensor name")
            n_dims = w.u32(f"{name} dimension count")
            if not 1 <= n_dims <= MAX_DIMS:
                raise w.fail(f"tensor {name} has {n_dims} dimensions")
            dims = [w.u64(f"{name} shape") for _ in range(n_dims)]
            tensors.append((name, dims, w.u32(f"{name} type"), w.u64(f"{name} offset")))
        data_start = -(-w.pos // alignment) * alignment
        sizes = gguf_lib().GGML_QUANT_SIZES
        for name, dims, ttype, offset in tensors:
            n = 1
            for d in dims:
                n *= d
            try:
                block, type_size = sizes[gguf_lib().GGMLQuantizationType(ttype)]
            except (ValueError, KeyError):
                raise w.fail(f"tensor {name} has unknown type {ttype}") from None
            nbytes = n // block * type_size
            if n % block or data_start + offset + nbytes > size:
                raise UserError(f"{path}: truncated GGUF (tensor {name} needs bytes "
                                f"{data_start + offset}..{data_start + offset + nbytes} of {size})")


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
    check_structure(path)
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
