"""Tiny models, tokenizers and datasets for the training tests (no downloads, fast)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import mlx.core as mx

from mlxtoy.model_config import ModelConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_byte_tokenizer(folder: str) -> None:
    """A byte-level BPE tokenizer without merges (every byte one token) + 3 special tokens."""
    from tokenizers import Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel

    os.makedirs(folder, exist_ok=True)
    alphabet = sorted(ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>", "bos_token": None, "add_bos_token": False,
                   "pad_token": "<|endoftext|>", "chat_template": CHATML}, f)


def byte_tokenizer(tmp_path):
    from mlxtoy.io.tokenizer import Tokenizer

    folder = os.path.join(str(tmp_path), "tok")
    write_byte_tokenizer(folder)
    return Tokenizer.from_hf_folder(folder)


def tiny_config(vocab_size: int = 259, **kw) -> ModelConfig:
    base = dict(arch="llama", vocab_size=vocab_size, d_model=32, n_layers=2, n_heads=4,
                n_kv_heads=2, d_head=8, d_ff=64, norm_eps=1e-5, rope_base=10000.0,
                tie_embeddings=True, context_length=512)
    base.update(kw)
    return ModelConfig(**base)


def run_training(cfg, resume: bool = False, on_event=None, control=None, taps_hook=None,
                 handle_sigint: bool = True):
    """What the job does (prepare, then the loop), with a test's own taps hook allowed."""
    from mlxtoy.events import MetricsSink, fan_out
    from mlxtoy.train.job import prepare
    from mlxtoy.train.loop import train

    p = prepare(cfg, resume)
    return train(p.cfg, p.model, p.tokenizer, p.dataset, p.run, facts=p.facts,
                 resume_from=p.resume_from, emit=fan_out(MetricsSink(p.run), on_event),
                 control=control, taps_hook=taps_hook, handle_sigint=handle_sigint, objective=p.objective)


def tiny_model(seed: int = 0, dtype=mx.float32, **kw):
    from mlxtoy.loading import build_model
    from mlxtoy.models.init import init_scratch

    model = init_scratch(build_model(tiny_config(**kw)), seed, 1.0)
    if dtype != mx.float32:
        model.set_dtype(dtype)
    return model


def write_tiny_model_folder(folder: str, seed: int = 0) -> str:
    """An HF folder (config.json, model.safetensors, tokenizer) holding a tiny random llama."""
    from mlx.utils import tree_flatten

    from mlxtoy.io.hf import save_hf
    from mlxtoy.io.tokenizer import Tokenizer

    tok_dir = folder + "-tok"
    write_byte_tokenizer(tok_dir)
    tok = Tokenizer.from_hf_folder(tok_dir)
    model = tiny_model(seed, vocab_size=tok.vocab_size)
    save_hf(folder, model.config, dict(tree_flatten(model.parameters())), tok)
    return folder


def write_jsonl(path: str, rows: list) -> str:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def qa_rows(n: int, seed: int = 0) -> list[dict]:
    """Tiny chat task: 'add one' to a two-digit number (learnable by a tiny model)."""
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a = rng.randrange(10, 98)
        rows.append({"messages": [{"role": "user", "content": f"{a}+1"},
                                  {"role": "assistant", "content": str(a + 1)}]})
    return rows


def run_cli(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m mlxtoy ARGS`, its output as text exactly as written: decoded here rather than with
    text=True, whose universal newlines turn a generated '\r' into '\n'."""
    e = dict(os.environ)
    e.update(env or {})
    r = subprocess.run([sys.executable, "-m", "mlxtoy", *args], capture_output=True, cwd=REPO, env=e, timeout=timeout)
    return subprocess.CompletedProcess(r.args, r.returncode, r.stdout.decode(), r.stderr.decode())


def unigram_entropy_nats(ids) -> float:
    import math
    from collections import Counter

    c = Counter(ids)
    n = sum(c.values())
    return -sum(v / n * math.log(v / n) for v in c.values())
