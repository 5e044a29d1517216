"""The op graphs of one decoding step and one LoRA step, mlxtoy's against mlx-lm's: how many MLX
primitives each builds (`mx.export_to_dot`), by kind. On a GPU each primitive is at least one
kernel launch, so the count is what a step's host time and launch overhead scale with; no GPU is
needed to count them.

    .venv/bin/python bench/op_graphs.py [--model HF_FOLDER] [--dot DIR]

The model: SmolLM2-135M (the built-in GGUF written as a float32 Hugging Face folder), loaded by
both tools in bfloat16, and 4-bit, group 32, the embedding and output tables too (mlxtoy's QLoRA
base with `tables`, mlx-lm's `nn.quantize`). mlxtoy builds
its graphs on the branches a GPU takes (Metal / CUDA: `backend.INFO.device` "cuda", no CPU
kernels: MLX's fast ops, an eager decoding step), the ones these counts are about; `--cpu` counts
its CPU branch instead. Decoding: the logits of one token after a 16-token prompt in the KV cache.
LoRA step: rank 8 on q and v, the same cross-entropy on a 1 x 64 batch for both, forward and
backward (value_and_grad), before any compilation.

Built here, on the CPU, MLX expands its fast ops (RMSNorm, RoPE, attention) into their fallback
graphs, which a GPU's stream runs as one kernel each: the totals are not a GPU's, the differences
between the tools are (both expand alike). "compute" leaves out the ops that are views on a GPU
(reshapes, transposes, broadcasts, slices: no kernel where the input is contiguous).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mlxtoy  # noqa: E402,F401  (fast BLAS before mlx.core)
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from bench_train import smollm2_hf  # noqa: E402
from mlxtoy import backend  # noqa: E402
from mlxtoy.config import TrainConfig  # noqa: E402
from mlxtoy.loading import load  # noqa: E402
from mlxtoy.models import fastmath  # noqa: E402
from mlxtoy.models.cache import make_cache  # noqa: E402
from mlxtoy.models.quant import QuantPlan  # noqa: E402
from mlxtoy.train.build import make_trainable  # noqa: E402

VIEWS = {"Reshape", "ExpandDims", "Squeeze", "Transpose", "Broadcast", "Slice", "Flatten", "Unflatten", "AsStrided"}
PROMPT = list(range(100, 116))
BATCH = mx.array([list(range(200, 265))])  # 64 inputs and their next tokens


def count_ops(dot: str) -> collections.Counter:
    """Primitives by kind in an `mx.export_to_dot` file (each a `shape=rectangle` node)."""
    with open(dot) as f:
        return collections.Counter(re.findall(r'label ="([^"]+)", shape=rectangle', f.read()))


def export(path: str, *outputs) -> collections.Counter:
    mx.export_to_dot(path, *outputs)  # every unevaluated input: the step's own ops only
    return count_ops(path)


def ours_decode(folder: str, quant: QuantPlan | None, path: str) -> collections.Counter:
    model, _ = load(folder, dtype=mx.bfloat16, quant=quant)
    mx.eval(model.parameters())
    cache = make_cache(model)
    with fastmath.inference():  # as generate's eager step (a GPU's) builds it
        mx.eval(model.logits(model.hidden(mx.array([PROMPT]), cache=cache)[:, -1, :]))
        logits = model.logits(model.hidden(mx.array([[PROMPT[-1]]]), cache=cache)[:, -1, :])
    return export(path, logits)


def theirs_decode(folder: str, quantized: bool, path: str) -> collections.Counter:
    from mlx_lm import load as lm_load
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = lm_load(folder)
    model.set_dtype(mx.bfloat16)
    if quantized:
        nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())  # quantized, cast: before the step, as for mlxtoy
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([PROMPT]), cache=cache)[:, -1, :], [c.state for c in cache])
    logits = model(mx.array([[PROMPT[-1]]]), cache=cache)[:, -1, :]  # generate_step's
    return export(path, logits)


def loss_fn(model, x, y):
    return nn.losses.cross_entropy(model(x).astype(mx.float32), y).mean()


def lora_step(model, path: str) -> collections.Counter:
    loss, grads = nn.value_and_grad(model, loss_fn)(model, BATCH[:, :-1], BATCH[:, 1:])
    return export(path, loss, *[g for _, g in tree_flatten(grads)])


def ours_lora(folder: str, quant: QuantPlan | None, path: str) -> collections.Counter:
    model, _ = load(folder, dtype=mx.bfloat16, quant=quant)
    make_trainable(model, TrainConfig(model=folder, method="lora", lora_rank=8, lora_alpha=16,
                                      lora_targets=["q", "v"]))
    model.train()
    mx.eval(model.parameters())  # the adapters' initial values: not the step's
    return lora_step(model, path)


def theirs_lora(folder: str, quantized: bool, path: str) -> collections.Counter:
    from mlx_lm import load as lm_load
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model, _ = lm_load(folder)
    model.set_dtype(mx.bfloat16)
    if quantized:
        nn.quantize(model, group_size=32, bits=4)
    model.freeze()
    linear_to_lora_layers(model, len(model.layers), {"rank": 8, "scale": 2.0, "dropout": 0.0,
                                                     "keys": ["self_attn.q_proj", "self_attn.v_proj"]})
    model.train()
    mx.eval(model.parameters())
    return lora_step(model, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a Hugging Face Llama folder (default: SmolLM2-135M, float32)")
    ap.add_argument("--dot", help="keep the .dot files in this folder")
    ap.add_argument("--cpu", action="store_true", help="mlxtoy's CPU branch (its kernels where built)")
    args = ap.parse_args()
    folder = args.model or smollm2_hf(os.path.join(tempfile.gettempdir(), "mlxtoy-bench-train"))
    if not args.cpu:
        backend.INFO.device, backend.INFO.kernels = "cuda", None  # the GPU's branches; MLX still runs on the CPU
    out = args.dot or tempfile.mkdtemp(prefix="op-graphs-")
    os.makedirs(out, exist_ok=True)
    rows = []
    for work, ours, theirs in (("decode", ours_decode, theirs_decode), ("LoRA step", ours_lora, theirs_lora)):
        for label, quantized in (("bf16", False), ("4-bit", True)):
            name = f"{work.split()[0].lower()}-{label}"
            # 4-bit: the tables too, as nn.quantize does them (a 4-bit folder of mlx-lm's holds them so)
            a = ours(folder, QuantPlan(tables=True) if quantized else None, os.path.join(out, f"{name}-mlxtoy.dot"))
            b = theirs(folder, quantized, os.path.join(out, f"{name}-mlx-lm.dot"))
            rows.append((f"{work}, {label}", a, b))
    branch = "CPU" if args.cpu else "GPU"
    print(f"| graph ({os.path.basename(os.path.normpath(folder))}, mlxtoy's {branch} branch) | mlxtoy ops "
          f"(compute) | mlx-lm ops (compute) | kinds where they differ (mlxtoy - mlx-lm) |")
    print("|---|---|---|---|")

    def compute(c: collections.Counter) -> int:
        return sum(n for k, n in c.items() if k not in VIEWS)

    for label, a, b in rows:
        diff = {k: a[k] - b[k] for k in set(a) | set(b) if a[k] != b[k]}
        worst = ", ".join(f"{k} {v:+d}" for k, v in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:8])
        print(f"| {label} | {sum(a.values())} ({compute(a)}) | {sum(b.values())} ({compute(b)}) | {worst or 'none'} |")
    print(f"(dot files in {out})", file=sys.stderr)


if __name__ == "__main__":
    main()
