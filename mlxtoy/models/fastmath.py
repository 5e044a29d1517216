"""Elementwise and row-wise maths that MLX's CPU backend computes slowly.

On CPU, MLX's `exp` (and so `sigmoid` and SiLU) runs at ~15-20 ns per element: in a SmolLM2
training step SiLU alone costs about as much as a third of the FFN GEMMs. A range-reduced
polynomial exp (Cody-Waite reduction, degree-6 Taylor on |r| <= ln2/2; relative error ~3e-7,
i.e. float32 rounding level), compiled so the whole SiLU fuses into one kernel, is ~5x faster.
Used on CPU only; Metal and CUDA have fast transcendental units.

Where the compiled kernels of `kernels/` (the `mlxtoy_kernels` package, MLX primitives in C++)
are installed, float32 CPU work goes through them instead: MLX runs its CPU elementwise and
reduction ops unfused on one thread, and MKL runs the one-row GEMVs of decoding on one thread,
so the softmaxes, cross-entropy, RMSNorm, SwiGLU and decode GEMVs are fused and split over the
cores there; inside `inference()` (decoding, prefill) they are called without gradient wrappers
and RoPE takes its kernel too. The pure-MLX forms here stay the fallback (and the reference the
tests compare with); MLXTOY_KERNELS=0 turns the kernels off.
"""

from __future__ import annotations

import functools
import threading
from contextlib import contextmanager
from typing import Iterator

import mlx.core as mx
import mlx.nn as nn

from mlxtoy import backend, settings

_LOG2E = 1.4426950408889634
_LN2_HI = 0.693145751953125  # ln 2 split in two so n * ln2 stays exact in float32
_LN2_LO = 1.428606765330187045e-06


def _exp(x: mx.array) -> mx.array:
    x = mx.clip(x, -87.0, 88.0)
    n = mx.floor(x * _LOG2E + 0.5)
    r = x - n * _LN2_HI - n * _LN2_LO
    p = 1.0 + r * (1.0 + r * (0.5 + r * (1 / 6 + r * (1 / 24 + r * (1 / 120 + r * (1 / 720))))))
    return p * ((n.astype(mx.int32) + 127) << 23).view(mx.float32)  # p * 2^n


@mx.compile
def _silu(x: mx.array) -> mx.array:
    return x / (1.0 + _exp(-x))


@mx.compile
def _silu_grad(x: mx.array, g: mx.array) -> mx.array:
    s = 1.0 / (1.0 + _exp(-x))
    return g * s * (1.0 + x * (1.0 - s))


@mx.custom_function
def fast_silu(x: mx.array) -> mx.array:
    return _silu(x)


@fast_silu.vjp
def _fast_silu_vjp(x, cotangent, output):
    return _silu_grad(x, cotangent)


def exp(x: mx.array) -> mx.array:
    """e^x: the polynomial form for float32 on CPU, MLX's own elsewhere."""
    if x.dtype == mx.float32 and _ON_CPU:
        return _exp(x)
    return mx.exp(x)


def silu(x: mx.array) -> mx.array:
    """SiLU: the fast polynomial form for float32 on CPU, MLX's own elsewhere."""
    if x.dtype == mx.float32 and _ON_CPU:
        return fast_silu(x)
    return nn.silu(x)


_ON_CPU = backend.INFO.device == "cpu"


def compiled_decode_pays() -> bool:
    """Whether generation runs each one-token step as one compiled graph over the cache's
    fixed-size buffers (a traced position, and a mask hiding the slots past it). On the CPU it
    pays: building a step's graph in Python takes the cores the matmuls need. On a GPU the next
    step is built while the last one runs (`mx.async_eval`), and the mask would keep one-query
    attention off MLX's vector kernel (CUDA's takes no array mask), so a step is built eagerly
    over the cache's exact length with no mask, as mlx-lm does."""
    return _ON_CPU


def _load_kernels():
    """The kernels module on CPU when it is installed, wanted and built against this MLX
    (`backend.cpu_kernels`), else None."""
    return backend.cpu_kernels()[0] if _ON_CPU else None


_K = _load_kernels()
KERNELS = _K is not None  # the compiled kernels are in use


def kernels_status() -> str:
    """`on (...)`, or `off (why)`: whether the compiled kernels are in use (`mlxtoy doctor`)."""
    if KERNELS:
        team = "MKL's OpenMP threads" if _K.openmp() else "their own pool"
        gemms = "the kernels' AVX-512 GEMM" if GEMM else "the BLAS"
        quantized = "AVX-512 VNNI integer products" if quant_vnni() else "float32"
        return (f"on ({_K.threads()} threads: {team}; float32 products of many rows: {gemms}; "
                f"decoding from a 4-bit base: {quantized})")
    if not _ON_CPU:
        return f"off (device {backend.INFO.device}: the kernels are for the CPU)"
    why = backend.cpu_kernels()[1]
    if why == "not installed":
        return f"off (not built: {backend.KERNELS_WHERE})"
    return f"off ({why})"


def _kernel_ok(*arrays: mx.array) -> bool:
    return _K is not None and all(a.dtype == mx.float32 for a in arrays)


def _cotangent(c):
    return c[0] if isinstance(c, (tuple, list)) else c


_MODE = threading.local()


@contextmanager
def inference() -> Iterator[None]:
    """Within (on this thread): graphs that are never differentiated (decoding, prefill) call the
    kernels bare, without the custom-function node that carries each one's gradient, and RoPE
    takes its kernel (mx.fast.rope's CPU form is about a dozen nodes): every graph node of a
    decoded token is a dispatch on the cores its GEMVs need."""
    before = getattr(_MODE, "inference", False)
    _MODE.inference = True
    try:
        yield
    finally:
        _MODE.inference = before


def _bare(*arrays: mx.array) -> bool:
    """The kernels apply and no gradient is wanted (inside `inference()`)."""
    return getattr(_MODE, "inference", False) and _kernel_ok(*arrays)


# --- RMSNorm, SwiGLU, decode GEMV --------------------------------------------------------------

_RMS_NORMS: dict = {}


def _kernel_rms_norm(eps: float):
    fn = _RMS_NORMS.get(eps)
    if fn is None:
        @mx.custom_function
        def fn(x, w):
            return _K.rms_norm(x, w, eps)

        @fn.vjp
        def fn_vjp(primals, cotangent, output):
            x, w = primals
            dx, dw = _K.rms_norm_grad(x, w, _cotangent(cotangent), eps)
            return dx, dw

        _RMS_NORMS[eps] = fn
    return fn


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """weight * x / sqrt(mean(x^2) + eps) over the last axis."""
    if _bare(x, weight):
        return _K.rms_norm(x, weight, eps)
    if _kernel_ok(x, weight):
        return _kernel_rms_norm(eps)(x, weight)
    return mx.fast.rms_norm(x, weight, eps)


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm (same parameters) through `rms_norm`."""

    def __call__(self, x: mx.array) -> mx.array:
        return rms_norm(x, self["weight"], self.eps)


@mx.custom_function
def _kernel_swiglu(a, b):
    return _K.swiglu(a, b)


@_kernel_swiglu.vjp
def _kernel_swiglu_vjp(primals, cotangent, output):
    a, b = primals
    da, db = _K.swiglu_grad(a, b, _cotangent(cotangent))
    return da, db


def swiglu(a: mx.array, b: mx.array) -> mx.array:
    """silu(a) * b (the SwiGLU FFN's gate times its up projection)."""
    if _bare(a, b):
        return _K.swiglu(a, b)
    if _kernel_ok(a, b):
        return _kernel_swiglu(a, b)
    return silu(a) * b


_GEMV_ROWS = 4  # at most this many rows of x take the threaded GEMV (decoding)


def _takes_gemv(x: mx.array, weight: mx.array) -> bool:
    return x.size <= _GEMV_ROWS * x.shape[-1] and _kernel_ok(x, weight)


@mx.custom_function
def _kernel_gemv(x, ws):
    return _K.gemv_many(x, ws)


@_kernel_gemv.vjp
def _kernel_gemv_vjp(primals, cotangents, outputs):
    x, ws = primals
    K = x.shape[-1]
    rows = x.reshape(-1, K)
    flat = [g.reshape(rows.shape[0], -1) for g in cotangents]  # (rows, N) per weight
    dx = sum(g @ w.reshape(-1, K) for g, w in zip(flat, ws)).reshape(x.shape)
    return dx, [(g.T @ rows).reshape(w.shape) for g, w in zip(flat, ws)]


def _gemv(x: mx.array, ws: list[mx.array]) -> list[mx.array]:
    return _K.gemv_many(x, ws) if _bare(x) else _kernel_gemv(x, ws)


# Products of many rows through the kernels' AVX-512 GEMM, which outruns the BLAS on these
# shapes whether or not the BLAS has AVX-512 kernels of its own (bench/, README)
GEMM = KERNELS and _K.gemm_ok() and settings.GEMM.value()
# Where AVX-512 runs as two 256-bit halves (Zen 4) the BLAS's GEMM beats the kernels' on 1B-class
# matrices (both sides >= 2048; docs/performance.md); smaller ones keep the kernels' (as fast
# there, and no transposed copies).
LARGE_TO_BLAS = GEMM and backend.split_avx512()
LARGE_SIDE = 2048


def _large(w: mx.array) -> bool:
    return min(w.size // w.shape[-1], w.shape[-1]) >= LARGE_SIDE


def _takes_gemm(x: mx.array, *weights: mx.array) -> bool:
    return GEMM and _kernel_ok(x, *weights) and not (LARGE_TO_BLAS and any(_large(w) for w in weights))


@mx.custom_function
def _kernel_linear(x, w):
    return _K.gemm(x.reshape(-1, x.shape[-1]), w, trans_b=True).reshape(*x.shape[:-1], w.shape[0])


@_kernel_linear.vjp
def _kernel_linear_vjp(primals, cotangent, output):
    x, w = primals
    rows = x.reshape(-1, x.shape[-1])
    g = _cotangent(cotangent).reshape(rows.shape[0], -1)
    return _K.gemm(g, w).reshape(x.shape), _K.gemm(g, rows, trans_a=True)  # dY W, dY^T X


def gemm(a: mx.array, b: mx.array, trans_a: bool = False, trans_b: bool = False, trans_out: bool = False) -> mx.array:
    """op(a) @ op(b), or its transpose with trans_out, op a transposition where asked, for 2-D a
    and b; no gradient. The kernels' GEMM where it applies (a transposed output costs nothing
    there), else MLX's matmul."""
    if _takes_gemm(a, b):
        return _K.gemm(a, b, trans_a, trans_b, trans_out)
    y = (a.T if trans_a else a) @ (b.T if trans_b else b)
    return y.T if trans_out else y


def linear(x: mx.array, weight: mx.array) -> mx.array:
    """x @ weight.T; a few rows of x (decoding) take the threaded GEMV kernel, many rows the
    kernels' GEMM where it applies (with its gradient, or bare inside `inference()`)."""
    if _takes_gemv(x, weight):
        return _gemv(x, [weight])[0]
    if _takes_gemm(x, weight):
        return _K.gemm_many(x, [weight])[0] if _bare(x) else _kernel_linear(x, weight)
    return x @ weight.T


def linear_many(x: mx.array, weights: list[mx.array]) -> list[mx.array]:
    """[x @ w.T for w in weights], a weight of more axes (..., K) giving x.shape[:-1] +
    w.shape[:-1] (a per-head (heads, d_head, K) weight: (..., heads, d_head)). When decoding
    one threaded GEMV call computes them all (a layer's q, k and v, or its gate and up): one
    split over the threads, and no reshapes around it."""
    if _takes_gemv(x, weights[0]) and _kernel_ok(*weights):
        return list(_gemv(x, weights))
    if _takes_gemm(x, *weights) and _bare(x):
        return list(_K.gemm_many(x, weights))
    out = []
    for w in weights:
        if w.ndim == 2:
            out.append(linear(x, w))
        else:
            out.append(linear(x, w.reshape(-1, w.shape[-1])).reshape(*x.shape[:-1], *w.shape[:-1]))
    return out


class Linear(nn.Linear):
    """nn.Linear (same parameters) through `linear`."""

    def __call__(self, x: mx.array) -> mx.array:
        w = self["weight"]
        if "bias" not in self:
            return linear(x, w)
        kernel = _takes_gemv(x, w) or _takes_gemm(x, w)
        return linear(x, w) + self["bias"] if kernel else mx.addmm(self["bias"], x, w.T)


def rope_kernel_ok(x: mx.array) -> bool:
    """`rope` applies: inside `inference()`, float32 (B, N, T, D) on CPU with the kernels."""
    return x.ndim == 4 and _bare(x)


def rope(x: mx.array, offset: int | mx.array, inv_freqs: mx.array, dims: int, traditional: bool,
         scale: float) -> mx.array:
    """mx.fast.rope's forward as one kernel call (no gradient: see `rope_kernel_ok`), with the
    inverse frequencies given (base ** (-2i / dims), or 1 / freqs)."""
    if isinstance(offset, mx.array):
        offset = offset.reshape(1) if offset.dtype == mx.int32 else offset.astype(mx.int32).reshape(1)
    else:
        offset = mx.array([offset], dtype=mx.int32)
    return _K.rope(x, offset, inv_freqs, dims, traditional, scale)


FUSED_DECODE = settings.FUSED_DECODE.value()  # tests compare both ways
PACKED_DECODE = settings.PACKED_DECODE.value()


def dequantize_affine(w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int
                      ) -> mx.array | None:
    """mx.dequantize's float32 values for a 2-D affine-quantized matrix, by the kernels (threaded:
    MLX's CPU dequantize runs on one thread); None where the kernels are off."""
    if _K is None or w.ndim != 2:
        return None
    return _K.dequantize_affine(w, scales, biases, group_size, bits)


def quant_linear_ok(x: mx.array) -> bool:
    """Whether `quant_linear` takes x (the kernels are on, float32)."""
    return _K is not None and x.dtype == mx.float32


@functools.lru_cache(maxsize=None)
def _kernel_quant_linear(group_size: int, bits: int, symmetric: bool):
    @mx.custom_function
    def product(x, w, scales, biases):
        rows = x.reshape(-1, x.shape[-1])
        return _K.quant_linear(rows, w, scales, biases, group_size, bits, symmetric=symmetric
                               ).reshape(*x.shape[:-1], w.shape[0])

    @product.vjp
    def product_vjp(primals, cotangent, output):
        x, w, scales, biases = primals
        g = _cotangent(cotangent).reshape(-1, cotangent.shape[-1])
        dx = quant_linear_input_grad(g, w, scales, biases, group_size, bits).reshape(x.shape)
        return dx, mx.zeros_like(w), mx.zeros_like(scales), mx.zeros_like(biases)

    return product


def quant_linear(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int,
                 symmetric: bool = False) -> mx.array:
    """x @ W.T for an affine-quantized W by the kernels (a slab of W dequantized at a time into
    the BLAS's SGEMM, forward and input gradient; at most 4 rows of x, decoding, the fused
    quantized GEMV that reads the packed words as they are, and not the biases where they are
    -2^(bits - 1) scales: `symmetric`); see `quant_linear_ok`. Inside `inference()` the kernel is
    called bare (no gradient node), and a prompt's rows take the GEMV's VNNI form as well where it
    runs (x rounded to 16 bits a group, as in decoding)."""
    if _bare(x):
        rows = x.reshape(-1, x.shape[-1])
        return _K.quant_linear(rows, w, scales, biases, group_size, bits, symmetric=symmetric, inference=True
                               ).reshape(*x.shape[:-1], w.shape[0])
    return _kernel_quant_linear(group_size, bits, symmetric)(x, w, scales, biases)


def quant_vnni() -> bool:
    """Whether `quant_linear`'s 4-bit GEMV (groups of 32) runs as AVX-512 VNNI integer products here
    (x rounded to 16 bits a group) rather than in float32."""
    return _K is not None and _K.quant_vnni_ok()


def quant_linear_input_grad(g: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int,
                            bits: int) -> mx.array:
    """g (N, rows) @ W for an affine-quantized W (rows, d_in) by the kernels, with no gradient of its
    own (`quant_linear`'s input gradient, and the fused loss's through a quantized output layer)."""
    return _K.quant_linear(g, w, scales, biases, group_size, bits, True)


def pack_lossless(w: mx.array) -> mx.array | None:
    """w (..., K) packed for decoding where that is lossless: as blocks of 32 weights d * q + m
    (q 4-bit; 0.75 bytes a weight, the weights of a Q4_1 GGUF) or d * q (q 8-bit; 1.125 bytes,
    Q8_0's), d and m float32, whichever holds every weight exactly; decoding then reads the same
    weights from a fraction of the bytes. None where neither does (trained or float weights),
    without the kernels, or with MLXTOY_PACKED_DECODE=0. The packed width tells the two apart."""
    if not (PACKED_DECODE and _kernel_ok(w) and w.ndim >= 2 and w.shape[-1] % 32 == 0):
        return None
    for bits in (4, 8):
        packed, ok = _K.pack(w, bits)
        mx.eval(packed, ok)
        if ok.item():
            return packed
    return None


def linear_packed(x: mx.array, packed: mx.array) -> mx.array:
    """x @ w.T for a few rows of x and w packed by `pack_lossless` (2-D), threaded; no gradient."""
    return _K.gemv_packed(x, packed)


def decode_block_ok(x: mx.array, *arrays: mx.array) -> bool:
    """`decode_block` applies: inside `inference()`, one token of one sequence, float32 arrays
    on CPU with the kernels (MLXTOY_FUSED_DECODE=0 turns it off)."""
    return FUSED_DECODE and x.ndim == 3 and x.shape[:2] == (1, 1) and _bare(x, *arrays)


def decode_block(x: mx.array, weights: list[mx.array], biases: list[mx.array], keys: mx.array,
                 values: mx.array, offset: mx.array, inv_freqs: mx.array, rope_dims: int,
                 traditional: bool, eps: float, attn_scale: float,
                 rope_scale: float) -> tuple[mx.array, mx.array, mx.array]:
    """A pre-norm Llama block's step for one token as one kernel call -> (x, keys, values):
    weights [attn_norm, q, k, v (per head), o, ffn_norm, gate, up, down] (a matrix float32 or
    `pack_lossless`ed), biases [] or [q, k, v]; the token's k (RoPE'd, as `rope`) and v go into
    slot `offset` of the caches (B = 1, (1, KV, S, Dh)), written in place (the returned caches
    share the given ones' buffers: the caller keeps no other use of them), and the query attends
    to slots 0..offset. The same values as the block's kernels one by one."""
    offset = offset.reshape(1) if offset.dtype == mx.int32 else offset.astype(mx.int32).reshape(1)
    y, keys, values = _K.decode_block(x, weights, biases, keys, values, offset, inv_freqs, rope_dims,
                                      traditional, eps, attn_scale, rope_scale)
    return y, keys, values


# --- optimizer ---------------------------------------------------------------------------------

def sum_squares(x: mx.array) -> mx.array:
    """sum(x^2) as a float32 scalar (a gradient norm's part); the kernel sums in double over
    fixed blocks, threaded, the same bits on any thread count."""
    if x.size and _kernel_ok(x):
        return _K.sum_squares(x).reshape(())
    return mx.sum(mx.square(x.astype(mx.float32)))


def adamw_step(parameter: mx.array, gradient: mx.array, m: mx.array, v: mx.array, lr: mx.array,
               ok: mx.array, grad_scale: mx.array | None, betas: tuple[float, float], eps: float,
               weight_decay: float) -> tuple[mx.array, mx.array, mx.array] | None:
    """One AdamW step without bias correction on gradient * grad_scale (None: 1) -> (parameter,
    m, v), the old three where `ok` is False, as one threaded pass of the kernel (the same bits
    as mlx.optimizers.AdamW on the scaled gradient); None where the kernel does not apply (not
    float32 on CPU with the kernels)."""
    if not _kernel_ok(parameter, gradient, m, v):
        return None
    b1, b2 = betas
    scale = mx.ones((1,)) if grad_scale is None else grad_scale.astype(mx.float32).reshape(1)
    scalars = mx.concatenate([lr.astype(mx.float32).reshape(1), ok.astype(mx.float32).reshape(1),
                              mx.array([b1, 1 - b1, b2, 1 - b2, eps, weight_decay], dtype=mx.float32), scale])
    p, m, v = _K.adamw(parameter, gradient, m, v, scalars)
    return p, m, v


def logsumexp(x: mx.array) -> mx.array:
    """log(sum(exp(x))) over the last axis (no gradient with the kernel): float32 on CPU takes
    the threaded kernel (MLX's runs its exp on one thread; a sampled token's log-probability
    over a 49K vocabulary cost a millisecond a token), summed in double."""
    if _kernel_ok(x) and x.size:
        y = _K.logsumexp(x)
        return y.reshape(x.shape[:-1])
    return mx.logsumexp(x, axis=-1)


# --- cross-entropy -------------------------------------------------------------------------------

@mx.compile
def _ce_and_dlogits(logits: mx.array, targets: mx.array) -> tuple[mx.array, mx.array]:
    x = logits.astype(mx.float32)
    m = x.max(axis=-1, keepdims=True)
    e = exp(x - m)
    s = e.sum(axis=-1, keepdims=True)
    picked = mx.take_along_axis(x, targets[..., None], axis=-1)[..., 0]
    is_target = mx.arange(x.shape[-1]) == targets[..., None]
    return (m + mx.log(s))[..., 0] - picked, mx.where(is_target, e / s - 1.0, e / s)


@mx.compile
def _softmax_minus_one_hot(x: mx.array, lse: mx.array, targets: mx.array) -> mx.array:
    # elementwise only (MLX's exp: the polynomial one does not fuse), so one (N, V) array
    p = mx.exp(x - lse[:, None])
    return mx.where(mx.arange(x.shape[-1]) == targets[:, None], p - 1.0, p)


def softmax_cross_entropy(logits: mx.array, targets: mx.array, grad: bool) -> tuple[mx.array, mx.array | None]:
    """logits (N, V), targets (N,) -> (cross-entropy logsumexp - logits[target] (N,), with
    `grad` its gradient softmax - one-hot (N, V), else None). The cross-entropy is the same
    to the bit with and without `grad`. With the kernels (logits by rows: a quantized output
    layer's) the threaded logsumexp, and the gradient in one pass that holds nothing but itself;
    else one compiled function (its polynomial exp is faster, its temporaries larger)."""
    if _kernel_ok(logits) and logits.ndim == 2:
        lse = logsumexp(logits)
        ce = lse - mx.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
        return ce, (_softmax_minus_one_hot(logits, lse, targets) if grad else None)
    ce, d = _ce_and_dlogits(logits, targets)
    return ce, (d if grad else None)


LOGITS_BY_COLUMNS = KERNELS  # losses over a vocabulary take the logits as (V, N) with the kernels


def softmax_cross_entropy_columns(logits_t: mx.array, targets: mx.array, grad: bool) -> tuple[mx.array, mx.array | None]:
    """`softmax_cross_entropy` for logits laid out (V, N): (N,) and (V, N) | None."""
    if _kernel_ok(logits_t):
        out = _K.cross_entropy_columns(logits_t, targets, grad)
        return out[0], (out[1] if grad else None)
    ce, d = softmax_cross_entropy(logits_t.T, targets, grad)
    return ce, (d.T if grad else None)


# --- attention -------------------------------------------------------------------------------
# MLX's CPU backend trains through an unfused softmax whose exp is a scalar call per score
# (4 x 9 x 256 x 256 scores per SmolLM2 layer). Here the softmax takes the polynomial exp, the
# probabilities are kept for the backward pass (which then needs no exp at all), and grouped
# query heads share their KV head without a copy: queries of a group are stacked along the rows.


@mx.compile
def _masked_softmax(s: mx.array, bias: mx.array) -> mx.array:
    s = s + bias
    e = _exp(s - s.max(axis=-1, keepdims=True))
    e = mx.where(bias == -mx.inf, 0.0, e)  # exactly zero where masked, as MLX's softmax gives
    return e / e.sum(axis=-1, keepdims=True)


@mx.compile
def _softmax_input_grad(p: mx.array, dp: mx.array, delta: mx.array) -> mx.array:
    return p * (dp - delta)


@mx.custom_function
def _grouped_attention(q: mx.array, k: mx.array, v: mx.array, bias: mx.array, scale: mx.array):
    """q (B, KV, G*T, D) with each group's queries stacked, k/v (B, KV, S, D), bias
    (B|1, 1, 1, T, S) additive -> (out (B, KV, G*T, D), probabilities (B, KV, G*T, S))."""
    B, KV, GT, _ = q.shape
    T, S = bias.shape[-2:]
    s = ((q * scale) @ k.swapaxes(-1, -2)).reshape(B, KV, GT // T, T, S)
    if _K is not None:
        p = _K.softmax_bias(s, bias.reshape(bias.shape[0], T, S)).reshape(B, KV, GT, S)
    else:
        p = _masked_softmax(s, bias).reshape(B, KV, GT, S)
    return p @ v, p


@_grouped_attention.vjp
def _grouped_attention_vjp(primals, cotangents, outputs):
    q, k, v, bias, scale = primals
    d_out = cotangents[0]
    out, p = outputs
    dv = p.swapaxes(-1, -2) @ d_out
    dp = d_out @ v.swapaxes(-1, -2)
    if _K is not None:
        ds = _K.softmax_grad(p, dp)
    else:
        ds = _softmax_input_grad(p, dp, (d_out * out).sum(axis=-1, keepdims=True))
    dq = (ds @ k) * scale
    dk = (ds.swapaxes(-1, -2) @ q) * scale
    return dq, dk, dv, mx.zeros_like(bias), mx.zeros_like(scale)


def additive_mask(mask, T: int, S: int) -> mx.array:
    """None, "causal" (the last T of S positions, as mx.fast's), boolean or additive masks
    broadcastable to (B, H, T, S) -> additive float32 (B|1, 1, T, S) of 0 and -inf."""
    if mask is None:
        return mx.zeros((1, 1, T, S))
    if isinstance(mask, str):
        mask = mx.arange(S)[None, :] <= mx.arange(T)[:, None] + (S - T)
    if mask.dtype == mx.bool_:
        mask = mx.where(mask, 0.0, -mx.inf)
    mask = mask.astype(mx.float32)
    while mask.ndim < 4:
        mask = mask[None]
    if mask.shape[1] != 1:
        raise ValueError("per-head attention masks are not supported")
    return mask


_DECODE_ATTENTIONS: dict = {}


def _kernel_decode_attention(scale: float):
    """The one-query attention kernel for this scale (its gradient: mx.fast's, recomputed)."""
    fn = _DECODE_ATTENTIONS.get(scale)
    if fn is None:
        def reference(q, k, v, bias):
            return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=bias[:, None, None, :])

        @mx.custom_function
        def fn(q, k, v, bias):
            return _K.decode_attention(q, k, v, bias, scale)

        @fn.vjp
        def fn_vjp(primals, cotangent, output):
            q, k, v, bias = primals
            _, grads = mx.vjp(lambda q, k, v: reference(q, k, v, bias), [q, k, v], [_cotangent(cotangent)])
            return (*grads, mx.zeros_like(bias))

        _DECODE_ATTENTIONS[scale] = fn
    return fn


# The kernels' block attention calls the BLAS from inside their threads: only where each call
# then runs on its calling thread (MKL inside its OpenMP team, an OpenBLAS set to one thread);
# BLAS threads of its own under each of ours would oversubscribe the cores.
BLOCK_ATTENTION = KERNELS and _K.block_attention_ok() and settings.BLOCK_ATTENTION.value()

_BLOCK_ATTENTIONS: dict = {}


def _kernel_block_attention(scale: float):
    """The kernels' attention over many query positions for this scale, with its gradient:
    (q (B, KV, G*T, D), k, v, bias (B|1, T, S)) -> (out, stats): out as `_grouped_attention`'s,
    stats each row's max and 1 / sum, from which the gradient computes the probabilities again."""
    fn = _BLOCK_ATTENTIONS.get(scale)
    if fn is None:
        @mx.custom_function
        def fn(q, k, v, bias):
            return tuple(_K.attention(q, k, v, bias, scale))

        @fn.vjp
        def fn_vjp(primals, cotangents, outputs):
            q, k, v, bias = primals
            dq, dk, dv = _K.attention_grad(q, k, v, bias, outputs[1], cotangents[0], scale)
            return dq, dk, dv, mx.zeros_like(bias)

        _BLOCK_ATTENTIONS[scale] = fn
    return fn


def attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask=None) -> mx.array:
    """Scaled dot-product attention, q (B, H, T, D), k/v (B, KV, S, D) -> (B, H, T, D); the
    fast forms here for float32 on CPU (one query position: the decode kernel, which reads
    no key past the mask's last open one), mx.fast's elsewhere."""
    B, H, T, D = q.shape
    if T == 1 and _ON_CPU and _kernel_ok(q, k, v):
        S = k.shape[2]
        bias = additive_mask(mask, 1, S)
        bias = bias.reshape(bias.shape[0], S)
        if _bare(q):
            return _K.decode_attention(q, k, v, bias, scale)
        return _kernel_decode_attention(scale)(q, k, v, bias)
    if not (_ON_CPU and q.dtype == mx.float32 and T > 1):
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    KV, S = k.shape[1], k.shape[2]
    stacked = q.reshape(B, KV, (H // KV) * T, D)
    bias = additive_mask(mask, T, S)  # (B|1, 1, T, S)
    if BLOCK_ATTENTION:
        bias = bias.reshape(bias.shape[0], T, S)
        out = _K.attention(stacked, k, v, bias, scale)[0] if _bare(q) else _kernel_block_attention(scale)(stacked, k, v, bias)[0]
    else:
        out, _ = _grouped_attention(stacked, k, v, bias[:, :, None], mx.array(scale, dtype=q.dtype))
    return out.reshape(B, H, T, D)
