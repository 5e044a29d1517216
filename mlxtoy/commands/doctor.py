"""`mlxtoy doctor [--json]`: what a bug report needs to say about this machine and install."""

from __future__ import annotations

import argparse
import json
import platform
import sys

import mlx.core as mx

import mlxtoy
from mlxtoy import backend
from mlxtoy.models import fastmath
from mlxtoy.train import memory


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("doctor", help="versions, device, GPU backends, memory, BLAS, kernels, dtype: "
                                      "for a bug report")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return p


def _gpu_backend(name: str) -> str:
    """"available" or "not available" for MLX's Metal or CUDA backend."""
    module = getattr(mx, name, None)
    available = module is not None and getattr(module, "is_available", lambda: False)()
    return "available" if available else "not available"


def report() -> dict[str, str]:
    """The facts, in the order they are printed."""
    info = backend.INFO
    blas = info.blas or "reference BLAS only (slow)"
    if info.blas_core:
        blas += f" {info.blas_core}"
    if info.blas_path:
        blas += f" ({info.blas_path})"
    figure, what = memory.machine_memory()
    facts = {
        "mlxtoy": mlxtoy.__version__,
        "mlx": mx.__version__,
        "python": platform.python_version() + f" ({sys.executable})",
        "platform": f"{platform.system()} {platform.release()} {platform.machine()}",
        "device": info.device,
        "metal": _gpu_backend("metal"),
        "cuda": _gpu_backend("cuda"),
        "memory": f"{figure / 1e9:.1f} GB ({what})" if figure else f"unknown ({what})",
        "blas": blas,
        "kernels": "on" if fastmath.KERNELS else fastmath.kernels_status(),
    }
    if fastmath.KERNELS:
        facts["kernels detail"] = fastmath.kernels_status().removeprefix("on (").removesuffix(")")
        facts["kernels built for"] = f"MLX {backend.kernels_stamp()}"
    facts["compute dtype"] = str(info.compute_dtype).replace("mlx.core.", "")
    return facts


def run(args) -> int:
    facts = report()
    if args.json:
        print(json.dumps(facts, indent=2))
    else:
        for key, value in facts.items():
            print(f"{key}: {value}")
    return 0
