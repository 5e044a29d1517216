"""Elementwise and row-wise maths that MLX's CPU backend computes slowly.

On CPU, a range-reduced polynomial exp (Cody-Waite, degree-6 Taylor on |r| <= ln2/2), compiled so
that SiLU fuses into one kernel, replaces MLX's slow `exp` (Metal and CUDA keep theirs). Where the
kernels of `kernels/` (`mlxtoy_kernels`, MLX primitives in C++) are installed, float32 CPU work
goes through them: softmaxes, cross-entropy, RMSNorm, SwiGLU, RoPE and the decode GEMVs fused and
split over the cores (MLX runs those ops unfused on one thread), called without gradient wrappers
inside `inference()`. The pure-MLX forms stay the fallback and the tests' reference;
MLXTOY_KERNELS=0 turns the kernels off (docs/performance.md).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator, NamedTuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxtoy import backend, routes, settings
from mlxtoy.models.compiled import compiled

_LOG2E = 1.4426950408889634
_LN2_HI = 0.693145751953125  # ln 2 split in two so n * ln2 stays exact in float32
_LN2_LO = 1.428606765330187045e-06


def poly_exp(x: mx.array) -> mx.array:
    x = mx.clip(x, -87.0, 88.0)
    n = mx.floor(x * _LOG2E + 0.5)
    r = x - n * _LN2_HI - n * _LN2_LO
    p = 1.0 + r * (1.0 + r * (0.5 + r * (1 / 6 + r * (1 / 24 + r * (1 / 120 + r * (1 / 720))))))
    return p * ((n.astype(mx.int32) + 127) << 23).view(mx.float32)  # p * 2^n


@compiled
def _silu(x: mx.array) -> mx.array:
    return x / (1.0 + poly_exp(-x))


@compiled
def _silu_grad(x: mx.array, g: mx.array) -> mx.array:
    s = 1.0 / (1.0 + poly_exp(-x))
    return g * s * (1.0 + x * (1.0 - s))


@mx.custom_function
def fast_silu(x: mx.array) -> mx.array:
    return _silu(x)


@fast_silu.vjp
def _fast_silu_vjp(x, cotangent, output):
    return _silu_grad(x, cotangent)


def exp(x: mx.array) -> mx.array:
    """e^x: the polynomial form for float32 on CPU, MLX's own elsewhere."""
    if x.dtype == mx.float32 and backend.INFO.on_cpu:
        return poly_exp(x)
    return mx.exp(x)


def silu(x: mx.array) -> mx.array:
    """SiLU: the fast polynomial form for float32 on CPU, MLX's own elsewhere."""
    if x.dtype == mx.float32 and backend.INFO.on_cpu:
        return fast_silu(x)
    return nn.silu(x)


def kernels_module():
    """The kernels module where MLX computes on the CPU and they are installed, wanted and built
    against this MLX (`backend.INFO.kernels`), else None: read at each graph, so a `--device`
    given after import reaches here."""
    return backend.INFO.kernels


def kernels_on() -> bool:
    """Whether the compiled kernels are in use."""
    return backend.INFO.kernels is not None


def kernels_status() -> str:
    """`on (...)`, or `off (why)`: whether the compiled kernels are in use (`mlxtoy doctor`)."""
    K = kernels_module()
    if K is not None:
        team = "MKL's OpenMP threads" if K.openmp() else "their own pool"
        gemms = ("the kernels' GEMM or the BLAS, whichever measures faster per shape (`doctor --calibrate`)"
                 if gemm_on() else "the BLAS")
        quantized = ("AVX-512 VNNI integer products (4 and 8 bits)" if quant_vnni() else
                     "AVX2 16-bit integer products (4 bits; 8 bits in float32)" if K.quant_x16_ok() else "float32")
        return (f"on ({K.forms()} forms, {K.threads()} threads: {team}; float32 products of many rows: {gemms}; "
                f"decoding from a quantized base: {quantized})")
    if not backend.INFO.on_cpu:
        return f"off (device {backend.INFO.device}: the kernels are for the CPU)"
    why = backend.cpu_kernels()[1]
    if why == "not installed":
        return f"off (not built: {backend.KERNELS_WHERE})"
    return f"off ({why})"


def kernel_ok(*arrays: mx.array) -> bool:
    return backend.INFO.kernels is not None and all(a.dtype == mx.float32 for a in arrays)


def single_cotangent(c):
    """A custom function's one cotangent (MLX hands a one-output function's as a list)."""
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


def bare(*arrays: mx.array) -> bool:
    """The kernels apply and no gradient is wanted (inside `inference()`)."""
    return getattr(_MODE, "inference", False) and kernel_ok(*arrays)


# --- RMSNorm, SwiGLU, decode GEMV --------------------------------------------------------------

_RMS_NORMS: dict = {}


def _kernel_rms_norm(eps: float):
    fn = _RMS_NORMS.get(eps)
    if fn is None:
        @mx.custom_function
        def fn(x, w):
            return kernels_module().rms_norm(x, w, eps)

        @fn.vjp
        def fn_vjp(primals, cotangent, output):
            x, w = primals
            dx, dw = kernels_module().rms_norm_grad(x, w, single_cotangent(cotangent), eps)
            return dx, dw

        _RMS_NORMS[eps] = fn
    return fn


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """weight * x / sqrt(mean(x^2) + eps) over the last axis."""
    if bare(x, weight):
        return kernels_module().rms_norm(x, weight, eps)
    if kernel_ok(x, weight):
        return _kernel_rms_norm(eps)(x, weight)
    return mx.fast.rms_norm(x, weight, eps)


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm (same parameters) through `rms_norm`."""

    def __call__(self, x: mx.array) -> mx.array:
        return rms_norm(x, self["weight"], self.eps)


@mx.custom_function
def _kernel_swiglu(a, b):
    return kernels_module().swiglu(a, b)


@_kernel_swiglu.vjp
def _kernel_swiglu_vjp(primals, cotangent, output):
    a, b = primals
    da, db = kernels_module().swiglu_grad(a, b, single_cotangent(cotangent))
    return da, db


@compiled(shapeless=True)
def _compiled_swiglu(a: mx.array, b: mx.array) -> mx.array:
    return nn.silu(a) * b


def swiglu(a: mx.array, b: mx.array) -> mx.array:
    """silu(a) * b (the SwiGLU FFN's gate times its up projection). Off the CPU's float32 forms,
    one compiled kernel (as mlx-lm's), where MLX's SiLU and the product were two a block."""
    if bare(a, b):
        return kernels_module().swiglu(a, b)
    if kernel_ok(a, b):
        return _kernel_swiglu(a, b)
    if a.dtype == mx.float32 and backend.INFO.on_cpu:
        return silu(a) * b
    return _compiled_swiglu(a, b)


GEMV_ROWS = 4  # at most this many rows of x take the threaded GEMVs, float32 and quantized (decoding)


def _takes_gemv(x: mx.array, weight: mx.array) -> bool:
    return x.size <= GEMV_ROWS * x.shape[-1] and kernel_ok(x, weight)


@mx.custom_function
def _kernel_gemv(x, ws):
    return kernels_module().gemv_many(x, ws)


@_kernel_gemv.vjp
def _kernel_gemv_vjp(primals, cotangents, outputs):
    x, ws = primals
    K = x.shape[-1]
    rows = x.reshape(-1, K)
    flat = [g.reshape(rows.shape[0], -1) for g in cotangents]  # (rows, N) per weight
    dx = sum(g @ w.reshape(-1, K) for g, w in zip(flat, ws)).reshape(x.shape)
    return dx, [(g.T @ rows).reshape(w.shape) for g, w in zip(flat, ws)]


def _gemv(x: mx.array, ws: list[mx.array]) -> list[mx.array]:
    return kernels_module().gemv_many(x, ws) if bare(x) else _kernel_gemv(x, ws)


def gemm_on() -> bool:
    """Whether the kernels' GEMM runs here (the kernels on, an x86-64 CPU with AVX-512 or AVX2, and not
    MLXTOY_GEMM=0); whether a product takes it is then measured per shape (`gemm_route`)."""
    K = kernels_module()
    return K is not None and K.gemm_ok() and settings.GEMM.value() is not False


_ROUTES: routes.RouteTable | None = None
# Products smaller than this (multiply-adds) are not measured: they cost microseconds either way,
# and a choice that could differ from process to process would change the last bits of the small
# models' values (the tests compare processes bit for bit); they take the kernels' GEMM.
ROUTED_MACS = 1 << 22
ROUTE_ROWS = (64, 256)  # rows classes of a product (a prompt's few rows, a batch's many), measured at these


def route_table() -> routes.RouteTable:
    """This machine's measured routes (`mlxtoy.routes`), read from the cache once a process."""
    global _ROUTES
    if _ROUTES is None:
        path = settings.ROUTES.value() or str(settings.cache_dir() / routes.ROUTES_FILE)
        _ROUTES = routes.RouteTable(path, backend.route_fingerprint())
        _ROUTES.load()
    return _ROUTES


def use_route_table(table: routes.RouteTable | None) -> routes.RouteTable | None:
    """Route by `table` from now on (None: the cache's, read again); returns the one before."""
    global _ROUTES
    before, _ROUTES = _ROUTES, table
    return before


_FORMS = {"nt": (False, True), "nn": (False, False), "tn": (True, False)}  # (trans_a, trans_b)


def _evaluated(product) -> routes.Candidate:
    def run():
        y = product()
        mx.eval(y)
        return [y]
    return run


# a dimension past this (a vocabulary) is measured at this: its rate per multiply-add is the same,
# and timing the whole product took seconds of a run's first step
MEASURED_WIDTH = 8192


def _measured(M: int, N: int, K: int) -> tuple[int, int, float]:
    """The widths a product (M, K) @ (K, N) is timed at, and the flops of that timing."""
    N, K = min(N, MEASURED_WIDTH), min(K, MEASURED_WIDTH)
    return N, K, 2.0 * M * N * K


def _gemm_candidates(form: str, M: int, N: int, K: int) -> tuple[dict[str, routes.Candidate], float]:
    """The BLAS (MLX's matmul; the reference) and the kernels' GEMM on random operands of one
    product's form, op(a) (M, K) @ op(b) (K, N), at its measured widths; and their flops."""
    trans_a, trans_b = _FORMS[form]
    N, K, flops = _measured(M, N, K)
    rng = np.random.default_rng(0)  # not MLX's key: measuring must not move the run's randomness
    a = mx.array(rng.standard_normal((K, M) if trans_a else (M, K), dtype=np.float32))
    b = mx.array(rng.standard_normal((N, K) if trans_b else (K, N), dtype=np.float32))
    mx.eval(a, b)
    return {"blas": _evaluated(lambda: (a.T if trans_a else a) @ (b.T if trans_b else b)),
            "kernels": _evaluated(lambda: kernels_module().gemm(a, b, trans_a, trans_b))}, flops


def gemm_route(form: str, M: int, N: int, K: int) -> bool:
    """Whether op(a) (M, K) @ op(b) (K, N) takes the kernels' GEMM (else the BLAS): MLXTOY_GEMM
    where set, the kernels' below ROUTED_MACS, else what measuring this shape class here chose
    (`route_table`; the first time it is met, measured now: about a second for a 1B model)."""
    if not gemm_on():
        return False
    if settings.GEMM.value() is True or M * N * K < ROUTED_MACS:
        return True
    rows = next((r for r in ROUTE_ROWS if M <= r), ROUTE_ROWS[-1])
    table = route_table()
    shape = (form, rows, N, K)
    if table.due("gemm", shape):
        with mx.stream(mx.cpu):
            table.choose("gemm", shape, *_gemm_candidates(form, rows, N, K), f"float32 product {form} {rows} x {K} x {N}")
    return table.chosen("gemm", shape).route == "kernels"


def _rows(x: mx.array) -> int:
    return x.size // x.shape[-1]


def _flat(w: mx.array) -> tuple[int, int]:
    return w.size // w.shape[-1], w.shape[-1]


def _takes_gemm(x: mx.array, *weights: mx.array, training: bool = False) -> bool:
    """Whether x @ w.T for each w takes the kernels' GEMM: its forward's route, or with
    `training` any of the forward's and the input gradient's (each then takes its own: `gemm`)."""
    if not (gemm_on() and kernel_ok(x, *weights)):
        return False
    M = _rows(x)
    for w in weights:
        n_out, k_in = _flat(w)
        if not (gemm_route("nt", M, n_out, k_in) or (training and gemm_route("nn", M, k_in, n_out))):
            return False
    return True


@mx.custom_function
def _kernel_linear(x, w):
    return gemm(x.reshape(-1, x.shape[-1]), w, trans_b=True).reshape(*x.shape[:-1], w.shape[0])


@_kernel_linear.vjp
def _kernel_linear_vjp(primals, cotangent, output):
    x, w = primals
    rows = x.reshape(-1, x.shape[-1])
    g = single_cotangent(cotangent).reshape(rows.shape[0], -1)
    return gemm(g, w).reshape(x.shape), gemm(g, rows, trans_a=True)  # dY W, dY^T X: each its own route


def gemm(a: mx.array, b: mx.array, trans_a: bool = False, trans_b: bool = False, trans_out: bool = False) -> mx.array:
    """op(a) @ op(b), or its transpose with trans_out, op a transposition where asked, for 2-D a
    and b; no gradient. The kernels' GEMM where it applies and its route is the faster here
    (`gemm_route`), else MLX's matmul (the BLAS); either lays a transposed output out by rows (a
    strided y.T would be copied whole by the kernel reading it: the loss by columns)."""
    M, K = (a.shape[1], a.shape[0]) if trans_a else a.shape
    N = b.shape[0] if trans_b else b.shape[1]
    form = next((f for f, trans in _FORMS.items() if trans == (trans_a, trans_b)), None)
    if kernel_ok(a, b) and gemm_on() and (form is None or gemm_route(form, M, N, K)):
        return kernels_module().gemm(a, b, trans_a, trans_b, trans_out)
    if trans_out:
        return (b if trans_b else b.T) @ (a if trans_a else a.T)
    return (a.T if trans_a else a) @ (b.T if trans_b else b)


FEW_ROWS = 32  # up to this many rows (a batch of decoded tokens), the threaded GEMV is a route
FEW_ROUTED_MACS = 1 << 20  # a batch's products smaller than this take the BLAS unmeasured


def _few_rows_candidates(M: int, N: int, K: int) -> tuple[dict[str, routes.Candidate], float]:
    N, K, flops = _measured(M, N, K)
    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((M, K), dtype=np.float32))
    w = mx.array(rng.standard_normal((N, K), dtype=np.float32))
    mx.eval(x, w)
    return ({"blas": _evaluated(lambda: x @ w.T), "gemv": _evaluated(lambda: kernels_module().gemv_many(x, [w])[0])}
            | ({"kernels": _evaluated(lambda: kernels_module().gemm_many(x, [w])[0])} if gemm_on() else {})), flops


def _few_rows_route(x: mx.array, *weights: mx.array) -> str | None:
    """For a few rows of x (a batch of decoded tokens, no gradient): the route every weight's
    product takes, measured per rows class and matrix (`route_table`) like the products of many
    rows: "gemv" (the threaded GEMV, every row against each block of a weight's rows while it is
    in cache), "kernels" (the kernels' GEMM, where it runs), "blas" (whose products of a few rows
    can run on one thread), or "mixed" where the weights' routes differ; None where x is not a
    few rows, or a product is too small to measure (the BLAS, as before these were measured)."""
    M = _rows(x)
    if not (GEMV_ROWS < M <= FEW_ROWS and bare(x) and kernel_ok(*weights)):
        return None
    rows = 8 if M <= 8 else FEW_ROWS
    table = route_table()
    names = ["blas", "gemv"] + (["kernels"] if gemm_on() else [])  # those of _few_rows_candidates
    chosen = set()
    for w in weights:
        shape = (rows, *_flat(w))
        if rows * w.size < FEW_ROUTED_MACS:
            return None
        route = table.kept_route("few", shape, names)
        if route is None:
            with mx.stream(mx.cpu):
                route = table.choose("few", shape, *_few_rows_candidates(*shape),
                                     f"float32 product of {rows} rows x {shape[2]} x {shape[1]}")
        chosen.add(route)
    return chosen.pop() if len(chosen) == 1 else "mixed"


def linear(x: mx.array, weight: mx.array) -> mx.array:
    """x @ weight.T; a few rows of x (decoding) take the threaded GEMV kernel, many rows the
    kernels' GEMM where it applies (with its gradient, or bare inside `inference()`)."""
    if _takes_gemv(x, weight):
        return _gemv(x, [weight])[0]
    few = _few_rows_route(x, weight)
    if few == "gemv":
        return _gemv(x, [weight])[0]
    if few is not None:
        return kernels_module().gemm_many(x, [weight])[0] if few == "kernels" else x @ weight.T
    if _takes_gemm(x, weight, training=not bare(x)):
        return kernels_module().gemm_many(x, [weight])[0] if bare(x) else _kernel_linear(x, weight)
    return x @ weight.T


def linear_many(x: mx.array, weights: list[mx.array]) -> list[mx.array]:
    """[x @ w.T for w in weights], a weight of more axes (..., K) giving x.shape[:-1] +
    w.shape[:-1] (a per-head (heads, d_head, K) weight: (..., heads, d_head)). When decoding
    one threaded GEMV call computes them all (a layer's q, k and v, or its gate and up): one
    split over the threads, and no reshapes around it."""
    if _takes_gemv(x, weights[0]) and kernel_ok(*weights):
        return list(_gemv(x, weights))
    few = _few_rows_route(x, *weights)
    if few == "gemv":
        return list(_gemv(x, weights))
    if few == "kernels":
        return list(kernels_module().gemm_many(x, weights))
    if few is None and _takes_gemm(x, *weights) and bare(x):
        return list(kernels_module().gemm_many(x, weights))
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
        kernel = _takes_gemv(x, w) or _takes_gemm(x, w, training=not bare(x))
        return linear(x, w) + self["bias"] if kernel else mx.addmm(self["bias"], x, w.T)


def rope_kernel_ok(x: mx.array) -> bool:
    """`rope` applies: inside `inference()`, float32 (B, N, T, D) on CPU with the kernels."""
    return x.ndim == 4 and bare(x)


def rope(x: mx.array, offset: int | mx.array, inv_freqs: mx.array, dims: int, traditional: bool,
         scale: float) -> mx.array:
    """mx.fast.rope's forward as one kernel call (no gradient: see `rope_kernel_ok`), with the
    inverse frequencies given (base ** (-2i / dims), or 1 / freqs)."""
    if isinstance(offset, mx.array):
        offset = offset.reshape(1) if offset.dtype == mx.int32 else offset.astype(mx.int32).reshape(1)
    else:
        offset = mx.array([offset], dtype=mx.int32)
    return kernels_module().rope(x, offset, inv_freqs, dims, traditional, scale)


FUSED_DECODE = settings.FUSED_DECODE.value()  # tests compare both ways
PACKED_DECODE = settings.PACKED_DECODE.value()
PACK_FORMS = {18: "q4_0", 24: "q4", 28: "q5", 34: "q8_0", 40: "q8"}  # a packed block's bytes (32 weights) -> its form


def quant_vnni() -> bool:
    """Whether `quant_linear`'s 4- and 8-bit GEMV (groups of 32) runs as AVX-512 VNNI integer
    products here (x rounded to 16 bits a group) rather than in float32."""
    return kernels_module() is not None and kernels_module().quant_vnni_ok()


def pack_lossless(w: mx.array) -> mx.array | None:
    """w (..., K) packed for decoding in the first form (the kernels' `pack`) that holds every
    weight exactly: q4_0, q8_0 (a Q4_0 / Q8_0 / Q5_0 GGUF's blocks), q4 (Q4_1's, Q4_K's), q8 (a d
    per 16: Q6_K's), q5 (Q5_1's, Q5_K's; slower to make). None where none does, no kernels,
    MLXTOY_PACKED_DECODE=0."""
    if not (PACKED_DECODE and kernel_ok(w) and w.ndim >= 2 and w.shape[-1] % 32 == 0):
        return None
    for form in ("q4_0", "q4", "q8_0", "q8", "q5"):
        packed, ok = kernels_module().pack(w, form)
        mx.eval(packed, ok)
        if ok.item():
            return packed
    return None


def linear_packed(x: mx.array, packed: mx.array) -> mx.array:
    """x @ w.T for a few rows of x and w packed by `pack_lossless` (2-D), threaded; no gradient."""
    return kernels_module().gemv_packed(x, packed)


def decode_block_ok(x: mx.array, *arrays: mx.array) -> bool:
    """`decode_block` applies: inside `inference()`, x (B, T, D), float32 arrays (and an affine
    matrix's uint32 words) on CPU with the kernels (MLXTOY_FUSED_DECODE=0 turns it off)."""
    return FUSED_DECODE and x.ndim == 3 and bare(x, *(a for a in arrays if a.dtype != mx.uint32))


class AffineMatrix(NamedTuple):
    """A matrix `decode_block` reads in MLX's affine layout as it is: 4 or 8 bits in groups of 32
    (`affine_decode_ok`), words (.., d_in * bits / 32) shaped as the float32 matrix's leading axes,
    scales and biases (rows, d_in / 32); symmetric: the biases are -2^(bits - 1) scales (Q4_0's,
    Q8_0's), never read."""
    words: mx.array
    scales: mx.array
    biases: mx.array
    symmetric: bool


def affine_decode_ok(d_in: int, bits: int = 4) -> bool:
    """Whether `decode_block` takes an affine matrix of these bits (groups of 32) and this width
    here: where the quantized GEMV has an integer form (4 bits: AVX-512 VNNI or AVX2; 8 bits:
    VNNI), whose values it then gives."""
    return kernels_module() is not None and kernels_module().quant_integer_form(d_in, 32, bits)


def decode_block(x: mx.array, weights: list[mx.array | AffineMatrix], biases: list[mx.array], keys: mx.array,
                 values: mx.array, offset: mx.array, starts: mx.array | None, inv_freqs: mx.array,
                 rope_dims: int, traditional: bool, eps: float, attn_scale: float,
                 rope_scale: float, low_rank: dict[int, tuple[mx.array, mx.array, mx.array | None]] | None = None,
                 ids: mx.array | None = None) -> tuple[mx.array, mx.array, mx.array]:
    """A pre-norm Llama block's step for T new tokens of each of B rows (x (B, T, D)) as one
    kernel call -> (x, keys, values): weights [attn_norm, q, k, v (per head), o, ffn_norm, gate,
    up, down] (a matrix float32, `pack_lossless`ed or an AffineMatrix), biases [] or [q, k, v]; token t's k
    (RoPE'd, as `rope`) and v go into slot offset + t of the caches ((B, KV, S, Dh)), written in
    place (the returned caches share the given ones' buffers: the caller keeps no other use of
    them), and its query attends to slots starts[b]..offset + t (a left-padded batch; None: all
    from 0; a padding slot, before starts[b], sees itself only), at its own position
    offset + t - starts[b]. low_rank {i: (A (S, r, in), B (S, out, r), k (S, out) or None)}: B[s] (A[s] v)
    added to each row's product by weights[i] (an adapter's, its scale in B), then times k[s]
    (DoRA), then a bias, before RoPE; s = ids[b] (ids (B,) int32; None: slot 0). The same values
    as the block's kernels one by one (a low-rank update within rounding of MLX's products)."""
    offset = offset.reshape(1) if offset.dtype == mx.int32 else offset.astype(mx.int32).reshape(1)
    if starts is not None and starts.size != x.shape[0]:  # one start for every row
        starts = mx.broadcast_to(starts.reshape(-1), (x.shape[0],))
    starts = None if starts is None else starts.astype(mx.int32)
    affine = [a for w in weights if isinstance(w, AffineMatrix) for a in (w.scales, w.biases)]
    symmetric = sum(1 << i for i, w in enumerate(weights) if isinstance(w, AffineMatrix) and w.symmetric)
    weights = [w.words if isinstance(w, AffineMatrix) else w for w in weights]
    low_rank = dict(sorted((low_rank or {}).items()))
    factors = [f.astype(mx.float32) for u in low_rank.values() for f in u if f is not None]
    return tuple(kernels_module().decode_block(
        x, weights, biases, keys, values, offset, inv_freqs, rope_dims, traditional, eps, attn_scale, rope_scale,
        starts=starts, affine=affine, symmetric=symmetric, low_rank=factors, low_rank_of=sum(1 << i for i in low_rank),
        dora_of=sum(1 << i for i, u in low_rank.items() if u[2] is not None), ids=ids))


# --- optimizer ---------------------------------------------------------------------------------

def sum_squares(x: mx.array) -> mx.array:
    """sum(x^2) as a float32 scalar (a gradient norm's part); the kernel sums in double over
    fixed blocks, threaded, the same bits on any thread count."""
    if x.size and kernel_ok(x):
        return kernels_module().sum_squares(x).reshape(())
    return mx.sum(mx.square(x.astype(mx.float32)))


def adamw_step(parameter: mx.array, gradient: mx.array, m: mx.array, v: mx.array, lr: mx.array,
               ok: mx.array, grad_scale: mx.array | None, betas: tuple[float, float], eps: float,
               weight_decay: float) -> tuple[mx.array, mx.array, mx.array] | None:
    """One AdamW step without bias correction on gradient * grad_scale (None: 1) -> (parameter,
    m, v), the old three where `ok` is False, as one threaded pass of the kernel (the same bits
    as mlx.optimizers.AdamW on the scaled gradient); None where the kernel does not apply (not
    float32 on CPU with the kernels)."""
    if not kernel_ok(parameter, gradient, m, v):
        return None
    b1, b2 = betas
    scale = mx.ones((1,)) if grad_scale is None else grad_scale.astype(mx.float32).reshape(1)
    scalars = mx.concatenate([lr.astype(mx.float32).reshape(1), ok.astype(mx.float32).reshape(1),
                              mx.array([b1, 1 - b1, b2, 1 - b2, eps, weight_decay], dtype=mx.float32), scale])
    p, m, v = kernels_module().adamw(parameter, gradient, m, v, scalars)
    return p, m, v


def argmax(x: mx.array) -> mx.array:
    """The index (uint32) of the largest entry over the last axis, the first of equal ones, as
    mx.argmax gives it: float32 on CPU takes the threaded kernel (MLX's is one thread through a
    scalar loop, milliseconds a decode step for a batch of rows over a large vocabulary)."""
    if kernel_ok(x) and x.size:
        return kernels_module().argmax(x).reshape(x.shape[:-1])
    return mx.argmax(x, axis=-1)


def logsumexp(x: mx.array) -> mx.array:
    """log(sum(exp(x))) over the last axis (no gradient with the kernel): float32 on CPU takes
    the threaded kernel (MLX's runs its exp on one thread; a sampled token's log-probability
    over a 49K vocabulary cost a millisecond a token), summed in double."""
    if kernel_ok(x) and x.size:
        y = kernels_module().logsumexp(x)
        return y.reshape(x.shape[:-1])
    return mx.logsumexp(x, axis=-1)
