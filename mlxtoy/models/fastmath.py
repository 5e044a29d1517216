"""Elementwise maths that MLX's CPU backend computes slowly.

On CPU, MLX's `exp` (and so `sigmoid` and SiLU) runs at ~15-20 ns per element: in a SmolLM2
training step SiLU alone costs about as much as a third of the FFN GEMMs. A range-reduced
polynomial exp (Cody-Waite reduction, degree-6 Taylor on |r| <= ln2/2; relative error ~3e-7,
i.e. float32 rounding level), compiled so the whole SiLU fuses into one kernel, is ~5x faster.
Used on CPU only; Metal and CUDA have fast transcendental units.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlxtoy import backend

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


def _on_cpu() -> bool:
    return backend.INFO.device == "cpu" and backend.os.environ.get("MLXTOY_FAST_MATH", "1") != "0"


_ON_CPU = _on_cpu()


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
    p = _masked_softmax(s, bias).reshape(B, KV, GT, S)
    return p @ v, p


@_grouped_attention.vjp
def _grouped_attention_vjp(primals, cotangents, outputs):
    q, k, v, bias, scale = primals
    d_out = cotangents[0]
    out, p = outputs
    dv = p.swapaxes(-1, -2) @ d_out
    dp = d_out @ v.swapaxes(-1, -2)
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


def attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask=None) -> mx.array:
    """Scaled dot-product attention, q (B, H, T, D), k/v (B, KV, S, D) -> (B, H, T, D); the
    fast form above for float32 prompts on CPU, mx.fast's elsewhere (decoding included)."""
    B, H, T, D = q.shape
    if not (_ON_CPU and q.dtype == mx.float32 and T > 1):
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    KV, S = k.shape[1], k.shape[2]
    bias = additive_mask(mask, T, S)[:, :, None]  # (B|1, 1, 1, T, S)
    out, _ = _grouped_attention(q.reshape(B, KV, (H // KV) * T, D), k, v, bias,
                                mx.array(scale, dtype=q.dtype))
    return out.reshape(B, H, T, D)
