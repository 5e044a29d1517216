"""`mlxtoy export SOURCE --out PATH [--format gguf|adapter-gguf|hf|mlx-lm|peft] [--dtype DTYPE]`."""

from __future__ import annotations

import argparse
import os
import sys

from mlxtoy import backend
from mlxtoy.export import DTYPES, FORMAT_HELP, check_format, check_output, export_source, load_source
from mlxtoy.io.quantize import QUANT_TYPES, tensor_types


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("export", help="write a model or a run as GGUF, a LoRA adapter, HF, mlx-lm or PEFT",
                       description="Export a model (re-typing it) or a training run (final weights or any\n"
                                   "checkpoint: RUN/checkpoints/step_N).\n\nformats:\n" +
                                   "\n".join(f"  {k:<14}{v}" for k, v in FORMAT_HELP.items()))
    p.add_argument("source", help="a run directory, a checkpoint directory, or a model "
                                  "(.gguf, Hugging Face folder or id, built-in name)")
    p.add_argument("--out", required=True, help="output file (gguf, adapter-gguf) or folder (hf, mlx-lm, peft)")
    p.add_argument("--format", default="gguf", help="gguf (default), adapter-gguf, hf, mlx-lm or peft")
    p.add_argument("--dtype", default=None, metavar="DTYPE",
                   help=f"one of {', '.join(DTYPES)}: f32 (default, lossless) and f16 for every format; "
                        f"q8_0 for GGUF; the K-quants (q4_k_m, q5_k_m, q6_k) and q4_0, q5_0 for a model "
                        f"GGUF, through llama.cpp's quantizer (pip install 'mlxtoy[gguf]', or "
                        f"llama-quantize on PATH)")
    p.add_argument("--verbose", action="store_true", help="show llama.cpp's quantizer log (a line a tensor)")
    return p


def run(args) -> int:
    fmt, dtype = check_format(args.format, args.dtype)  # bad flags fail before any loading
    check_output(args.out, fmt)
    src = load_source(args.source, fmt=fmt)

    def progress(n: int, total: int) -> None:
        if sys.stderr.isatty():
            print(f"\rexport: tensor {n}/{total}", end="" if n < total else "\n", file=sys.stderr, flush=True)

    with backend.wired_limit(src.weights):  # the weights stay resident while they are written
        path = export_source(src, args.out, fmt, dtype, progress, verbose=args.verbose)
    size = _size(path)
    # a K-quant keeps some tensors in other types (rows that are not whole blocks, its mix)
    written = f"{dtype}: tensors {tensor_types(path)}" if dtype in QUANT_TYPES else dtype
    print(f"export: wrote {path} ({fmt}, {written}, {size / 1e6:.1f} MB)", file=sys.stderr)
    print(path)
    return 0


def _size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)
