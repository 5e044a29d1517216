"""Two builds of the kernels in one process, their quantized products timed call by call in turn.

On a shared machine the rate of one process differs from the next by 10-35%, more than most
kernel changes; two builds loaded side by side and alternated see the same machine. Each build is
a folder holding an `_ext*.so` (copy one from `kernels/mlxtoy_kernels/` before and after a change):

    python bench/kernel_ab.py /tmp/before /tmp/after --shapes 1536x576,576x1536 --rows 1,4,32

Prints the best time of each build (of `--reps` rounds of 5 calls), their ratio (above 1: B is
faster), and whether the two give the same bits. On one core: each build has its own pool, and
one's idle workers, spinning for their next job, would take the cores from the other's.
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import time


os.environ["MLXTOY_KERNEL_THREADS"] = "1"  # (read when a build's pool starts)

import numpy as np

import mlxtoy  # noqa: F401  (the BLAS before mlx.core)
import mlx.core as mx


def load_build(folder: str):
    """The `_ext` module of the build in `folder`, loaded beside any other."""
    found = glob.glob(f"{folder}/_ext*.so")
    if not found:
        raise SystemExit(f"{folder}: no _ext*.so")
    spec = importlib.util.spec_from_file_location("_ext", found[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def quantized(rng: np.random.Generator, n: int, k: int, bits: int, symmetric: bool) -> tuple[mx.array, ...]:
    """A random (n, k) matrix quantized by MLX (groups of 32), float16 scales; symmetric: the
    biases -2^(bits - 1) scales (a Q4_0 or Q8_0 block)."""
    words, scales, biases = mx.quantize(mx.array(rng.standard_normal((n, k), dtype=np.float32)), 32, bits)
    scales = scales.astype(mx.float16)
    if symmetric:
        biases = -(2 ** (bits - 1)) * scales.astype(mx.float32)
    return words, scales, biases.astype(mx.float16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", help="folder with build A's _ext*.so")
    ap.add_argument("b", help="folder with build B's _ext*.so")
    ap.add_argument("--shapes", default="1536x576,576x1536", help="N x K of W, comma-separated")
    ap.add_argument("--rows", default="1,4,32", help="rows of x, comma-separated")
    ap.add_argument("--bits", type=int, default=4, choices=(4, 8))
    ap.add_argument("--asymmetric", action="store_true", help="biases of their own (Q4_1), not -2^(bits-1) scales")
    ap.add_argument("--reps", type=int, default=40)
    args = ap.parse_args()
    builds = {"A": load_build(args.a), "B": load_build(args.b)}
    symmetric = not args.asymmetric
    rng = np.random.default_rng(0)
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        w, s, b = quantized(rng, n, k, args.bits, symmetric)
        for rows in (int(r) for r in args.rows.split(",")):
            x = mx.array(rng.standard_normal((rows, k)).astype(np.float32))
            mx.eval(w, s, b, x)

            def call(ext):
                return ext.quant_linear(x, w, s, b, 32, args.bits, symmetric=symmetric, inference=True)

            same = np.array_equal(*(np.array(call(ext)) for ext in builds.values()))
            best = dict.fromkeys(builds, float("inf"))
            for _ in range(args.reps):
                for name, ext in builds.items():
                    t = time.perf_counter()
                    mx.eval([call(ext) for _ in range(5)])
                    best[name] = min(best[name], (time.perf_counter() - t) / 5)
            print(f"{args.bits}-bit {shape}, {rows} rows: A {best['A'] * 1e6:.1f} us, B {best['B'] * 1e6:.1f} us, "
                  f"A/B {best['A'] / best['B']:.3f}, same bits: {same}", flush=True)


if __name__ == "__main__":
    main()
