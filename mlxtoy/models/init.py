"""The from-scratch initialisation every architecture shares (scaled normal init)."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

EMBED_STD = 0.02  # embeddings (token and position) ~ N(0, EMBED_STD)


def init_scratch(model: nn.Module, seed: int, init_scale: float = 1.0) -> nn.Module:
    """The scaled normal initialisation: norms 1, biases 0, matmul weights N(0, init_scale/sqrt(fan_in)),
    embeddings N(0, 0.02); one key per parameter (sorted names), so the result depends only on
    the seed and the shapes."""
    key = mx.random.key(seed)
    new = {}
    for i, (name, p) in enumerate(sorted(tree_flatten(model.parameters()))):
        k = mx.random.fold_in(key, i) if hasattr(mx.random, "fold_in") else mx.random.split(key, i + 2)[i + 1]
        if name.endswith("norm.weight"):
            v = mx.ones(p.shape)
        elif name.endswith(".bias"):
            v = mx.zeros(p.shape)
        elif name.startswith(("tok_embeddings", "pos_embeddings")):
            v = EMBED_STD * mx.random.normal(p.shape, key=k)
        else:
            fan_in = p.shape[-1]  # (out, in) and per-head (H, Dh, in)
            v = (init_scale / math.sqrt(fan_in)) * mx.random.normal(p.shape, key=k)
        new[name] = v.astype(p.dtype)
    model.load_weights(list(new.items()))
    mx.eval(model.parameters())
    return model
