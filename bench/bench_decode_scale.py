"""Decoding at the sizes users bring, from a Q4_0 GGUF: mlxtoy with the base kept quantized (the
kernels' fused quantized GEMV) against llama.cpp (llama-cpp-python) on the same file, tokens/s and
peak RSS, each engine in its own process, alternating round by round.

Models: bench_scale.py's random Q4_0 GGUFs (`1b`: Llama-3.2-1B's block shapes, tied; `8b`:
Llama-3.1-8B's, untied; SmolLM2's 49,152-token vocabulary), written there if missing.

    python bench/bench_decode_scale.py --size 1b,8b [--rounds 3] [--prompt-tokens 32]
                                       [--decode-tokens 32] [--threads 2] [--engines mlxtoy,llama.cpp]

Per run: prompt tok/s = prompt tokens / time to the first new token; decode tok/s = tokens after
the first / their time (greedy, EOS ignored), after a warm-up generation in the same process;
peak RSS is the process's high-water mark (loading included); load is the seconds to a model
that generates. Engines: `mlxtoy` = `load(MODEL, quant=QuantPlan())` (what `mlxtoy generate
--quantized on` runs; at 8B `--quantized auto` picks it too), `mlxtoy-dense` = the float32 model
(1B and --models: an 8B does not fit; what `generate` runs below
--quantized auto's size, its matrices read from lossless packs where their blocks allow),
`llama.cpp` = n_threads=--threads on the same file, `mlx-lm` = mlx-lm's `generate_step` (for a model folder mlx-lm loads: `--models` an mlx-lm 4-bit folder, which
mlxtoy loads as it is too).

    python bench/bench_decode_scale.py --models FOLDER_OR_GGUF,... --engines mlxtoy,mlx-lm
        # named models instead of --size (bench/gpu_check.sh on a GPU). On a GPU the table's
        # peak column is MLX's peak memory (the GPU's), not RSS.
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

HERE = os.path.dirname(os.path.abspath(__file__))
ENGINES = ("mlxtoy", "mlxtoy-dense", "llama.cpp", "mlx-lm")


def peak_rss() -> tuple[float, float]:
    """(VmHWM, VmRSS) of this process in GB."""
    vals = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmHWM:", "VmRSS:")):
                key, kb = line.split()[:2]
                vals[key] = int(kb) * 1024 / 1e9
    return vals["VmHWM:"], vals["VmRSS:"]


def timed(tokens, n_decode: int) -> tuple[float, float, list[int]]:
    """Drive an iterator of new tokens -> (seconds to the first, decode tok/s after it, tokens)."""
    t0 = time.perf_counter()
    out: list[int] = []
    t1 = t0
    for tok in tokens:
        out.append(int(tok))
        if len(out) == 1:
            t1 = time.perf_counter()
        if len(out) == n_decode + 1:
            break
    t2 = time.perf_counter()
    return t1 - t0, (len(out) - 1) / (t2 - t1), out


def worker(args) -> dict:
    ids = json.loads(args.ids)
    t0 = time.perf_counter()
    if args.worker.startswith("mlxtoy"):
        import mlxtoy  # noqa: F401  (fast BLAS before mlx.core)
        import mlx.core as mx
        from mlxtoy.generate import generate_tokens
        from mlxtoy.loading import load
        from mlxtoy.models.quant import QuantPlan

        model, _ = load(args.model, quant=QuantPlan() if args.worker == "mlxtoy" else None)
        load_s = time.perf_counter() - t0

        def run(n):
            return (t for t, _ in generate_tokens(model, ids, max_tokens=n + 1))

        after = mx.synchronize
    elif args.worker == "mlx-lm":
        import mlxtoy  # noqa: F401  (the same fast BLAS)
        import mlx.core as mx
        from mlx_lm import load as lm_load
        from mlx_lm.generate import generate_step

        lm_model, _ = lm_load(args.model)
        load_s = time.perf_counter() - t0

        def run(n):
            return (t for t, _ in generate_step(mx.array(ids), lm_model, max_tokens=n + 1))

        after = mx.synchronize
    else:
        import llama_cpp

        llm = llama_cpp.Llama(model_path=args.model, n_ctx=max(512, len(ids) + args.decode_tokens + 8),
                              n_batch=512, n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
        load_s = time.perf_counter() - t0

        def run(n):
            llm.reset()
            return llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True)

        def after():
            pass
    timed(run(4), 4)  # warm-up: first dispatch, the decode trace, page-in of the mapped file
    after()
    first_s, decode_tps, tokens = timed(run(args.decode_tokens), args.decode_tokens)
    after()
    hwm, rss = peak_rss()
    if args.worker != "llama.cpp" and mx.default_device() == mx.gpu:
        hwm = mx.get_peak_memory() / 1e9  # the GPU's memory is what limits there
    return {"engine": args.worker, "load_s": load_s, "prompt_tps": len(ids) / first_s, "decode_tps": decode_tps,
            "peak_rss_gb": hwm, "rss_gb": rss, "tokens": tokens[:8]}


def prompt_ids(model: str, n: int) -> list[int]:
    sys.path.insert(0, HERE)
    import mlxtoy  # noqa: F401
    from bench_generate import prompt_ids as ids_of
    from mlxtoy.loading import load_tokenizer

    return ids_of(load_tokenizer(model), n)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1b,8b", help="comma-separated: 1b, 8b")
    ap.add_argument("--models", help="comma-separated model files or folders, instead of --size")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp's threads (mlxtoy's kernels use the cores "
                                                            "the process may run on)")
    ap.add_argument("--engines", default="mlxtoy,llama.cpp", help=f"comma-separated, of {', '.join(ENGINES)}")
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "mlxtoy-bench-scale"))
    ap.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--ids", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return 0

    sys.path.insert(0, HERE)
    from bench_scale import make_model

    engines = [e for e in args.engines.split(",") if e]
    os.makedirs(args.work, exist_ok=True)
    table = []
    named = [m for m in (args.models or "").split(",") if m]
    for size in named or [s for s in args.size.split(",") if s]:
        if named:
            model, size = size, os.path.basename(os.path.normpath(size))[:24]
        else:
            model = make_model(size, os.path.join(args.work, f"random-{size}-q4_0.gguf"))
        ids = prompt_ids(model, args.prompt_tokens)
        runs: dict[str, list[dict]] = {}
        print(f"{size}: {model}; {args.prompt_tokens} prompt tokens, "
              f"{args.decode_tokens} decoded, greedy; load average {os.getloadavg()[0]:.2f}", file=sys.stderr,
              flush=True)
        for r in range(args.rounds):
            for engine in engines:
                if engine == "mlxtoy-dense" and not named and size != "1b":  # (an 8B does not fit dense)
                    continue
                cmd = [sys.executable, os.path.abspath(__file__), "--worker", engine, "--model", model, "--ids",
                       json.dumps(ids), "--decode-tokens", str(args.decode_tokens), "--threads", str(args.threads)]
                p = subprocess.run(cmd, capture_output=True, text=True)
                line = next((l for l in p.stdout.splitlines() if l.startswith("RESULT ")), None)
                if p.returncode != 0 or line is None:
                    print(f"  {engine}: failed\n{p.stderr[-3000:]}", file=sys.stderr)
                    continue
                res = json.loads(line[7:])
                runs.setdefault(engine, []).append(res)
                print(f"  round {r + 1}: {engine:13s} decode {res['decode_tps']:6.2f} tok/s  prompt "
                      f"{res['prompt_tps']:6.1f} tok/s  peak RSS {res['peak_rss_gb']:5.2f} GB  load "
                      f"{res['load_s']:5.1f} s  load average {os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)
        for engine, rs in runs.items():
            table.append((size, engine, statistics.median(x["decode_tps"] for x in rs),
                          statistics.median(x["prompt_tps"] for x in rs), max(x["peak_rss_gb"] for x in rs),
                          statistics.median(x["load_s"] for x in rs), len(rs)))
    print(f"{'model':5} {'engine':13} {'decode tok/s':>12} {'prompt tok/s':>12} {'peak RSS GB':>11} {'load s':>7} runs")
    for size, engine, d, p, rss, load_s, n in table:
        print(f"{size:5} {engine:13} {d:12.2f} {p:12.1f} {rss:11.2f} {load_s:7.1f} {n:4d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
