"""Device choice, the compute dtype policy, the CPU kernels and memory limits.

The optimized BLAS must be loaded before `mlx.core` is first imported (`mlxtoy.cpublas`, imported
here first); `mlxtoy/__init__.py` imports this module before anything touches `mlx.core`.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import importlib.metadata
import importlib.util
import math
import os
import platform
import sys
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Iterator

from mlxtoy import cpublas, settings
from mlxtoy.cpublas import cpu_model, package_dir, usable_cores
from mlxtoy.errors import UserError


def _keep_freed_memory() -> bool:
    """glibc serves allocations over 32 MiB with fresh mmap pages and unmaps them on free, so
    every large array of every step page-faults and is zeroed again by the kernel (a training
    step's logits, softmax and gradients are hundreds of MB each): on Linux CPU this doubled
    the SmolLM2 step time. Serving them from the heap and never trimming it keeps freed memory
    for the next step. A thread's arena (a server's decoding thread, the kernels' pool) is not
    bound by the trim threshold: glibc unmaps a heap of it (64 MiB at most) once its top is free
    unless the top pad exceeds that free top plus the previous heap's unused room, each under
    64 MiB; a pad of 128 MiB keeps every heap. The pad is address space, touched only when used.
    The process then holds on to its peak; MLXTOY_MALLOC=system opts out."""
    if platform.system() != "Linux" or settings.MALLOC.value() == "system":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4
        return (bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, -1))
                and bool(libc.mallopt(M_TOP_PAD, 128 << 20)))
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False


_MALLOC_TUNED = _keep_freed_memory()

try:
    import mlx.core as mx  # noqa: E402  (must come after the BLAS is loaded)
except ImportError as e:
    if "libmlx" not in str(e):
        raise
    raise ImportError("MLX is installed without a backend (no libmlx.so): on Linux install one of "
                      "mlxtoy's extras: pip install -e '.[cpu]' (or '.[cuda]' / '.[cuda13]' for an NVIDIA "
                      "GPU with CUDA 12 / 13), never two") from None
from mlx.utils import tree_reduce  # noqa: E402

GB = 1e9
# mlx-lm's rule: a model above this share of Metal's recommended working set still runs, but
# pages in and out of the wired set (slowly); say so before it starts
WIRED_WARN_SHARE = 0.9
# Apple GPUs that run bfloat16 emulated (M1: applegpu_g13*, M2: applegpu_g14*), where float16
# runs at full rate; later families (M3: g15, M4: g16) run bfloat16 natively
EMULATED_BF16_ARCHS = ("applegpu_g13", "applegpu_g14")
# what MLX's backends say when memory runs out: Metal's command buffer, CUDA's allocator and
# runtime, MLX's own allocator
OUT_OF_MEMORY_MARKERS = ("Insufficient Memory", "out of memory", "[malloc] Unable to allocate",
                         "cudaErrorMemoryAllocation")


# What rebuilds the kernels against the MLX installed now (from a checkout of mlxtoy)
KERNELS_FIX = "pip install --no-build-isolation --force-reinstall --no-deps <mlxtoy's source folder>"
# Where mlxtoy's install builds them (setup.py)
KERNELS_WHERE = ("mlxtoy's install builds them on Linux x86-64 with CMake and a C++20 compiler"
                 if platform.system() == "Linux" and platform.machine() == "x86_64"
                 else "they are for Linux x86-64 CPUs")
KERNELS_STAMP = "mlx_version.txt"  # in the mlxtoy_kernels package: the MLX version it was built against


def kernels_stamp() -> str | None:
    """The MLX version the installed kernels were built against; None where they are not
    installed or carry no stamp (a build older than the stamp)."""
    kernels = package_dir("mlxtoy_kernels")
    try:
        with open(os.path.join(kernels or "", KERNELS_STAMP), encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None


@functools.cache
def cpu_kernels() -> tuple[ModuleType | None, str]:
    """(the `mlxtoy_kernels` module, "on") where it is installed, wanted (MLXTOY_KERNELS) and built
    against this MLX; else (None, why). A build for another MLX is never imported: its primitives
    would meet another MLX's arrays. Refusing one prints one warning line naming the fix."""
    if not settings.KERNELS.value():
        return None, f"{settings.KERNELS.name}=0"
    folder = package_dir("mlxtoy_kernels")
    if folder is None or not glob.glob(os.path.join(folder, "_ext*")):  # (the build may have failed)
        return None, "not installed"
    stamp = kernels_stamp()
    if stamp != mx.__version__:
        why = f"built for MLX {stamp}" if stamp else "built for an unknown MLX (no stamp)"
        print(f"warning: mlxtoy's CPU kernels were {why}, this is MLX {mx.__version__}: running "
              f"without them; rebuild them with `{KERNELS_FIX}`", file=sys.stderr)
        return None, f"{why}, this is MLX {mx.__version__}: {KERNELS_FIX}"
    try:
        import mlxtoy_kernels  # deferred: only a build stamped for this MLX is imported

        with mx.stream(mx.cpu):
            mx.eval(mlxtoy_kernels.swiglu(mx.zeros((1,)), mx.zeros((1,))))
    except (ImportError, OSError, TypeError, RuntimeError, ValueError) as e:
        print(f"warning: mlxtoy's CPU kernels do not load ({e}): running without them; rebuild them "
              f"with `{KERNELS_FIX}`", file=sys.stderr)
        return None, f"do not load ({type(e).__name__}): {KERNELS_FIX}"
    return mlxtoy_kernels, "on"


@dataclass
class BackendInfo:
    """The device MLX computes on, and what the code computing there asks of it: the one object
    (`INFO`) that fastmath, quant, memory, inference and generate read, at the time they build a
    graph, so `use_device` (which changes it in place) reaches every module. No module compares
    device names; each asks the capability it needs."""

    device: str  # "metal", "cuda" or "cpu"
    blas: str | None
    blas_path: str | None
    compute_dtype: mx.Dtype
    blas_core: str | None = None  # OpenBLAS's kernel family
    kernels: ModuleType | None = None  # the x86 CPU kernels, where on and MLX computes on the CPU
    dtype_why: str = ""  # why compute_dtype (doctor shows it)

    @property
    def on_cpu(self) -> bool:
        """MLX computes on the CPU: float32 maths, the polynomial exp, fastmath's CPU forms."""
        return self.device == "cpu"

    @property
    def native_quantized_matmul(self) -> bool:
        """mx.quantized_matmul runs at speed here (Metal, CUDA); MLX's CPU one runs at a few
        GFLOP/s, so a quantized base is dequantized a slab at a time into the float32 GEMM."""
        return self.device != "cpu"

    @property
    def compiled_decode(self) -> bool:
        """Whether a one-token decoding step pays as one compiled graph over the cache's whole
        buffer with a mask (the CPU, where building the graph in Python takes the cores the
        products need); on a GPU the next step is built while the last runs and one-query
        attention takes MLX's vector kernel only without an array mask."""
        return self.device == "cpu"

    @property
    def wired_memory(self) -> bool:
        """Whether the model's memory can be wired (Metal's `mx.set_wired_limit`)."""
        return self.device == "metal"

    def memory_budget(self) -> tuple[int | None, str]:
        """(bytes a model and its work may use here, what that figure is): on Metal the recommended
        working set, on CUDA the GPU's memory, else the physical memory; MLXTOY_MEMORY_GB overrides
        it. The one figure training's memory check, `--qlora auto` and inference's fit check ask."""
        value = settings.MEMORY_GB.value()
        if value is not None:
            if not (math.isfinite(value) and value > 0):
                raise UserError(f"{settings.MEMORY_GB.name}={settings.MEMORY_GB.raw()!r}: expected a "
                                f"number of GB > 0")
            return int(value * GB), settings.MEMORY_GB.name
        info = device_info() if self.device in ("metal", "cuda") else {}
        if self.device == "metal" and info.get("max_recommended_working_set_size"):
            return int(info["max_recommended_working_set_size"]), "Metal's recommended working set"
        if self.device == "cuda" and info.get("total_memory"):
            return int(info["total_memory"]), "GPU memory"
        return physical_memory(), "physical memory"

    def describe(self) -> str:
        blas = self.blas or "reference BLAS only (slow: install `mkl` or `scipy-openblas32`)"
        if self.blas_core:
            blas += f" {self.blas_core}"
        if self.blas_path:
            blas += f" ({self.blas_path})"
        dtype = str(self.compute_dtype).replace("mlx.core.", "")
        return f"device={self.device} blas={blas} compute_dtype={dtype}"


def gpu_name() -> str | None:
    """The GPU backend this MLX can compute on ("metal" or "cuda"), None where there is none."""
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and getattr(cuda, "is_available", lambda: False)():
        return "cuda"
    return None


def _pick_device(want: str) -> str:
    """"cpu", "gpu" (an error where there is none) or "" (the GPU where there is one)."""
    if want == "cpu":
        return "cpu"
    gpu = gpu_name()
    if want == "gpu" and gpu is None:
        raise UserError("no GPU here (this MLX finds neither Metal nor CUDA)")
    return gpu or "cpu"


def physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def device_info() -> dict[str, Any]:
    """MLX's facts about the default device (Metal: architecture, max_recommended_working_set_size,
    memory_size; CUDA: total_memory, ...); {} where MLX gives none."""
    try:
        info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
    except (RuntimeError, AttributeError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def default_dtype(device: str, info: dict[str, Any]) -> tuple[mx.Dtype, str]:
    """(the compute dtype for `device`, why): float32 on the CPU (MLX's bf16/fp16 and quantized
    matmuls run at a few GFLOP/s there); float16 on an Apple GPU that emulates bfloat16 (M1, M2:
    `info`'s architecture); bfloat16 on other GPUs."""
    if device == "cpu":
        return mx.float32, "the CPU: MLX's half-precision matmuls are slow there"
    arch = str(info.get("architecture", ""))
    if device == "metal" and arch.startswith(EMULATED_BF16_ARCHS):
        return mx.float16, f"{arch} emulates bfloat16; float16 runs at full rate"
    return mx.bfloat16, f"{device}" + (f" ({arch})" if arch else "") + " runs bfloat16 natively"


def _setup(want: str) -> BackendInfo:
    device = _pick_device(want)
    mx.set_default_device(mx.cpu if device == "cpu" else mx.gpu)
    compute, why = default_dtype(device, device_info() if device == "metal" else {})
    if settings.DTYPE.value():
        compute, why = getattr(mx, settings.DTYPE.value()), f"set by {settings.DTYPE.name}"
    kernels = cpu_kernels()[0] if device == "cpu" else None
    return BackendInfo(device, cpublas.LOADED.name, cpublas.LOADED.path, compute, cpublas.LOADED.core, kernels, why)


def _setup_from_environment() -> BackendInfo:
    try:
        return _setup(settings.DEVICE.value())
    except UserError as e:  # at import there is no `error:` handling yet: fall back, say so
        print(f"warning: {settings.DEVICE.name}=gpu: {e}; computing on the CPU", file=sys.stderr)
        return _setup("cpu")


INFO = _setup_from_environment()


def use_device(want: str) -> BackendInfo:
    """Compute on "cpu" or "gpu" from now on (`--device`), with that device's compute dtype and
    capabilities; a UserError where the GPU is asked for and there is none. `INFO` changes in
    place, so every module follows from its next graph on; arrays made earlier stay where they
    are. Processes this one starts (the TUI's trainer) inherit the choice through MLXTOY_DEVICE."""
    try:
        new = _setup(want)
    except UserError as e:
        raise UserError(f"--device {want}: {e}; use --device cpu") from None
    INFO.device, INFO.compute_dtype, INFO.kernels = new.device, new.compute_dtype, new.kernels
    INFO.dtype_why = new.dtype_why
    os.environ[settings.DEVICE.name] = want
    return INFO


def route_fingerprint() -> dict[str, str]:
    """What a measured choice of route (`mlxtoy.routes`) depends on: the CPU, the cores this
    process may use, mlxtoy, MLX, the BLAS and the kernels' build. A choice kept under another
    fingerprint is measured again."""
    try:
        version = importlib.metadata.version("mlxtoy")
    except importlib.metadata.PackageNotFoundError:  # a checkout on sys.path, not installed
        version = "unknown"
    cores = usable_cores()
    threads = os.environ.get("MKL_NUM_THREADS") or os.environ.get("OPENBLAS_NUM_THREADS") or ""
    return {"cpu": cpu_model(), "cores": f"{cores} (BLAS threads {threads or 'default'})",
            "mlxtoy": version, "mlx": mx.__version__,
            "blas": f"{cpublas.LOADED.name} {cpublas.LOADED.core or ''} {cpublas.LOADED.path or ''}".strip(),
            "kernels": kernels_build()}


def kernels_build() -> str:
    """The kernels' build as a route depends on it: the MLX they were built for, the extension
    file's size and time (a rebuild of changed kernels measures its routes again), and the
    instruction forms they take (their own answer: AVX2 ones on an AVX-512 CPU where
    MLXTOY_KERNEL_AVX512=0)."""
    stamp = kernels_stamp()
    if stamp is None:
        return "none"
    forms = f"{INFO.kernels.forms()} forms" if INFO.kernels is not None else "kernels off"
    built = glob.glob(os.path.join(package_dir("mlxtoy_kernels") or "", "_ext*"))
    if not built:
        return f"{stamp}, {forms}"
    info = os.stat(built[0])
    return f"{stamp} ({info.st_size} bytes, {int(info.st_mtime)}), {forms}"


def compute_dtype() -> mx.Dtype:
    return INFO.compute_dtype


def tree_bytes(tree: Any) -> int:
    """The bytes of every array in a model or a tree of arrays (mlx-lm's measure of a model)."""
    return tree_reduce(lambda total, x: total + x.nbytes if isinstance(x, mx.array) else total, tree, 0)


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


@contextlib.contextmanager
def wired_limit(model: Any = None, warn: Callable[[str], None] | None = _warn) -> Iterator[str | None]:
    """Wire the model's memory while it runs, as mlx-lm does for generating, serving and training:
    on Metal the wired limit goes up to the recommended working set (at most the memory budget,
    MLXTOY_MEMORY_GB) and back to what it was on leaving, after the device's queued work is done
    (the limit must not change under a running graph). `model` (a module or a tree of arrays) larger
    than WIRED_WARN_SHARE of that set gets one `warn` line. Elsewhere nothing changes. Yields what
    was set, for a log line (None: nothing)."""
    if not INFO.wired_memory:
        yield None
        return
    recommended = int(device_info().get("max_recommended_working_set_size") or 0)
    budget = INFO.memory_budget()[0]
    limit = min(recommended, budget) if recommended and budget else recommended or budget
    if not limit:
        yield None
        return
    size = tree_bytes(model) if model is not None else 0
    if warn is not None and recommended and size > WIRED_WARN_SHARE * recommended:
        warn(f"the model takes {size / GB:.1f} GB, close to Metal's recommended working set "
             f"({recommended / GB:.1f} GB): it will run, slowly; a quantized base (--quantized on, "
             f"--qlora on) takes less")
    old = mx.set_wired_limit(limit)
    try:
        yield f"Metal wired limit {limit / GB:.1f} GB"
    finally:
        mx.synchronize()
        mx.set_wired_limit(old)


@contextlib.contextmanager
def model_memory(model: Any, doing: str, fixes: list[str],
                 warn: Callable[[str], None] | None = _warn) -> Iterator[str | None]:
    """Run a model: its memory wired while the block runs (`wired_limit`), and MLX running out of
    memory in it turned into the one-line error `out_of_memory_error` names (`doing`, `fixes`)."""
    with wired_limit(model, warn) as wired:
        try:
            yield wired
        except RuntimeError as e:
            error = out_of_memory_error(e, doing, fixes)
            if error is None:
                raise
            raise error from None


THREAD_STREAMS: dict[str, Any] = {}  # device name -> its mx.ThreadLocalStream, made once


def thread_stream() -> Any:
    """The stream MLX work runs on off the main thread (the TUI's model thread, the server's
    engine): since MLX 0.31.2 a stream belongs to the thread that made it, and using one from
    another thread fails ("There is no Stream(gpu, 0) in current thread"); MLX's thread-local
    stream (`mx.new_thread_local_stream`, as mlx-lm's generation stream) is each thread's own.
    One per device, so `use_device` is followed. Use as `with mx.stream(backend.thread_stream()):`."""
    if INFO.device not in THREAD_STREAMS:
        stream = mx.new_thread_local_stream(mx.cpu if INFO.device == "cpu" else mx.gpu)
        THREAD_STREAMS.setdefault(INFO.device, stream)  # (two threads at once: the first one made wins)
    return THREAD_STREAMS[INFO.device]


def with_thread_stream(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` for another thread (a Thread's target, an executor's job): it runs on that thread's
    own stream (`thread_stream`), so MLX work built and evaluated there stays on it."""
    @functools.wraps(fn)
    def run(*args: Any, **kw: Any) -> Any:
        with mx.stream(thread_stream()):
            return fn(*args, **kw)

    return run


def out_of_memory_error(error: BaseException, doing: str, fixes: list[str]) -> UserError | None:
    """For MLX running out of memory (`error` a RuntimeError carrying one of OUT_OF_MEMORY_MARKERS;
    Metal's failed command buffer is raised on the thread that waits for it since
    ml-explore/mlx#3523, where MLX before it aborted the process), the one-line error the CLI
    prints (exit 2, as for a run the memory check refuses): what ran out `doing` what, MLX's
    words, and `fixes`, settings that take less. None for any other error."""
    text = str(error).strip()
    if not isinstance(error, RuntimeError) or not any(m in text for m in OUT_OF_MEMORY_MARKERS):
        return None
    said = text.splitlines()[0] if text else ""
    return UserError(f"out of memory while {doing} ({said}); try " + (", or ".join(fixes) or "a smaller model"))


def gemm_gflops(n: int = 1024, repeats: int = 10, matmul=mx.matmul) -> float:
    """Measured float32 GEMM throughput on the default device (MLX's matmul, or `matmul`)."""
    a = mx.random.normal((n, n))
    b = mx.random.normal((n, n))
    mx.eval(matmul(a, b))
    start = time.perf_counter()
    for _ in range(repeats):
        mx.eval(matmul(a, b))
    elapsed = time.perf_counter() - start
    return 2 * n**3 * repeats / elapsed / 1e9
