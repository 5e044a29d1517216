"""GGUF files, any architecture: open one, read its key/values, dequantize one tensor exactly.

The reader (`mlxtoy.io.gguf_read`) and the writer (`mlxtoy.io.gguf_write`), which loop over an
architecture's spec (`mlxtoy.arch`), stand on this; it knows no layout of ours.

The header is walked here (every count bounded by the file size) and the file memory-mapped;
each tensor is dequantized on its own (to float32, exactly as GGML's reference dequantizers
do), so a reader never holds the weights twice: the common block types by the compiled kernels
(`mlxtoy_kernels.dequantize`, threaded, the same values), the rest by gguf-py.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from mlxtoy import backend, cpublas
from mlxtoy.errors import UserError

# the compiled kernels dequantize the common block types natively (threaded); else gguf-py
mlxtoy_kernels = backend.cpu_kernels()[0]

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


# GGUF value types -> struct format, which numpy reads as a dtype too (strings and arrays are walked)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_SCALAR_SIZES = {t: struct.calcsize(f) for t, f in _SCALARS.items()}
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
        return self.buf[start:start + n].decode("utf-8", errors="replace")

    def value(self, vtype: int, key: str, depth: int = 0) -> Any:
        if vtype in _SCALARS:
            return struct.unpack_from(_SCALARS[vtype], self.buf, self.take(_SCALAR_SIZES[vtype], key))[0]
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
            if item in _SCALARS:
                start = self.take(count * least, key)
                return np.frombuffer(self.buf, np.dtype(_SCALARS[item]), count, start).tolist()
            if item == _STRING:  # vocabularies: 100k+ strings, so a tight loop
                pos, buf, size, unpack = self.pos, self.buf, self.size, struct.unpack_from
                out = []
                for _ in range(count):
                    if pos + 8 > size:
                        break
                    n = unpack("<Q", buf, pos)[0]
                    if pos + 8 + n > size:
                        break
                    out.append(buf[pos + 8:pos + 8 + n].decode("utf-8", errors="replace"))
                    pos += 8 + n
                else:
                    self.pos = pos
                    return out
                raise self.fail(f"{key}: a string runs past the end of the file")
            return [self.value(item, key, depth + 1) for _ in range(count)]
        raise self.fail(f"{key}: unknown value type {vtype}")


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # GGML order (ne): the innermost dimension first
    tensor_type: Any  # gguf.GGMLQuantizationType
    data: np.ndarray  # the raw bytes, uint8 (rows..., bytes a row), a view of the mapped file
    offset: int = 0  # of its first byte in the file


@dataclass
class GGUFFile:
    path: str
    metadata: dict[str, Any]  # key -> str, int, float, bool or a list of them
    tensors: list[GGUFTensor]
    mapping: mmap.mmap | None = None  # what the tensors' bytes are views of

    def release(self, tensor: GGUFTensor) -> None:
        """Drop the tensor's pages from this process's resident set (they stay in the page
        cache): a streaming load then holds only what it built, not the file it read."""
        if self.mapping is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = tensor.offset - tensor.offset % mmap.PAGESIZE
        try:
            self.mapping.madvise(mmap.MADV_DONTNEED, start, tensor.offset + tensor.data.nbytes - start)
        except (OSError, ValueError):
            pass


def read_gguf(path: str) -> GGUFFile:
    """The key/values and tensor table of a GGUF, with each tensor's bytes as a view of the
    memory-mapped file (nothing is read until used). Every count, length and data range is
    bounded by the file size first; a bad one raises UserError naming the key or tensor.
    (gguf-py's GGUFReader builds numpy views per vocabulary entry, which dominated a load.)"""
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
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = w.string("a key name")
            metadata[key] = w.value(w.u32(f"{key} type"), key)
        alignment = metadata.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise w.fail(f"general.alignment {alignment} is not a power of two")
        table = []
        for _ in range(n_tensors):
            name = w.string("a tensor name")
            n_dims = w.u32(f"{name} dimension count")
            if not 1 <= n_dims <= MAX_DIMS:
                raise w.fail(f"tensor {name} has {n_dims} dimensions")
            dims = tuple(w.u64(f"{name} shape") for _ in range(n_dims))
            table.append((name, dims, w.u32(f"{name} type"), w.u64(f"{name} offset")))
        data_start = -(-w.pos // alignment) * alignment
    gguf = gguf_lib()
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    data = np.frombuffer(mapping, dtype=np.uint8)  # slices of a memmap cost ~1 us each
    tensors = []
    for name, dims, ttype, offset in table:
        try:
            qtype = gguf.GGMLQuantizationType(ttype)
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise w.fail(f"tensor {name} has unknown type {ttype}") from None
        if dims[0] % block:
            raise w.fail(f"tensor {name}: rows of {dims[0]} are not whole {qtype.name} blocks of {block}")
        nbytes = math.prod(dims) // block * type_size
        if data_start + offset + nbytes > size:
            raise UserError(f"{path}: truncated GGUF (tensor {name} needs bytes "
                            f"{data_start + offset}..{data_start + offset + nbytes} of {size})")
        rows = tuple(reversed(dims[1:])) + (dims[0] // block * type_size,)
        raw = data[data_start + offset:data_start + offset + nbytes].reshape(rows)
        tensors.append(GGUFTensor(name, dims, qtype, raw, data_start + offset))
    return GGUFFile(path, metadata, tensors, mapping)


def gguf_lib():
    """The gguf-py package, imported on first use: only GGUF files need it."""
    import gguf

    return gguf


def open_gguf(path: str) -> GGUFFile:
    if not os.path.exists(path):
        raise UserError(f"{path}: no such file")
    if os.path.isdir(path):
        raise UserError(f"{path}: is a folder, not a GGUF file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise UserError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
    return read_gguf(path)


def dequantize_tensor(tensor: GGUFTensor, path: str) -> np.ndarray:
    """One GGUF tensor -> float32 numpy array with numpy shape (reversed ne)."""
    gguf = gguf_lib()
    qtype = tensor.tensor_type
    if qtype.name not in SUPPORTED_TYPES:
        raise UserError(f"{path}: tensor {tensor.name} has unsupported type {qtype.name} "
                        f"(supported: {', '.join(SUPPORTED_TYPES)})")
    shape = tuple(reversed(tensor.shape))
    try:
        if qtype == gguf.GGMLQuantizationType.F32:
            arr = tensor.data.view(np.float32)
        elif qtype == gguf.GGMLQuantizationType.BF16:
            raw = tensor.data.view(np.uint16).astype(np.uint32) << 16
            arr = raw.view(np.float32)
        elif mlxtoy_kernels is not None and mlxtoy_kernels.dequantizes(int(qtype)):
            arr = mlxtoy_kernels.dequantize(tensor.data.reshape(-1), int(qtype), math.prod(shape))
        else:
            arr = gguf.quants.dequantize(tensor.data, qtype)
        return arr.reshape(shape)
    except UserError:
        raise
    except Exception as e:
        raise UserError(f"{path}: cannot read tensor {tensor.name} ({type(e).__name__}: {e})") from None


# GGUF block types whose values are exactly MLX's affine form scale * q + bias per group of 32
# (q unsigned): type -> (bits, bytes a block).
AFFINE_BLOCKS = {"Q4_0": (4, 18), "Q4_1": (4, 20), "Q8_0": (8, 34)}
# blocks whose bias is -2^(bits - 1) scales in that layout (no offset of their own)
SYMMETRIC_BLOCKS = ("Q4_0", "Q8_0")


def affine_bits(type_name: str) -> int | None:
    """The bits of a GGML type whose blocks are MLX's affine layout as they are (group 32), else None."""
    kind = AFFINE_BLOCKS.get(type_name)
    return kind[0] if kind else None


def affine_blocks(tensor: GGUFTensor) -> tuple[mx.array, mx.array, mx.array, int] | None:
    """A Q4_0 / Q4_1 / Q8_0 tensor as MLX's affine quantized layout, group size 32, with no
    re-quantization: (packed uint32 (rows, d_in * bits / 32), scales (rows, d_in / 32),
    biases, bits); None for other types. Q4_0's (q - 8) * d is d * q + (-8 d), Q8_0's signed
    q * d is d * (q + 128) + (-128 d): float16 holds each scale and bias exactly (float32 where
    one would overflow), so dequantizing in float32 gives GGML's values bit for bit."""
    kind = AFFINE_BLOCKS.get(tensor.tensor_type.name)
    if kind is None:
        return None
    bits, size = kind
    raw = np.ascontiguousarray(tensor.data).reshape(-1)
    d_in = tensor.shape[0]
    rows = raw.size // (d_in // 32 * size)
    if mlxtoy_kernels is not None:  # the same values, threaded, straight into MLX arrays
        return mlxtoy_kernels.affine_blocks(raw, int(tensor.tensor_type), rows, d_in)
    blocks = raw.reshape(rows, d_in // 32, size)
    packed = np.empty((rows, d_in * bits // 32), np.uint32)
    scales = np.empty((rows, d_in // 32), np.float16)
    biases = np.empty((rows, d_in // 32), np.float32)
    # numpy lets go of the GIL inside each operation: row ranges convert on all the cores
    workers = min(cpublas.usable_cores() or 1, max(1, rows // 256))
    step = -(-rows // workers)

    def convert(r0: int) -> None:
        r = slice(r0, r0 + step)
        _affine_rows(blocks[r], tensor.tensor_type.name, bits, packed[r], scales[r], biases[r])

    if workers == 1:
        convert(0)
    else:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(convert, range(0, rows, step)))
    half = biases.astype(np.float16)
    if np.all(np.isfinite(half)):
        return mx.array(packed), mx.array(scales), mx.array(half), bits
    return mx.array(packed), mx.array(scales.astype(np.float32)), mx.array(biases), bits


def _affine_rows(blocks: np.ndarray, type_name: str, bits: int, packed: np.ndarray, scales: np.ndarray,
                 biases: np.ndarray) -> None:
    """`affine_blocks` for rows of blocks (rows, d_in / 32, block bytes), into the given rows
    of its outputs."""
    rows = blocks.shape[0]
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    scales[...] = d
    if type_name == "Q8_0":
        q = blocks[..., 2:] ^ np.uint8(0x80)  # int8 q + 128, as unsigned bytes
        biases[...] = d.astype(np.float32) * -128.0
    else:
        qs = blocks[..., 4:] if type_name == "Q4_1" else blocks[..., 2:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # element j low nibble, j + 16 high
        if type_name == "Q4_1":
            biases[...] = blocks[..., 2:4].copy().view(np.float16)[..., 0]
        else:
            biases[...] = d.astype(np.float32) * -8.0
    q = q.reshape(rows, -1)
    if bits == 4:  # MLX packs element k of a word at bits 4k: little-endian bytes of two nibbles
        q = q[:, 0::2] | (q[:, 1::2] << 4)
    packed[...] = np.ascontiguousarray(q).view("<u4")
