"""The bridge to llama.cpp's own quantizer (K-quants and the legacy Q4_0 / Q5_0).

We never re-implement these formats: `quantize_gguf(src, dst, dtype)` hands an F16 / F32 GGUF
that we wrote to llama.cpp, through llama-cpp-python's `llama_model_quantize` when it imports
(`pip install 'mlxtoy[gguf]'`), else through a `llama-quantize` binary on PATH. With neither,
`find_quantizer` raises one UserError naming both ways to get one. llama.cpp's log (a line per
tensor, its warnings about rows that fall back to another type) stays out of the terminal unless
`verbose`; `tensor_types` says what the file holds afterwards, since a K-quant's tensors are not
all of its named type.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from typing import IO, Iterator

from mlxtoy import cpublas
from mlxtoy.errors import UserError
from mlxtoy.io.gguf_file import read_gguf

# our --dtype -> llama.cpp's type name (its `llama-quantize` argument; the ftype constant is
# llama_cpp.LLAMA_FTYPE_MOSTLY_<name>)
QUANT_TYPES = {"q4_k_m": "Q4_K_M", "q5_k_m": "Q5_K_M", "q6_k": "Q6_K", "q4_0": "Q4_0", "q5_0": "Q5_0"}
BINARY = "llama-quantize"
HOW_TO_GET = (f"install llama-cpp-python (pip install 'mlxtoy[gguf]') or put llama.cpp's {BINARY} "
              f"on PATH")


@dataclass(frozen=True)
class Quantizer:
    kind: str  # "llama-cpp-python" or "binary"
    binary: str | None = None

    def describe(self) -> str:
        return self.binary if self.kind == "binary" else "llama-cpp-python's llama_model_quantize"


def _llama_cpp():
    """llama_cpp when importable (an optional dependency), else None."""
    try:
        import llama_cpp
    except ImportError:
        return None
    return llama_cpp


def find_quantizer(dtype: str) -> Quantizer:
    """The quantizer to use for `dtype`; UserError when there is none."""
    if _llama_cpp() is not None:
        return Quantizer("llama-cpp-python")
    binary = shutil.which(BINARY)
    if binary:
        return Quantizer("binary", binary)
    raise UserError(f"--dtype {dtype} needs llama.cpp's quantizer: {HOW_TO_GET}")


@contextlib.contextmanager
def _stderr_into(log: IO[bytes]) -> Iterator[None]:
    """stderr into `log` for a while: file descriptor 2 (llama.cpp's C code writes there) and
    sys.stderr (llama-cpp-python's log callback prints there)."""
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(log.fileno(), 2)
    try:
        with open(log.fileno(), "w", closefd=False) as text, contextlib.redirect_stderr(text):
            yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no output"


def quantize_gguf(src: str, dst: str, dtype: str, threads: int | None = None, verbose: bool = False) -> str:
    """llama.cpp's quantizer: the F16/F32 GGUF `src` -> `dst` in `dtype` (a QUANT_TYPES key).
    Its log goes to stderr only when `verbose` (a failure quotes its last line)."""
    name = QUANT_TYPES[dtype]
    q = find_quantizer(dtype)
    threads = threads or cpublas.usable_cores() or 1
    if q.kind == "llama-cpp-python":
        llama_cpp = _llama_cpp()
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{name}")
        params.nthread = threads
        # its log reaches stderr through this logger (warnings and up unless verbose) and
        # through C's own writes to fd 2: both go to a file unless verbose
        logger = logging.getLogger("llama-cpp-python")
        level = logger.level
        logger.setLevel(logging.DEBUG if verbose else logging.ERROR)
        with tempfile.TemporaryFile() as log:
            try:
                with contextlib.nullcontext() if verbose else _stderr_into(log):
                    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params)
            finally:
                logger.setLevel(level)
            log.seek(0)
            said = _last_line(log.read().decode("utf-8", "replace"))
        if rc != 0:
            raise UserError(f"{src}: llama.cpp's quantizer failed ({name}, return code {rc}: {said})")
        return dst
    proc = subprocess.run([q.binary, src, dst, name, str(threads)], capture_output=True, text=True)
    if verbose:
        sys.stderr.write(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        last = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
        raise UserError(f"{src}: {q.binary} failed ({name}, exit {proc.returncode}: {last})")
    return dst


def tensor_types(path: str) -> str:
    """What a GGUF's tensors are stored as, most first: "Q4_K 92, Q5_0 180, F32 65"."""
    counts = Counter(t.tensor_type.name for t in read_gguf(path).tensors)
    return ", ".join(f"{name} {n}" for name, n in counts.most_common())
