"""The packed GEMV (what a decoded row reads a GGUF's weights through) in each lossless form, on
the grids the GGUF types load as: G weights/s for one row of x (and a few), with the matrices in
cache and from memory.

    python bench/bench_packed_gemv.py [--rows 1,4] [--repeats 5]

Each case packs random weights quantized by gguf-py (Q4_0, Q4_1, Q8_0, Q5_1) in every form that
holds them (`pack(w, form)`), then times `gemv_packed` over one 6144 x 576 matrix again and again
("in cache": 2.7-3.5 MB) and over 30 of them in turn ("from memory": 80-130 MB), best of
--repeats; the call's own overhead (an MLX eval of a tiny op) is taken off. SmolLM2's blocks are
576 wide. x86 kernels only (the MLX-only path does not read packs).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import mlxtoy  # noqa: F401  (fast BLAS before mlx.core)
import gguf
import mlx.core as mx
from mlxtoy.models import fastmath

Q = gguf.GGMLQuantizationType
FORMS = {Q.Q4_0: ("q4_0", "q4"), Q.Q4_1: ("q4",), Q.Q8_0: ("q8_0", "q8"), Q.Q5_1: ("q5",)}
N, K = 6144, 576


def grid(rng: np.random.Generator, qtype: Q) -> mx.array:
    w = rng.standard_normal((N, K)).astype(np.float32) * 0.02
    return mx.array(gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype).reshape(N, K).astype(np.float32))


def seconds_per_call(fn, calls: int, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    kernels = fastmath.kernels_module()
    if kernels is None:
        raise SystemExit("the kernels are off here (MLXTOY_KERNELS=0, or not built)")
    rng = np.random.default_rng(0)
    tiny = mx.zeros((1,))
    overhead = seconds_per_call(lambda: mx.eval(tiny + 1), 300, args.repeats)
    print(f"{'GGUF type':9} {'form':5} {'rows':>4} {'in cache':>10} {'from memory':>12}  (G weights of W a second, "
          "each times every row of x)")
    for qtype, forms in FORMS.items():
        weights = [grid(rng, qtype) for _ in range(30)]
        for form in forms:
            packs = [kernels.pack(w, form)[0] for w in weights]
            mx.eval(packs)
            for rows in (int(r) for r in args.rows.split(",")):
                x = mx.array(rng.standard_normal((rows, K), dtype=np.float32))
                hot = seconds_per_call(lambda: mx.eval(kernels.gemv_packed(x, packs[0])), 100, args.repeats)
                cold = seconds_per_call(lambda: [mx.eval(kernels.gemv_packed(x, p)) for p in packs], 10, args.repeats)
                rate = lambda s: N * K / max(s - overhead, 1e-9) / 1e9  # noqa: E731
                print(f"{qtype.name:9} {form:5} {rows:4d} {rate(hot):10.1f} {rate(cold / len(packs)):12.1f}")


if __name__ == "__main__":
    main()
