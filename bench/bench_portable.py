"""The path a Mac runs, measured on a CPU: mlxtoy's MLX-only path (MLXTOY_KERNELS=0: the MLX ops
that Metal and CUDA run) against mlx-lm, with mlxtoy's x86 kernels beside them, in one run on the
same MLX, BLAS, model and rows. bench/bench_train.py's harness (SmolLM2-135M float32, LoRA r8
q,v and full fine-tuning, batch 4 x 256, tools alternating), its ratios taken to mlx-lm.

    python bench/bench_portable.py [--steps 8] [--rounds 2] [--methods lora,full] [--batch 4] [--seq 256]

Decoding, the same way: python bench/bench_generate.py --skip llama.cpp mlxtoy-f32
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_train  # noqa: E402

if __name__ == "__main__":
    bench_train.main(sys.argv[1:] + ["--baseline", "mlx-lm"], tools="mlxtoy-mlx,mlx-lm,mlxtoy")
