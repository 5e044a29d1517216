"""The kernels' AVX-512 GEMM of prefill (gemm.h): products against numpy float64, the bits on
one thread against two, where fastmath takes it, and a prefill through it against one through
MLX's matmul."""

from __future__ import annotations

import io

import numpy as np
import pytest

import mlxtoy  # noqa: F401  (fast BLAS before mlx.core)
import mlx.core as mx
import mlxtoy_kernels as K

from mlxtoy.generate import generate_tokens
from mlxtoy.models import fastmath
from test_generate import tiny_model
from test_kernels import run_py

pytestmark = pytest.mark.skipif(not K.gemm_ok(), reason="the prefill GEMM needs a CPU with AVX-512")


def ref(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    K_ = x.shape[-1]
    y = x.astype(np.float64).reshape(-1, K_) @ w.astype(np.float64).reshape(-1, K_).T
    return y.reshape(*x.shape[:-1], *w.shape[:-1])


def graph(*outputs: mx.array) -> str:
    f = io.StringIO()
    mx.export_to_dot(f, *outputs)
    return f.getvalue()


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


def test_fastmath_takes_the_gemm_only_for_inference():
    r = np.random.default_rng(5)
    x, w = mx.array(r.standard_normal((2, 9, 64)).astype(np.float32)), mx.array(r.standard_normal((70, 64)).astype(np.float32))
    assert "MlxtoyKernel" not in graph(fastmath.linear(x, w))  # training: MLX's matmul, whose gradient MLX knows
    with fastmath.inference():
        y = fastmath.linear(x, w)
        ys = fastmath.linear_many(x, [w, w[:10]])
        one = fastmath.linear(x[:, :1], w)
    assert "MlxtoyKernel" in graph(y) and "MlxtoyKernel" in graph(*ys)
    np.testing.assert_allclose(np.array(y), ref(np.array(x), np.array(w)), rtol=0, atol=2e-5)
    np.testing.assert_array_equal(np.array(ys[0]), np.array(y))
    np.testing.assert_array_equal(np.array(ys[1]), np.array(y)[..., :10])
    np.testing.assert_allclose(np.array(one), np.array(y)[:, :1], rtol=0, atol=2e-5)  # the GEMV, for one row


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen2-bias"])
def test_prefill_through_the_gemm_matches_mlx_matmul(monkeypatch, kind):
    model = tiny_model(kind, seed=2)
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, 300, 70)]

    def run() -> tuple[list[int], list[float]]:
        out = list(generate_tokens(model, prompt, max_tokens=6))
        return [t for t, _ in out], [lp for _, lp in out]

    calls = []
    gemm_many = K.gemm_many
    monkeypatch.setattr(K, "gemm_many", lambda x, ws: calls.append(x.shape) or gemm_many(x, ws))
    tokens, logprobs = run()
    assert calls and all(s[-2] == 70 for s in calls)  # positive control: the prompt's products took it
    monkeypatch.setattr(fastmath, "PREFILL_GEMM", False)
    calls.clear()
    ref_tokens, ref_logprobs = run()
    assert not calls
    assert tokens == ref_tokens
    np.testing.assert_allclose(logprobs, ref_logprobs, rtol=0, atol=1e-4)
