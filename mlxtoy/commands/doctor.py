"""`mlxtoy doctor [--json]`: what a bug report needs to say about this machine and install."""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import mlx.core as mx

import mlxtoy
from mlxtoy import backend, cpujit, cpublas, settings
from mlxtoy.models import calibrate, fastmath
from mlxtoy.train import logprobs


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("doctor", help="versions, device, GPU backends, memory, BLAS, kernels, dtype: "
                                      "for a bug report")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--calibrate", action="store_true",
                   help="measure which route (the kernels' GEMM or the BLAS, the attention forms, the fused "
                        "block or op by op for a short prompt) runs each shape class of the built-in "
                        "model's and a 1B model's training and prompt steps fastest here, keep the choices, and "
                        "show them with each route's GFLOP/s; a choice already kept is measured again, each route "
                        "rated by its better look (run it on an idle machine, not between a run and its resume: "
                        "a route changed there changes the resumed run's sums)")
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
    if info.blas and platform.system() == "Linux":
        measured = cpublas.measured_blas(cpublas.blas_paths())
        blas += ("; measured fastest here" if measured == info.blas else
                 "; not measured here (`mlxtoy doctor --calibrate`)" if measured is None else
                 f"; {measured} measured fastest here, {settings.BLAS.name} chose this" if settings.BLAS.value() else
                 f"; {measured} measured fastest here, loaded from the next command on")
    figure, what = info.memory_budget()
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
        "kernels": "on" if fastmath.kernels_on() else fastmath.kernels_status(),
    }
    if fastmath.kernels_on():
        facts["kernels detail"] = fastmath.kernels_status().removeprefix("on (").removesuffix(")")
        facts["kernels built for"] = f"MLX {backend.kernels_stamp()}"
    if info.on_cpu:
        facts["kernel compiles"] = jit_summary()
    facts["compute dtype"] = str(info.compute_dtype).replace("mlx.core.", "")
    facts["compute dtype why"] = info.dtype_why
    # every MLXTOY_* switch that is set, with its value (and what is wrong with it)
    facts["switches"] = ", ".join(f"{k}={v}" for k, v in settings.set_switches().items()) or "none set"
    return facts


def jit_summary() -> str:
    """Whether MLX's CPU kernels compile with mlxtoy's precompiled header (`mlxtoy.cpujit`)."""
    why = cpujit.unavailable()
    if why is not None:
        return f"MLX's own (no precompiled header: {why})"
    if cpujit.header_path().exists():
        return f"with a precompiled header ({cpujit.header_path()})"
    return "with a precompiled header, made by the next training run or `mlxtoy doctor --calibrate`"


def routes_summary() -> str:
    """How many shape classes this machine has measured routes for, and where they are kept."""
    if not backend.INFO.on_cpu:
        return f"not measured (device {backend.INFO.device}: MLX's own ops)"
    rows = calibrate.measured()
    kernels = sum(row["route"] in ("kernels", "block", "gemv", "fused") for row in rows)
    where = fastmath.route_table().path
    if not rows:
        return f"none measured yet ({where}; `mlxtoy doctor --calibrate` measures them)"
    return f"{len(rows)} shape classes measured, {kernels} of them to the kernels ({where})"


def _route_line(row: dict) -> str:
    rates = ", ".join(f"{name} {'wrong values' if rate is None else rate}" for name, rate in row["gflops"].items())
    return f"  {row['work']}: {row['route']} (GFLOP/s: {rates}; measured in {row['seconds']} s)"


def run(args) -> int:
    blas_rates = None
    if args.calibrate and backend.INFO.on_cpu:
        start = time.perf_counter()
        print(f"MLX's kernel compiles' precompiled header: {cpujit.build_header()}", file=sys.stderr)
        fastmath.route_table().look_again = True
        blas_rates = calibrate.calibrate_blas()
        for shapes in calibrate.REFERENCE_SHAPES:
            calibrate.calibrate(shapes, batch=4, seq_len=256, training=True)  # a training step
            logprobs.calibrate_loss(4 * 256, shapes.vocab, shapes.d_model)  # and its loss
            calibrate.calibrate(shapes, batch=1, seq_len=256, training=False)  # a prompt
            calibrate.calibrate_prefill(shapes)  # a short prompt: the fused block or op by op
        print(f"calibrated in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    facts = report()
    facts["routes"] = routes_summary()
    if blas_rates:
        shown = ", ".join(f"{kind} {'did not load' if rate is None else f'{rate:.0f}'}" for kind, rate in blas_rates.items())
        facts["blas measured"] = f"GFLOP/s {shown} (the fastest loads from the next command on)"
    if args.json:
        print(json.dumps(facts | ({"routes measured": calibrate.measured()} if args.calibrate else {}), indent=2))
    else:
        for key, value in facts.items():
            print(f"{key}: {value}")
        if args.calibrate:
            for row in calibrate.measured():
                print(_route_line(row))
    return 0
