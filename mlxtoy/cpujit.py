"""MLX's CPU kernels are compiled on this machine the first time they run: each fused element-wise
kernel of an `mx.compile`d graph is a C++ file g++ builds into a shared library in MLX's cache
folder (`$TMPDIR/mlx/<version>/cpu`, kept until the temp folder is cleared). Most of a build is
g++ parsing MLX's preamble header, the same for every kernel. A training step's first run on an
empty cache builds a couple of dozen of them one after the other, its largest first-step cost
on a new machine.

`build_header` precompiles that preamble once into the cache folder, where g++ looks first for
the kernels' `#include "mlx/backend/cpu/compiled_preamble.h"` (the directory of the file being
compiled), with the flags MLX's own build command uses (read from `libmlx.so`): g++ then loads
it instead of parsing the header. A header g++ finds stale or built otherwise it ignores, and
parses the real one: nothing but time depends on it. Linux and g++ only (clang does not look
for a `.gch` beside an include). `MLXTOY_JIT_HEADER=0` leaves MLX's builds as they are.
"""

from __future__ import annotations

import functools
import os
import platform
import re
import shlex
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import mlx.core as mx

from mlxtoy import backend, settings

HEADER = "mlx/backend/cpu/compiled_preamble.h"
# a builder that died leaves its lock; another process takes over after this long
LOCK_STALE_SECONDS = 120


def cache_dir() -> Path:
    """MLX's folder of compiled CPU kernels (std::filesystem::temp_directory_path()'s mlx/<version>/cpu)."""
    return Path(tempfile.gettempdir()) / "mlx" / mx.__version__ / "cpu"


def header_path() -> Path:
    return cache_dir() / (HEADER + ".gch")


@functools.lru_cache(maxsize=1)
def mlx_flags() -> list[str] | None:
    """The compiler flags of MLX's kernel builds (`g++ <flags> -shared -I ...`), read from the
    build command in libmlx.so; None where it is not found (another MLX, another platform)."""
    lib = Path(mx.__file__).parent / "lib" / "libmlx.so"
    try:
        found = re.search(rb"g\+\+ ((?:-[\w=+]+ )+)-shared \{\}", lib.read_bytes())
    except OSError:
        return None
    return found.group(1).decode().split() if found else None


def unavailable() -> str | None:
    """Why no header is built here, or None."""
    if not settings.JIT_HEADER.value():
        return "MLXTOY_JIT_HEADER=0"
    if not backend.INFO.on_cpu:
        return f"device {backend.INFO.device}: MLX compiles no CPU kernels for it"
    if platform.system() != "Linux":
        return "not Linux"
    if shutil.which("g++") is None:
        return "no g++"
    if mlx_flags() is None:
        return "MLX's kernel build command not found in libmlx.so"
    return None


def _launch() -> subprocess.Popen | str:
    """Start building the header where it is missing: its lock taken and its build's shell
    started (g++, then the rename and the lock's removal, which the shell does itself, so a
    process that exits meanwhile, as a job refused in its first seconds does, still leaves the
    header made) -> the shell's process, or what was done instead."""
    target = header_path()
    if target.exists():
        return "kept"
    why = unavailable()
    if why is not None:
        return f"not built: {why}"
    lock = target.with_name(target.name + ".lock")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a temp folder that cannot be written: MLX's compiles fail there anyway
        return f"not built: {e}"
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        try:
            if time.time() - lock.stat().st_mtime < LOCK_STALE_SECONDS:
                return "being built by another process"
            lock.unlink()
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except OSError:
            return "being built by another process"
    except OSError as e:
        return f"not built: {e}"
    os.close(fd)
    for old in target.parent.glob(target.name + ".*.part"):  # a builder's that was killed
        old.unlink(missing_ok=True)
    part, include = target.with_name(f"{target.name}.{os.getpid()}.part"), Path(mx.__file__).parent / "include"
    build = shlex.join(["g++", *mlx_flags(), "-x", "c++-header", "-I", str(include), str(include / HEADER),
                        "-o", str(part)])
    part_q, target_q, lock_q = (shlex.quote(str(p)) for p in (part, target, lock))
    try:
        return subprocess.Popen(["sh", "-c", f"{build} && mv -f {part_q} {target_q}; s=$?; rm -f {part_q} {lock_q}; "
                                 "exit $s"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except OSError as e:
        lock.unlink(missing_ok=True)
        return f"not built: {e}"


def build_header() -> str:
    """Make the precompiled header if it is missing (a few seconds of one core, once per
    machine and temp folder) and wait for it -> what was done, for a log line. Another process
    building it meanwhile is left to finish; the header appears whole or not at all (written to
    a temp name, renamed)."""
    start = time.perf_counter()
    shell = _launch()
    if isinstance(shell, str):
        return shell
    try:  # (no pipe from g++: one whose reader exited would kill it at its first warning)
        shell.wait(timeout=300)
    except subprocess.TimeoutExpired:
        shell.kill()
        return "not built: g++ took over 300 s"
    if shell.returncode != 0:
        return f"not built: g++ failed (exit status {shell.returncode})"
    return f"built in {time.perf_counter() - start:.1f} s"


def start_header() -> threading.Thread | None:
    """Start building the header where it is missing and return a thread that waits for it (a
    training job starts it before loading its model, so the build runs beside the load, and
    joins it before the first step); None where there is nothing to do."""
    shell = _launch()
    if isinstance(shell, str):
        return None
    thread = threading.Thread(target=shell.wait, name="mlxtoy-jit-header", daemon=True)
    thread.start()
    return thread
