"""Training throughput and peak memory: mlxtoy vs mlx-lm's tuner, same weights, same batches.

SmolLM2-135M-Instruct (the built-in GGUF, dequantized to float32 and written once as a Hugging
Face folder that both tools load), LoRA rank 8 on q and v of every layer, and full fine-tuning
(every block weight), batch 4 x 256 tokens of plain text (every row full, so both tools do the
same work), AdamW. Each (tool, method) runs in its own process, so peak memory is its own.

    python bench/bench_train.py [--steps 8] [--methods lora,full] [--tools mlx-lm,mlxtoy]

Needs `pip install mlx-lm`. Prints a table: median tokens/s over the steps after the first two
(compilation), MLX peak memory and peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
BATCH, SEQ = 4, 256


def prepare(work: str) -> tuple[str, str]:
    """-> (HF folder of SmolLM2 in float32, data folder of long text examples)."""
    import mlxtoy  # noqa: F401  (fast BLAS first)
    import mlx.core as mx

    from mlxtoy.io.hf import save_hf
    from mlxtoy.loading import load_weights

    hf = os.path.join(work, "smollm2-f32-hf")
    if not os.path.exists(os.path.join(hf, "model.safetensors")):
        cfg, weights, _, tok = load_weights("smollm2-135m", mx.float32)
        save_hf(hf, cfg, weights, tok)
    data = os.path.join(work, "data")
    os.makedirs(data, exist_ok=True)
    text = open(os.path.join(REPO, "assets", "corpus", "fables.txt")).read()
    sentences = [s.strip() + "." for s in text.replace("\n", " ").split(".") if len(s.strip()) > 20]
    rng = random.Random(0)
    for split, n in (("train", 64), ("valid", 8)):
        with open(os.path.join(data, f"{split}.jsonl"), "w") as f:
            for _ in range(n):  # ~2,000 characters: well over 256 tokens, so every row is full
                f.write(json.dumps({"text": " ".join(rng.choice(sentences) for _ in range(24))}) + "\n")
    return hf, data


def _rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux


def worker_mlxtoy(method: str, hf: str, data: str, steps: int) -> dict:
    import mlxtoy  # noqa: F401
    import mlx.core as mx

    from mlxtoy.config import TrainConfig
    from mlxtoy.train.job import run_job

    out = tempfile.mkdtemp(prefix="bench-mlxtoy-")
    cfg = TrainConfig(model=hf, data=data, out=os.path.join(out, "run"), method=method, steps=steps,
                      batch_size=BATCH, seq_len=SEQ, lr=1e-5 if method == "full" else 1e-4,
                      lora_rank=8, lora_alpha=16, lora_targets=["q", "v"], eval_every=0, schedule="constant",
                      eval_batches=1, save_every=0, grad_clip=0, dtype="float32")
    tps: list[float] = []
    tokens: list[int] = []
    t0 = time.perf_counter()
    res = run_job(lambda: (cfg, False), handle_sigint=False,
                  emit=lambda e: (tps.append(e.tokens_per_sec)) if e.event == "step" else None).result
    return {"tokens_per_sec": tps, "loss": res.losses, "peak_gb": mx.get_peak_memory() / 1e9,
            "rss_gb": _rss_gb(), "wall": time.perf_counter() - t0}


def worker_mlxlm(method: str, hf: str, data: str, steps: int) -> dict:
    import mlxtoy  # noqa: F401  (the same fast BLAS for mlx-lm)
    import mlx.core as mx
    import mlx.optimizers as optim
    from mlx_lm import load
    from mlx_lm.tuner.datasets import CacheDataset, TextDataset
    from mlx_lm.tuner.trainer import TrainingArgs, TrainingCallback, train
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model, tok = load(hf)
    mx.random.seed(0)
    model.freeze()
    if method == "full":
        for layer in model.layers:
            layer.unfreeze()
    else:
        linear_to_lora_layers(model, len(model.layers), {"rank": 8, "scale": 2.0, "dropout": 0.0,
                                                         "keys": ["self_attn.q_proj", "self_attn.v_proj"]})
    rows = [json.loads(line) for line in open(os.path.join(data, "train.jsonl"))]
    valid = [json.loads(line) for line in open(os.path.join(data, "valid.jsonl"))]
    train_set = CacheDataset(TextDataset(rows, tok))
    valid_set = CacheDataset(TextDataset(valid, tok))
    tps: list[float] = []
    losses: list[float] = []

    class CB(TrainingCallback):
        def on_train_loss_report(self, info):
            tps.append(info["tokens_per_second"])
            losses.append(info["train_loss"])

    adapter = os.path.join(tempfile.mkdtemp(prefix="bench-mlxlm-"), "adapters.safetensors")
    # max_seq_length 257: mlx-lm feeds batch[:, :-1], so rows are 256 inputs, as ours are
    args = TrainingArgs(batch_size=BATCH, iters=steps, val_batches=1, steps_per_report=1,
                        steps_per_eval=10**9, steps_per_save=10**9, max_seq_length=SEQ + 1,
                        adapter_file=adapter)
    opt = optim.AdamW(learning_rate=1e-5 if method == "full" else 1e-4, weight_decay=0.0)
    t0 = time.perf_counter()
    import io
    from contextlib import redirect_stdout

    with redirect_stdout(io.StringIO()):  # its own progress lines would clutter ours
        train(model=model, optimizer=opt, train_dataset=train_set, val_dataset=valid_set, args=args,
              training_callback=CB())
    return {"tokens_per_sec": tps, "loss": losses, "peak_gb": mx.get_peak_memory() / 1e9,
            "rss_gb": _rss_gb(), "wall": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--methods", default="lora,full")
    ap.add_argument("--tools", default="mlx-lm,mlxtoy")
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "mlxtoy-bench-train"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--method", help=argparse.SUPPRESS)
    ap.add_argument("--hf", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        fn = worker_mlxtoy if args.worker == "mlxtoy" else worker_mlxlm
        print("RESULT " + json.dumps(fn(args.method, args.hf, args.data, args.steps)))
        return
    os.makedirs(args.work, exist_ok=True)
    hf, data = prepare(args.work)
    results = {}
    for method in args.methods.split(","):
        for tool in args.tools.split(","):
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", tool, "--method", method,
                   "--hf", hf, "--data", data, "--steps", str(args.steps)]
            p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
            line = next((l for l in p.stdout.splitlines() if l.startswith("RESULT ")), None)
            if p.returncode != 0 or line is None:
                print(f"{tool} {method}: failed\n{p.stderr[-3000:]}", file=sys.stderr)
                continue
            r = json.loads(line[7:])
            steady = r["tokens_per_sec"][2:] or r["tokens_per_sec"]
            r["median_tps"] = statistics.median(steady)
            results[(method, tool)] = r
            print(f"{method:5s} {tool:7s} {r['median_tps']:7.1f} tok/s  first step "
                  f"{BATCH * SEQ / r['tokens_per_sec'][0]:5.1f} s  peak {r['peak_gb']:.2f} GB  "
                  f"RSS {r['rss_gb']:.2f} GB  loss {r['loss'][0]:.3f} -> {r['loss'][-1]:.3f}",
                  flush=True)
    print(f"\nSmolLM2-135M float32, batch {BATCH} x {SEQ}, {args.steps} steps, median of steps 3+")
    print(f"{'method':6s} {'tool':8s} {'tokens/s':>9s} {'peak MLX GB':>12s} {'peak RSS GB':>12s}")
    for (method, tool), r in results.items():
        print(f"{method:6s} {tool:8s} {r['median_tps']:9.1f} {r['peak_gb']:12.2f} {r['rss_gb']:12.2f}")


if __name__ == "__main__":
    main()
