"""Device choice, fast BLAS on Linux CPU, and the compute dtype policy.

MLX's Linux CPU wheel links the reference (netlib) BLAS: ~2.5 GFLOP/s for a float32
GEMM on a 2-core box. Loading an optimized BLAS with global symbols *before* `mlx.core`
is first imported makes MLX's cblas calls resolve to it (~60x faster). This module must
therefore be imported before anything touches `mlx.core`; `mlxtoy/__init__.py` does so.
"""

from __future__ import annotations

import ctypes
import glob
import os
import platform
import sys
import time
from dataclasses import dataclass

_BLAS_NAME: str | None = None
_BLAS_PATH: str | None = None


def _blas_candidates() -> list[tuple[str, str]]:
    """Optimized BLAS libraries we know how to load, best first, as (name, path)."""
    found: list[tuple[str, str]] = []
    override = os.environ.get("MLXTOY_BLAS")
    if override:
        if override.lower() in ("none", "off", "0"):
            return []
        return [("custom", override)]
    prefixes = {sys.prefix, sys.base_prefix, os.path.join(os.path.expanduser("~"), ".local")}
    for prefix in prefixes:
        # PyPI `mkl` drops libmkl_rt into <prefix>/lib.
        for path in sorted(glob.glob(os.path.join(prefix, "lib", "libmkl_rt.so*"))):
            found.append(("mkl", path))
    system_dirs = ["/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib"]
    for d in system_dirs:
        for pattern in ("openblas-pthread/libopenblas.so.0", "libopenblas.so.0", "libopenblasp*.so*",
                        "libblis.so.4"):
            for path in sorted(glob.glob(os.path.join(d, pattern))):
                found.append(("openblas" if "openblas" in path else "blis", path))
    return found


def _load_fast_blas() -> None:
    global _BLAS_NAME, _BLAS_PATH
    if "mlx.core" in sys.modules:
        # Too late to interpose symbols; report honestly rather than pretend.
        _BLAS_NAME = "unknown (mlx.core was imported before mlxtoy)"
        return
    if platform.system() != "Linux":
        _BLAS_NAME = "accelerate" if platform.system() == "Darwin" else None
        return
    threads = str(os.cpu_count() or 1)
    os.environ.setdefault("MKL_NUM_THREADS", threads)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", threads)
    for name, path in _blas_candidates():
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        _BLAS_NAME, _BLAS_PATH = name, path
        if name == "mkl":
            _load_mkl_openmp(os.path.dirname(path))
        return
    _BLAS_NAME = None


def _load_mkl_openmp(lib_dir: str) -> None:
    """MKL's OpenMP runtime (libiomp5, which MKL would otherwise load privately at its first
    GEMM) with global symbols: the kernels' parallel loops (mlxtoy_kernels) then bind to it and
    run on the threads MKL's GEMMs run on, instead of a second set of threads fighting them."""
    for path in sorted(glob.glob(os.path.join(lib_dir, "libiomp5.so*"))):
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            return
        except OSError:
            continue


_load_fast_blas()


def _keep_freed_memory() -> bool:
    """glibc serves allocations over 32 MiB with fresh mmap pages and unmaps them on free, so
    every large array of every step page-faults and is zeroed again by the kernel (a training
    step's logits, softmax and gradients are hundreds of MB each): on Linux CPU this doubled
    the SmolLM2 step time. Serving them from the heap and never trimming it keeps freed memory
    for the next step. The process then holds on to its peak; MLXTOY_MALLOC=system opts out."""
    if platform.system() != "Linux" or os.environ.get("MLXTOY_MALLOC", "").lower() == "system":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
        return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, -1))
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False


_MALLOC_TUNED = _keep_freed_memory()

import mlx.core as mx  # noqa: E402  (must come after the BLAS is loaded)


@dataclass
class BackendInfo:
    device: str  # "metal", "cuda" or "cpu"
    blas: str | None
    blas_path: str | None
    compute_dtype: mx.Dtype

    def describe(self) -> str:
        blas = self.blas or "reference BLAS only (slow: install `mkl` or libopenblas0-pthread)"
        if self.blas_path:
            blas += f" ({self.blas_path})"
        dtype = str(self.compute_dtype).replace("mlx.core.", "")
        return f"device={self.device} blas={blas} compute_dtype={dtype}"


def _pick_device() -> str:
    want = os.environ.get("MLXTOY_DEVICE", "").lower()
    if want == "cpu":
        return "cpu"
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and getattr(cuda, "is_available", lambda: False)():
        return "cuda"
    return "cpu"


def _setup() -> BackendInfo:
    device = _pick_device()
    mx.set_default_device(mx.cpu if device == "cpu" else mx.gpu)
    # bf16/fp16 and quantized matmuls are slow on MLX CPU: compute in float32 there.
    compute = mx.float32 if device == "cpu" else mx.bfloat16
    if os.environ.get("MLXTOY_DTYPE"):
        compute = getattr(mx, os.environ["MLXTOY_DTYPE"])
    return BackendInfo(device, _BLAS_NAME, _BLAS_PATH, compute)


INFO = _setup()


def compute_dtype() -> mx.Dtype:
    return INFO.compute_dtype


def gemm_gflops(n: int = 1024, repeats: int = 10) -> float:
    """Measured float32 GEMM throughput on the default device."""
    a = mx.random.normal((n, n))
    b = mx.random.normal((n, n))
    mx.eval(a @ b)
    start = time.perf_counter()
    for _ in range(repeats):
        mx.eval(a @ b)
    elapsed = time.perf_counter() - start
    return 2 * n**3 * repeats / elapsed / 1e9
