"""`mlxtoy taps MODEL --prompt TEXT [--adapter RUN] [--quantized auto|on|off] [--save FILE]
[--compare OTHER] [--json]`.

A QLoRA run's base is tapped quantized as it trained, the adapters unmerged on top, as
`generate` runs it (`inference.load_for_inference`): an 8B base never goes whole to float32.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import mlx.core as mx
from rich.console import Console
from rich.table import Table

from mlxtoy.errors import UserError
from mlxtoy.inference import QUANTIZED_FLAG, load_for_inference
from mlxtoy.rundir import is_run_or_checkpoint
from mlxtoy.taps import capture, drift, load_taps, save_taps, summarize


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("taps", help="per-layer activation taps; compare two models layer by layer")
    p.add_argument("model",
                   help="a .gguf file, a Hugging Face folder or id (org/name[@rev], "
                        "org/name/file.gguf), or a built-in name")
    p.add_argument("--prompt", required=True, help="text to run through the model")
    p.add_argument("--adapter", help="a run directory whose adapters or weights are applied")
    p.add_argument("--quantized", **QUANTIZED_FLAG)
    p.add_argument("--save", metavar="FILE", help="write the raw tap tensors (.safetensors)")
    p.add_argument("--compare", metavar="OTHER",
                   help="another model, a run directory, or a saved taps file: print the drift")
    p.add_argument("--sites", help="comma-separated subset of attn_norm,ffn_out,resid_post")
    p.add_argument("--layers", help="comma-separated layer indices (default: all)")
    p.add_argument("--heads", action="store_true", help="also per-head attention entropy and output norm")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return p


def _load_other(other: str, base: str, quantized: str):
    """OTHER: a run or one of its checkpoints (applied to the base model), else a model; its
    base kept as --quantized says, like the first model's."""
    if is_run_or_checkpoint(other):
        return load_for_inference(base, adapter=other, mode=quantized)
    return load_for_inference(other, mode=quantized)


def run(args) -> int:
    if not args.prompt:
        raise UserError("--prompt is empty")
    sites = [s.strip() for s in args.sites.split(",") if s.strip()] if args.sites else None
    try:
        layers = [int(x) for x in args.layers.split(",")] if args.layers else None
    except ValueError:
        raise UserError(f"--layers must be comma-separated integers, got {args.layers!r}") from None
    model, tokenizer = load_for_inference(args.model, args.adapter, args.quantized)
    tokens = tokenizer.encode(args.prompt)
    if not tokens:
        raise UserError("--prompt encodes to no tokens")
    taps = capture(model, mx.array([tokens]), sites, layers, heads=args.heads)
    if args.save:
        save_taps(args.save, taps, model, tokens)
        print(f"saved {len(taps)} tap tensors to {args.save}", file=sys.stderr)

    if args.compare:
        if args.compare.endswith(".safetensors") and os.path.isfile(args.compare):
            other, _, other_tokens = load_taps(args.compare, model)
            if other_tokens != tokens:
                raise UserError(f"{args.compare}: taps were saved for a different prompt")
        else:
            other_model, other_tok = _load_other(args.compare, args.model, args.quantized)
            if other_model.config.vocab_size != model.config.vocab_size:
                raise UserError(f"{args.compare}: vocabulary differs ({other_model.config.vocab_size} vs "
                                f"{model.config.vocab_size}); cannot feed it the same tokens")
            if len(other_model.layers) != len(model.layers):
                raise UserError(f"{args.compare}: {len(other_model.layers)} layers vs {len(model.layers)}")
            other = capture(other_model, mx.array([tokens]), sites, layers)
        rows = drift(taps, other)
        if args.json:
            print(json.dumps(rows))
            return 0
        _print_drift(rows)
        return 0

    stats, heads = summarize(taps)
    if args.json:
        print(json.dumps({"tokens": len(tokens), "stats": stats, "heads": heads}))
        return 0
    _print_stats(stats, heads, len(tokens))
    return 0


def _print_stats(stats: list[dict], heads: list[dict], n_tokens: int) -> None:
    table = Table(title=f"taps over {n_tokens} tokens", header_style="bold")
    for col in ("layer", "site", "mean", "rms", "max |x|", "near-zero", "histogram"):
        table.add_column(col, justify="right" if col not in ("site", "histogram") else "left")
    bars = " ▁▂▃▄▅▆▇█"
    for s in stats:
        peak = max(s["hist"]) or 1
        spark = "".join(bars[min(8, round(8 * h / peak))] for h in s["hist"])
        table.add_row(str(s["layer"]), s["site"], f"{s['mean']:+.4f}", f"{s['rms']:.4f}",
                      f"{s['max_abs']:.3f}", f"{100 * s['zero_frac']:.1f}%", spark)
    console = Console(width=max(100, Console().width))
    console.print(table)
    for h in heads:
        vals = " ".join(f"{v:.2f}" for v in h["values"])
        console.print(f"layer {h['layer']:>2} {h['site']:<14} {vals}")


def _print_drift(rows: list[dict]) -> None:
    sites = sorted({r["site"] for r in rows}, key=["attn_norm", "ffn_out", "resid_post"].index)
    table = Table(title="drift (relative L2 difference)", header_style="bold")
    table.add_column("layer", justify="right")
    for s in sites:
        table.add_column(s, justify="right")
    by_layer: dict[int, dict[str, float]] = {}
    for r in rows:
        by_layer.setdefault(r["layer"], {})[r["site"]] = r["drift"]
    for layer in sorted(by_layer):
        table.add_row(str(layer), *(f"{by_layer[layer].get(s, float('nan')):.3e}" for s in sites))
    Console().print(table)
