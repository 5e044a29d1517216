"""Serving: `mlxtoy serve` against `mlx_lm.server` (and llama.cpp's server where
llama-cpp-python has it), the same model, prompts and greedy settings, in one run.

    python bench/bench_serve.py [--model smollm2-135m] [--streams 1,8,32] [--tokens 64]
                                [--adapters 8] [--adapter-targets q,v] [--skip mlx-lm,llama.cpp]
                                [--kept] [--engine] [--json OUT]

For each server and each number of concurrent streams C: C clients at once, each streaming a
completion of its own prompt (`/v1/completions`, temperature 0, `max_tokens` --tokens), through
the OpenAI HTTP API. The peers come with `pip install -e ".[bench]"`. Reported: aggregate tokens/s (every stream's tokens / the wall time from the
first request to the last token) and the median time to first token. Tokens are counted from
the streamed chunks (a chunk a token for both servers; EOS may end a stream early, which counts
what was produced).

- mlxtoy and mlx-lm serve the same float32 Hugging Face folder written from MODEL with
  mlxtoy's save_hf (mlx-lm cannot read a GGUF); llama.cpp serves MODEL's GGUF as it is (Q4_1
  for the built-in SmolLM2: other weights, the same shapes).
- --adapters N: N LoRA runs of rank 8 on q,v (--adapter-targets: q,k,v,o,gate,up,down is
  Unsloth's default and a common mlx-lm-lora choice) are trained for one step each (`mlxtoy train
  --steps 1`, seeds differ) and served together; C streams spread over them (stream i reads
  adapter i mod N) against the same streams all on adapter 0: the many-adapter batch's
  tokens/s over the one-adapter batch's.
- --kept: a server `mlxtoy-kept` too, `mlxtoy serve MODEL --quantized on` (MODEL as it is, its
  base kept quantized: a GGUF's Q4_0 / Q4_1 / Q8_0 blocks, what auto keeps for 500M+ parameters),
  and with --engine its batched decoder alone.
- --engine: mlxtoy's batched decoder alone too (`BatchDecoder`, no HTTP, in this process), with
  as many rows as each number of streams: 20-token prompts, 100 steps timed after 5 (a step a
  token for every row, none ending).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

import mlxtoy  # noqa: F401  (fast BLAS before mlx.core)
from mlx.utils import tree_flatten
from mlxtoy.engine import BatchDecoder, Request
from mlxtoy.inference import load_for_inference, served_name
from mlxtoy.io.hf import save_hf
from mlxtoy.io.registry import resolve_model
from mlxtoy.loading import load

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Prompts whose greedy continuations run past the tokens asked (SmolLM2-135M's Q4_1 and Q4_0 files,
# 32 streams of 64 tokens each, checked): a stream that stops early at its end-of-text token leaves
# the batch narrower for the rest of the run, so the aggregate of many streams would count less
# work than one stream's, not a slower server. `drive` reports the tokens received against those asked.
PROMPTS = ["The old sailor told the children a long story about", "Here is a list of European capitals: Paris, Berlin,",
           "The recipe for bread starts with", "Ten facts about the moon: 1.",
           "Count from one to a hundred: one, two, three,", "The rules of chess are", "Once upon a time",
           "A tour of the solar system begins at"]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(argv: list[str], url: str, env: dict | None = None) -> subprocess.Popen:
    log = tempfile.TemporaryFile()  # stderr, for the reason of a server that exits (a file: no pipe to fill)
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            last = (log.read().decode(errors="replace").strip().splitlines() or [""])[-1]
            raise RuntimeError(f"{argv[:4]} exited with {proc.returncode}: {last}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code < 500:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{argv[:4]} did not start")


async def one_stream(client: httpx.AsyncClient, url: str, model: str, prompt: str, tokens: int):
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0.0, "stream": True}
    t0 = time.perf_counter()
    first, n = None, 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                n += 1
                first = first or time.perf_counter() - t0
    return first or float("nan"), n, time.perf_counter()


async def drive(url: str, models: list[str], streams: int, tokens: int) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*[one_stream(client, url, models[i % len(models)],
                                                    PROMPTS[i % len(PROMPTS)] + f" ({i})", tokens)
                                         for i in range(streams)])
    wall = max(r[2] for r in results) - t0
    total = sum(r[1] for r in results)
    return {"streams": streams, "tokens": total, "asked": streams * tokens, "tokens_per_sec": total / wall,
            "ttft_ms": 1000 * statistics.median(r[0] for r in results)}


def engine_rates(model, rows: list[int], steps: int = 100) -> list[dict]:
    """Tokens/s of `BatchDecoder` alone with each number of rows (prompts of 20 tokens, `steps`
    steps timed after 5, no row ending)."""
    out = []
    for n in rows:
        engine = BatchDecoder(model)
        engine.add_many([(Request(list(range(100 + i, 120 + i)), steps + 10), 1) for i in range(n)])
        for _ in range(5):
            engine.step()
        t0 = time.perf_counter()
        tokens = sum(len(engine.step()) for _ in range(steps))
        wall = time.perf_counter() - t0
        out.append({"rows": n, "tokens_per_sec": tokens / wall, "step_ms": 1000 * wall / steps})
    return out


def train_adapters(model: str, n: int, root: str, targets: str) -> list[str]:
    runs = []
    for i in range(n):
        out = os.path.join(root, f"a{i}")
        subprocess.run([sys.executable, "-m", "mlxtoy", "train", "--model", model, "--data",
                        os.path.join(REPO, "assets", "demo"), "--out", out, "--steps", "1", "--lora-rank", "8",
                        "--lora-targets", targets, "--seed", str(i), "--batch-size", "1", "--seq-len", "256",
                        "--eval-every", "0", "--save-every", "0"],
                       check=True, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        runs.append(out)
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--streams", default="1,8,32")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--adapter-targets", default="q,v", help="the adapters' --lora-targets")
    ap.add_argument("--skip", default="", help="comma-separated: mlx-lm, llama.cpp, adapters")
    ap.add_argument("--engine", action="store_true", help="time mlxtoy's batched decoder alone too (no HTTP)")
    ap.add_argument("--kept", action="store_true", help="serve MODEL with its base kept quantized too (mlxtoy-kept)")
    ap.add_argument("--json", default=None, help="write the results here too")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    streams = [int(s) for s in args.streams.split(",")]

    results: dict[str, list] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model, tok = load(args.model)
        folder = os.path.join(tmp, "hf")
        save_hf(folder, model.config, dict(tree_flatten(model.parameters())), tok)
        del model
        engines = {"engine": (folder, "off")} | ({"engine-kept": (args.model, "on")} if args.kept else {})
        for name, (served_model, mode) in engines.items() if args.engine else ():  # as the server loads it
            results[name] = engine_rates(load_for_inference(served_model, mode=mode)[0], streams)
            for r in results[name]:
                print(f"{name:11s} rows    {r['rows']:3d}: {r['tokens_per_sec']:8.1f} tokens/s, "
                      f"a step {r['step_ms']:6.1f} ms", flush=True)
        # (server, the "model" its requests name)
        servers = {"mlxtoy": (lambda port: [sys.executable, "-m", "mlxtoy", "serve", folder, "--port", str(port),
                                            "--max-batch", str(max(streams))], "hf")}
        if args.kept:
            servers["mlxtoy-kept"] = (lambda port: [sys.executable, "-m", "mlxtoy", "serve", args.model,
                                                    "--quantized", "on", "--port", str(port),
                                                    "--max-batch", str(max(streams))],
                                      served_name(args.model))
        if "mlx-lm" not in skip:
            servers["mlx-lm"] = (lambda port: [sys.executable, "-m", "mlx_lm", "server", "--model", folder,
                                               "--port", str(port), "--decode-concurrency", str(max(streams))],
                                 folder)
        if "llama.cpp" not in skip:
            kind, gguf = resolve_model(args.model)
            if kind == "gguf":
                servers["llama.cpp"] = (lambda port: [sys.executable, "-m", "llama_cpp.server", "--model", gguf,
                                                      "--port", str(port), "--n_threads", str(os.cpu_count() or 2),
                                                      "--n_ctx", "4096"], gguf)
        for name, (argv, served) in servers.items():
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            try:
                proc = start(argv(port), url)
            except RuntimeError as e:
                print(f"{name}: {e}", file=sys.stderr)
                continue
            results[name] = []
            try:
                for c in streams:
                    try:
                        asyncio.run(drive(url, [served], c, 8))  # warm-up: every batch size traced once
                        r = asyncio.run(drive(url, [served], c, args.tokens))
                    except httpx.HTTPError as e:  # (mlx_lm.server dropped connections at 32 streams here)
                        results[name].append({"streams": c, "error": repr(e)})
                        print(f"{name:11s} streams {c:3d}: failed: {e!r}", flush=True)
                        continue
                    results[name].append(r)
                    print(f"{name:11s} streams {c:3d}: {r['tokens_per_sec']:8.1f} tokens/s, "
                          f"time to first token {r['ttft_ms']:7.1f} ms, {r['tokens']} of {r['asked']} tokens", flush=True)
            finally:
                proc.terminate()
                proc.wait(60)
        if "adapters" not in skip and args.adapters > 0:
            runs = train_adapters(folder, args.adapters, tmp, args.adapter_targets)
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            proc = start([sys.executable, "-m", "mlxtoy", "serve", folder, "--port", str(port),
                          "--max-batch", str(max(streams))] + [a for r in runs for a in ("--adapter", r)], url)
            try:
                names = [os.path.basename(r) for r in runs]
                c = max(streams)
                asyncio.run(drive(url, names, c, 8))  # warm-up: every batch size traced once
                one = asyncio.run(drive(url, names[:1], c, args.tokens))
                many = asyncio.run(drive(url, names, c, args.tokens))
            finally:
                proc.terminate()
                proc.wait(60)
            results["adapters"] = [{"one": one, "many": many, "ratio": many["tokens_per_sec"] / one["tokens_per_sec"]}]
            print(f"{len(runs)} adapters on {args.adapter_targets} in one batch of {c}: "
                  f"{many['tokens_per_sec']:.1f} tokens/s against "
                  f"{one['tokens_per_sec']:.1f} on one adapter ({results['adapters'][0]['ratio']:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
