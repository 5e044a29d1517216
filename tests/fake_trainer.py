"""A test double that speaks the same protocol as `python -m mlxtoy.train.remote`.

`fake_events()` is a deterministic event sequence (fixed times) for snapshot tests;
`python tests/fake_trainer.py --config JSON` streams such events on stdout at a chosen pace and
obeys the mlxtoy.events Commands on stdin, without a model. Its checkpoint paths are the real
layout's (mlxtoy.rundir), so tests that follow them see what a real run writes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
from typing import Any, Iterator

from mlxtoy.events import PAUSED, RUNNING, Command
from mlxtoy.rundir import CHECKPOINTS, checkpoint_name

SITES = ("attn_norm", "ffn_out", "resid_post")
T0 = 1_700_000_000.0  # a fixed clock so snapshots are identical run to run


def _loss(step: int) -> float:
    return 2.0 + 3.0 * math.exp(-step / 12.0) + 0.08 * math.sin(step * 1.7)


def _taps(step: int, n_layers: int) -> list[dict[str, Any]]:
    stats = []
    for layer in range(n_layers):
        for k, site in enumerate(SITES):
            # resid_post grows with depth as real residual streams do; the others wobble
            base = (0.9 + 0.35 * layer) if site == "resid_post" else (1.0 + 0.3 * math.sin(layer + k))
            rms = base * (1.0 + 0.02 * step / 10)
            stats.append({"layer": layer, "site": site, "mean": 0.01 * k, "rms": rms,
                          "max_abs": rms * 6, "zero_frac": 0.01, "hist": [0] * 16,
                          "hist_edges": [-rms * 6, rms * 6]})
    return stats


def fake_events(steps: int = 30, n_layers: int = 6, eval_every: int = 10, taps_every: int = 10,
                sample_every: int = 15, save_every: int = 20, run_dir: str = "runs/demo",
                done: bool = True, t0: float = T0, objective: str = "sft") -> Iterator[dict[str, Any]]:
    """A realistic, fully deterministic run: start, steps, evals, taps, samples, checkpoints, done.
    objective dpo / orpo: step and eval events carry rewards and pair accuracy too; grpo: the
    mean reward (TRL's names) and sampled completions with their rewards."""
    from mlxtoy.train.objectives import OBJECTIVE_TYPES  # what the objective shows, as the trainer sends it

    def ev(kind: str, at: int, **kw) -> dict[str, Any]:
        return {"event": kind, "time": t0 + at * 2.0, **kw}

    yield ev("start", 0, run_dir=run_dir, method="lora", total_steps=steps, start_step=0,
             trainable_params=460_800, total_params=134_975_808,
             config={"model": "smollm2-135m", "method": "lora", "steps": steps, "batch_size": 4,
                     "seq_len": 256, "lr": 1e-4, "lora_rank": 8, "objective": objective},
             shows=OBJECTIVE_TYPES[objective].shows())
    pref = objective in ("dpo", "orpo")
    grpo = objective == "grpo"
    yield ev("taps", 0, step=0, stats=_taps(0, n_layers), heads=[])
    for step in range(1, steps + 1):
        lr = 1e-4 * 0.5 * (1 + math.cos(math.pi * step / steps))
        margin = round(2.0 * (1 - math.exp(-step / 10)), 4)
        extra = {"reward_chosen": margin / 2, "reward_rejected": -margin / 2, "reward_margin": margin,
                 "pref_accuracy": round(min(1.0, 0.5 + step / 40), 4)} if pref else {}
        if grpo:
            reward = round(0.2 + margin / 2.5, 4)
            extra = {"reward": reward, "reward_std": 0.2, "rewards/exact/mean": reward, "kl": 0.0, "entropy": 1.5,
                     "completions/mean_length": 9.0, "frac_reward_zero_std": 0.25,
                     "samples": [{"prompt": "Write the date 2011-12-26 as day, month name and year.",
                                  "completion": f"26 December 2011 (step {step})", "reward": reward,
                                  "rewards": {"exact": reward}}]}
        yield ev("step", step, step=step, loss=round(_loss(step), 4), lr=lr, tokens=1024,
                 tokens_per_sec=512.0, elapsed=2.0 * step, eta=2.0 * (steps - step),
                 peak_memory_gb=2.61, grad_norm=1.0, **extra)
        if eval_every and step % eval_every == 0:
            v = _loss(step) + 0.15
            extra = {"pref_accuracy": round(min(1.0, 0.45 + step / 40), 4), "reward_margin": margin} if pref else {}
            if grpo:
                extra = {"reward": round(0.1 + margin / 2.5, 4), "rewards/exact/mean": round(0.1 + margin / 2.5, 4)}
            yield ev("eval", step, step=step, val_loss=round(v, 4), val_ppl=math.exp(v), val_tokens=4096, **extra)
        if taps_every and step % taps_every == 0:
            yield ev("taps", step, step=step, stats=_taps(step, n_layers), heads=[])
        if sample_every and step % sample_every == 0:
            yield ev("sample", step, step=step, prompt="What is the capital of France?",
                     text=f"The capital of France is Paris. (sample at step {step})")
        if save_every and step % save_every == 0:
            yield ev("checkpoint", step, step=step, path=_ckpt(run_dir, step))
    if done:
        yield ev("done", steps, step=steps, reason="finished", final_path=run_dir)


def _ckpt(run_dir: str, step: int) -> str:
    return f"{run_dir}/{CHECKPOINTS}/{checkpoint_name(step)}"


class _Control:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.paused = threading.Event()
        self.stop = threading.Event()
        self.requests: list[str] = []

    def read_commands(self, stream) -> None:
        for line in stream:
            cmd = Command.parse(line)
            if cmd is Command.PAUSE:
                self.paused.set()
            elif cmd is Command.RESUME:
                self.paused.clear()
            elif cmd is Command.STOP:
                self.stop.set()
                self.paused.clear()
            elif cmd in (Command.SAMPLE, Command.CHECKPOINT):
                with self.lock:
                    self.requests.append(cmd)
        self.stop.set()  # the UI went away: stop (and save) like a real trainer would
        self.paused.clear()

    def take(self) -> list[str]:
        with self.lock:
            out, self.requests = self.requests, []
        return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True, help="JSON object or a path to a JSON file")
    ap.add_argument("--delay", type=float, default=0.2, help="seconds per step")
    args = ap.parse_args(argv)
    cfg = json.loads(args.config) if args.config.lstrip().startswith("{") else json.load(open(args.config))
    run_dir = cfg.get("out") or "runs/fake"
    os.makedirs(run_dir, exist_ok=True)
    metrics = open(os.path.join(run_dir, "metrics.jsonl"), "a")
    ctl = _Control()
    threading.Thread(target=ctl.read_commands, args=(sys.stdin,), daemon=True).start()

    def emit(ev: dict[str, Any]) -> None:
        ev = {**ev, "time": time.time()}
        line = json.dumps(ev, separators=(",", ":"))
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
        metrics.write(line + "\n")
        metrics.flush()

    steps = int(cfg.get("steps", 30))
    step = 0
    was_paused = False
    for ev in fake_events(steps=steps, eval_every=int(cfg.get("eval_every", 10)),
                          taps_every=int(cfg.get("taps_every", 10)),
                          sample_every=int(cfg.get("sample_every", 15)),
                          save_every=int(cfg.get("save_every", 20)), run_dir=run_dir, done=False):
        while ctl.paused.is_set() and not ctl.stop.is_set():
            if not was_paused:
                emit({"event": "status", "step": step, "state": PAUSED})
                was_paused = True
            for req in ctl.take():
                emit(_serve(req, step, run_dir))
            time.sleep(0.02)
        if was_paused:
            emit({"event": "status", "step": step, "state": RUNNING})
            was_paused = False
        if ctl.stop.is_set():
            break
        if ev["event"] == "step":
            time.sleep(args.delay)
            step = ev["step"]
        emit(ev)
        for req in ctl.take():
            emit(_serve(req, step, run_dir))
    reason = "stopped" if ctl.stop.is_set() else "finished"
    emit({"event": "checkpoint", "step": step, "path": _ckpt(run_dir, step)})
    emit({"event": "done", "step": step, "reason": reason, "final_path": run_dir})
    return 0


def _serve(req: Command, step: int, run_dir: str) -> dict[str, Any]:
    if req is Command.SAMPLE:
        return {"event": "sample", "step": step, "prompt": "Hello", "text": f"Hello from step {step}."}
    return {"event": "checkpoint", "step": step, "path": _ckpt(run_dir, step)}


if __name__ == "__main__":
    raise SystemExit(main())
