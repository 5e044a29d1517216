"""Attention over many query positions and the one-query decode step, in the forms the CPU
computes fast, and which of them runs here.

MLX's CPU backend trains through an unfused softmax whose exp is a scalar call per score
(4 x 9 x 256 x 256 scores per SmolLM2 layer). Here the softmax takes the polynomial exp, the
probabilities are kept for the backward pass (which then needs no exp at all), and grouped
query heads share their KV head without a copy: queries of a group are stacked along the rows
("grouped"); where the x86 kernels are on, their block attention computes the probabilities
again in the backward pass instead of keeping them ("block"). Which of these and MLX's own
`mx.fast.scaled_dot_product_attention` ("fast") runs a shape class is measured on this machine
(`mlxtoy.routes`). Metal and CUDA take mx.fast's.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlxtoy import backend, routes, settings
from mlxtoy.models.compiled import compiled
from mlxtoy.models.fastmath import (bare, inference, kernel_ok, kernels_module, poly_exp,
                                    route_table, single_cotangent)

@compiled
def _masked_softmax(s: mx.array, bias: mx.array) -> mx.array:
    s = s + bias
    e = poly_exp(s - s.max(axis=-1, keepdims=True))
    e = mx.where(bias == -mx.inf, 0.0, e)  # exactly zero where masked, as MLX's softmax gives
    return e / e.sum(axis=-1, keepdims=True)


@compiled
def _softmax_input_grad(p: mx.array, dp: mx.array, delta: mx.array) -> mx.array:
    return p * (dp - delta)


@mx.custom_function
def _grouped_attention(q: mx.array, k: mx.array, v: mx.array, bias: mx.array, scale: mx.array):
    """q (B, KV, G*T, D) with each group's queries stacked, k/v (B, KV, S, D), bias
    (B|1, 1, 1, T, S) additive -> (out (B, KV, G*T, D), probabilities (B, KV, G*T, S))."""
    B, KV, GT, _ = q.shape
    T, S = bias.shape[-2:]
    s = ((q * scale) @ k.swapaxes(-1, -2)).reshape(B, KV, GT // T, T, S)
    if kernels_module() is not None:
        p = kernels_module().softmax_bias(s, bias.reshape(bias.shape[0], T, S)).reshape(B, KV, GT, S)
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
    if kernels_module() is not None:
        ds = kernels_module().softmax_grad(p, dp)
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


# Attention smaller than this (B H T S D) is not measured: microseconds either way, and a choice
# that could differ from process to process would change the last bits of small models' values.
ROUTED_WORK = 1 << 22

_DECODE_ATTENTIONS: dict = {}


def _kernel_decode_attention(scale: float):
    """The one-query attention kernel for this scale (its gradient: mx.fast's, recomputed)."""
    fn = _DECODE_ATTENTIONS.get(scale)
    if fn is None:
        def reference(q, k, v, bias):
            return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=bias[:, None, None, :])

        @mx.custom_function
        def fn(q, k, v, bias):
            return kernels_module().decode_attention(q, k, v, bias, scale)

        @fn.vjp
        def fn_vjp(primals, cotangent, output):
            q, k, v, bias = primals
            _, grads = mx.vjp(lambda q, k, v: reference(q, k, v, bias), [q, k, v], [single_cotangent(cotangent)])
            return (*grads, mx.zeros_like(bias))

        _DECODE_ATTENTIONS[scale] = fn
    return fn


def block_attention_on() -> bool:
    """Whether the kernels' block attention may run here. It calls the BLAS from inside their
    threads: only where each call then runs on its calling thread (MKL inside its OpenMP team,
    an OpenBLAS set to one thread); BLAS threads of its own under each of ours would
    oversubscribe the cores. MLXTOY_BLOCK_ATTENTION=0 turns it off."""
    K = kernels_module()
    return K is not None and K.block_attention_ok() and settings.BLOCK_ATTENTION.value() is not False

_BLOCK_ATTENTIONS: dict = {}


def _kernel_block_attention(scale: float):
    """The kernels' attention over many query positions for this scale, with its gradient:
    (q (B, KV, G*T, D), k, v, bias (B|1, T, S)) -> (out, stats): out as `_grouped_attention`'s,
    stats each row's max and 1 / sum, from which the gradient computes the probabilities again."""
    fn = _BLOCK_ATTENTIONS.get(scale)
    if fn is None:
        @mx.custom_function
        def fn(q, k, v, bias):
            return tuple(kernels_module().attention(q, k, v, bias, scale))

        @fn.vjp
        def fn_vjp(primals, cotangents, outputs):
            q, k, v, bias = primals
            dq, dk, dv = kernels_module().attention_grad(q, k, v, bias, outputs[1], cotangents[0], scale)
            return dq, dk, dv, mx.zeros_like(bias)

        _BLOCK_ATTENTIONS[scale] = fn
    return fn


def attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask=None) -> mx.array:
    """Scaled dot-product attention, q (B, H, T, D), k/v (B, KV, S, D) -> (B, H, T, D); the
    fast forms here for float32 on CPU (one query position: the decode kernel, which reads
    no key past the mask's last open one), mx.fast's elsewhere."""
    B, H, T, D = q.shape
    if T == 1 and backend.INFO.on_cpu and kernel_ok(q, k, v):
        S = k.shape[2]
        bias = additive_mask(mask, 1, S)
        bias = bias.reshape(bias.shape[0], S)
        if bare(q):
            return kernels_module().decode_attention(q, k, v, bias, scale)
        return _kernel_decode_attention(scale)(q, k, v, bias)
    if not (backend.INFO.on_cpu and q.dtype == mx.float32 and T > 1):
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    route = attention_route(B, H, k.shape[1], T, k.shape[2], D, training=not bare(q))
    if route == "fast":
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    return _cpu_attention(route, q, k, v, scale, additive_mask(mask, T, k.shape[2]))


def _cpu_attention(route: str, q: mx.array, k: mx.array, v: mx.array, scale: float, bias: mx.array) -> mx.array:
    """Many query positions on the CPU by `route` ("block": the kernels' block attention,
    "grouped": MLX's GEMMs around the softmax), bias (B|1, 1, T, S) additive."""
    B, H, T, D = q.shape
    KV, S = k.shape[1], k.shape[2]
    stacked = q.reshape(B, KV, (H // KV) * T, D)
    if route == "block":
        bias = bias.reshape(bias.shape[0], T, S)
        out = kernels_module().attention(stacked, k, v, bias, scale)[0] if bare(q) else _kernel_block_attention(scale)(stacked, k, v, bias)[0]
    else:
        out, _ = _grouped_attention(stacked, k, v, bias[:, :, None], mx.array(scale, dtype=q.dtype))
    return out.reshape(B, H, T, D)


def _attention_candidates(B: int, H: int, KV: int, T: int, S: int, D: int, training: bool) -> dict[str, routes.Candidate]:
    """MLX's own attention (mx.fast's; the reference), the grouped form, and the kernels' block
    attention where it may run, on random (B, H, T, D) queries with a causal mask: the forward,
    and with `training` the gradients of q, k and v as well."""
    rng = np.random.default_rng(0)
    q, k, v, d_out = (mx.array(rng.standard_normal(shape, dtype=np.float32))
                      for shape in ((B, H, T, D), (B, KV, S, D), (B, KV, S, D), (B, H, T, D)))
    bias = additive_mask("causal", T, S)
    scale = D ** -0.5

    def candidate(route: str) -> routes.Candidate:
        def forward(q, k, v):
            if route == "fast":
                return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=bias)
            return _cpu_attention(route, q, k, v, scale, bias)

        def run():
            if training:
                out, grads = mx.vjp(forward, [q, k, v], [d_out])
                outputs = [out[0], *grads]
            else:
                with inference():
                    outputs = [forward(q, k, v)]
            mx.eval(outputs)
            return outputs
        return run

    names = ["fast", "grouped"] + (["block"] if block_attention_on() else [])
    return {name: candidate(name) for name in names}


def attention_route(B: int, H: int, KV: int, T: int, S: int, D: int, training: bool, measure: bool = True) -> str:
    """How many query positions attend on the CPU in float32: "fast" (mx.fast's), "grouped" or
    "block" (`_cpu_attention`). MLXTOY_BLOCK_ATTENTION=1 forces the block form where it may run,
    a small problem takes the block form (else the grouped one), and any other is measured the
    first time its shape class is met (`route_table`); without `measure` (the memory estimate,
    which must not take a second of a run it may refuse), an unmeasured one is taken as small."""
    if not backend.INFO.on_cpu:
        return "fast"
    block = block_attention_on()
    if block and settings.BLOCK_ATTENTION.value() is True:
        return "block"
    table = route_table()
    # measured for one sequence: the work per row is what differs between the routes
    shape = (H, KV, T, S, D, "train" if training else "infer") + (("block",) if block else ())
    if B * H * T * S * D < ROUTED_WORK or (not measure and table.chosen("attention", shape) is None):
        return "block" if block else "grouped"
    if table.due("attention", shape):
        with mx.stream(mx.cpu):
            flops = 4.0 * H * T * S * D * (3 if training else 1)
            table.choose("attention", shape, _attention_candidates(1, H, KV, T, S, D, training), flops,
                         f"attention {H} heads x {T} x {S} x {D}{' with gradients' if training else ''}")
    return table.chosen("attention", shape).route
