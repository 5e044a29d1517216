"""The compiled float32 CPU kernels (`mlxtoy_kernels`, built from kernels/) against references
outside them: numpy float64 formulas, MLX's own ops and autodiff, and the pure-MLX fallback
(MLXTOY_KERNELS=0, in a subprocess since the switch is read at import)."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import numpy as np
import pytest

import mlxtoy  # noqa: F401  (fast BLAS before mlx.core)
import mlx.core as mx
import mlx.nn as nn
import mlxtoy_kernels as K
from mlx.utils import tree_flatten

from mlxtoy import backend
from mlxtoy.models import attention, fastmath

pytestmark = pytest.mark.kernels  # the kernels themselves: skipped under MLXTOY_KERNELS=0 (conftest)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NEG_INF = -np.inf
f64 = np.float64


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def arr(a) -> mx.array:
    return mx.array(np.asarray(a, dtype=np.float32))


def np_(a: mx.array) -> np.ndarray:
    return np.array(a, dtype=f64)


def run_py(code: str, *args, timeout: float = 60, **env) -> subprocess.CompletedProcess:
    """Run `code` (with argv `args`) in a fresh interpreter: the repo as cwd, `env` added."""
    proc = subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=REPO, env=os.environ | env,
                          capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def uses_kernel(*outputs: mx.array) -> bool:
    """Whether the graph of `outputs` holds one of the kernels' primitives."""
    f = io.StringIO()
    mx.export_to_dot(f, *outputs)
    return "MlxtoyKernel" in f.getvalue()


# --- softmax(s + bias) -----------------------------------------------------------------------

def ref_softmax_bias(s: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """float64 softmax(s + bias) over the last axis, bias (1|B, T, S) broadcast over s's middle
    dims; fully masked rows are zeros."""
    b = bias.reshape(bias.shape[:1] + (1,) * (s.ndim - 3) + bias.shape[1:])
    x = s.astype(f64) + b
    m = x.max(axis=-1, keepdims=True)
    dead = m == NEG_INF
    e = np.exp(x - np.where(dead, 0.0, m))
    e = np.where(x == NEG_INF, 0.0, e)
    return np.where(dead, 0.0, e / np.where(dead, 1.0, e.sum(axis=-1, keepdims=True)))


def mask_bias(allowed: np.ndarray) -> np.ndarray:
    return np.where(allowed, 0.0, NEG_INF).astype(np.float32)


def causal(T: int, S: int) -> np.ndarray:
    """The last T of S positions see everything up to themselves (a KV cache's prefix)."""
    return np.arange(S)[None, :] <= np.arange(T)[:, None] + (S - T)


def check_softmax(s: np.ndarray, bias: np.ndarray) -> np.ndarray:
    p = np_(K.softmax_bias(arr(s), arr(bias)))
    ref = ref_softmax_bias(s, bias)
    assert p.shape == s.shape
    np.testing.assert_allclose(p, ref, rtol=0, atol=1e-6)
    # masked entries exactly 0; the others positive (moderate scores: no underflow), rows sum to 1
    masked = np.broadcast_to(bias.reshape(bias.shape[:1] + (1,) * (s.ndim - 3) + bias.shape[1:]), s.shape) == NEG_INF
    assert (p[masked] == 0).all()
    assert (p[~masked] > 0).all()
    live = ~masked.all(axis=-1)
    np.testing.assert_allclose(p.sum(-1)[live], 1.0, atol=2e-6)
    return p


def test_softmax_bias_causal():
    r = rng(0)
    for T, S in ((64, 64), (5, 37)):  # square causal, and the last 5 of 37 positions (a cache)
        s = 3 * r.standard_normal((2, 4, T, S))  # 512 rows of 64: split over threads
        check_softmax(s, mask_bias(causal(T, S))[None])


def test_softmax_bias_block_causal_per_batch():
    r = rng(1)
    T = 48
    seg = np.array([[0] * 20 + [1] * 28, [0] * 7 + [1] * 30 + [2] * 11])
    allowed = (seg[:, :, None] == seg[:, None, :]) & causal(T, T)[None]  # (2, T, T)
    s = 3 * r.standard_normal((2, 3, T, T))
    p = check_softmax(s, mask_bias(allowed))
    # positive control: each batch used its own bias (batch 0's lets token 10 see token 5)
    assert (p[1, :, 10, 5] == 0).all() and (p[0, :, 10, 5] > 0).all()


def test_softmax_bias_sliding_window():
    r = rng(2)
    T, W = 40, 6
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    allowed = (j <= i) & (i - j < W)  # leading and trailing masked runs
    check_softmax(3 * r.standard_normal((1, 2, T, T)), mask_bias(allowed)[None])


def test_softmax_bias_broadcast_batch_and_head_dims():
    r = rng(3)
    B, KV, G, T, S = 3, 2, 3, 9, 13
    s = 3 * r.standard_normal((B, KV, G, T, S))
    check_softmax(s, mask_bias(causal(T, S))[None])  # bias batch 1 over B = 3


def test_softmax_bias_fully_masked_row_is_zero():
    r = rng(4)
    T = 8
    allowed = causal(T, T).copy()
    allowed[3] = False  # row 3 sees nothing
    allowed[5, :2] = False  # row 5 masked at its start
    s = r.standard_normal((2, 1, T, T))
    p = check_softmax(s, mask_bias(allowed)[None])
    assert (p[:, :, 3] == 0).all()
    # positive control: MLX's own softmax gives NaN there, the other rows agree with it
    q = np_(mx.softmax(arr(s) + arr(mask_bias(allowed))[None], axis=-1))
    assert np.isnan(q[:, :, 3]).all()
    np.testing.assert_allclose(np.delete(p, 3, axis=2), np.delete(q, 3, axis=2), atol=1e-6)


# --- softmax gradient ------------------------------------------------------------------------

def test_softmax_grad():
    r = rng(5)
    T = 64
    x = arr(3 * r.standard_normal((2, 4, T, T)))
    bias = arr(mask_bias(causal(T, T)))
    dp = arr(r.standard_normal((2, 4, T, T)))
    p = mx.softmax(x + bias, axis=-1)  # zero tails: the kernel skips them
    ds = np_(K.softmax_grad(p, dp))
    pn, dpn = np_(p), np_(dp)
    ref = pn * (dpn - (pn * dpn).sum(-1, keepdims=True))
    np.testing.assert_allclose(ds, ref, rtol=0, atol=1e-6)
    # MLX's autodiff of its own softmax
    _, (vjp,) = mx.vjp(lambda x: mx.softmax(x + bias, axis=-1), [x], [dp])
    np.testing.assert_allclose(ds, np_(vjp), rtol=0, atol=2e-6)
    assert np.abs(ref).max() > 0.1  # positive control: not a trivially zero gradient


# --- cross-entropy by columns ---------------------------------------------------------------

def ce_inputs(V: int = 5003, N: int = 37, seed: int = 6):
    r = rng(seed)
    logits = (4 * r.standard_normal((V, N))).astype(np.float32)
    t = r.integers(0, V, N)
    t[0], t[-1] = 0, V - 1
    t[5] = logits[:, 5].argmax()  # a confident token: small ce
    return logits, t.astype(np.int32)


def ref_ce(logits: np.ndarray, t: np.ndarray):
    x = logits.astype(f64)
    m = x.max(axis=0)
    e = np.exp(x - m)
    ce = m + np.log(e.sum(axis=0)) - x[t, np.arange(x.shape[1])]
    d = e / e.sum(axis=0)
    d[t, np.arange(x.shape[1])] -= 1
    return ce, d


def test_cross_entropy_columns():
    logits, t = ce_inputs()
    ce, d = (np_(a) for a in K.cross_entropy_columns(arr(logits), mx.array(t), True))
    (ce_only,) = K.cross_entropy_columns(arr(logits), mx.array(t), False)
    ref, dref = ref_ce(logits, t)
    assert ce.shape == (37,) and d.shape == logits.shape
    np.testing.assert_allclose(ce, ref, rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(d, dref, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(np.array(ce_only), np.array(ce, dtype=np.float32))  # bit-equal
    # the targets at 0 and V-1 took their -1; the d columns sum to 0
    assert dref[0, 0] < -0.5 and dref[-1, -1] < -0.5
    np.testing.assert_allclose(d[[0, -1], [0, -1]], dref[[0, -1], [0, -1]], atol=1e-6)
    np.testing.assert_allclose(d.sum(axis=0), 0.0, atol=1e-5)
    # the float64 reference agrees with MLX's own float32 logsumexp
    mlx_ce = np_(mx.logsumexp(arr(logits), axis=0) - arr(logits)[mx.array(t), mx.arange(37)])
    np.testing.assert_allclose(mlx_ce, ref, rtol=1e-5)


def test_cross_entropy_columns_integer_targets_of_other_types():
    logits, t = ce_inputs(V=301, N=19, seed=7)
    (a,) = K.cross_entropy_columns(arr(logits), mx.array(t), False)
    (b,) = K.cross_entropy_columns(arr(logits), mx.array(t.astype(np.uint32)), False)
    np.testing.assert_array_equal(np.array(a), np.array(b))
    np.testing.assert_allclose(np_(a), ref_ce(logits, t)[0], rtol=2e-6, atol=1e-6)


# --- RMSNorm ---------------------------------------------------------------------------------

EPS = 1e-5


def ref_rms_norm(x, w, g, eps=EPS):
    x, w, g = (a.astype(f64) for a in (x, w, g))
    r = 1 / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    y = w * x * r
    dx = r * w * g - x * r ** 3 * (x * w * g).mean(-1, keepdims=True)
    dw = (g * x * r).reshape(-1, x.shape[-1]).sum(0)
    return y, dx, dw


def rms_inputs(shape=(4, 33, 577), seed=8):  # 132 rows of 577: split over threads
    r = rng(seed)
    x = r.standard_normal(shape) * 2 + 0.3
    w = 1 + 0.1 * r.standard_normal(shape[-1])
    g = r.standard_normal(shape)
    return x, w, g


def test_rms_norm_and_grad_vs_numpy():
    x, w, g = rms_inputs()
    y = np_(K.rms_norm(arr(x), arr(w), EPS))
    dx, dw = (np_(a) for a in K.rms_norm_grad(arr(x), arr(w), arr(g), EPS))
    ry, rdx, rdw = ref_rms_norm(x, w, g)
    np.testing.assert_allclose(y, ry, rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(dx, rdx, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dw, rdw, rtol=1e-5, atol=1e-4)
    # finite differences of the float64 formula confirm the reference gradient itself
    xs, ws, gs = x[0, :2], w, g[0, :2]
    h = 1e-6
    k = 7
    xp, xm = xs.copy(), xs.copy()
    xp[1, k] += h
    xm[1, k] -= h
    fd = ((ref_rms_norm(xp, ws, gs)[0] - ref_rms_norm(xm, ws, gs)[0]) * gs).sum() / (2 * h)
    assert abs(fd - ref_rms_norm(xs, ws, gs)[1][1, k]) < 1e-6


def test_rms_norm_vs_mlx_fast():
    x, w, g = rms_inputs(seed=9)
    xa, wa, ga = arr(x), arr(w), arr(g)
    y = K.rms_norm(xa, wa, EPS)
    np.testing.assert_allclose(np_(y), np_(mx.fast.rms_norm(xa, wa, EPS)), rtol=2e-6, atol=1e-6)
    loss_ref = lambda x, w: (mx.fast.rms_norm(x, w, EPS) * ga).sum()
    dx_ref, dw_ref = mx.grad(loss_ref, argnums=(0, 1))(xa, wa)
    dx, dw = K.rms_norm_grad(xa, wa, ga, EPS)
    np.testing.assert_allclose(np_(dx), np_(dx_ref), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np_(dw), np_(dw_ref), rtol=1e-5, atol=1e-4)
    # fastmath.rms_norm: the kernel (positive control) with the MLX gradient
    loss = lambda x, w: (fastmath.rms_norm(x, w, EPS) * ga).sum()
    assert fastmath.kernels_on() and uses_kernel(fastmath.rms_norm(xa, wa, EPS))
    fdx, fdw = mx.grad(loss, argnums=(0, 1))(xa, wa)
    np.testing.assert_allclose(np_(fdx), np_(dx_ref), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np_(fdw), np_(dw_ref), rtol=1e-5, atol=1e-4)
    # and as a module: fastmath.RMSNorm == nn.RMSNorm
    norm = fastmath.RMSNorm(577, eps=EPS)
    norm.weight = wa
    ref = nn.RMSNorm(577, eps=EPS)
    ref.weight = wa
    np.testing.assert_allclose(np_(norm(xa)), np_(ref(xa)), rtol=2e-6, atol=1e-6)


# --- SwiGLU ----------------------------------------------------------------------------------

def swiglu_inputs(seed=10):
    r = rng(seed)
    a = 4 * r.standard_normal((3, 129, 101))  # 39087 elements: split over threads at an odd offset
    a.flat[:8] = [30.0, -30.0, 88.0, -88.0, 95.0, -95.0, 1e4, -1e4]
    b = r.standard_normal(a.shape)
    g = r.standard_normal(a.shape)
    return a, b, g


def ref_swiglu(a, b, g):
    a, b, g = (x.astype(f64) for x in (a, b, g))
    with np.errstate(over="ignore"):
        s = 1 / (1 + np.exp(-a))
    return a * s * b, g * b * s * (1 + a * (1 - s)), g * a * s


def test_swiglu_vs_numpy():
    a, b, g = swiglu_inputs()
    y = np_(K.swiglu(arr(a), arr(b)))
    da, db = (np_(t) for t in K.swiglu_grad(arr(a), arr(b), arr(g)))
    ry, rda, rdb = ref_swiglu(a, b, g)
    for got, ref in ((y, ry), (da, rda), (db, rdb)):
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, ref, rtol=2e-6, atol=1e-6)
    # the large |a| are in there: silu(30) ~ 30, silu(-30) ~ -30 e^-30
    assert abs(y.flat[0] - 30 * b.flat[0]) < 1e-4 * abs(b.flat[0]) + 1e-6
    assert abs(y.flat[1]) < 1e-10


def test_fastmath_swiglu_gradient():
    a, b, g = swiglu_inputs(seed=11)
    aa, ba, ga = arr(a), arr(b), arr(g)
    assert uses_kernel(fastmath.swiglu(aa, ba))  # positive control: the kernel path
    ours = mx.grad(lambda a, b: (fastmath.swiglu(a, b) * ga).sum(), argnums=(0, 1))(aa, ba)
    ref = mx.grad(lambda a, b: (a * mx.sigmoid(a) * b * ga).sum(), argnums=(0, 1))(aa, ba)
    for o, r in zip(ours, ref):
        np.testing.assert_allclose(np_(o), np_(r), rtol=1e-5, atol=1e-6)


# --- decode GEMV -----------------------------------------------------------------------------

@pytest.mark.parametrize("K_", [577, 603])  # a row's tail of 1 float after 32-float steps; 8-float steps and 3
def test_gemv_vs_numpy(K_):
    r = rng(12)
    N = 1537  # 1537 rows of w: split over threads
    w = r.standard_normal((N, K_)) / np.sqrt(K_)
    alone = None
    for M in (1, 2, 3, 4, 5, 9):  # (one pass of x rows, several, and a pass short of four)
        x = r.standard_normal((M, K_))
        y = np_(K.gemv(arr(x), arr(w)))
        assert y.shape == (M, N)
        np.testing.assert_allclose(y, x.astype(np.float32).astype(f64) @ w.astype(np.float32).astype(f64).T,
                                   rtol=0, atol=2e-5)
        if M == 1:
            alone = (x, y)
        elif K.forms() != "portable":  # a row among others sums as it does alone (AVX-512 or AVX2)
            y1 = np_(K.gemv(arr(np.concatenate([alone[0], x])), arr(w)))
            assert np.array_equal(y1[0], alone[1][0]) and np.array_equal(y1[1:M], y[:M - 1])
    x3 = r.standard_normal((1, 1, K_))
    y3 = np_(K.gemv(arr(x3), arr(w)))
    assert y3.shape == (1, 1, N)
    np.testing.assert_allclose(y3, x3 @ w.T, rtol=0, atol=2e-5)


def test_rows_against_a_packed_matrix_sum_as_they_do_anywhere_in_the_batch():
    """Several rows of x against a packed (lossless) matrix: its rows unpacked, then 4 rows of W
    against 4 rows of x a pass, whose 16 sums are reduced at once, and the tail rows of x (here 3)
    one reduction at a time. A row of x gets the same bits wherever it sits in the batch, and
    float32 sums of float64's products."""
    r = rng(21)
    K_, N = 576, 203  # 203: passes of 4 rows of W and a tail
    levels = r.integers(-127, 128, (N, K_)).astype(np.float32)
    levels[:, ::32] = 127  # each block's largest: d = that / 127, as the packer finds it
    d = r.uniform(1e-3, 1e-2, (N, K_ // 32)).astype(np.float16).astype(np.float32)
    w = np.repeat(d, 32, axis=1) * levels  # a Q8_0 grid (float16 scales): packed losslessly
    x = r.standard_normal((7, K_)).astype(np.float32)
    for form in ("q8", "q8_0"):  # a d per half of 16, float32; Q8_0's own block, float16 d
        packed, ok = K.pack(arr(w), form)
        assert ok.item()
        y = np_(K.gemv_packed(arr(x), packed))
        np.testing.assert_allclose(y, x.astype(f64) @ w.astype(f64).T, rtol=0, atol=2e-5)
        for shift in range(1, 7):  # every row through the 4 x 4 pass and through the tail
            moved = np_(K.gemv_packed(arr(np.roll(x, shift, axis=0)), packed))
            assert np.array_equal(moved, np.roll(y, shift, axis=0))


def test_fastmath_linear_gradient():
    r = rng(13)
    x, w, g = arr(r.standard_normal((1, 1, 96))), arr(r.standard_normal((200, 96)) / 10), arr(r.standard_normal((1, 1, 200)))
    assert uses_kernel(fastmath.linear(x, w))  # one row: the GEMV kernel
    # 5 rows: a GEMM, the kernels' on AVX-512 or AVX2 CPUs (test_gemm.py), else MLX's
    assert uses_kernel(fastmath.linear(arr(r.standard_normal((5, 96))), w)) == fastmath.gemm_on()
    ours = mx.grad(lambda x, w: (fastmath.linear(x, w) * g).sum(), argnums=(0, 1))(x, w)
    ref = mx.grad(lambda x, w: ((x @ w.T) * g).sum(), argnums=(0, 1))(x, w)
    for o, rf in zip(ours, ref):
        assert o.shape == rf.shape
        np.testing.assert_allclose(np_(o), np_(rf), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np_(fastmath.linear(x, w)), np_(x @ w.T), rtol=1e-5, atol=1e-5)


def test_gemv_many_vs_numpy_and_gradient():
    r = rng(20)
    K_ = 577
    ws = [r.standard_normal((n, K_)) / np.sqrt(K_) for n in (1537, 192, 17)]  # rows not a multiple of a chunk
    for M in (1, 3):
        x = r.standard_normal((M, K_))
        ys = K.gemv_many(arr(x), [arr(w) for w in ws])
        assert len(ys) == 3
        for y, w in zip(ys, ws):
            assert y.shape == (M, w.shape[0])
            np.testing.assert_allclose(np_(y), x.astype(np.float32).astype(f64) @ w.astype(np.float32).astype(f64).T,
                                       rtol=0, atol=2e-5)
    # through fastmath: one row takes the kernel (one primitive for all three), five rows GEMMs
    x1, mw = arr(r.standard_normal((1, 1, K_))), [arr(w) for w in ws]
    assert uses_kernel(*fastmath.linear_many(x1, mw))
    assert uses_kernel(*fastmath.linear_many(arr(r.standard_normal((5, K_))), mw)) == fastmath.gemm_on()
    gs = [arr(r.standard_normal((1, 1, w.shape[0]))) for w in ws]
    loss = lambda f: lambda x, a, b, c: sum((y * g).sum() for y, g in zip(f(x, [a, b, c]), gs))
    ours = mx.grad(loss(fastmath.linear_many), argnums=(0, 1, 2, 3))(x1, *mw)
    ref = mx.grad(loss(lambda x, ws: [x @ w.T for w in ws]), argnums=(0, 1, 2, 3))(x1, *mw)
    for o, rf in zip(ours, ref):
        assert o.shape == rf.shape
        np.testing.assert_allclose(np_(o), np_(rf), rtol=1e-5, atol=1e-5)


def test_gemv_many_per_head_weights_give_head_shaped_outputs_and_gradients():
    r = rng(24)
    K_ = 96
    w3 = [arr(r.standard_normal((h, 16, K_)) / np.sqrt(K_)) for h in (6, 2)]  # (heads, d_head, K)
    w2 = arr(r.standard_normal((40, K_)) / np.sqrt(K_))
    x = arr(r.standard_normal((1, 1, K_)))
    ys = K.gemv_many(x, [*w3, w2])
    assert [y.shape for y in ys] == [(1, 1, 6, 16), (1, 1, 2, 16), (1, 1, 40)]
    for y, w in zip(ys, [*w3, w2]):
        want = (np_(x).reshape(1, K_) @ np_(w).reshape(-1, K_).T).reshape(y.shape)
        np.testing.assert_allclose(np_(y), want, rtol=0, atol=2e-5)
    # fastmath.linear_many: the kernel for one row, the reshaped GEMM for many; the same values and gradients
    ref = lambda x, ws: [(x @ w.reshape(-1, K_).T).reshape(*x.shape[:-1], *w.shape[:-1]) for w in ws]
    for xs in (x, arr(r.standard_normal((2, 5, K_)))):
        gs = [arr(r.standard_normal((*xs.shape[:-1], *w.shape[:-1]))) for w in w3]
        loss = lambda f: lambda x, a, b: sum((y * g).sum() for y, g in zip(f(x, [a, b]), gs))
        ours = mx.grad(loss(fastmath.linear_many), argnums=(0, 1, 2))(xs, *w3)
        theirs = mx.grad(loss(ref), argnums=(0, 1, 2))(xs, *w3)
        for o, t in zip(ours, theirs):
            assert o.shape == t.shape
            np.testing.assert_allclose(np_(o), np_(t), rtol=1e-5, atol=1e-5)
    assert uses_kernel(*fastmath.linear_many(x, w3))  # positive control: one row took the kernel


def ref_decode_attention(q, k, v, bias, scale):
    """float64: each query head h against KV head h // (H / KV); fully masked rows give zeros."""
    B, H, _, _ = q.shape
    group = H // k.shape[1]
    out = np.zeros((B, H, 1, v.shape[-1]))
    for b in range(B):
        row = bias[0 if bias.shape[0] == 1 else b]
        for h in range(H):
            s = scale * (k[b, h // group].astype(f64) @ q[b, h, 0].astype(f64)) + row
            if np.isinf(s).all():
                continue
            p = np.exp(s - s.max())
            out[b, h, 0] = (p / p.sum()) @ v[b, h // group]
    return out


@pytest.mark.parametrize("H, KV, S, D, Dv", [(9, 3, 300, 64, 48), (6, 2, 150, 20, 24), (8, 2, 700, 64, 64),
                                             (4, 2, 90, 128, 80)])
def test_decode_attention_vs_numpy(H, KV, S, D, Dv):
    """GQA groups over the cache in parts of 512 positions (the AVX-512 forms for value rows of
    a multiple of 16 floats, the AVX2 forms for a multiple of 8, 64 columns at a time, the
    portable loops otherwise; keys of 20 floats end in a partial vector), a part's keys all
    masked, whole rows masked."""
    r = rng(21)
    B = 2
    q, k, v = r.standard_normal((B, H, 1, D)), r.standard_normal((B, KV, S, D)), r.standard_normal((B, KV, S, Dv))
    prefix = np.zeros((1, S))
    prefix[:, 201:] = NEG_INF  # a cache filled to 201 of S slots
    holes = np.where(r.random((B, S)) < 0.7, 0.0, NEG_INF)  # per batch row, masked keys inside
    holes[0, :512] = NEG_INF  # (S = 700) a whole part masked
    holes[1] = NEG_INF  # a row with every key masked: zeros
    for bias in (prefix, holes, np.zeros((1, S))):
        got = np_(K.decode_attention(arr(q), arr(k), arr(v), arr(bias), 0.125))
        assert got.shape == (B, H, 1, Dv)
        np.testing.assert_allclose(got, ref_decode_attention(q, k, v, bias, 0.125), rtol=0, atol=2e-6)
    if S < 201:
        return
    # the masked tail is not read: NaN keys there change nothing
    k_nan = k.copy()
    k_nan[:, :, 201:] = np.nan
    same = K.decode_attention(arr(q), arr(k_nan), arr(v), arr(prefix), 0.125)
    np.testing.assert_array_equal(np.array(same), np.array(K.decode_attention(arr(q), arr(k), arr(v), arr(prefix), 0.125)))


def test_fastmath_attention_one_query_uses_kernel_and_matches_mlx():
    r = rng(22)
    q, k, v = arr(r.standard_normal((1, 4, 1, 16))), arr(r.standard_normal((1, 2, 40, 16))), arr(r.standard_normal((1, 2, 40, 16)))
    mask = mx.arange(40)[None, None, None, :] <= 25  # the compiled decoder's mask: a cache filled to 26
    out = attention.attention(q, k, v, 0.25, mask)
    assert uses_kernel(out)
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    np.testing.assert_allclose(np_(out), np_(ref), rtol=0, atol=2e-6)
    g = arr(r.standard_normal((1, 4, 1, 16)))
    ours = mx.grad(lambda q, k, v: (attention.attention(q, k, v, 0.25, mask) * g).sum(), argnums=(0, 1, 2))(q, k, v)
    theirs = mx.grad(lambda q, k, v: (mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask) * g).sum(),
                     argnums=(0, 1, 2))(q, k, v)
    for o, t in zip(ours, theirs):
        np.testing.assert_allclose(np_(o), np_(t), rtol=1e-5, atol=1e-6)


# --- attention over many query positions (training, prefill) ---------------------------------

def ref_block_attention(q, k, v, bias, scale, d_out):
    """float64 attention and its gradient from the formulas, for the kernels' layout: q (B, KV,
    G*T, D) with G query heads stacked per KV head, bias (1|B, T, S) -> out, p, (dq, dk, dv)."""
    GT, T = q.shape[2], bias.shape[1]
    b = np.tile(bias.astype(f64), (1, GT // T, 1))[:, None]  # (1|B, 1, G*T, S)
    s = scale * (q.astype(f64) @ k.astype(f64).swapaxes(-1, -2)) + b
    m = s.max(axis=-1, keepdims=True)
    dead = m == NEG_INF
    e = np.where(s == NEG_INF, 0.0, np.exp(s - np.where(dead, 0.0, m)))
    p = np.where(dead, 0.0, e / np.where(dead, 1.0, e.sum(axis=-1, keepdims=True)))
    out = p @ v.astype(f64)
    dv = p.swapaxes(-1, -2) @ d_out
    dp = d_out @ v.astype(f64).swapaxes(-1, -2)
    ds = p * (dp - (p * dp).sum(axis=-1, keepdims=True))
    return out, p, (scale * ds @ k, scale * ds.swapaxes(-1, -2) @ q, dv)


def check_block_attention(B, KV, G, T, S, D, bias, seed, scale=0.125):
    """The kernels' attention and its gradient against `ref_block_attention`; the stats are each
    row's max and 1 / sum (so logsumexp = max - log(1 / sum)). -> the reference p."""
    r = rng(seed)
    q, k, v = r.standard_normal((B, KV, G * T, D)), r.standard_normal((B, KV, S, D)), r.standard_normal((B, KV, S, D))
    d_out = r.standard_normal((B, KV, G * T, D))
    out, stats = K.attention(arr(q), arr(k), arr(v), arr(bias), scale)
    grads = K.attention_grad(arr(q), arr(k), arr(v), arr(bias), stats, arr(d_out), scale)
    want_out, want_p, want_grads = ref_block_attention(q, k, v, bias, scale, d_out)
    np.testing.assert_allclose(np_(out), want_out, rtol=0, atol=1e-5)
    for got, want in zip(grads, want_grads):
        np.testing.assert_allclose(np_(got), want, rtol=0, atol=2e-5)
    s_ref = scale * (q @ k.swapaxes(-1, -2)) + np.tile(bias.astype(f64), (1, G, 1))[:, None]
    live = np.isfinite(s_ref).any(axis=-1)
    m, inv = np_(stats)[..., 0], np_(stats)[..., 1]
    with np.errstate(divide="ignore", invalid="ignore"):  # the fully masked rows: -inf, 0
        lse = np.log(np.exp(s_ref - np.where(live, s_ref.max(-1), 0)[..., None]).sum(-1)) + s_ref.max(-1)
        np.testing.assert_allclose((m - np.log(inv))[live], lse[live], rtol=0, atol=2e-5)
    assert (m[~live] == NEG_INF).all() and (inv[~live] == 0).all()
    return want_p


def test_block_attention_vs_numpy_causal_gqa_and_cache_prefix():
    # GQA groups of 3 over 2 KV heads; T past one and two row blocks, not a multiple of them
    check_block_attention(2, 2, 3, 150, 150, 16, mask_bias(causal(150, 150))[None], seed=40)
    # the last 70 of 200 positions (a prefill after a cached prefix): every key block is open
    check_block_attention(1, 3, 1, 70, 200, 8, mask_bias(causal(70, 200))[None], seed=41)
    # no mask at all, and an additive bias of finite values (ALiBi-like) with a masked tail
    check_block_attention(2, 1, 2, 33, 33, 8, np.zeros((1, 33, 33), np.float32), seed=42)
    slopes = -0.1 * np.abs(np.arange(33)[None, :] - np.arange(33)[:, None]).astype(np.float32)
    check_block_attention(1, 1, 1, 33, 33, 8, np.where(causal(33, 33), slopes, NEG_INF)[None].astype(np.float32), seed=43)


def test_block_attention_per_batch_masks_and_fully_masked_rows():
    # packed rows: per batch, a block-causal mask; row 0 of batch 1 sees nobody, and no one the
    # keys from 90 (open lengths inside a key block)
    T = 130
    seg = np.stack([np.repeat([0, 1, 2], [40, 60, 30]), np.repeat([0, 1], [100, 30])])
    allowed = (seg[:, :, None] == seg[:, None, :]) & causal(T, T)[None]
    allowed[1, 0] = False
    allowed[:, :, 90:] &= False
    p = check_block_attention(2, 2, 2, T, T, 16, mask_bias(allowed), seed=44)
    assert (p[1, :, 0] == 0).all() and (p[1, :, T] == 0).all()  # the masked row, in both query heads
    assert (p[..., 90:] == 0).all()


def test_block_attention_skips_closed_keys_and_is_the_same_on_one_thread():
    """Keys past a row block's last open one are never read: NaN there changes nothing (a
    positive control: NaN in an open key does). The sums over rows are in a fixed order: one
    kernel thread gives the same bits."""
    r = rng(45)
    T, D = 192, 16
    q, k, v = (arr(r.standard_normal((2, 2, 2 * T, D))) for _ in range(3))
    k, v = k[:, :, :T], v[:, :, :T]
    bias = arr(mask_bias(causal(T, T))[None])
    out, _ = K.attention(q, k, v, bias, 0.25)
    rows = np.r_[0:128, T:T + 128]  # each query head's first two row blocks: they see keys < 128
    for poison_at, changes in ((128, False), (10, True)):
        k_nan = mx.concatenate([k[:, :, :poison_at], mx.full((2, 2, T - poison_at, D), mx.nan)], axis=2)
        got = np.array(K.attention(q, k_nan, v, bias, 0.25)[0])
        assert np.isnan(got[:, :, rows]).any() == changes
        assert np.isnan(got).any()  # the later rows read the poisoned keys
        if not changes:
            np.testing.assert_array_equal(got[:, :, rows], np.array(out)[:, :, rows])
    d_out = arr(r.standard_normal((2, 2, 2 * T, D)))
    code = ("import sys, numpy as np, mlxtoy, mlx.core as mx, mlxtoy_kernels as K\n"
            "a = [mx.array(x) for x in np.load(sys.argv[1]).values()]\n"
            "out, stats = K.attention(a[0], a[1], a[2], a[3], 0.25)\n"
            "np.savez(sys.argv[1], *[np.array(x) for x in [out, stats, *K.attention_grad(a[0], a[1], a[2], a[3], stats, a[4], 0.25)]])")
    results = []
    for threads in ("1", "2"):
        path = os.path.join(REPO, ".pytest-attention-%s.npz" % threads)
        np.savez(path, *[np.array(x) for x in (q, k, v, bias, d_out)])
        try:
            run_py(code, path, MLXTOY_KERNEL_THREADS=threads)
            results.append([x for x in np.load(path).values()])
        finally:
            os.remove(path)
    for one, two in zip(*results):
        np.testing.assert_array_equal(one, two)


def test_fastmath_attention_many_queries_uses_block_kernel_and_matches_mlx():
    """Training's attention (T > 1) is the kernels' block attention, forward and gradient, and
    agrees with mx.fast's (a different implementation) under a causal and a boolean mask."""
    assert attention.block_attention_on()  # CI installs the kernels and MKL or OpenBLAS: the path under test
    r = rng(46)
    q, k, v = arr(r.standard_normal((2, 6, 90, 16))), arr(r.standard_normal((2, 2, 90, 16))), arr(r.standard_normal((2, 2, 90, 16)))
    g = arr(r.standard_normal((2, 6, 90, 16)))
    seg = mx.array(np.stack([np.repeat([0, 1], [50, 40]), np.zeros(90, int)]))  # two documents, one
    for mask in ("causal", (seg[:, None, :, None] == seg[:, None, None, :]) & (mx.arange(90)[:, None] >= mx.arange(90)[None, :])):
        out = attention.attention(q, k, v, 0.25, mask)
        f = io.StringIO()
        mx.export_to_dot(f, out)
        assert "MlxtoyBlockAttention" in f.getvalue()
        ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
        np.testing.assert_allclose(np_(out), np_(ref), rtol=0, atol=5e-6)
        ours = mx.grad(lambda q, k, v: (attention.attention(q, k, v, 0.25, mask) * g).sum(), argnums=(0, 1, 2))(q, k, v)
        theirs = mx.grad(lambda q, k, v: (mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask) * g).sum(),
                         argnums=(0, 1, 2))(q, k, v)
        for o, t in zip(ours, theirs):
            np.testing.assert_allclose(np_(o), np_(t), rtol=1e-5, atol=1e-5)


# --- RoPE and inference mode -------------------------------------------------------------------

def ref_rope(x: np.ndarray, offset: int, dims: int, traditional: bool, scale: float, inv: np.ndarray) -> np.ndarray:
    """RoPE in float64 from its definition: x (B, N, T, D), position (offset + t) * scale."""
    T, half = x.shape[2], dims // 2
    theta = ((np.arange(T) + offset) * scale)[:, None] * inv.astype(f64)[None, :]  # (T, half)
    c, s = np.cos(theta), np.sin(theta)
    a = np.arange(half) * 2 if traditional else np.arange(half)
    b = a + 1 if traditional else a + half
    out = x.astype(f64).copy()
    out[..., a] = x[..., a] * c - x[..., b] * s
    out[..., b] = x[..., a] * s + x[..., b] * c
    return out


def test_rope_vs_mlx_fast_and_numpy():
    r = rng(30)
    x_btnd = r.standard_normal((2, 5, 6, 64))
    xv = arr(x_btnd).transpose(0, 2, 1, 3)  # (B, N, T, D) as attention has it: a strided view
    freqs = arr(10000 ** (np.arange(0, 48, 2) / 48) * (1 + r.random(24)))  # llama3-like custom freqs
    for traditional in (False, True):
        for dims, scale, offset, fr in ((64, 1.0, 0, None), (48, 0.25, 37, None), (48, 1.0, 5, freqs)):
            half = dims // 2
            inv = 1.0 / fr if fr is not None else mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * (np.log(10000.0) / half))
            got = K.rope(xv, mx.array([offset], dtype=mx.int32), inv, dims, traditional, scale)
            ref = mx.fast.rope(xv, dims, traditional=traditional, base=None if fr is not None else 10000.0,
                               scale=scale, offset=offset, freqs=fr)
            np.testing.assert_allclose(np_(got), np_(ref), rtol=0, atol=2e-6)
            want = ref_rope(np_(xv), offset, dims, traditional, scale, np_(inv))
            np.testing.assert_allclose(np_(got), want, rtol=0, atol=2e-5)
            np.testing.assert_array_equal(np.array(got)[..., dims:], np.array(xv)[..., dims:])  # not rotated
            assert np.abs(np_(got) - np_(xv))[..., :dims].max() > 0.1  # positive control: it turned


def test_inference_mode_calls_kernels_bare_with_the_same_values():
    r = rng(31)
    x, w = arr(r.standard_normal((1, 1, 64))), arr(1 + 0.1 * r.standard_normal(64))
    wq = arr(r.standard_normal((48, 64)))
    q, k, v = arr(r.standard_normal((1, 4, 1, 16))), arr(r.standard_normal((1, 2, 9, 16))), arr(r.standard_normal((1, 2, 9, 16)))
    calls = [lambda: fastmath.rms_norm(x, w, EPS), lambda: fastmath.swiglu(x, x), lambda: fastmath.linear(x, wq),
             lambda: fastmath.linear_many(x, [wq, wq])[1], lambda: attention.attention(q, k, v, 0.25, None)]

    def graph(out: mx.array) -> str:
        f = io.StringIO()
        mx.export_to_dot(f, out)
        return f.getvalue()

    for call in calls:
        wrapped = call()
        with fastmath.inference():
            bare = call()
        g_wrapped, g_bare = graph(wrapped), graph(bare)  # before evaluation cuts the graphs
        assert "CustomTransforms" in g_wrapped and "CustomTransforms" not in g_bare
        assert "MlxtoyKernel" in g_bare  # positive control: still the kernel
        np.testing.assert_array_equal(np.array(bare), np.array(wrapped))
    # no gradient inside: the bare kernel has none; outside it the wrapped one does
    with fastmath.inference():
        with pytest.raises((ValueError, RuntimeError)):
            mx.eval(mx.grad(lambda a: fastmath.swiglu(a, x).sum())(x))
    mx.eval(mx.grad(lambda a: fastmath.swiglu(a, x).sum())(x))


def test_inference_mode_is_per_thread_and_restored():
    import threading

    seen = {}
    with fastmath.inference():
        t = threading.Thread(target=lambda: seen.update(other=fastmath.rope_kernel_ok(mx.zeros((1, 1, 1, 8)))))
        t.start()
        t.join()
        seen["here"] = fastmath.rope_kernel_ok(mx.zeros((1, 1, 1, 8)))
    assert seen == {"other": False, "here": True}
    assert not fastmath.rope_kernel_ok(mx.zeros((1, 1, 1, 8)))


def test_rope_module_kernel_matches_mx_fast_for_each_scaling():
    from mlxtoy.model_config import ModelConfig
    from mlxtoy.models.llama import RoPE

    x = arr(rng(32).standard_normal((1, 3, 7, 32)))
    offset = mx.array([11], dtype=mx.int32)
    for extra in ({}, {"rope_traditional": False, "rope_dims": 16},
                  {"rope_scaling": {"type": "linear", "factor": 4.0}},
                  {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 16}}):
        rope = RoPE(ModelConfig(d_model=96, n_heads=3, n_kv_heads=3, d_head=32, **extra))
        outside = rope(x, offset)
        with fastmath.inference():
            inside = rope(x, offset)
        assert uses_kernel(inside) and not uses_kernel(outside)
        np.testing.assert_allclose(np_(inside), np_(outside), rtol=0, atol=3e-6)


# --- optimizer -------------------------------------------------------------------------------

def adamw_inputs(shape=(300, 577), seed=23):
    r = rng(seed)
    p, g, m = (arr(r.standard_normal(shape)) for _ in range(3))
    return p, g, m, mx.abs(arr(r.standard_normal(shape)))


def test_adamw_same_bits_as_mlx_optimizers():
    import mlx.optimizers as optim

    p, g, m, v = adamw_inputs()
    lr, b1, b2, eps, wd = mx.array(3e-4), 0.9, 0.95, 1e-8, 0.1
    opt = optim.AdamW(learning_rate=lr, betas=[b1, b2], eps=eps, weight_decay=wd)
    for scale in (None, mx.array(0.37)):
        state = {"m": m, "v": v}
        ref_p = opt.apply_single(g if scale is None else g * scale, p, state)
        got = fastmath.adamw_step(p, g, m, v, lr, mx.array(True), scale, (b1, b2), eps, wd)
        assert uses_kernel(*got)
        for a, b in zip(got, (ref_p, state["m"], state["v"])):
            np.testing.assert_array_equal(np.array(a), np.array(b))
        assert not np.array_equal(np.array(got[0]), np.array(p))  # positive control: it moved
    # a withheld step gives back the old values, bit for bit
    kept = fastmath.adamw_step(p, g, m, v, lr, mx.array(False), None, (b1, b2), eps, wd)
    for a, b in zip(kept, (p, m, v)):
        np.testing.assert_array_equal(np.array(a), np.array(b))
    # float64 formula
    P, G, M, V = (np_(a) for a in (p, g, m, v))
    M1, V1 = b1 * M + (1 - b1) * G, b2 * V + (1 - b2) * G * G
    ref = P * (1 - 3e-4 * wd) - 3e-4 * M1 / (np.sqrt(V1) + eps)
    got = fastmath.adamw_step(p, g, m, v, lr, mx.array(True), None, (b1, b2), eps, wd)
    np.testing.assert_allclose(np_(got[0]), ref, rtol=1e-6, atol=1e-7)


def test_sum_squares_vs_numpy_and_thread_independent_blocks():
    r = rng(24)
    for n in (1, 1000, (1 << 16) * 3 + 17):
        x = r.standard_normal(n).astype(np.float32)
        got = float(fastmath.sum_squares(arr(x).reshape(-1, 1) if n > 1 else arr(x)))
        assert abs(got - float((x.astype(f64) ** 2).sum())) <= 1e-6 * max(1.0, got)
    assert uses_kernel(fastmath.sum_squares(arr(r.standard_normal((5, 7)))))


def test_guarded_adamw_step_matches_mlx_reference_with_clipping_and_a_withheld_step():
    """The training step through GuardedAdamW (the kernel) against the same step built from
    mlx.optimizers.AdamW, optim.clip_grad_norm and selects (the path other optimizers take)."""
    from mlxtoy.train.step import GuardedAdamW

    r = rng(25)
    params = {"a": arr(r.standard_normal((70, 33))), "b": arr(r.standard_normal((33,)))}
    grads = {"a": arr(5 * r.standard_normal((70, 33))), "b": arr(5 * r.standard_normal((33,)))}
    import mlx.optimizers as optim

    for ok in (True, False):
        ours, ref = GuardedAdamW(learning_rate=1e-2, weight_decay=0.01), optim.AdamW(learning_rate=1e-2, weight_decay=0.01)
        ours.init(params)
        ref.init(params)
        for _ in range(2):  # a second step sees non-zero moments
            gnorm = mx.sqrt(sum(fastmath.sum_squares(g) for g in grads.values()))
            ours.ok, ours.grad_scale = mx.array(ok), mx.minimum(1.0 / (gnorm + 1e-6), 1.0)
            new = ours.apply_gradients(grads, params)
            clipped, _ = optim.clip_grad_norm(grads, 1.0)
            want = ref.apply_gradients(clipped, params) if ok else params
            for k in params:
                np.testing.assert_allclose(np_(new[k]), np_(want[k]), rtol=1e-6, atol=1e-7)
            if ok:
                assert float(mx.abs(new["a"] - params["a"]).max()) > 1e-3  # positive control
            params = new


# --- layouts and validation ------------------------------------------------------------------

def test_non_contiguous_inputs_equal_contiguous_copies():
    r = rng(14)
    same = lambda a, b: np.testing.assert_array_equal(np.array(a), np.array(b))
    copy = lambda a: mx.array(np.array(a))
    T = 16
    st = arr(r.standard_normal((2, 3, T, T))).swapaxes(-1, -2)  # a transposed view
    bias = mx.broadcast_to(arr(mask_bias(causal(T, T)))[None], (2, T, T))  # a broadcast view
    p = K.softmax_bias(st, bias)
    same(p, K.softmax_bias(copy(st), copy(bias)))
    np.testing.assert_allclose(np_(p), ref_softmax_bias(np_(st), np_(bias)), atol=1e-6)
    dp = arr(r.standard_normal((2, 3, T, T))).swapaxes(-1, -2)
    same(K.softmax_grad(p, dp), K.softmax_grad(p, copy(dp)))
    logits, t = ce_inputs(V=257, N=21, seed=15)
    lt = arr(logits.T.copy()).T  # (V, N) view of an (N, V) array
    for x, y in zip(K.cross_entropy_columns(lt, mx.array(t), True), K.cross_entropy_columns(arr(logits), mx.array(t), True)):
        same(x, y)
    xs = arr(r.standard_normal((6, 2 * 577)))[:, ::2]  # strided
    w = arr(1 + 0.1 * r.standard_normal(2 * 577))[::2]
    g = arr(r.standard_normal((577, 6))).T
    same(K.rms_norm(xs, w, EPS), K.rms_norm(copy(xs), copy(w), EPS))
    for x, y in zip(K.rms_norm_grad(xs, w, g, EPS), K.rms_norm_grad(copy(xs), copy(w), copy(g), EPS)):
        same(x, y)
    a, b = arr(r.standard_normal((40, 30))).T, arr(r.standard_normal((30, 40)))
    ga = arr(r.standard_normal((40, 60)))[:, ::2].T
    same(K.swiglu(a, b), K.swiglu(copy(a), b))
    for x, y in zip(K.swiglu_grad(a, b, ga), K.swiglu_grad(copy(a), b, copy(ga))):
        same(x, y)
    wv = arr(r.standard_normal((300, 2 * 577)))[:, 577:]  # rows with a stride
    xv = arr(r.standard_normal((577, 2))).T
    y = K.gemv(xv, wv)
    same(y, K.gemv(copy(xv), copy(wv)))
    np.testing.assert_allclose(np_(y), np_(xv) @ np_(wv).T, atol=2e-5)
    xr = arr(r.standard_normal((1, 3, 4, 32)))[..., ::2]  # D itself strided
    off, inv = mx.array([3], dtype=mx.int32), arr(r.random(8))
    same(K.rope(xr, off, inv, 16, False, 1.0), K.rope(copy(xr), off, inv, 16, False, 1.0))
    xb = mx.broadcast_to(arr(r.standard_normal((1, 1, 1, 16))), (2, 3, 4, 16))  # broadcast rows
    same(K.rope(xb, off, inv, 16, True, 1.0), K.rope(copy(xb), off, inv, 16, True, 1.0))


def test_input_validation():
    f, h = mx.zeros((2, 3, 4, 4)), mx.zeros((2, 3, 4, 4), dtype=mx.float16)
    bias = mx.zeros((1, 4, 4))
    x, w = mx.zeros((3, 8)), mx.ones((8,))
    wg = mx.zeros((5, 8))
    bad = [
        lambda: K.softmax_bias(h, bias),
        lambda: K.softmax_bias(f, bias.astype(mx.float16)),
        lambda: K.softmax_bias(f, mx.zeros((1, 4, 5))),  # S differs
        lambda: K.softmax_bias(f, mx.zeros((3, 4, 4))),  # bias batch neither 1 nor B
        lambda: K.softmax_bias(mx.zeros((4, 4)), mx.zeros((1, 4, 4))),  # s without a batch
        lambda: K.softmax_grad(h, h),
        lambda: K.softmax_grad(f, f[..., :3]),
        lambda: K.cross_entropy_columns(mx.zeros((7, 3), dtype=mx.float16), mx.zeros((3,), dtype=mx.int32), True),
        lambda: K.cross_entropy_columns(mx.zeros((7, 3)), mx.zeros((4,), dtype=mx.int32), False),
        lambda: K.rms_norm(x.astype(mx.float16), w, EPS),
        lambda: K.rms_norm(x, mx.ones((7,)), EPS),
        lambda: K.rms_norm_grad(x, w, mx.zeros((3, 7)), EPS),
        lambda: K.swiglu(x.astype(mx.float16), x.astype(mx.float16)),
        lambda: K.swiglu(x, x[:2]),
        lambda: K.swiglu_grad(x, x, x[:, :4]),
        lambda: K.gemv(x[:1].astype(mx.float16), wg),
        lambda: K.gemv(x[:1], mx.zeros((5, 7))),
        lambda: K.swiglu(mx.array(1.0), mx.array(1.0)),  # 0-d
        lambda: K.softmax_grad(mx.array(1.0), mx.array(1.0)),
        lambda: K.rms_norm(mx.array(1.0), mx.ones((1,)), EPS),
        lambda: K.gemv(mx.array(1.0), mx.ones((2, 2))),
        lambda: K.adamw(x, x, x, x[:2], mx.zeros((9,))),
        lambda: K.adamw(x, x, x, x, mx.zeros((8,))),
        lambda: K.adamw(x.astype(mx.float16), x, x, x, mx.zeros((9,))),
        lambda: K.sum_squares(mx.zeros((0,))),
        lambda: K.gemv_many(x[:1], []),
        lambda: K.gemv_many(x[:1], [wg, mx.zeros((5, 7))]),
        lambda: K.gemv_many(x[:1], [mx.zeros((8,))]),  # a weight needs an output axis
        lambda: K.gemv_many(x[:1], [wg, wg.astype(mx.float16)]),
        lambda: K.decode_attention(mx.zeros((1, 4, 2, 8)), mx.zeros((1, 2, 6, 8)), mx.zeros((1, 2, 6, 8)),
                                   mx.zeros((1, 6)), 1.0),  # two query positions
        lambda: K.decode_attention(mx.zeros((1, 3, 1, 8)), mx.zeros((1, 2, 6, 8)), mx.zeros((1, 2, 6, 8)),
                                   mx.zeros((1, 6)), 1.0),  # 3 heads over 2 KV heads
        lambda: K.decode_attention(mx.zeros((1, 4, 1, 8)), mx.zeros((1, 2, 6, 8)), mx.zeros((1, 2, 6, 8)),
                                   mx.zeros((1, 5)), 1.0),  # bias length
        lambda: K.decode_attention(mx.zeros((1, 4, 1, 8)), mx.zeros((1, 2, 6, 8)), mx.zeros((1, 2, 5, 8)),
                                   mx.zeros((1, 6)), 1.0),  # v's positions
        lambda: K.rope(mx.zeros((1, 2, 3, 8)), mx.array([0], dtype=mx.int32), mx.ones((3,)), 7, False, 1.0),  # odd
        lambda: K.rope(mx.zeros((1, 2, 3, 8)), mx.array([0], dtype=mx.int32), mx.ones((5,)), 10, False, 1.0),  # > D
        lambda: K.rope(mx.zeros((1, 2, 3, 8)), mx.array([0], dtype=mx.int32), mx.ones((2,)), 6, False, 1.0),
        lambda: K.rope(mx.zeros((1, 2, 3, 8)), mx.array([0.0]), mx.ones((3,)), 6, False, 1.0),  # float offset
        lambda: K.rope(mx.zeros((2, 3, 8)), mx.array([0], dtype=mx.int32), mx.ones((3,)), 6, False, 1.0),  # 3-d
    ]
    for call in bad:
        with pytest.raises(ValueError, match=r"^\[mlxtoy_kernels\]"):
            mx.eval(call())
    # positive control: the same calls with float32 and matching shapes work
    good = [K.softmax_bias(f, bias), K.softmax_grad(f, f),
            *K.cross_entropy_columns(mx.zeros((7, 3)), mx.zeros((3,), dtype=mx.int32), True),
            K.rms_norm(x, w, EPS), *K.rms_norm_grad(x, w, x, EPS), K.swiglu(x, x),
            *K.swiglu_grad(x, x, x), K.gemv(x[:1], wg), *K.gemv_many(x[:1], [wg, wg]),
            *K.adamw(x, x, x, x, mx.zeros((9,))), K.sum_squares(x),
            K.decode_attention(mx.zeros((1, 4, 1, 8)), mx.zeros((1, 2, 6, 8)), mx.zeros((1, 2, 6, 8)),
                               mx.zeros((1, 6)), 1.0),
            K.rope(mx.zeros((1, 2, 3, 8)), mx.array([0], dtype=mx.int32), mx.ones((3,)), 6, False, 1.0)]
    mx.eval(good)
    assert K.gemv(x[:1], wg).shape == (1, 5)


def test_cross_entropy_columns_target_outside_vocabulary_is_nan():
    # a target outside [0, V) is neither read nor written: its loss is NaN (the training step's
    # non-finite guard reports it); the other columns are unaffected
    logits = mx.array(np.random.default_rng(3).normal(size=(5, 3)).astype(np.float32))
    ce, d = K.cross_entropy_columns(logits, mx.array([5, 2, -1]), True)
    ref = np.log(np.exp(np.array(logits, np.float64)).sum(0)) - np.array(logits)[2, 1]
    assert np.isnan(np.array(ce)[[0, 2]]).all()
    assert abs(float(ce[1]) - ref[1]) < 1e-6
    assert np.isfinite(np.array(d)).all() and abs(float(d[:, 0].sum()) - 1.0) < 1e-6  # no one-hot taken


# --- threads ---------------------------------------------------------------------------------

THREADS_SCRIPT = """
import sys, numpy as np
import mlxtoy, mlx.core as mx, mlxtoy_kernels as K
d = dict(np.load(sys.argv[1]))
p = K.softmax_bias(mx.array(d["s"]), mx.array(d["bias"]))
ce, dl = K.cross_entropy_columns(mx.array(d["logits"]), mx.array(d["t"]), True)
y = K.gemv_many(mx.array(d["x"]), [mx.array(d["w"]), mx.array(d["w"][:100])])
np.savez(sys.argv[2], p=np.array(p), ce=np.array(ce), d=np.array(dl), y0=np.array(y[0]), y1=np.array(y[1]),
         sq=np.array(K.sum_squares(mx.array(d["w"]))), threads=K.threads(), openmp=K.openmp())
"""


@pytest.mark.parametrize("env", [{"MLXTOY_KERNEL_THREADS": "1"}, {"MLXTOY_KERNEL_POOL": "own"}],
                         ids=["one-thread", "own-pool"])
def test_one_thread_and_either_pool_give_the_same_bits(tmp_path, env):
    r = rng(16)
    T = 64
    logits, t = ce_inputs(V=2003, N=37, seed=17)
    d = {"s": (3 * r.standard_normal((2, 4, T, T))).astype(np.float32),  # 512 rows: 2 slices
         "bias": mask_bias(causal(T, T)[None] & (r.random((2, T, T)) < 0.8)), "logits": logits, "t": t,
         "x": r.standard_normal((1, 577)).astype(np.float32),  # GEMV rows are handed out first come, first served
         "w": r.standard_normal((3001, 577)).astype(np.float32)}
    d["bias"][:, :, 0] = 0  # every row sees its first position
    np.savez(tmp_path / "in.npz", **d)
    out = tmp_path / "out.npz"
    run_py(THREADS_SCRIPT, tmp_path / "in.npz", out, **env)
    got = np.load(out)
    if "MLXTOY_KERNEL_THREADS" in env:
        assert int(got["threads"]) == 1 and K.threads() >= 1
    else:  # this process runs on MKL's OpenMP threads where MKL is the BLAS, the other its own pool
        assert not bool(got["openmp"]) and K.threads() == int(got["threads"])
        assert K.openmp() == (backend.INFO.blas == "mkl")
    p = K.softmax_bias(arr(d["s"]), arr(d["bias"]))
    ce, dl = K.cross_entropy_columns(arr(d["logits"]), mx.array(d["t"]), True)
    np.testing.assert_array_equal(got["p"], np.array(p))
    np.testing.assert_array_equal(got["ce"], np.array(ce))
    np.testing.assert_array_equal(got["d"], np.array(dl))
    y = K.gemv_many(arr(d["x"]), [arr(d["w"]), arr(d["w"][:100])])
    np.testing.assert_array_equal(got["y0"], np.array(y[0]))
    np.testing.assert_array_equal(got["y1"], np.array(y[1]))
    np.testing.assert_array_equal(got["y1"], got["y0"][:, :100])  # the same rows, whichever call and thread
    np.testing.assert_array_equal(got["sq"], np.array(K.sum_squares(arr(d["w"]))))
    # positive control: the results are right, not merely alike
    np.testing.assert_allclose(got["p"], ref_softmax_bias(d["s"], d["bias"]), atol=1e-6)
    np.testing.assert_allclose(got["ce"], ref_ce(d["logits"], d["t"])[0], rtol=2e-6, atol=1e-6)


GEMV_FORMS_SCRIPT = """
import sys, numpy as np
import mlxtoy, mlx.core as mx, mlxtoy_kernels as K
d = dict(np.load(sys.argv[1]))
out = {"forms": np.array(K.forms())}
for i in range(len(d) // 2):
    x, w = d[f"x{i}"], mx.array(d[f"w{i}"])
    out[f"batch{i}"] = np.array(K.gemv(mx.array(x), w))
    out[f"alone{i}"] = np.concatenate([np.array(K.gemv(mx.array(x[j:j + 1]), w)) for j in range(len(x))])
np.savez(sys.argv[2], **out)
"""


@pytest.mark.skipif(K.forms() == "portable", reason="the kernels' SIMD forms do not run here")
def test_the_avx2_gemv_sums_a_row_in_a_batch_as_alone(tmp_path):
    """MLXTOY_KERNEL_AVX512=0 runs the kernels as an AVX2-only CPU does (on an AVX-512 CPU too, so
    every machine tests it): the float32 GEMV of a row among others (a batch of decoded tokens)
    gives the bits it gives alone, through every pass of the several-rows form and its tails."""
    r = rng(23)
    shapes = [(2, 603), (3, 576), (4, 23), (5, 1536), (9, 577), (32, 576)]  # (rows of x, K)
    d = {}
    for i, (M, K_) in enumerate(shapes):
        d[f"x{i}"] = r.standard_normal((M, K_)).astype(np.float32)
        d[f"w{i}"] = (r.standard_normal((203, K_)) / np.sqrt(K_)).astype(np.float32)  # 203 rows: passes and a tail
    np.savez(tmp_path / "in.npz", **d)
    run_py(GEMV_FORMS_SCRIPT, tmp_path / "in.npz", tmp_path / "avx2.npz", MLXTOY_KERNEL_AVX512="0")
    got = np.load(tmp_path / "avx2.npz")
    assert str(got["forms"]) == "avx2"  # positive control: the other process took the AVX2 forms
    for i, (M, K_) in enumerate(shapes):
        want = d[f"x{i}"].astype(f64) @ d[f"w{i}"].astype(f64).T
        np.testing.assert_allclose(got[f"batch{i}"], want, rtol=0, atol=3e-5)
        np.testing.assert_array_equal(got[f"batch{i}"], got[f"alone{i}"], err_msg=f"{M} rows, K = {K_}")

COLD_SCRIPT = """
import mlx.core as mx, mlxtoy_kernels as K
x = mx.ones((64, 16384))
mx.eval(x)
y = K.swiglu(x, x)  # the process's first kernel call is a parallel one: the pool starts in it
print(float(mx.abs(y - 0.7310585786300049).max()), K.threads())
"""


def test_cold_pool_first_parallel_call_finishes():
    """Regression: a pool worker that started after the first run() began used to take that
    run's generation as already seen, never checked in, and run() waited forever."""
    for n in (2, 3):
        err, threads = run_py(COLD_SCRIPT, timeout=20, MLXTOY_KERNEL_THREADS=str(n)).stdout.split()
        assert int(threads) == n and float(err) < 1e-6  # silu(1) * 1 everywhere


# --- a tiny Llama with the kernels on and off ------------------------------------------------

CFG = dict(arch="llama", vocab_size=259, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_head=16,
           d_ff=96, norm_eps=1e-5, rope_base=10000.0, tie_embeddings=True, context_length=128)
PROMPT = [5, 17, 200, 33, 90, 41, 7, 128, 250, 3, 64]


def model_outputs(weights_path, batch_path) -> dict:
    """The tiny Llama of CFG with the saved weights: sft_loss and its gradients on the saved
    batch (packed rows: block-causal masks), plain per-token losses, and 8 greedy KV-cached tokens."""
    from mlxtoy.model_config import ModelConfig
    from mlxtoy.generate import generate_tokens
    from mlxtoy.sampling import SamplingParams
    from mlxtoy.loading import build_model
    from mlxtoy.train.objectives import sft_loss, token_losses

    model = build_model(ModelConfig(**CFG), mx.load(str(weights_path)))
    batch = np.load(batch_path)
    inputs, targets, w, seg = (mx.array(batch[k]) for k in ("inputs", "targets", "weights", "segments"))
    loss, grads = nn.value_and_grad(model, lambda: sft_loss(model, inputs, targets, w, seg, w.sum()))()
    plain = token_losses(model, inputs, targets, train=False)
    toks = [t for t, _ in generate_tokens(model, PROMPT, max_tokens=8, sampling=SamplingParams(temp=0.0, seed=0))]
    out = {"g/" + k: np.array(v) for k, v in tree_flatten(grads)}
    return out | {"loss": np.array(loss), "plain": np.array(plain), "tokens": np.array(toks),
                  "kernels": fastmath.kernels_on()}


MODEL_SCRIPT = """
import sys
import numpy as np
sys.path.insert(0, "tests")
from test_kernels import model_outputs
np.savez(sys.argv[3], **model_outputs(sys.argv[1], sys.argv[2]))
"""


def test_tiny_llama_same_with_and_without_kernels(tmp_path):
    from mlxtoy.model_config import ModelConfig
    from mlxtoy.loading import build_model

    r = rng(18)
    params = {}
    for name, p in tree_flatten(build_model(ModelConfig(**CFG)).parameters()):
        if name.endswith("norm.weight"):
            v = 1 + 0.1 * r.standard_normal(p.shape)
        elif name == "tok_embeddings.weight":
            v = r.standard_normal(p.shape)  # spread-out logits: greedy choices far from ties
        else:
            v = r.standard_normal(p.shape) / np.sqrt(p.shape[-1])
        params[name] = arr(v)
    wpath = tmp_path / "w.safetensors"
    mx.save_safetensors(str(wpath), params)
    B, T = 2, 24
    batch = {"inputs": r.integers(0, 259, (B, T)).astype(np.int32),
             "targets": r.integers(0, 259, (B, T)).astype(np.int32),
             "weights": (r.random((B, T)) < 0.7).astype(np.float32),
             "segments": np.array([[0] * 10 + [1] * 14, [0] * 3 + [1] * 15 + [2] * 6], dtype=np.int32)}
    bpath = tmp_path / "batch.npz"
    np.savez(bpath, **batch)

    on = model_outputs(wpath, bpath)
    assert on["kernels"]  # positive control: this process runs the kernels
    out = tmp_path / "off.npz"
    run_py(MODEL_SCRIPT, wpath, bpath, out, MLXTOY_KERNELS="0")
    off = dict(np.load(out))
    assert not bool(off["kernels"])

    assert abs(float(on["loss"]) - float(off["loss"])) <= 1e-5 * abs(float(off["loss"]))
    np.testing.assert_allclose(on["plain"], off["plain"], rtol=1e-5)
    names = [k for k in off if k.startswith("g/")]
    # positive control: the two paths really computed differently (not one path twice)
    assert any(not np.array_equal(on[k], off[k]) for k in names)
    assert sorted(names) == sorted(k for k in on if k.startswith("g/")) and len(names) > 10
    for k in names:
        scale = np.abs(off[k]).max()
        assert scale > 0, k
        assert np.abs(on[k] - off[k]).max() <= 1e-4 * scale, k
    assert on["tokens"].tolist() == off["tokens"].tolist() and len(on["tokens"]) == 8
