"""Every `MLXTOY_*` environment switch in one table: its type, default, help, and whether it is
for users or for debugging and benchmarks.

The Python code reads a switch only through `Switch.value()`; the kernels' C++ (kernels/src/pool.h)
reads its own switches, which are listed here so the table is complete. `markdown_table()`
renders the table for docs/platforms.md. No MLX import: `mlxtoy.backend` reads its switches
before `mlx.core` is first imported.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

from mlxtoy.errors import UserError

USER, DEBUG = "user", "debug"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True)
class Switch:
    name: str
    kind: type  # bool, int, float or str
    default: Any
    help: str
    audience: str = USER  # USER: a user may need it; DEBUG: tests, benchmarks, comparisons
    read_by: str = "Python"  # "Python", or "C++" for the kernels' own switches
    choices: tuple[str, ...] | None = None  # for str switches where only these words apply

    def raw(self) -> str:
        return os.environ.get(self.name, "").strip()

    def value(self) -> Any:
        """The switch's value from the environment, typed; the default when unset or empty.
        A bool switch takes 1/0, true/false, yes/no, on/off; an unreadable bool or choice warns on
        stderr and keeps the default (these are read at import, before any `error:` handling),
        an unreadable number is a UserError."""
        raw = self.raw()
        if not raw:
            return self.default
        if self.kind is bool:
            if raw.lower() in _TRUE or raw.lower() in _FALSE:
                return raw.lower() in _TRUE
            print(f"warning: {self.name}={raw!r} is not 0 or 1: using {int(self.default)}", file=sys.stderr)
            return self.default
        if self.kind in (int, float):
            try:
                return self.kind(raw)
            except ValueError:
                raise UserError(f"{self.name}={raw!r}: expected a {self.kind.__name__}") from None
        if self.choices and raw.lower() not in self.choices:
            print(f"warning: {self.name}={raw!r} is not one of {', '.join(self.choices)}: ignored",
                  file=sys.stderr)
            return self.default
        return raw.lower() if self.choices else raw


# --- for users --------------------------------------------------------------------------------
DEVICE = Switch("MLXTOY_DEVICE", str, "", "the device MLX computes on: cpu or gpu (Metal or CUDA); "
                "unset: the GPU where there is one. `--device` sets it for one command",
                choices=("cpu", "gpu"))
DTYPE = Switch("MLXTOY_DTYPE", str, "", "the compute dtype (float32, bfloat16, float16); unset: "
               "float32 on CPU, bfloat16 on a GPU (float16 on an M1/M2, which emulate bfloat16)",
               choices=("float32", "bfloat16", "float16"))
BLAS = Switch("MLXTOY_BLAS", str, "", "Linux: the BLAS loaded for MLX: mkl, openblas, a library's "
              "path, or none; unset: the fastest found (OpenBLAS first on AVX-512 AMD, else MKL)")
KERNELS = Switch("MLXTOY_KERNELS", bool, True, "0: the MLX-only path (the one Metal and CUDA run) "
                 "instead of the x86 CPU kernels of kernels/")
MALLOC = Switch("MLXTOY_MALLOC", str, "", "Linux: `system` keeps glibc's malloc defaults (by default "
                "freed memory is kept for the next step, so a process holds its peak)",
                choices=("system",))
CACHE = Switch("MLXTOY_CACHE", str, "", "where built-in models are unpacked and this machine's "
               "measured routes are kept (default: $XDG_CACHE_HOME/mlxtoy or ~/.cache/mlxtoy)")
MEMORY_GB = Switch("MLXTOY_MEMORY_GB", float, None, "the memory a training step may use, in GB, for "
                   "the memory check (default: Metal's working set, the GPU's memory, or the RAM)")
KERNEL_THREADS = Switch("MLXTOY_KERNEL_THREADS", int, None, "threads of the CPU kernels (default: "
                        "the CPU count, or MKL's OpenMP threads)", read_by="C++")

# --- for tests, benchmarks and comparisons ----------------------------------------------------
GEMM = Switch("MLXTOY_GEMM", bool, None, "float32 products of many rows: 1 the kernels' AVX-512 GEMM, "
              "0 the BLAS; unset: whichever measures faster here, per shape (`doctor --calibrate`)",
              audience=DEBUG)
BLOCK_ATTENTION = Switch("MLXTOY_BLOCK_ATTENTION", bool, None, "attention over many positions: 1 the "
                         "kernels' block attention, 0 never it; unset: whichever of it, MLX's GEMMs around "
                         "the softmax and mx.fast's measures faster here, per shape", audience=DEBUG)
FUSED_DECODE = Switch("MLXTOY_FUSED_DECODE", bool, True, "0: decode op by op instead of one kernel "
                      "call per block", audience=DEBUG)
PACKED_DECODE = Switch("MLXTOY_PACKED_DECODE", bool, True, "0: decode reads float32 weights instead "
                       "of losslessly packed 4/8-bit blocks (bench_generate's F32 row)", audience=DEBUG)
KERNEL_POOL = Switch("MLXTOY_KERNEL_POOL", str, "", "own or openmp: which threads run the kernels "
                     "(default: MKL's OpenMP threads where MKL is loaded)", audience=DEBUG,
                     read_by="C++", choices=("own", "openmp"))
KERNEL_SPINS = Switch("MLXTOY_KERNEL_SPINS", int, 4000, "how long the kernels' own threads spin "
                      "for work before they sleep", audience=DEBUG, read_by="C++")
KERNEL_DONE_SPINS = Switch("MLXTOY_KERNEL_DONE_SPINS", int, 400, "how long the kernels' calling "
                           "thread spins for its workers to finish before it sleeps",
                           audience=DEBUG, read_by="C++")
KERNEL_VNNI = Switch("MLXTOY_KERNEL_VNNI", bool, True, "0: decoding from a 4-bit base multiplies in "
                     "float32 instead of AVX-512 VNNI integer products (x rounded to 16 bits a group)",
                     audience=DEBUG, read_by="C++")
GPU_SLAB_ROWS = Switch("MLXTOY_GPU_SLAB_ROWS", int, 0, "on a GPU, a quantized base's products of at "
                       "least this many rows dequantize slabs into the dense matmul instead of "
                       "mx.quantized_matmul (0: never; bench/gpu_check.sh times both)", audience=DEBUG)

SWITCHES: tuple[Switch, ...] = (DEVICE, DTYPE, BLAS, KERNELS, MALLOC, CACHE, MEMORY_GB, KERNEL_THREADS,
                                GEMM, BLOCK_ATTENTION, FUSED_DECODE, PACKED_DECODE, KERNEL_POOL,
                                KERNEL_SPINS, KERNEL_DONE_SPINS, KERNEL_VNNI, GPU_SLAB_ROWS)


def markdown_table(switches: tuple[Switch, ...] = SWITCHES) -> str:
    """The switches as a Markdown table (docs/platforms.md)."""
    rows = ["| switch | for | default | what it does |", "|---|---|---|---|"]
    for s in switches:
        default = "unset" if s.default in ("", None) else (str(int(s.default)) if s.kind is bool else str(s.default))
        where = s.audience + (" (read by the C++ kernels)" if s.read_by == "C++" else "")
        rows.append(f"| `{s.name}` | {where} | {default} | {s.help.replace('|', '/')} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":  # python -m mlxtoy.settings: the table
    sys.stdout.write(markdown_table())
