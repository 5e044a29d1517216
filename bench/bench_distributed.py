"""Data-parallel throughput: 1 process vs 2 processes (mlx.launch, ring backend, loopback).

SmolLM2-135M-Instruct (built-in GGUF, float32 on CPU), LoRA r8 on q,v, global batch 4 x SEQ of
packed plain text (assets/corpus/fables.txt), AdamW. Configurations:
  1 process, 1 BLAS thread   (the per-core baseline)
  1 process, 2 BLAS threads  (what one process gets out of the whole machine)
  2 processes, 1 thread each (data-parallel, each rank pinned to one core's worth of BLAS)
Each reports the median tokens/s (global tokens per wall-clock second, from metrics.jsonl) over
the steps after the first (compilation), and for 2 processes the median all-reduce time per step
(rank 0's wall time in the gradient all-reduce, including waiting for the slower rank).

    python bench/bench_distributed.py [--steps 5] [--seq-len 128]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
LAUNCH = os.path.join(os.path.dirname(sys.executable), "mlx.launch")


def worker(argv: list[str]) -> int:
    """A rank: run `mlxtoy train`, then (rank 0) print the all-reduce times as one JSON line."""
    import mlxtoy  # noqa: F401
    from mlxtoy.cli import main
    from mlxtoy.train import distributed

    code = main(["train", *argv])
    d = distributed.active()
    if d is not None and d.is_main:
        print("ALLREDUCE " + json.dumps(d.allreduce_seconds), file=sys.stderr, flush=True)
    return code


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return min(s.getsockname()[1], 60000)


def one(label: str, n_procs: int, threads: int, train_args: list[str], out: str) -> dict:
    env = dict(os.environ, MKL_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads),
               OPENBLAS_NUM_THREADS=str(threads))
    args = [*train_args, "--out", out]
    if n_procs == 1:
        cmd = [sys.executable, __file__, "--worker", *args]
    else:
        cmd = [LAUNCH, "--backend", "ring", "-n", str(n_procs), "--starting-port", str(free_port()),
               *sum((["--env", f"{k}={threads}"] for k in ("MKL_NUM_THREADS", "OMP_NUM_THREADS",
                                                          "OPENBLAS_NUM_THREADS")), []),
               "--python", sys.executable, "--", __file__, "--worker", *args]
    t0 = time.time()
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.time() - t0
    if r.returncode != 0 or '"reason": "finished"' not in r.stdout:
        raise SystemExit(f"{label} failed:\n{r.stdout}\n{r.stderr[-3000:]}")
    steps = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
    tps = [e["tokens_per_sec"] for e in steps if e["event"] == "step"][1:]
    ar = None
    for line in r.stderr.splitlines():
        if line.startswith("ALLREDUCE "):
            ar = json.loads(line[len("ALLREDUCE "):])[1:]
    return {"config": label, "tokens_per_sec": statistics.median(tps),
            "allreduce_ms": statistics.median(ar) * 1e3 if ar else None, "wall_s": wall}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--configs", default="1x1,1x2,2x1", help="procs x threads, comma-separated")
    a = ap.parse_args()
    train_args = ["--model", "smollm2-135m", "--data", os.path.join(REPO, "assets", "corpus", "fables.txt"),
                  "--method", "lora", "--lora-rank", "8", "--lora-targets", "q,v",
                  "--steps", str(a.steps), "--batch-size", str(a.batch_size), "--seq-len", str(a.seq_len),
                  "--eval-every", "0", "--valid-fraction", "0", "--save-every", "0", "--sample-every", "0", "--lr", "1e-4"]
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for spec in a.configs.split(","):
            n, t = (int(x) for x in spec.split("x"))
            label = f"{n} process{'es' if n > 1 else ''}, {t} thread{'s' if t > 1 else ''} each"
            rows.append(one(label, n, t, train_args, os.path.join(work, spec)))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    base = rows[0]["tokens_per_sec"]
    print(f"SmolLM2-135M LoRA r8 q,v, global batch {a.batch_size} x {a.seq_len}, "
          f"{a.steps} steps (median of steps 2..{a.steps})")
    print(f"{'configuration':34s} {'tokens/s':>9s} {'speed-up':>9s} {'all-reduce ms/step':>19s}")
    for r in rows:
        ar = f"{r['allreduce_ms']:.1f}" if r["allreduce_ms"] is not None else "-"
        print(f"{r['config']:34s} {r['tokens_per_sec']:9.1f} {r['tokens_per_sec'] / base:8.2f}x {ar:>19s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
