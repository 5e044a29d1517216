"""The CPU fast SiLU equals MLX's SiLU to float32 rounding, in value and gradient."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxtoy.models.fastmath import fast_silu


def test_fast_silu_matches_reference():
    x = mx.concatenate([mx.random.normal((4096,)) * 6, mx.array([-1e4, -90.0, -87.5, -20.0, 0.0, 20.0, 88.5, 1e4])])
    ref = np.asarray(x, dtype=np.float64)
    with np.errstate(over="ignore"):
        ref = ref / (1 + np.exp(-ref))
    got = np.asarray(fast_silu(x), dtype=np.float64)
    assert np.isfinite(got).all()
    # relative error at float32 rounding level; below ~1e-25 (x < -55) both are "zero"
    err = np.abs(got - ref) / np.maximum(np.abs(ref), 1e-25)
    assert np.max(err) < 2e-6


def test_fast_silu_gradient():
    x = mx.random.normal((512, 64)) * 4
    g = mx.random.normal((512, 64))
    ours = mx.grad(lambda x: (fast_silu(x) * g).sum())(x)
    ref = mx.grad(lambda x: (nn.silu(x) * g).sum())(x)
    assert mx.allclose(ours, ref, rtol=1e-5, atol=1e-6).item()
