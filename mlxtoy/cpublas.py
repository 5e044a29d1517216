"""The CPU this process runs on (vendor, flags, model, the cores it may use) and the optimized
BLAS loaded for MLX before `mlx.core` is first imported: MLX's Linux CPU wheel links the
reference (netlib) BLAS, ~2.5 GFLOP/s for a float32 GEMM on a 2-core box; an optimized BLAS
loaded with global symbols first makes MLX's cblas calls resolve to it (~60x faster). Which one:
`doctor --calibrate`'s measurement on this machine, else a guess from the CPU's vendor.
Nothing here imports `mlx.core` (`mlxtoy.backend` imports this module first)."""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import json
import os
import platform
import sys
from dataclasses import dataclass

from mlxtoy import settings

# PyPI's OpenBLAS (scipy-openblas32) prefixes its symbols; mlxtoy_kernels' libmlxtoy_blas gives
# MLX the plain CBLAS names for them.
_OPENBLAS_PREFIX = "scipy_"


def cpu_features() -> tuple[str, set[str]]:
    """The CPU's vendor and feature flags, from /proc/cpuinfo (empty where there is none)."""
    vendor, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "vendor_id":
                    vendor = value.strip()
                elif key == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    return vendor, flags


def cpu_model() -> str:
    """The CPU's model name, family, model and stepping, from /proc/cpuinfo (what a measurement made
    on this machine is keyed by); platform.processor() where there is no /proc/cpuinfo."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "cpu family", "model", "stepping") and key not in fields:
                    fields[key] = value.strip()
                elif not line.strip() and fields:
                    break
    except OSError:
        pass
    if not fields:
        return platform.processor() or platform.machine()
    return (f"{fields.get('model name', '?')} (family {fields.get('cpu family', '?')}, model "
            f"{fields.get('model', '?')}, stepping {fields.get('stepping', '?')})")


def package_dir(name: str) -> str | None:
    """Where an installed package lives, without importing it (mlxtoy_kernels imports mlx.core)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def blas_libraries() -> dict[str, list[tuple[str, str]]]:
    """The optimized BLAS libraries found here, by kind ("mkl", "openblas", "blis"), as (name,
    path); name "openblas+prefix" is PyPI's OpenBLAS, reached through libmlxtoy_blas."""
    mkl: list[tuple[str, str]] = []
    for prefix in {sys.prefix, sys.base_prefix, os.path.join(os.path.expanduser("~"), ".local")}:
        # PyPI `mkl` drops libmkl_rt into <prefix>/lib.
        mkl += [("mkl", path) for path in sorted(glob.glob(os.path.join(prefix, "lib", "libmkl_rt.so*")))]
    openblas: list[tuple[str, str]] = []
    pypi = package_dir("scipy_openblas32")
    if pypi:
        openblas += [("openblas+prefix", path) for path in sorted(glob.glob(os.path.join(pypi, "lib", "libscipy_openblas*.so")))]
    blis: list[tuple[str, str]] = []
    for d in ["/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib"]:
        for pattern in ("openblas-pthread/libopenblas.so.0", "libopenblas.so.0", "libopenblasp*.so*"):
            openblas += [("openblas", path) for path in sorted(glob.glob(os.path.join(d, pattern)))]
        blis += [("blis", path) for path in sorted(glob.glob(os.path.join(d, "libblis.so.4")))]
    return {"mkl": mkl, "openblas": openblas, "blis": blis}


def blas_paths() -> dict[str, str]:
    """The first library found of each optimized BLAS kind (what `doctor --calibrate` times)."""
    return {kind: found[0][1] for kind, found in blas_libraries().items() if found and kind != "blis"}


def blas_candidates(vendor: str, flags: set[str]) -> list[tuple[str, str]]:
    """Optimized BLAS libraries we know how to load, best first for this machine: the one
    `doctor --calibrate` measured fastest here, else a guess from the CPU's vendor and flags
    (`cpu_features()`). MLXTOY_BLAS=mkl|openblas|none|<path> chooses instead."""
    override = settings.BLAS.value()
    if override.lower() in ("none", "off", "0"):
        return []
    if override and override.lower() not in ("mkl", "openblas"):
        return [("custom", override)]
    found = blas_libraries()
    if override:
        return found[override.lower()]
    measured = measured_blas(blas_paths())
    if measured:  # `doctor --calibrate` timed each here
        return found[measured] + [c for kind, paths in found.items() if kind != measured for c in paths]
    # Unmeasured: on a CPU that is not Intel's, MKL loads its generic kernels (libmkl_def), and
    # OpenBLAS's GEMM was faster on every AMD core measured (Zen 3, 4, 5); on Intel's, MKL first
    # (the kernels then share its OpenMP threads). `doctor --calibrate` replaces this guess with a
    # measurement.
    if vendor == "AuthenticAMD":
        return found["openblas"] + found["mkl"] + found["blis"]
    return found["mkl"] + found["openblas"] + found["blis"]


BLAS_FILE = "blas.json"  # in the cache folder: the BLAS `doctor --calibrate` measured fastest here


def usable_cores() -> int | None:
    """The cores this process may run on (what a measured choice holds for)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def blas_fingerprint(libraries: dict[str, str]) -> dict:
    """What a measured BLAS choice depends on: the CPU, the cores, and the libraries timed."""
    cores = usable_cores()
    return {"cpu": cpu_model(), "cores": cores, "libraries": dict(sorted(libraries.items()))}


def kept_blas(libraries: dict[str, str]) -> dict:
    """What `doctor --calibrate` kept of its BLAS measurement on this machine among these same
    libraries ({"fastest": kind, "gflops": {kind: rate}}); {} where it has not measured them (or
    the file is unreadable: never an error)."""
    try:
        with open(settings.cache_dir() / BLAS_FILE, encoding="utf-8") as f:
            data = json.load(f)
        if data["fingerprint"] == blas_fingerprint(libraries) and data["fastest"] in libraries:
            return data
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return {}


def measured_blas(libraries: dict[str, str]) -> str | None:
    """The BLAS (mkl, openblas) `doctor --calibrate` measured fastest on this machine among these
    same libraries; None where it has not."""
    kept = kept_blas(libraries)
    return str(kept["fastest"]) if kept else None


def _load_prefixed(path: str) -> bool:
    """PyPI's OpenBLAS behind libmlxtoy_blas, which takes global symbols only once bound."""
    kernels = package_dir("mlxtoy_kernels")
    forwarder = glob.glob(os.path.join(kernels, "libmlxtoy_blas*.so")) if kernels else []
    if not forwarder:
        return False
    lib = ctypes.CDLL(forwarder[0])
    if lib.mlxtoy_blas_bind(path.encode(), _OPENBLAS_PREFIX.encode()) != 0:
        return False
    ctypes.CDLL(forwarder[0], mode=ctypes.RTLD_GLOBAL | os.RTLD_NOLOAD)
    return True


def _core_name(name: str, path: str) -> str | None:
    symbol = (_OPENBLAS_PREFIX if name == "openblas+prefix" else "") + "openblas_get_corename"
    try:
        get = getattr(ctypes.CDLL(path), symbol)
    except (OSError, AttributeError):
        return None
    get.restype = ctypes.c_char_p
    return get().decode()


@dataclass(frozen=True)
class Blas:
    """The optimized BLAS MLX's CPU products call: name (mkl, openblas, blis, custom, accelerate;
    None: the reference BLAS), its library, and OpenBLAS's kernel family ("Haswell", ...)."""
    name: str | None
    path: str | None = None
    core: str | None = None


def load_fast_blas() -> Blas:
    """The best optimized BLAS that loads here (`blas_candidates`), loaded with global symbols;
    Blas(None) where none does, or where `mlx.core` came first."""
    if "mlx.core" in sys.modules:
        # Too late to interpose symbols; report honestly rather than pretend.
        return Blas("unknown (mlx.core was imported before mlxtoy)")
    if platform.system() != "Linux":
        return Blas("accelerate" if platform.system() == "Darwin" else None)
    # the cores this process may run on (taskset, a container's cpuset), not the machine's: 16
    # threads on 2 allowed cores spin against each other
    threads = str(usable_cores() or 1)
    os.environ.setdefault("MKL_NUM_THREADS", threads)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", threads)
    # OpenBLAS's idle threads spin ~0.1 s after each GEMM (2^28 cycles) on the cores the kernels'
    # threads need next; 2^4 lets them sleep at once.
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
    for name, path in blas_candidates(*cpu_features()):
        try:
            if name == "openblas+prefix":
                if not _load_prefixed(path):
                    continue
            elif name == "mkl":
                _load_mkl(path)
            else:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            if name == "custom":  # the user's own library: say why it is not used
                settings.BLAS.warn(f"cannot be loaded ({e}): using the reference BLAS")
            continue
        core = _core_name(name, path) if name.startswith("openblas") else None
        if core and os.environ.get("OPENBLAS_CORETYPE"):  # not OpenBLAS's own pick
            core += " (set by OPENBLAS_CORETYPE)"
        return Blas(name.removesuffix("+prefix"), path, core)
    return Blas(None)


MKL_THREADING_INTEL = 0  # mkl_service.h: MKL_Set_Threading_Layer's Intel OpenMP layer


def _load_mkl(path: str) -> None:
    """MKL with global symbols, after its OpenMP runtime (libiomp5, beside it): the kernels'
    parallel loops (mlxtoy_kernels) then bind to it and run on the threads MKL's GEMMs run on,
    instead of a second set of threads fighting them. MKL is told that runtime's layer before
    its first GEMM: left to choose, libmkl_rt took its GNU OpenMP layer on an Intel host (a
    library the PyPI wheel has, which a partial install may lack) and exited there."""
    openmp = False
    for candidate in sorted(glob.glob(os.path.join(os.path.dirname(path), "libiomp5.so*"))):
        try:
            ctypes.CDLL(candidate, mode=ctypes.RTLD_GLOBAL)
            openmp = True
            break
        except OSError:
            continue
    mkl = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    if openmp and hasattr(mkl, "MKL_Set_Threading_Layer"):
        mkl.MKL_Set_Threading_Layer(MKL_THREADING_INTEL)


LOADED = load_fast_blas()
