"""The kernels' GEMM (gemm.h; AVX-512, or AVX2 and FMA): products against numpy float64 for every
transposition, in both forms, the bits on one thread against two, the linear layer's gradient
through it, and a prefill through it against one through MLX's matmul."""

from __future__ import annotations

import io
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import mlxtoy  # noqa: F401  (fast BLAS before mlx.core)
import mlx
import mlx.core as mx
import mlxtoy_kernels as K

from mlxtoy.generate import generate_tokens
from mlxtoy.models import fastmath
from mlxtoy.models import prefill as prefill_module
from test_generate import tiny_model
from test_kernels import run_py

pytestmark = pytest.mark.kernels  # the kernels themselves: skipped under MLXTOY_KERNELS=0 (conftest)
needs_gemm = pytest.mark.skipif(not K.gemm_ok(), reason="the GEMM kernel needs a CPU with AVX-512, or AVX2 and FMA")
REPO = Path(__file__).resolve().parent.parent


def ref(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    K_ = x.shape[-1]
    y = x.astype(np.float64).reshape(-1, K_) @ w.astype(np.float64).reshape(-1, K_).T
    return y.reshape(*x.shape[:-1], *w.shape[:-1])


def graph(*outputs: mx.array) -> str:
    f = io.StringIO()
    mx.export_to_dot(f, *outputs)
    return f.getvalue()


@needs_gemm
@pytest.mark.parametrize("M", [1, 5, 31, 32, 33, 129, 300])  # one panel short, exact, over; over a chunk of 128
def test_gemm_many_vs_numpy(M):
    r = np.random.default_rng(M)
    K_ = 577  # odd: no vector tail in k is assumed
    # rows of w: fewer than a tile, a tile and one over, many tiles with a tail
    ws = [(r.standard_normal((n, K_)) / np.sqrt(K_)).astype(np.float32) for n in (1, 13, 601)]
    x = r.standard_normal((M, K_)).astype(np.float32)
    ys = K.gemm_many(mx.array(x), [mx.array(w) for w in ws])
    for y, w in zip(ys, ws):
        assert y.shape == (M, w.shape[0])
        np.testing.assert_allclose(np.array(y), ref(x, w), rtol=0, atol=2e-5)


@needs_gemm
def test_gemm_many_head_shaped_weights_and_strided_x():
    r = np.random.default_rng(7)
    w3 = (r.standard_normal((3, 16, 96)) / 10).astype(np.float32)  # (heads, d_head, K)
    xt = r.standard_normal((96, 2, 40)).astype(np.float32)
    x = mx.array(xt).transpose(1, 2, 0)  # (2, 40, 96), not row-contiguous: copied before the packing
    y = K.gemm_many(x, [mx.array(w3)])[0]
    assert y.shape == (2, 40, 3, 16)
    np.testing.assert_allclose(np.array(y), ref(xt.transpose(1, 2, 0), w3), rtol=0, atol=2e-5)
    with pytest.raises(ValueError, match=r"^\[mlxtoy_kernels\]"):  # gemv_many's checks
        K.gemm_many(x, [mx.zeros((5, 7))])


GEMM_SCRIPT = """
import sys, numpy as np
import mlxtoy, mlx.core as mx, mlxtoy_kernels as K
d = dict(np.load(sys.argv[1]))
np.save(sys.argv[2], np.array(K.gemm_many(mx.array(d["x"]), [mx.array(d["w"])])[0]))
"""


@needs_gemm
def test_gemm_many_one_thread_gives_the_same_bits(tmp_path):
    # every output is one tile's sum in k order, whichever thread takes the tile
    r = np.random.default_rng(3)
    d = {"x": r.standard_normal((150, 320)).astype(np.float32), "w": r.standard_normal((500, 320)).astype(np.float32)}
    np.savez(tmp_path / "in.npz", **d)
    run_py(GEMM_SCRIPT, tmp_path / "in.npz", tmp_path / "one.npy", MLXTOY_KERNEL_THREADS="1")
    assert K.threads() > 1
    here = np.array(K.gemm_many(mx.array(d["x"]), [mx.array(d["w"])])[0])
    np.testing.assert_array_equal(np.load(tmp_path / "one.npy"), here)
    np.testing.assert_allclose(here, ref(d["x"], d["w"]), rtol=0, atol=1e-4)  # positive control: right, not merely alike


FORMS_SCRIPT = """
import sys, numpy as np
import mlxtoy, mlx.core as mx, mlxtoy_kernels as K
d = dict(np.load(sys.argv[1]))
out = {}
for i in range(len(d) // 2):
    A, B = d[f"a{i}"], d[f"b{i}"]
    for ta in (0, 1):
        for tb in (0, 1):
            y = K.gemm(mx.array(A.T.copy() if ta else A), mx.array(B.T.copy() if tb else B), bool(ta), bool(tb), False)
            out[f"{i}{ta}{tb}"] = np.array(y)
np.savez(sys.argv[2], **out)
"""


@needs_gemm
def test_the_avx2_form_on_every_transposition_and_thread_count(tmp_path):
    """MLXTOY_KERNEL_AVX512=0 runs the AVX2 form wherever the GEMM runs (on an AVX-512 CPU too, so
    every machine tests it): each transposition against numpy float64, through the blockings it
    has (a panel's and a tile's tails; a chunk of rows and several, which the threads share or
    split between them; a sum long enough to run in blocks), the same bits on one thread as on two."""
    r = np.random.default_rng(5)
    shapes = [(37, 577, 29), (130, 64, 13), (1, 5, 1), (20, 1100, 14), (300, 600, 50), (257, 1030, 7)]
    d = {}
    for i, (M, S, N) in enumerate(shapes):
        d[f"a{i}"] = r.standard_normal((M, S)).astype(np.float32)
        d[f"b{i}"] = r.standard_normal((S, N)).astype(np.float32)
    np.savez(tmp_path / "in.npz", **d)
    run_py(FORMS_SCRIPT, tmp_path / "in.npz", tmp_path / "two.npz", MLXTOY_KERNEL_AVX512="0", MLXTOY_KERNEL_THREADS="2")
    run_py(FORMS_SCRIPT, tmp_path / "in.npz", tmp_path / "one.npz", MLXTOY_KERNEL_AVX512="0", MLXTOY_KERNEL_THREADS="1")
    two, one = np.load(tmp_path / "two.npz"), np.load(tmp_path / "one.npz")
    for i, (M, S, N) in enumerate(shapes):
        want = d[f"a{i}"].astype(np.float64) @ d[f"b{i}"].astype(np.float64)
        for ta in (0, 1):
            for tb in (0, 1):
                key = f"{i}{ta}{tb}"
                np.testing.assert_allclose(two[key], want, rtol=0, atol=2e-5 * np.sqrt(S), err_msg=key)
                np.testing.assert_array_equal(one[key], two[key], err_msg=key)


@needs_gemm
@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("trans_out", [False, True])
def test_gemm_each_transposition_vs_numpy(trans_a, trans_b, trans_out):
    r = np.random.default_rng(11)
    # panel and tile tails, one chunk and more; a sum long enough to run in blocks (the loss's over the vocabulary)
    for M, S, N in [(37, 577, 29), (130, 64, 13), (1, 5, 1), (20, 4099, 14)]:
        A, B = r.standard_normal((M, S)).astype(np.float32), r.standard_normal((S, N)).astype(np.float32)
        y = K.gemm(mx.array(A.T.copy() if trans_a else A), mx.array(B.T.copy() if trans_b else B),
                   trans_a, trans_b, trans_out)
        want = A.astype(np.float64) @ B.astype(np.float64)
        np.testing.assert_allclose(np.array(y), want.T if trans_out else want, rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match=r"^\[mlxtoy_kernels\] gemm"):
        K.gemm(mx.zeros((3, 4)), mx.zeros((5, 6)))
    # empty operands: an empty sum is zeros (as MLX's matmul gives), no rows no output
    np.testing.assert_array_equal(np.array(K.gemm(mx.ones((3, 0)), mx.ones((0, 5)))), np.zeros((3, 5)))
    assert K.gemm(mx.ones((0, 4)), mx.ones((4, 5))).shape == (0, 5)


@needs_gemm
@pytest.mark.parametrize("switch", ["1", "0"])  # the kernels' GEMM, the BLAS
def test_either_route_of_a_product_gives_its_values_laid_out_by_rows(monkeypatch, switch):
    """fastmath.gemm on each route, each transposition: numpy float64's values, and a transposed
    output laid out by rows (the loss by columns reads it; a strided view would be copied whole
    first, which took ~40 ms of each 256-token chunk of SmolLM2's output layer)."""
    monkeypatch.setenv("MLXTOY_GEMM", switch)
    r = np.random.default_rng(12)
    A, B = r.standard_normal((37, 300)).astype(np.float32), r.standard_normal((300, 29)).astype(np.float32)
    want = A.astype(np.float64) @ B.astype(np.float64)
    for trans_a in (False, True):
        for trans_b in (False, True):
            for trans_out in (False, True):
                y = np.asarray(fastmath.gemm(mx.array(A.T.copy() if trans_a else A), mx.array(B.T.copy() if trans_b else B),
                                             trans_a, trans_b, trans_out))
                np.testing.assert_allclose(y, want.T if trans_out else want, rtol=0, atol=1e-4)
                assert y.flags["C_CONTIGUOUS"], (trans_a, trans_b, trans_out)
    # positive control: the check sees a transposed view's layout
    assert not np.asarray((mx.array(A) @ mx.array(B)).T).flags["C_CONTIGUOUS"]


@needs_gemm
def test_fastmath_linear_through_the_gemm_and_its_gradient():
    r = np.random.default_rng(5)
    x = mx.array(r.standard_normal((2, 9, 64)).astype(np.float32))
    w = mx.array(r.standard_normal((70, 64)).astype(np.float32))
    g = r.standard_normal((2, 9, 70))
    y = fastmath.linear(x, w)
    assert "MlxtoyKernel" in graph(y)  # positive control: many rows took the kernel
    np.testing.assert_allclose(np.array(y), ref(np.array(x), np.array(w)), rtol=0, atol=2e-5)
    dx, dw = mx.grad(lambda x, w: (fastmath.linear(x, w) * mx.array(g.astype(np.float32))).sum(), argnums=(0, 1))(x, w)
    xs = np.array(x, dtype=np.float64).reshape(-1, 64)
    np.testing.assert_allclose(np.array(dx), (g @ np.array(w, dtype=np.float64)), rtol=0, atol=1e-4)
    np.testing.assert_allclose(np.array(dw), g.reshape(-1, 70).T @ xs, rtol=0, atol=1e-4)
    with fastmath.inference():  # no gradient wanted: the bare kernel, one call for many weights
        ys = fastmath.linear_many(x, [w, w[:10]])
        one = fastmath.linear(x[:, :1], w)  # one row: the GEMV
    np.testing.assert_array_equal(np.array(ys[0]), np.array(y))
    np.testing.assert_array_equal(np.array(ys[1]), np.array(y)[..., :10])
    np.testing.assert_allclose(np.array(one), np.array(y)[:, :1], rtol=0, atol=2e-5)


@needs_gemm
@pytest.mark.parametrize("kind", ["llama-gqa", "qwen2-bias"])
def test_prefill_through_the_gemm_matches_mlx_matmul(monkeypatch, kind):
    model = tiny_model(kind, seed=2)
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, 300, 70)]

    def run() -> tuple[list[int], list[float]]:
        out = list(generate_tokens(model, prompt, max_tokens=6))
        return [t for t, _ in out], [lp for _, lp in out]

    # the prompt op by op, whose products are this test's (not the fused block's prefill, nor its
    # route's measurement)
    monkeypatch.setattr(prefill_module, "PREFILL_FUSED_ROWS", 0)
    calls = []
    gemm_many = K.gemm_many
    monkeypatch.setattr(K, "gemm_many", lambda x, ws: calls.append(x.shape) or gemm_many(x, ws))
    tokens, logprobs = run()
    assert calls and all(s[-2] == 70 for s in calls)  # positive control: the prompt's products took it
    monkeypatch.setenv("MLXTOY_GEMM", "0")
    calls.clear()
    ref_tokens, ref_logprobs = run()
    assert not calls
    assert tokens == ref_tokens
    np.testing.assert_allclose(logprobs, ref_logprobs, rtol=0, atol=1e-4)


def test_the_portable_stubs_build():
    """Where the CPU or compiler has no x86-64 code (macOS on ARM, other Linux CPUs), gemm.h's stubs
    stand in: kernels.cpp must compile with them (the positive control: and without them)."""
    compiler = shutil.which("c++") or shutil.which("g++")
    include = Path(mlx.__path__[0]) / "include"
    src = REPO / "kernels" / "src"
    for flags in (["-DMLXTOY_NO_AVX512"], []):
        r = subprocess.run([compiler, "-std=c++20", "-fsyntax-only", *flags, f"-I{include}", f"-I{src}",
                            str(src / "kernels.cpp")], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
