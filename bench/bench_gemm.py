"""float32 GEMM rates on SmolLM2-135M's shapes: the kernels' AVX-512 GEMM vs the BLAS MLX runs on
vs torch, side by side, in one run.

    python bench/bench_gemm.py [--repeats 15]

Shapes: a LoRA/full step's products over 4 x 256 tokens (the forward x W^T, the input's gradient
dY W, the weight's dY^T X, the output projection and its gradient over a 256-token chunk of the
49,152-word vocabulary) and a 128-token prefill's. GFLOP/s from the median of --repeats timed
calls after 3 warm-ups; each product is timed for every engine in turn before the next shape.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlxtoy  # noqa: F401  (fast BLAS first; must come before mlx.core)
import mlx.core as mx
import numpy as np
import torch

from mlxtoy import backend
from mlxtoy.models import fastmath

# name, (M, S, N): op(a) (M, S) @ op(b) (S, N), with a and/or b stored transposed as training has them
SHAPES = [
    ("fwd x W^T, q/o", (1024, 576, 576), False, True),
    ("fwd x W^T, gate/up", (1024, 576, 1536), False, True),
    ("fwd x W^T, down", (1024, 1536, 576), False, True),
    ("dY W, gate/up", (1024, 1536, 576), False, False),
    ("dY^T X, gate/up", (1536, 1024, 576), True, False),
    ("logits h W^T, a chunk", (256, 576, 49152), False, True),
    ("dh over the vocabulary", (256, 49152, 576), True, False),
    ("prefill 128, gate/up", (128, 576, 1536), False, True),
]


def timed(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    print(f"{backend.INFO.describe()}; kernels' GEMM {'on' if fastmath.gemm_on() else 'off (no AVX-512, or MLXTOY_GEMM=0)'}; "
          f"torch {torch.__version__} on {torch.get_num_threads()} threads")
    print(f"{'product':24s} {'M x S x N':>18s} {'kernel':>8s} {'BLAS':>8s} {'torch':>8s}  GFLOP/s")
    rng = np.random.default_rng(0)
    for name, (M, S, N), trans_a, trans_b in SHAPES:
        a = rng.standard_normal((S, M) if trans_a else (M, S)).astype(np.float32)
        b = rng.standard_normal((N, S) if trans_b else (S, N)).astype(np.float32)
        ma, mb = mx.array(a), mx.array(b)
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        mx.eval(ma, mb)
        op_a, op_b = (ma.T if trans_a else ma), (mb.T if trans_b else mb)
        top_a, top_b = (ta.T if trans_a else ta), (tb.T if trans_b else tb)
        flops = 2 * M * S * N / 1e9
        kernel = (flops / timed(lambda: mx.eval(fastmath.gemm(ma, mb, trans_a, trans_b)), args.repeats)
                  if fastmath.gemm_on() else float("nan"))
        blas = flops / timed(lambda: mx.eval(op_a @ op_b), args.repeats)
        tch = flops / timed(lambda: top_a @ top_b, args.repeats)
        print(f"{name:24s} {f'{M} x {S} x {N}':>18s} {kernel:8.1f} {blas:8.1f} {tch:8.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
