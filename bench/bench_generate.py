"""Generation speed on SmolLM2-135M: mlxtoy vs mlx-lm vs llama.cpp, side by side, in one run.

    python bench/bench_generate.py [--model MODEL] [--prompt-tokens 128] [--decode-tokens 128]
                                   [--repeats 3] [--threads 2]

For each engine: prompt tokens/s = prompt tokens / time to the first new token (prefill plus one
sampling step), decode tokens/s = tokens after the first / their time. Greedy, EOS ignored, the
same 128 prompt token ids for every engine; each engine runs in its own process (a warm-up run,
then one measured run) so no engine's threads interfere with another's; medians over --repeats
round-robin rounds.

- mlxtoy: the model dequantized to float32 (the CPU compute dtype), `generate_tokens`; decoding
  reads the matrices that are exactly 4- or 8-bit blocks (all of a Q4_1/Q8_0 GGUF's) packed
  (`fastmath.pack_lossless`), packed once in the warm-up run. "mlxtoy (f32 decode)" is the same
  with MLXTOY_PACKED_DECODE=0: every weight read as float32, as llama.cpp's F32 run reads them.
  "mlxtoy (MLX-only, f32)" is mlxtoy with MLXTOY_KERNELS=0: MLX's own ops, the path Metal and
  CUDA run (`--skip llama.cpp mlxtoy-f32` leaves it, mlx-lm and the kernels' packed decode).
- mlx-lm: the same float32 weights written as a Hugging Face folder with mlxtoy's save_hf and
  loaded by mlx-lm, `mlx_lm.generate.generate_step` (mlxtoy is imported first, so both use
  the same fast BLAS).
- llama.cpp (llama-cpp-python): the original Q4_1 file and an F32 re-typing of it,
  n_threads=--threads.
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

import gguf

import mlxtoy  # noqa: F401  (fast BLAS first; must come before mlx.core and mlx_lm)
import mlx.core as mx

TEXT = ("The history of the lighthouse begins in the ancient world, where fires were lit on hills "
        "to guide ships home. Over centuries these fires became towers of stone, and the towers "
        "gained lenses, clockwork and finally electric lamps. Keepers lived in small rooms at the "
        "base, trimming wicks and writing logs of every passing storm. ")


def prompt_ids(tokenizer, n: int) -> list[int]:
    ids = tokenizer.encode(TEXT)
    while len(ids) < n:
        ids = ids + tokenizer.encode(TEXT)
    return ids[:n]


def timed(token_iter, n_prompt: int, n_decode: int) -> tuple[float, float]:
    """Drive an iterator of new tokens; -> (prompt tok/s, decode tok/s)."""
    t0 = time.perf_counter()
    t1 = None
    count = 0
    for _ in token_iter:
        count += 1
        if count == 1:
            t1 = time.perf_counter()
        if count == n_decode + 1:
            break
    t2 = time.perf_counter()
    mx.synchronize()  # work an engine queued ahead must not bleed into the next measurement
    return n_prompt / (t1 - t0), (count - 1) / (t2 - t1)


ENGINES = ("mlxtoy", "mlxtoy-f32", "mlxtoy-mlx", "mlx-lm", "llama.cpp-q4_1", "llama.cpp-f32")
# read at import: set for the worker process
ENV = {"mlxtoy-f32": {"MLXTOY_PACKED_DECODE": "0"}, "mlxtoy-mlx": {"MLXTOY_KERNELS": "0"}}


def make_engine(engine: str, args, files: dict) -> tuple[str, object]:
    """-> (label, a function returning a fresh iterator of new tokens) for one engine."""
    from mlxtoy.generate import generate_tokens
    from mlxtoy.loading import build_model, load_weights

    ids = files["ids"]  # tokenized once, by the parent: the same ids for every engine
    n_d = args.decode_tokens
    if engine.startswith("mlxtoy"):
        cfg, weights, _, _ = load_weights(args.model)
        model = build_model(cfg, weights)
        label = {"mlxtoy-f32": "mlxtoy (f32 decode)", "mlxtoy-mlx": "mlxtoy (MLX-only, f32)"}.get(
            engine, "mlxtoy (packed decode)")
        return label, lambda: (t for t, _ in generate_tokens(model, ids, max_tokens=n_d + 1))
    if engine == "mlx-lm":
        from pathlib import Path

        from mlx_lm.generate import generate_step
        from mlx_lm.utils import load_model

        lm_model, _ = load_model(Path(files["hf"]))
        prompt = mx.array(ids)
        return "mlx-lm (f32)", lambda: (t for t, _ in generate_step(prompt, lm_model, max_tokens=n_d + 1))
    import llama_cpp

    path = files["gguf"] if engine == "llama.cpp-q4_1" else files["f32"]
    n_ctx = max(512, args.prompt_tokens + args.decode_tokens + 8)  # a longer prompt needs a longer context
    llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=512, n_threads=args.threads,
                          n_threads_batch=args.threads, verbose=False)

    def run():
        llm.reset()  # no prompt-cache reuse between runs
        return llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True)

    # the file's own type (the engine's id says Q4_1, the built-in model's; --model may be any)
    file_type = llm.metadata.get("general.file_type")
    kind = "F32" if engine != "llama.cpp-q4_1" else (
        gguf.LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_") if file_type is not None else "GGUF")
    return f"llama.cpp ({kind}, {args.threads} thr)", run


def worker(args) -> None:
    """One engine in this process: a warm-up run, then one measured run (prompt, decode tok/s)."""
    files = json.loads(args.files)
    label, make_iter = make_engine(args.worker, args, files)
    n_p = args.prompt_tokens
    timed(make_iter(), n_p, min(args.decode_tokens, 16))  # warm-up (allocations, first dispatch, traces)
    p, d = timed(make_iter(), n_p, args.decode_tokens)
    print("RESULT " + json.dumps({"engine": label, "prompt_tps": p, "decode_tps": d}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="a llama GGUF (default: the built-in SmolLM2)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    ap.add_argument("--skip", nargs="*", default=[], choices=["mlxtoy", "mlx-lm", "llama.cpp", *ENGINES])
    ap.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    ap.add_argument("--files", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0

    from mlxtoy import backend
    from mlxtoy.io.registry import resolve_model
    from mlxtoy.loading import load_weights

    kind, gguf_path = resolve_model(args.model)
    if kind != "gguf":
        raise SystemExit("bench_generate needs a GGUF model (llama.cpp runs the file itself)")
    engines = [e for e in ENGINES if e.split("-")[0] not in args.skip and e not in args.skip]
    print(f"SmolLM2 generation bench: {args.prompt_tokens} prompt tokens, {args.decode_tokens} decode tokens, "
          f"greedy, each engine in its own process, median of {args.repeats} round-robin rounds; "
          f"{backend.INFO.describe()}; load average {os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-gen-") as tmp:
        cfg, weights, meta, tokenizer = load_weights(args.model)
        files = {"gguf": str(gguf_path), "ids": prompt_ids(tokenizer, args.prompt_tokens)}
        if "mlx-lm" in engines:
            from mlxtoy.io.hf import save_hf

            files["hf"] = os.path.join(tmp, "hf")
            save_hf(files["hf"], cfg, weights, tokenizer)
        del weights
        if "llama.cpp-f32" in engines:
            sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
            from helpers_gguf import retype_gguf_to_f32

            files["f32"] = retype_gguf_to_f32(str(gguf_path), os.path.join(tmp, "f32.gguf"))
        # Round-robin, one process per engine and round: a busy machine slows all alike, and no
        # engine's threads (still spinning after its run) share a process with another's.
        for r in range(args.repeats):
            for engine in engines:
                cmd = [sys.executable, os.path.abspath(__file__), "--worker", engine, "--files", json.dumps(files),
                       "--model", args.model, "--prompt-tokens", str(args.prompt_tokens),
                       "--decode-tokens", str(args.decode_tokens), "--threads", str(args.threads)]
                p = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | ENV.get(engine, {}))
                line = next((l for l in p.stdout.splitlines() if l.startswith("RESULT ")), None)
                if p.returncode != 0 or line is None:
                    print(f"{engine}: failed\n{p.stderr[-3000:]}", file=sys.stderr)
                    continue
                res = json.loads(line[7:])
                runs.setdefault(res["engine"], []).append(res)
                print(f"  round {r + 1}: {res['engine']:26s} prompt {res['prompt_tps']:7.1f} tok/s   "
                      f"decode {res['decode_tps']:6.1f} tok/s", file=sys.stderr, flush=True)
    print(f"{'engine':26s} {'prompt tok/s':>12s} {'decode tok/s':>12s}")
    for name, rs in runs.items():
        print(f"{name:26s} {statistics.median(x['prompt_tps'] for x in rs):12.1f} "
              f"{statistics.median(x['decode_tps'] for x in rs):12.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
