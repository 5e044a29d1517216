"""Tiny random models with a tokenizer, and llama.cpp / mlx-lm / transformers as reference runners
for the export tests."""

from __future__ import annotations

import json
import math
import os

import numpy as np

import mlxtoy  # noqa: F401  (fast BLAS before mlx.core)
import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from mlxtoy.io.gguf_write import write_gguf
from mlxtoy.io.tokenizer import Tokenizer
from mlxtoy.model_config import LoadedMeta, ModelConfig
from mlxtoy.models.llama import LlamaModel

from helpers_parity import tiny_bpe_vocab


# 128 SmolLM2 tokens of English prose, for the real-model checks
TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
        "combined a screw press with movable metal type. Books became cheaper, literacy spread across "
        "Europe, and scientists could share their results far more quickly than before. Within fifty "
        "years, presses were running in more than two hundred cities, and millions of volumes had been "
        "printed. Historians still argue about how much the press changed religion, politics and "
        "science, but few doubt that it changed how ideas travel from one mind to another. Newspapers "
        "followed in the seventeenth century, pamphlets carried arguments through every market town, "
        "and printers themselves became a new kind of merchant, selling knowledge by the sheet.")


def tiny_tokenizer_metadata() -> dict:
    """GGUF tokenizer keys for the tiny byte-level BPE vocab (267 tokens)."""
    tokens, merges, types = tiny_bpe_vocab()
    return {
        "general.name": "tiny-export-test",
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 0,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    }


VOCAB = len(tiny_bpe_vocab()[0])

# d_model and d_ff are multiples of 32 so every matrix has Q8_0-sized rows.
CONFIGS = {
    "llama_gqa": dict(arch="llama", n_heads=4, n_kv_heads=2, d_head=16),
    "qwen2_bias": dict(arch="qwen2", n_heads=4, n_kv_heads=2, d_head=16, qkv_bias=True,
                       rope_traditional=False, rope_base=1000000.0, norm_eps=1e-6),
    "llama_untied": dict(arch="llama", n_heads=4, n_kv_heads=4, d_head=16, tie_embeddings=False),
    "llama_linear_rope": dict(arch="llama", n_heads=2, n_kv_heads=2, d_head=32,
                              rope_scaling={"type": "linear", "factor": 4.0}),
    "llama3_rope": dict(arch="llama", n_heads=4, n_kv_heads=1, d_head=32, rope_base=500000.0,
                        # a short original context so the llama3 factors differ from 1 within 128 tokens
                        rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
}


def write_tiny_tokenizer(folder: str) -> Tokenizer:
    """The tiny tokenizer as a Hugging Face folder's tokenizer.json + tokenizer_config.json
    (transformers, PEFT and mlx-lm load the folder with it)."""
    tok = Tokenizer.from_gguf_metadata(tiny_tokenizer_metadata(), source="tiny")
    with open(os.path.join(folder, "tokenizer.json"), "w") as f:
        f.write(tok.to_hf_tokenizer_json())
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(tok.to_hf_tokenizer_config(), f)
    return tok


def tiny_config(name: str) -> ModelConfig:
    base = dict(vocab_size=VOCAB, d_model=64, n_layers=2, d_ff=128, norm_eps=1e-5, rope_base=10000.0,
                context_length=256, tie_embeddings=True)
    base.update(CONFIGS[name])
    return ModelConfig(**base)


MATRIX_GAIN = 0.5


def randomize(model: LlamaModel, seed: int = 0) -> LlamaModel:
    """Every parameter random: matrices 0.5 N(0, 1/fan_in), norms 1 + 0.1 N, biases 0.1 N,
    embeddings N(0, 1) (logits spread out, argmax decisive); an untied output is the embeddings
    plus noise."""
    rng = np.random.default_rng(seed)
    params = {}
    for name, p in tree_flatten(model.parameters()):
        shape = p.shape
        if name.endswith("norm.weight"):
            v = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith("bias"):
            v = 0.1 * rng.standard_normal(shape)
        elif name == "tok_embeddings.weight":
            v = rng.standard_normal(shape)
        else:
            v = MATRIX_GAIN * rng.standard_normal(shape) / math.sqrt(shape[-1])
        params[name] = mx.array(v.astype(np.float32))
    if "output.weight" in params:
        # Untied, but close to the embeddings: a random output matrix makes top-2 logit gaps as
        # small as Q8_0's activation rounding, and argmax checks would measure luck, not export.
        emb = np.array(params["tok_embeddings.weight"])
        params["output.weight"] = mx.array((emb + 0.5 * rng.standard_normal(emb.shape)).astype(np.float32))
    model.update(tree_unflatten(list(params.items())))
    mx.eval(model.parameters())
    return model


def tiny_model(name: str, seed: int = 0) -> LlamaModel:
    model = randomize(LlamaModel(tiny_config(name)), seed)
    model.meta = LoadedMeta(source=f"tiny-{name}", format="gguf", metadata=tiny_tokenizer_metadata())
    return model


def write_tiny_gguf(path: str, model: LlamaModel, dtype: str) -> str:
    """`model` written to `path` as a GGUF of `dtype` with the tiny tokenizer's metadata (a file
    llama.cpp loads); -> path."""
    write_gguf(path, model.config, dict(tree_flatten(model.parameters())), tiny_tokenizer_metadata(), dtype=dtype)
    return path


def tokens_128(seed: int = 1) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, 128).tolist()


def our_logits(model, tokens: list[int]) -> np.ndarray:
    return np.array(model(mx.array([tokens]))[0].astype(mx.float32))


def llama_cpp_logits(path: str, tokens: list[int], lora_path: str | None = None) -> np.ndarray:
    """All-position logits from llama.cpp (f32 KV cache)."""
    import llama_cpp

    kwargs = dict(lora_path=lora_path) if lora_path else {}
    llm = llama_cpp.Llama(model_path=path, logits_all=True, n_ctx=256, n_batch=256, n_ubatch=256,
                          n_threads=2, verbose=False, type_k=0, type_v=0, flash_attn=False, **kwargs)
    try:
        llm.eval(tokens)
        return np.array(llm.scores[: len(tokens)], dtype=np.float32)
    finally:
        llm.close()


def llama_cpp_tokenize(path: str, text: str) -> list[int]:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    try:
        return llm.tokenize(text.encode(), add_bos=False, special=True)
    finally:
        llm.close()


def max_rel_diff(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(a - ref).max() / np.abs(ref).max())


def argmax_agreement(a: np.ndarray, ref: np.ndarray) -> float:
    return float((a.argmax(-1) == ref.argmax(-1)).mean())
