"""Whether a short prompt's tokens go through a Llama block as one call of the fused kernel (the
decode block's prefill: each weight read once for all the tokens, the products as several-rows
GEMVs) or op by op (the products as GEMMs: the BLAS or the kernels' GEMM). The fused call reads
the weights once, which wins while the products are few rows and bound by reading them; the
GEMMs win once there are enough rows to be bound by arithmetic. Where that happens depends on
the CPU, the BLAS and the weights' form (float32 or packed 4-/8-bit blocks), so it is measured
here per rows class and block shape, like the products' routes (`mlxtoy.routes`)."""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx

from mlxtoy.models import fastmath
from mlxtoy.models.cache import KVCache

# At most this many new tokens (all rows together) may take the fused prefill: beyond it the
# GEMMs are the route, unmeasured (0 sends every prompt op by op; the tests set it so).
PREFILL_FUSED_ROWS = 128
# Up to this many the fused call is taken unmeasured: its products are GEMVs bound by reading
# the weights, as a decode step's are.
PREFILL_UNMEASURED_ROWS = 4


def prefill_fits(x: mx.array, mask: Any, cache: Any) -> bool:
    """Whether a block's call on `x` with this cache may be the fused kernel's prefill: a KVCache,
    at most PREFILL_FUSED_ROWS new tokens, and the mask the kernel applies itself (causal: none
    or "causal" for a cache without starts; a left-padded batch's mask is its starts', which is
    what `mlxtoy.engine` passes)."""
    return (isinstance(cache, KVCache) and 0 < x.shape[0] * x.shape[1] <= PREFILL_FUSED_ROWS
            and (cache.starts is not None or mask is None or isinstance(mask, str)))


def rows_class(rows: int) -> int:
    """The rows a prefill of `rows` new tokens is measured at: the next power of two, from 8."""
    return max(8, 1 << (rows - 1).bit_length())


def prefill_route(rows: int, shape: tuple, macs: int, fused: Callable[[mx.array, KVCache], mx.array | None],
                  ops: Callable[[mx.array, KVCache], mx.array]) -> str:
    """"fused" or "ops" for a prefill of `rows` new tokens through a block of `shape` (its
    dimensions and its matrices' forms; `macs` its matrices' multiply-adds a token, which the
    measured rates are reported in), measured once per rows class on this machine: each of
    `fused(x, cache)` and `ops(x, cache)` (the block's two ways, "ops" the reference whose values
    the fused call must give) runs on random tokens with a fresh cache."""
    if rows <= PREFILL_UNMEASURED_ROWS:
        return "fused"
    n = rows_class(rows)
    key = (n, *shape)
    table = fastmath.route_table()
    kept = table.kept_route("prefill", key, ["ops", "fused"])
    if kept is not None:
        return kept
    d_model = shape[0]
    x = mx.random.normal((1, n, d_model), key=mx.random.key(0))
    mx.eval(x)

    def run(way: Callable[[mx.array, KVCache], mx.array | None]) -> Callable[[], list]:
        def once() -> list:
            cache = KVCache()
            y = way(x, cache)
            if y is None:  # the kernel does not apply after all: no values, never the route
                return []
            mx.eval(y, cache.keys, cache.values)
            return [y]
        return once

    with mx.stream(mx.cpu):
        return table.choose("prefill", key, {"ops": run(ops), "fused": run(fused)}, 2.0 * n * macs,
                            f"prefill of {n} tokens through a block {d_model} x {shape[1]} ({shape[5]})")
