"""`mlxtoy export SOURCE --out PATH [--format gguf|adapter-gguf|hf|mlx-lm|peft] [--dtype f32|f16|q8_0]`."""

from __future__ import annotations

import argparse
import os
import sys

from mlxtoy.export import check_format, check_output, export_source, load_source

FORMAT_HELP = {
    "gguf": "llama.cpp model GGUF (LoRA merged)",
    "adapter-gguf": "llama.cpp LoRA adapter GGUF (apply with --lora on the base GGUF)",
    "hf": "Hugging Face folder: config.json + model.safetensors + tokenizer.json",
    "mlx-lm": "mlx-lm adapter folder (adapters.safetensors + adapter_config.json)",
    "peft": "PEFT adapter folder (adapter_model.safetensors + adapter_config.json)",
}


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("export", help="write a model or a run as GGUF, a LoRA adapter, HF, mlx-lm or PEFT",
                       description="Export a model (re-typing it) or a training run (final weights or "
                                   "any checkpoint: RUN/checkpoints/step_N). Formats: " +
                                   "; ".join(f"{k}: {v}" for k, v in FORMAT_HELP.items()))
    p.add_argument("source", help="a run directory, a checkpoint directory, or a model "
                                  "(.gguf, Hugging Face folder, built-in name)")
    p.add_argument("--out", required=True, help="output file (gguf, adapter-gguf) or folder (hf, mlx-lm, peft)")
    p.add_argument("--format", default="gguf", help="gguf (default), adapter-gguf, hf, mlx-lm or peft")
    p.add_argument("--dtype", default=None, help="f32 (default, lossless), f16 or q8_0 (GGUF only)")
    return p


def run(args) -> int:
    fmt, dtype = check_format(args.format, args.dtype)  # bad flags fail before any loading
    check_output(args.out, fmt)
    src = load_source(args.source, fmt=fmt)

    def progress(n: int, total: int) -> None:
        if sys.stderr.isatty():
            print(f"\rexport: tensor {n}/{total}", end="" if n < total else "\n", file=sys.stderr, flush=True)

    path = export_source(src, args.out, fmt, dtype, progress)
    size = _size(path)
    print(f"export: wrote {path} ({fmt}, {dtype}, {size / 1e6:.1f} MB)", file=sys.stderr)
    print(path)
    return 0


def _size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)
