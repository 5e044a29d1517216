"""Generation speed on SmolLM2-135M: mlxtoy vs mlx-lm vs llama.cpp, side by side, in one run.

    python bench/bench_generate.py [--model MODEL] [--prompt-tokens 128] [--decode-tokens 128]
                                   [--repeats 3] [--threads 2]

For each engine: prompt tokens/s = prompt tokens / time to the first new token (prefill plus one
sampling step), decode tokens/s = tokens after the first / their time. Greedy, EOS ignored, the
same 128 prompt token ids for every engine; medians over --repeats round-robin rounds after one warm-up each.

- mlxtoy: the model dequantized to float32 (the CPU compute dtype), `generate_tokens`.
- mlx-lm: the same float32 weights written as a Hugging Face folder with mlxtoy's save_hf and
  loaded by mlx-lm, `mlx_lm.generate.generate_step` (mlxtoy is imported first, so both use
  the same fast BLAS).
- llama.cpp (llama-cpp-python): the original Q4_1 file and an F32 re-typing of it,
  n_threads=--threads.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

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


def bench_all(engines: list[tuple[str, object]], n_prompt: int, n_decode: int, repeats: int) -> list[dict]:
    """Round-robin: every engine runs once per round, so a busy machine slows all alike."""
    for _, make_iter in engines:
        timed(make_iter(), n_prompt, min(n_decode, 16))  # warm-up (allocations, first dispatch)
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in engines}
    for r in range(repeats):
        for name, make_iter in engines:
            runs[name].append(timed(make_iter(), n_prompt, n_decode))
            p, d = runs[name][-1]
            print(f"  round {r + 1}: {name:26s} prompt {p:7.1f} tok/s   decode {d:6.1f} tok/s",
                  file=sys.stderr, flush=True)
    return [{"engine": name, "prompt_tps": statistics.median(x[0] for x in rs),
             "decode_tps": statistics.median(x[1] for x in rs)} for name, rs in runs.items()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="a llama GGUF (default: the built-in SmolLM2)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    ap.add_argument("--skip", nargs="*", default=[], choices=["mlxtoy", "mlx-lm", "llama.cpp"])
    args = ap.parse_args()

    from mlxtoy import backend
    from mlxtoy.generate import generate_tokens
    from mlxtoy.io.registry import resolve_model
    from mlxtoy.loading import build_model, load_weights

    kind, gguf_path = resolve_model(args.model)
    if kind != "gguf":
        raise SystemExit("bench_generate needs a GGUF model (llama.cpp runs the file itself)")
    cfg, weights, meta, tokenizer = load_weights(args.model)
    ids = prompt_ids(tokenizer, args.prompt_tokens)
    n_p, n_d, reps = len(ids), args.decode_tokens, args.repeats
    print(f"SmolLM2 generation bench: {n_p} prompt tokens, {n_d} decode tokens, greedy, "
          f"median of {reps} round-robin rounds; {backend.INFO.describe()}; load average {os.getloadavg()[0]:.2f}",
          file=sys.stderr, flush=True)
    engines: list[tuple[str, object]] = []
    closers = []
    with tempfile.TemporaryDirectory(prefix="bench-gen-") as tmp:
        if "mlxtoy" not in args.skip:
            model = build_model(cfg, weights)
            engines.append(("mlxtoy (f32)", lambda: (t for t, _ in generate_tokens(
                model, ids, max_tokens=n_d + 1))))
        if "mlx-lm" not in args.skip:
            from pathlib import Path

            from mlx_lm.generate import generate_step
            from mlx_lm.utils import load_model

            from mlxtoy.io.hf import save_hf

            hf_dir = os.path.join(tmp, "hf")
            save_hf(hf_dir, cfg, weights, tokenizer)
            lm_model, _ = load_model(Path(hf_dir))
            prompt = mx.array(ids)
            engines.append(("mlx-lm (f32)", lambda: (t for t, _ in generate_step(
                prompt, lm_model, max_tokens=n_d + 1))))
        del weights
        if "llama.cpp" not in args.skip:
            import llama_cpp

            sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
            from helpers_gguf import retype_gguf_to_f32

            f32 = retype_gguf_to_f32(str(gguf_path), os.path.join(tmp, "f32.gguf"))
            for label, path in ((f"llama.cpp (Q4_1, {args.threads} thr)", str(gguf_path)),
                                (f"llama.cpp (F32, {args.threads} thr)", f32)):
                llm = llama_cpp.Llama(model_path=path, n_ctx=512, n_batch=512, n_threads=args.threads,
                                      n_threads_batch=args.threads, verbose=False)
                closers.append(llm)

                def run(llm=llm):
                    llm.reset()  # no prompt-cache reuse between runs
                    return llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True)

                engines.append((label, run))
        rows = bench_all(engines, n_p, n_d, reps)
        for llm in closers:
            llm.close()
    print(f"{'engine':26s} {'prompt tok/s':>12s} {'decode tok/s':>12s}")
    for r in rows:
        print(f"{r['engine']:26s} {r['prompt_tps']:12.1f} {r['decode_tps']:12.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
