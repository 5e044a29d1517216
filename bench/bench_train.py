"""Training throughput and peak memory: mlxtoy vs mlx-lm's tuner, same weights, same batches.

SmolLM2-135M-Instruct (the built-in GGUF, dequantized to float32 and written once as a Hugging
Face folder that every tool loads: mlxtoy, mlx-lm's tuner, transformers + peft on torch), LoRA rank 8 on q and v of every layer, and full fine-tuning
(every block weight), batch 4 x 256 tokens of plain text (every row full, so both tools do the
same work), AdamW. Each (tool, method) runs in its own process, so peak memory is its own.

    python bench/bench_train.py [--steps 8] [--rounds 2] [--methods lora,full] [--tools mlxtoy,torch,mlx-lm]
                                [--baseline torch] [--batch 4] [--seq 256] [--model HF_FOLDER] [--cold]

`--model` trains another Hugging Face folder on the same rows (`python bench/bench_scale.py
--write-hf 1b` writes one with Llama-3.2-1B's shapes). `--cold` runs each process in an empty temp
folder of its own: MLX compiles its CPU kernels into `$TMPDIR/mlx` on first use, so the first step
is then a new machine's (and mlxtoy builds its precompiled header for those compiles again).

Tool `mlxtoy-mlx` is mlxtoy with MLXTOY_KERNELS=0: the MLX-only path, which Metal and CUDA run
(bench/bench_portable.py compares it with mlx-lm); `mlxtoy-blas` keeps the kernels but gives
float32 products of many rows to the BLAS (MLXTOY_GEMM=0).

Needs mlx-lm, torch, transformers and peft (`scripts/setup.sh test` installs them). Prints a
table: median tokens/s over the steps after the first two (compilation), the ratio to
torch + peft, the first step's time (compilation included), MLX peak memory and peak RSS. A
step's tokens/s is timed the same way for every tool (`StepClock`: report to report).
"""

from __future__ import annotations

import argparse
import contextlib
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
DTYPE = "float32"  # --dtype: what every tool trains in (bfloat16 on a GPU)


def smollm2_hf(work: str) -> str:
    """The built-in SmolLM2 written once as a float32 Hugging Face folder."""
    import mlxtoy  # noqa: F401  (fast BLAS first)
    import mlx.core as mx

    from mlxtoy.io.hf import save_hf
    from mlxtoy.loading import load_weights

    hf = os.path.join(work, "smollm2-f32-hf")
    if not os.path.exists(os.path.join(hf, "model.safetensors")):
        cfg, weights, _, tok = load_weights("smollm2-135m", mx.float32)
        save_hf(hf, cfg, weights, tok)
    return hf


def write_text_data(work: str) -> str:
    """A data folder (train 64, valid 8) of plain-text rows from the bundled corpus, each well
    over 256 tokens, so every row of a batch is full and every tool does the same work."""
    data = os.path.join(work, "data")
    os.makedirs(data, exist_ok=True)
    text = open(os.path.join(REPO, "assets", "corpus", "fables.txt")).read()
    sentences = [s.strip() + "." for s in text.replace("\n", " ").split(".") if len(s.strip()) > 20]
    rng = random.Random(0)
    for split, n in (("train", 64), ("valid", 8)):
        with open(os.path.join(data, f"{split}.jsonl"), "w") as f:
            for _ in range(n):  # ~2,000 characters
                f.write(json.dumps({"text": " ".join(rng.choice(sentences) for _ in range(24))}) + "\n")
    return data


def _rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux


class StepClock:
    """Tokens/s of each step by the same clock for every tool: the wall time from one step's
    report to the next (batch building included, which mlx-lm's own figure leaves out; it shows
    where a step is a few milliseconds, on a GPU). The first step keeps the tool's own figure."""

    def __init__(self) -> None:
        self.tokens_per_sec: list[float] = []
        self.last: float | None = None

    def step(self, own_figure: float) -> None:
        now = time.perf_counter()
        self.tokens_per_sec.append(own_figure if self.last is None else BATCH * SEQ / (now - self.last))
        self.last = now


def worker_mlxtoy(method: str, hf: str, data: str, steps: int) -> dict:
    import mlxtoy  # noqa: F401
    import mlx.core as mx

    from mlxtoy.config import TrainConfig
    from mlxtoy.train.job import run_job

    clock = StepClock()
    # the run's checkpoints (~2 GB for a full fine-tune) go with the directory
    with tempfile.TemporaryDirectory(prefix="bench-mlxtoy-") as out:
        cfg = TrainConfig(model=hf, data=data, out=os.path.join(out, "run"), method=method, steps=steps,
                          batch_size=BATCH, seq_len=SEQ, lr=1e-5 if method == "full" else 1e-4,
                          lora_rank=8, lora_alpha=16, lora_targets=["q", "v"], eval_every=0,
                          schedule="constant", eval_batches=1, save_every=0, grad_clip=0, dtype=DTYPE)
        t0 = time.perf_counter()
        res = run_job(lambda: (cfg, False), handle_sigint=False,
                      emit=lambda e: clock.step(e.tokens_per_sec) if e.event == "step" else None).result
        wall = time.perf_counter() - t0
    return {"tokens_per_sec": clock.tokens_per_sec, "loss": res.losses, "peak_gb": mx.get_peak_memory() / 1e9,
            "rss_gb": _rss_gb(), "wall": wall}


def worker_mlxlm(method: str, hf: str, data: str, steps: int) -> dict:
    import mlxtoy  # noqa: F401  (the same fast BLAS for mlx-lm)
    import mlx.core as mx
    import mlx.optimizers as optim
    from mlx_lm import load
    from mlx_lm.tuner.datasets import CacheDataset, TextDataset
    from mlx_lm.tuner.trainer import TrainingArgs, TrainingCallback, train
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model, tok = load(hf)
    model.set_dtype(getattr(mx, DTYPE))  # whatever the folder holds, every tool trains in DTYPE
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
    clock = StepClock()
    losses: list[float] = []

    class CB(TrainingCallback):
        def on_train_loss_report(self, info):
            clock.step(info["tokens_per_second"])
            losses.append(info["train_loss"])

    import io
    from contextlib import redirect_stdout

    opt = optim.AdamW(learning_rate=1e-5 if method == "full" else 1e-4, weight_decay=0.0)
    with tempfile.TemporaryDirectory(prefix="bench-mlxlm-") as out:
        # max_seq_length 257: mlx-lm feeds batch[:, :-1], so rows are 256 inputs, as ours are
        args = TrainingArgs(batch_size=BATCH, iters=steps, val_batches=1, steps_per_report=1,
                            steps_per_eval=10**9, steps_per_save=10**9, max_seq_length=SEQ + 1,
                            adapter_file=os.path.join(out, "adapters.safetensors"))
        t0 = time.perf_counter()
        with redirect_stdout(io.StringIO()):  # its own progress lines would clutter ours
            train(model=model, optimizer=opt, train_dataset=train_set, val_dataset=valid_set, args=args,
                  training_callback=CB())
        wall = time.perf_counter() - t0
    return {"tokens_per_sec": clock.tokens_per_sec, "loss": losses, "peak_gb": mx.get_peak_memory() / 1e9,
            "rss_gb": _rss_gb(), "wall": wall}


def worker_torch(method: str, hf: str, data: str, steps: int) -> dict:
    """transformers + peft on the same HF folder and the same rows (on CUDA where torch has it)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tok = AutoTokenizer.from_pretrained(hf)
    model = AutoModelForCausalLM.from_pretrained(hf, torch_dtype=getattr(torch, DTYPE)).to(device)
    if method == "full":
        for name, p in model.named_parameters():  # every block weight, as the others train
            p.requires_grad = ".layers." in name
    else:
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                 target_modules=["q_proj", "v_proj"]))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5 if method == "full" else 1e-4, weight_decay=0.0)
    rows = [json.loads(line)["text"] for line in open(os.path.join(data, "train.jsonl"))]
    ids = [tok(r)["input_ids"][:SEQ + 1] for r in rows]
    clock = StepClock()
    losses: list[float] = []
    t0 = time.perf_counter()
    for step in range(steps):
        batch = torch.tensor([ids[(step * BATCH + j) % len(ids)] for j in range(BATCH)], device=device)
        t = time.perf_counter()
        out = model(input_ids=batch[:, :-1], labels=batch[:, :-1])
        # transformers shifts the labels itself: pass the inputs, and BATCH x SEQ tokens train
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(out.loss))  # (waits for the GPU)
        clock.step(BATCH * SEQ / (time.perf_counter() - t))
    peak = torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else float("nan")
    return {"tokens_per_sec": clock.tokens_per_sec, "loss": losses, "peak_gb": peak, "rss_gb": _rss_gb(),
            "wall": time.perf_counter() - t0}


WORKERS = {"mlxtoy": worker_mlxtoy, "mlxtoy-mlx": worker_mlxtoy, "mlxtoy-blas": worker_mlxtoy,
           "mlxtoy-slabs": worker_mlxtoy, "mlx-lm": worker_mlxlm, "torch": worker_torch}
# read at import: set for the worker process (mlxtoy-blas: the kernels on, the BLAS's GEMM;
# mlxtoy-slabs: on a GPU, a quantized base's products of many rows through dequantized slabs)
ENV = {"mlxtoy-mlx": {"MLXTOY_KERNELS": "0"}, "mlxtoy-blas": {"MLXTOY_GEMM": "0"},
       "mlxtoy-slabs": {"MLXTOY_GPU_SLAB_ROWS": "256"}}


def main(argv: list[str] | None = None, tools: str = "mlxtoy,torch,mlx-lm") -> None:
    global BATCH, SEQ, DTYPE  # the workers read them; --batch / --seq / --dtype set them
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--methods", default="lora,full")
    ap.add_argument("--tools", default=tools)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--baseline", default="torch", help="the tool the ratios are to")
    ap.add_argument("--batch", type=int, default=BATCH)
    ap.add_argument("--seq", type=int, default=SEQ)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=DTYPE,
                    help="what every tool trains in (bfloat16: the GPU's)")
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "mlxtoy-bench-train"))
    ap.add_argument("--model", help="a Hugging Face folder to train instead of SmolLM2-135M")
    ap.add_argument("--cold", action="store_true", help="each run in an empty temp folder (MLX's kernel "
                    "cache empty: a new machine's first step)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--method", help=argparse.SUPPRESS)
    ap.add_argument("--hf", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    BATCH, SEQ, DTYPE = args.batch, args.seq, args.dtype
    if args.worker:
        fn = WORKERS[args.worker]
        print("RESULT " + json.dumps(fn(args.method, args.hf, args.data, args.steps)))
        return
    os.makedirs(args.work, exist_ok=True)
    data = write_text_data(args.work)
    hf = args.model or smollm2_hf(args.work)  # (no SmolLM2 needed where --model is given)
    runs: dict[tuple[str, str], list[dict]] = {}
    for rnd in range(args.rounds):  # tools alternate, so drift in the machine hits each of them
        for method in args.methods.split(","):
            for tool in args.tools.split(","):
                cmd = [sys.executable, os.path.abspath(__file__), "--worker", tool, "--method", method,
                       "--hf", hf, "--data", data, "--steps", str(args.steps), "--batch", str(BATCH),
                       "--seq", str(SEQ), "--dtype", DTYPE]
                with tempfile.TemporaryDirectory(prefix="bench-cold-") if args.cold else contextlib.nullcontext() as cold:
                    p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO,
                                       env=os.environ | ENV.get(tool, {}) | ({"TMPDIR": cold} if cold else {}))
                line = next((l for l in p.stdout.splitlines() if l.startswith("RESULT ")), None)
                if p.returncode != 0 or line is None:
                    print(f"{tool} {method}: failed\n{p.stderr[-3000:]}", file=sys.stderr)
                    continue
                r = json.loads(line[7:])
                r["steady"] = r["tokens_per_sec"][2:] or r["tokens_per_sec"]
                r["first_s"] = BATCH * SEQ / r["tokens_per_sec"][0]
                runs.setdefault((method, tool), []).append(r)
                print(f"round {rnd + 1} {method:5s} {tool:10s} {statistics.median(r['steady']):7.1f} tok/s  "
                      f"first step {r['first_s']:5.1f} s  peak {r['peak_gb']:.2f} GB  RSS {r['rss_gb']:.2f} GB  "
                      f"loss {r['loss'][0]:.3f} -> {r['loss'][-1]:.3f}", flush=True)
    name = os.path.basename(os.path.normpath(args.model)) if args.model else "SmolLM2-135M"
    print(f"\n{name} {DTYPE}, batch {BATCH} x {SEQ}, {args.steps} steps x {args.rounds} rounds; "
          f"tokens/s: median over every round's steps 3+; first step: median over rounds")
    print(f"{'method':6s} {'tool':10s} {'tokens/s':>9s} {'vs ' + args.baseline:>10s} {'first step s':>13s} "
          f"{'peak MLX GB':>12s} {'peak RSS GB':>12s}")
    for (method, tool), rs in runs.items():
        tps = statistics.median([t for r in rs for t in r["steady"]])
        base = runs.get((method, args.baseline))
        ratio = tps / statistics.median([t for r in base for t in r["steady"]]) if base else float("nan")
        print(f"{method:6s} {tool:10s} {tps:9.1f} {ratio:9.2f}x {statistics.median(r['first_s'] for r in rs):13.1f} "
              f"{max(r['peak_gb'] for r in rs):12.2f} {max(r['rss_gb'] for r in rs):12.2f}")


if __name__ == "__main__":
    main()
