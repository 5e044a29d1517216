"""Our GGUF header walk (mlxtoy.io.gguf_file.read_gguf) against gguf-py's GGUFReader: the same
key/values, as the same Python values, and the same tensor bytes, for every value type GGUF has
and for float, half, bfloat16 and block-quantized tensors written by gguf-py's GGUFWriter."""

from __future__ import annotations

import gguf
import numpy as np

import mlxtoy  # noqa: F401  (fast BLAS before mlx.core)
from mlxtoy.io.gguf_file import dequantize_tensor, open_gguf

T = gguf.GGUFValueType
VALUES = {
    "t.u8": (200, T.UINT8), "t.i8": (-100, T.INT8), "t.u16": (60000, T.UINT16), "t.i16": (-30000, T.INT16),
    "t.u32": (4_000_000_000, T.UINT32), "t.i32": (-2_000_000_000, T.INT32), "t.f32": (0.1, T.FLOAT32),
    "t.bool": (True, T.BOOL), "t.u64": (2**63 + 5, T.UINT64), "t.i64": (-(2**62), T.INT64),
    "t.f64": (0.1, T.FLOAT64), "t.str": ("héllo ▁wörld", T.STRING),
}
ARRAYS = {
    "t.ints": [3, -1, 7], "t.floats": [0.5, -2.25, 1e-5], "t.bools": [True, False, True],
    "t.strs": ["a", "", "ünï", "<|im_end|>"], "t.nested": [[1, 2], [3]],
}


def write(path: str) -> dict[str, np.ndarray]:
    w = gguf.GGUFWriter(path, "llama")
    for key, (value, vtype) in VALUES.items():
        w.add_key_value(key, value, vtype)
    for key, value in ARRAYS.items():
        w.add_array(key, value)
    r = np.random.default_rng(0)
    tensors = {"f32": r.standard_normal((3, 64)).astype(np.float32),
               "f16": r.standard_normal((2, 4, 32)).astype(np.float16),
               "vec": r.standard_normal(96).astype(np.float32)}
    for name, arr in tensors.items():
        w.add_tensor(name, arr)
    q = r.standard_normal((5, 64)).astype(np.float32)
    w.add_tensor("q8", gguf.quants.quantize(q, gguf.GGMLQuantizationType.Q8_0),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    bf = (r.standard_normal((4, 32)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    w.add_tensor("bf16", bf.view(np.uint8), raw_dtype=gguf.GGMLQuantizationType.BF16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {**tensors, "q8": q, "bf16": (bf.astype(np.uint32) << 16).view(np.float32)}


def test_read_gguf_agrees_with_gguf_py_on_every_value_type_and_tensor(tmp_path):
    path = str(tmp_path / "m.gguf")
    originals = write(path)
    ours = open_gguf(path)
    theirs = gguf.GGUFReader(path)
    keys = {k for k in theirs.fields if not k.startswith("GGUF.")}
    assert set(ours.metadata) == keys
    for key in keys - {"t.nested"}:  # gguf-py flattens nested arrays ([[1, 2], [3]] -> [1, 2, 3])
        want = theirs.fields[key].contents()
        want = want.item() if isinstance(want, np.generic) else want
        assert ours.metadata[key] == want and type(ours.metadata[key]) is type(want), key
    # and the values that were written (so the agreement above is not two readers equally wrong)
    for key, (value, vtype) in VALUES.items():
        expected = float(np.float32(value)) if vtype == T.FLOAT32 else value
        assert ours.metadata[key] == expected, key
    assert {k: ours.metadata[k] for k in ARRAYS} == {**ARRAYS, "t.floats": [0.5, -2.25, float(np.float32(1e-5))]}
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, ref in zip(ours.tensors, theirs.tensors):
        assert mine.shape == tuple(ref.shape.tolist()) and mine.tensor_type == ref.tensor_type
        assert mine.data.tobytes() == np.asarray(ref.data).tobytes(), mine.name
        got = dequantize_tensor(mine, path)
        want = originals[mine.name]
        if mine.name == "q8":  # within Q8_0's step of the original, and exactly its dequantization
            np.testing.assert_allclose(got, want, atol=np.abs(want).max() / 100)
            want = gguf.quants.dequantize(gguf.quants.quantize(want, gguf.GGMLQuantizationType.Q8_0),
                                          gguf.GGMLQuantizationType.Q8_0)
        assert got.shape == want.shape and np.array_equal(got, want.astype(np.float32)), mine.name


NATIVE_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def test_native_dequantize_gives_gguf_py_bits_for_every_block_type():
    """The kernels' dequantizer against gguf-py's numpy one, bit for bit, on random blocks:
    every byte random, so the half-precision scales include subnormals, zeros, infinities and
    NaNs, and every packed field takes all its values. A flipped quant bit changes the output
    (positive control), and the types it does not take are refused."""
    import mlxtoy_kernels as K

    r = np.random.default_rng(7)
    for name in NATIVE_TYPES:
        qtype = gguf.GGMLQuantizationType[name]
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        assert K.dequantizes(int(qtype))
        data = r.integers(0, 256, (3000, type_size), dtype=np.uint8)
        # half the blocks with tame scales (finite, normal), so most values are finite numbers
        tame = r.standard_normal((1500, 2)).astype(np.float16).view(np.uint8)  # (1500, 4): two halves a block
        if name == "Q6_K":  # the scale d is the last two bytes
            data[:1500, -2:] = tame[:, :2]
        else:
            data[:1500, :2] = tame[:, :2]
            if name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K"):  # the min / dmin
                data[:1500, 2:4] = tame[:, 2:]
        with np.errstate(invalid="ignore", over="ignore"):  # the random scales include inf and NaN
            want = gguf.quants.dequantize(data, qtype).reshape(-1)
        got = K.dequantize(data.reshape(-1), int(qtype), data.shape[0] * block_size)
        assert got.dtype == np.float32 and got.shape == want.shape
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=name)
        assert np.isfinite(got).mean() > 0.4  # the comparison covered real numbers
        flipped = data.copy()
        flipped[0, -1] ^= 0x10  # a bit of a quant (Q6_K: of its scale d's half)
        assert not np.array_equal(K.dequantize(flipped.reshape(-1), int(qtype), got.size), got)
    for name in ("Q2_K", "Q3_K", "F16", "IQ4_NL"):
        assert not K.dequantizes(int(gguf.GGMLQuantizationType[name]))
    try:
        K.dequantize(np.zeros(35, np.uint8), int(gguf.GGMLQuantizationType.Q8_0), 32)  # not whole blocks
    except ValueError as e:
        assert "35 bytes" in str(e)
    else:
        raise AssertionError("a ragged buffer was accepted")


def test_process_exits_cleanly_after_native_dequantize_and_kernel_attention():
    """Dequantizing on Python's thread, then attention and decoding on MLX's stream thread, then
    exit: the process ends with status 0 every time (an OpenMP team started from both threads
    made libiomp's shutdown crash in about a third of such runs)."""
    import subprocess
    import sys

    code = ("import numpy as np, mlxtoy, mlx.core as mx, mlxtoy_kernels as K\n"
            "w = K.dequantize(np.random.default_rng(0).integers(0, 127, 34 * 4096, dtype=np.uint8), 8, 32 * 4096)\n"
            "q = mx.random.normal((1, 2, 64, 16)); k = mx.random.normal((1, 2, 64, 16))\n"
            "mx.eval(K.attention(q, k, k, mx.zeros((1, 64, 64)), 0.25)[0] + mx.array(w).sum())\n")
    for _ in range(8):
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
