"""Every `MLXTOY_*` environment switch in one table: its type, default, valid values, help, and
whether it is for users or for debugging and benchmarks.

The Python code reads a switch only through `Switch.value()`; the kernels' C++ (kernels/src/pool.h)
reads its own switches, which are listed here so the table is complete and checked the same way.
Every value is checked by one rule (`Switch.parse`): a wrong one is refused (numbers, paths: the
CLI's `check_all` at start, one `error:` line, exit 2) or, where a fallback is safe (on/off
switches, words from a list, the BLAS), warned about once on stderr and replaced by the default;
never ignored. `markdown_table()` renders the table for docs/platforms.md. No MLX import:
`mlxtoy.backend` reads its switches before `mlx.core` is first imported.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from mlxtoy.errors import UserError

USER, DEBUG = "user", "debug"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_WARNED: set[str] = set()  # warnings already given: each is said once a process


def at_least(low: float) -> Callable[[Any], str | None]:
    return lambda v: None if v >= low else f"must be >= {low:g}"


def above(low: float) -> Callable[[Any], str | None]:
    return lambda v: None if v > low else f"must be > {low:g}"


def blas_choice(v: str) -> str | None:
    """MLXTOY_BLAS: a name we know or a library file that exists."""
    if v.lower() in ("mkl", "openblas", "none", "off", "0") or os.path.isfile(v):
        return None
    return "is not mkl, openblas, none or an existing library file"


def folder_path(v: str) -> str | None:
    return "is a file, not a folder" if os.path.exists(v) and not os.path.isdir(v) else None


def file_path(v: str) -> str | None:
    return "is a folder, not a file" if os.path.isdir(v) else None


@dataclass(frozen=True)
class Switch:
    name: str
    kind: type  # bool, int, float or str
    default: Any
    help: str
    audience: str = USER  # USER: a user may need it; DEBUG: tests, benchmarks, comparisons
    read_by: str = "Python"  # "Python", or "C++" for the kernels' own switches
    choices: tuple[str, ...] | None = None  # for str switches where only these words apply
    check: Callable[[Any], str | None] | None = None  # why a typed value is wrong (None: it is fine)
    # a wrong value: warned about and replaced by the default (a safe fallback), or refused;
    # None: by kind (on/off switches and word choices warn, numbers and free text refuse)
    falls_back: bool | None = None

    def raw(self) -> str:
        return os.environ.get(self.name, "").strip()

    @property
    def warns(self) -> bool:
        """A wrong value falls back to the default with a warning (else it is refused)."""
        if self.falls_back is not None:
            return self.falls_back
        return self.kind is bool or self.choices is not None

    def parse(self, raw: str | None = None) -> tuple[Any, str | None]:
        """(the typed value, None) or (the default, why `raw` (default: the environment's) is
        wrong): the one rule every switch is checked by."""
        raw = self.raw() if raw is None else raw.strip()
        if not raw:
            return self.default, None
        if self.kind is bool:
            if raw.lower() in _TRUE or raw.lower() in _FALSE:
                return raw.lower() in _TRUE, None
            return self.default, "is not 0 or 1"
        if self.kind in (int, float):
            try:
                value = self.kind(raw)
            except ValueError:
                return self.default, f"expected a {'whole number' if self.kind is int else 'number'}"
            if not math.isfinite(value):
                return self.default, "expected a finite number"
        elif self.choices:
            if raw.lower() not in self.choices:
                return self.default, f"is not one of {', '.join(self.choices)}"
            value = raw.lower()
        else:
            value = raw
        why = self.check(value) if self.check else None
        return (self.default, why) if why else (value, None)

    def problem(self) -> str | None:
        """The one line that says what is wrong with the environment's value, or None."""
        _, why = self.parse()
        if why is None:
            return None
        if self.warns:
            if self.default in ("", None):
                return f"{self.name}={self.raw()!r} {why}: ignored (as if unset)"
            default = int(self.default) if self.kind is bool else self.default
            return f"{self.name}={self.raw()!r} {why}: ignored (using {default})"
        return f"{self.name}={self.raw()!r}: {why}"

    def value(self) -> Any:
        """The switch's value from the environment, typed; the default when unset, empty or
        wrong. A wrong value that falls back is warned about on stderr (once); one that is
        refused is left to `check_all` (which the CLI runs first: these are read at import,
        before any `error:` handling)."""
        value, why = self.parse()
        if why is not None and self.warns:
            self.warn()
        return value

    def warn(self, why: str | None = None) -> None:
        """Say once on stderr that this switch's value is not used (and why)."""
        line = f"{self.name}={self.raw()!r}: {why}" if why else self.problem()
        if line and line not in _WARNED:
            _WARNED.add(line)
            print(f"warning: {line}", file=sys.stderr)


# --- for users --------------------------------------------------------------------------------
DEVICE = Switch("MLXTOY_DEVICE", str, "", "the device MLX computes on: cpu or gpu (Metal or CUDA); "
                "unset: the GPU where there is one. `--device` sets it for one command",
                choices=("cpu", "gpu"))
DTYPE = Switch("MLXTOY_DTYPE", str, "", "the compute dtype (float32, bfloat16, float16); unset: "
               "float32 on CPU, bfloat16 on a GPU (float16 on an M1/M2, which emulate bfloat16)",
               choices=("float32", "bfloat16", "float16"))
BLAS = Switch("MLXTOY_BLAS", str, "", "Linux: the BLAS loaded for MLX: mkl, openblas, a library's "
              "path, or none; unset: the fastest found (OpenBLAS first on AVX-512 AMD, else MKL)",
              check=blas_choice, falls_back=True)
KERNELS = Switch("MLXTOY_KERNELS", bool, True, "0: the MLX-only path (the one Metal and CUDA run) "
                 "instead of the x86 CPU kernels of kernels/")
MALLOC = Switch("MLXTOY_MALLOC", str, "", "Linux: `system` keeps glibc's malloc defaults (by default "
                "freed memory is kept for the next step, so a process holds its peak)",
                choices=("system",))
CACHE = Switch("MLXTOY_CACHE", str, "", "where built-in models are unpacked and this machine's "
               "measured routes are kept (default: $XDG_CACHE_HOME/mlxtoy or ~/.cache/mlxtoy)", check=folder_path)
MEMORY_GB = Switch("MLXTOY_MEMORY_GB", float, None, "the memory a training step may use, in GB, for "
                   "the memory check (default: Metal's working set, the GPU's memory, or the RAM)",
                   check=above(0))
KERNEL_THREADS = Switch("MLXTOY_KERNEL_THREADS", int, None, "threads of the CPU kernels (default: "
                        "the CPU count, or MKL's OpenMP threads)", read_by="C++",
                        check=at_least(1))

# --- for tests, benchmarks and comparisons ----------------------------------------------------
GEMM = Switch("MLXTOY_GEMM", bool, None, "float32 products of many rows: 1 the kernels' GEMM, "
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
                      "for work before they sleep", audience=DEBUG, read_by="C++",
                      check=at_least(0))
KERNEL_DONE_SPINS = Switch("MLXTOY_KERNEL_DONE_SPINS", int, 400, "how long the kernels' calling "
                           "thread spins for its workers to finish before it sleeps",
                           audience=DEBUG, read_by="C++", check=at_least(0))
KERNEL_VNNI = Switch("MLXTOY_KERNEL_VNNI", bool, True, "0: decoding from a 4- or 8-bit base multiplies in "
                     "float32 instead of integer products (AVX-512 VNNI or AVX2; x rounded to 16 bits a group)",
                     audience=DEBUG, read_by="C++")
KERNEL_AVX512 = Switch("MLXTOY_KERNEL_AVX512", bool, True, "0: every kernel takes its AVX2 form on an "
                       "AVX-512 CPU, as an AVX2-only CPU runs them (tests, comparisons)", audience=DEBUG,
                       read_by="C++")
GPU_SLAB_ROWS = Switch("MLXTOY_GPU_SLAB_ROWS", int, 0, "on a GPU, a quantized base's products of at "
                       "least this many rows dequantize slabs into the dense matmul instead of "
                       "mx.quantized_matmul (0: never; bench/gpu_check.sh times both)", audience=DEBUG,
                       check=at_least(0))
JIT_HEADER = Switch("MLXTOY_JIT_HEADER", bool, True, "0: MLX's CPU kernels are compiled without the "
                    "precompiled header mlxtoy makes for them (Linux, g++; each first compile then takes "
                    "~4x as long)", audience=DEBUG)
ROUTES = Switch("MLXTOY_ROUTES", str, "", "the file this machine's measured routes are kept in "
                "(default: routes.json in the cache folder; the tests keep their own)", audience=DEBUG,
                check=file_path)

SWITCHES: tuple[Switch, ...] = (DEVICE, DTYPE, BLAS, KERNELS, MALLOC, CACHE, MEMORY_GB, KERNEL_THREADS,
                                GEMM, BLOCK_ATTENTION, FUSED_DECODE, PACKED_DECODE, KERNEL_POOL,
                                KERNEL_SPINS, KERNEL_DONE_SPINS, KERNEL_VNNI, KERNEL_AVX512, GPU_SLAB_ROWS,
                                JIT_HEADER, ROUTES)


def check_all(switches: tuple[Switch, ...] = SWITCHES) -> None:
    """Check every switch once (the CLI does, before a command runs): a value that falls back is
    warned about, the first that is refused raises one UserError."""
    for s in switches:
        if s.problem() is None:
            continue
        if not s.warns:
            raise UserError(s.problem())
        s.warn()


def set_switches(switches: tuple[Switch, ...] = SWITCHES) -> dict[str, str]:
    """The switches set in the environment: name -> value, with what is wrong with it (doctor)."""
    out = {}
    for s in switches:
        if s.raw():
            why = s.problem()
            out[s.name] = s.raw() + (f" ({why.split(': ', 1)[1] if ': ' in why else why})" if why else "")
    return out


def cache_dir() -> Path:
    """mlxtoy's cache folder (MLXTOY_CACHE): the built-in models, this machine's measured routes."""
    root = CACHE.value() or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mlxtoy")
    return Path(root)


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
