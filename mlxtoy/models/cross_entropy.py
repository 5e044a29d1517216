"""The cross-entropy of logits over a vocabulary and its gradient (softmax - one-hot), with the
kernels where they apply (the threaded logsumexp; logits laid out (V, N), which is how the
kernels' GEMM gives the output layer's products), else compiled MLX."""

from __future__ import annotations

import mlx.core as mx

from mlxtoy.models.compiled import compiled
from mlxtoy.models.fastmath import exp, kernel_ok, kernels_module, kernels_on, logsumexp


@compiled
def _ce_and_dlogits(logits: mx.array, targets: mx.array) -> tuple[mx.array, mx.array]:
    x = logits.astype(mx.float32)
    m = x.max(axis=-1, keepdims=True)
    e = exp(x - m)
    s = e.sum(axis=-1, keepdims=True)
    picked = mx.take_along_axis(x, targets[..., None], axis=-1)[..., 0]
    is_target = mx.arange(x.shape[-1]) == targets[..., None]
    return (m + mx.log(s))[..., 0] - picked, mx.where(is_target, e / s - 1.0, e / s)


@compiled
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
    if kernel_ok(logits) and logits.ndim == 2:
        lse = logsumexp(logits)
        ce = lse - mx.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
        return ce, (_softmax_minus_one_hot(logits, lse, targets) if grad else None)
    ce, d = _ce_and_dlogits(logits, targets)
    return ce, (d if grad else None)


def logits_by_columns() -> bool:
    """Whether losses over a vocabulary take the logits as (V, N): with the kernels."""
    return kernels_on()


def softmax_cross_entropy_columns(logits_t: mx.array, targets: mx.array, grad: bool) -> tuple[mx.array, mx.array | None]:
    """`softmax_cross_entropy` for logits laid out (V, N): (N,) and (V, N) | None."""
    if kernel_ok(logits_t):
        out = kernels_module().cross_entropy_columns(logits_t, targets, grad)
        return out[0], (out[1] if grad else None)
    ce, d = softmax_cross_entropy(logits_t.T, targets, grad)
    return ce, (d.T if grad else None)
