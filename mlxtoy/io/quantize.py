"""The bridge to llama.cpp's own quantizer (K-quants and the legacy Q4_0 / Q5_0).

We never re-implement these formats: `quantize_gguf(src, dst, dtype)` hands an F16 / F32 GGUF
that we wrote to llama.cpp, through llama-cpp-python's `llama_model_quantize` when it imports
(`pip install 'mlxtoy[gguf]'`), else through a `llama-quantize` binary on PATH. With neither,
`find_quantizer` raises one UserError naming both ways to get one.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from dataclasses import dataclass

from mlxtoy.errors import UserError

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


def quantize_gguf(src: str, dst: str, dtype: str, threads: int | None = None) -> str:
    """llama.cpp's quantizer: the F16/F32 GGUF `src` -> `dst` in `dtype` (a QUANT_TYPES key)."""
    name = QUANT_TYPES[dtype]
    q = find_quantizer(dtype)
    threads = threads or os.cpu_count() or 1
    if q.kind == "llama-cpp-python":
        llama_cpp = _llama_cpp()
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{name}")
        params.nthread = threads
        # its per-tensor log goes to stderr through this logger: keep errors only
        logger = logging.getLogger("llama-cpp-python")
        level = logger.level
        logger.setLevel(logging.ERROR)
        try:
            rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params)
        finally:
            logger.setLevel(level)
        if rc != 0:
            raise UserError(f"{src}: llama.cpp's quantizer failed ({name}, return code {rc})")
        return dst
    proc = subprocess.run([q.binary, src, dst, name, str(threads)], capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
        raise UserError(f"{src}: {q.binary} failed ({name}, exit {proc.returncode}: {last})")
    return dst
