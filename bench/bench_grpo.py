"""A GRPO step's time and the share of it spent generating: rollouts through the batched decoder
(`generate_batch`: each prompt prefilled once, its group's rows decoded together) against one
completion at a time (`generate_tokens` per completion with the seed each row draws from: what
rollouts were before the batched engine). Both sample the same completions, so the runs' losses
must be equal, which the script checks.

    python bench/bench_grpo.py [--steps 6] [--tokens 32] [--rounds 2]

The README's GRPO example (assets/grpo/grpo.yaml: SmolLM2-135M, LoRA, group 8 x 2 prompts) with
--tokens completion tokens and no evaluation, each way in its own process, alternating; medians
of the steps after the first (report to report).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

import numpy as np
import yaml

import mlxtoy  # noqa: F401  (fast BLAS before mlx.core)
from mlxtoy.config import TrainConfig
from mlxtoy.generate import generate_tokens
from mlxtoy.train import grpo
from mlxtoy.train.job import run_job

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one_at_a_time(model, tokenizer, prompts, group_size, sampling, max_tokens, seed):
    """`grpo.generate_groups`'s completions, each decoded alone (row r of the batch draws from
    seed * 2**20 + r, as `generate_batch` seeds it)."""
    eos = set(tokenizer.eos_ids)
    outs = []
    for i, p in enumerate(prompts):
        for j in range(group_size):
            tokens = []
            for t, _ in generate_tokens(model, p.tokens.tolist(), max_tokens=max_tokens,
                                        sampling=replace(sampling, seed=seed * 2**20 + i * group_size + j)):
                tokens.append(t)
                if t in eos:
                    break
            outs.append(tokens)
    return outs, np.array([not (o and o[-1] in eos) for o in outs])


def worker(way: str, steps: int, tokens: int) -> dict:
    raw = yaml.safe_load(open(os.path.join(REPO, "assets", "grpo", "grpo.yaml")))
    raw.update(data=os.path.join(REPO, "assets", "grpo"), steps=steps, eval_every=0, max_completion_tokens=tokens,
               reward=raw["reward"].replace("assets/", os.path.join(REPO, "assets") + "/"))
    generate = grpo.generate_groups if way == "batched" else one_at_a_time
    gen_times: list[float] = []

    def timed(*args, **kwargs):
        t = time.perf_counter()
        out = generate(*args, **kwargs)
        gen_times.append(time.perf_counter() - t)
        return out

    grpo.generate_groups = timed
    stamps: list[float] = []
    with tempfile.TemporaryDirectory() as out:
        cfg = TrainConfig(**raw, out=os.path.join(out, "run"))
        res = run_job(lambda: (cfg, False), handle_sigint=False,
                      emit=lambda e: stamps.append(time.perf_counter()) if e.event == "step" else None).result
    steps_s = list(np.diff(stamps))  # report to report: every step after the first
    gens = gen_times[-len(steps_s):]
    return {"step_s": statistics.median(steps_s), "generation_s": statistics.median(gens),
            "share": statistics.median(g / s for g, s in zip(gens, steps_s)), "losses": res.losses}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=32, help="max completion tokens")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.steps, args.tokens)))
        return
    results: dict[str, list[dict]] = {"batched": [], "one at a time": []}
    for r in range(args.rounds):
        for way, name in (("batched", "batched"), ("sequential", "one at a time")):
            out = subprocess.run([sys.executable, __file__, "--worker", way, "--steps", str(args.steps),
                                  "--tokens", str(args.tokens)], capture_output=True, text=True, check=True)
            res = json.loads(out.stdout.strip().splitlines()[-1])
            results[name].append(res)
            print(f"round {r + 1}: {name:13s} step {res['step_s']:6.2f} s, generation {res['generation_s']:5.2f} s "
                  f"({100 * res['share']:.0f}% of the step)", flush=True)
    losses = {json.dumps(res["losses"]) for runs in results.values() for res in runs}
    print("the same completions both ways (equal losses):", "yes" if len(losses) == 1 else f"NO: {losses}")


if __name__ == "__main__":
    main()
