"""Tiny random GGUF models written with gguf-py, and llama.cpp as the reference runner."""

from __future__ import annotations

import os

import numpy as np

import mlxtoy  # noqa: F401  (fast BLAS before mlx.core)
from mlxtoy.io.llama_vocab import bytes_to_unicode
from mlxtoy.model_config import ModelConfig

# llama.cpp's file types (enum llama_ftype) for llama_model_quantize
LLAMA_FTYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9,
                "Q4_K": 15, "Q6_K": 18, "Q5_K": 17, "Q3_K": 12, "Q2_K": 10}


def tiny_bpe_vocab() -> tuple[list[str], list[str], list[int]]:
    """A small byte-level BPE vocab: <|endoftext|>, the 256 bytes, and a few merges."""
    alphabet = list(bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s", "r e", "a t"]
    tokens = ["<|endoftext|>"] + alphabet + [m.replace(" ", "") for m in merges]
    types = [3] + [1] * (len(tokens) - 1)
    return tokens, merges, types


def tiny_config(**overrides) -> ModelConfig:
    base = dict(arch="llama", vocab_size=len(tiny_bpe_vocab()[0]), d_model=256, n_layers=2,
                n_heads=4, n_kv_heads=2, d_head=64, d_ff=512, norm_eps=1e-5, rope_base=10000.0,
                rope_traditional=True, tie_embeddings=True, context_length=512)
    base.update(overrides)
    cfg = ModelConfig(**base)
    if cfg.arch == "qwen2":
        cfg.rope_traditional = False
    return cfg


def random_gguf_tensors(cfg: ModelConfig, seed: int = 0, freq_factors: np.ndarray | None = None
                        ) -> dict[str, np.ndarray]:
    """GGUF tensor name -> float32 numpy array (numpy shape = reversed GGML ne)."""
    rng = np.random.default_rng(seed)
    d, h, kv, dh, ff = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_head, cfg.d_ff

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t = {"token_embd.weight": rng.standard_normal((cfg.vocab_size, d)).astype(np.float32),
         "output_norm.weight": norm(d)}
    if not cfg.tie_embeddings:
        t["output.weight"] = mat(cfg.vocab_size, d)
    if freq_factors is not None:
        t["rope_freqs.weight"] = freq_factors.astype(np.float32)
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = norm(d)
        t[p + "attn_q.weight"] = mat(h * dh, d)
        t[p + "attn_k.weight"] = mat(kv * dh, d)
        t[p + "attn_v.weight"] = mat(kv * dh, d)
        if cfg.qkv_bias:
            t[p + "attn_q.bias"] = (0.1 * rng.standard_normal(h * dh)).astype(np.float32)
            t[p + "attn_k.bias"] = (0.1 * rng.standard_normal(kv * dh)).astype(np.float32)
            t[p + "attn_v.bias"] = (0.1 * rng.standard_normal(kv * dh)).astype(np.float32)
        t[p + "attn_output.weight"] = mat(d, h * dh)
        t[p + "ffn_norm.weight"] = norm(d)
        t[p + "ffn_gate.weight"] = mat(ff, d)
        t[p + "ffn_up.weight"] = mat(ff, d)
        t[p + "ffn_down.weight"] = mat(d, ff)
    return t


def write_tiny_gguf(path: str, cfg: ModelConfig, tensors: dict[str, np.ndarray],
                    rope_scaling_linear: float | None = None) -> str:
    """Write an F32 GGUF with a tiny byte-level BPE tokenizer. Returns path."""
    import gguf

    arch = cfg.arch
    w = gguf.GGUFWriter(path, arch)
    w.add_name("tiny-test")
    w.add_context_length(cfg.context_length)
    w.add_embedding_length(cfg.d_model)
    w.add_block_count(cfg.n_layers)
    w.add_feed_forward_length(cfg.d_ff)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    if cfg.d_head != cfg.d_model // cfg.n_heads:
        w.add_key_length(cfg.d_head)
        w.add_value_length(cfg.d_head)
    w.add_rope_dimension_count(cfg.d_head)
    w.add_rope_freq_base(cfg.rope_base)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if rope_scaling_linear:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope_scaling_linear)
    assert len(tiny_bpe_vocab()[0]) == cfg.vocab_size, "tiny models use the tiny BPE vocab"
    return finish_tiny_gguf(w, path, tensors)


def finish_tiny_gguf(w, path: str, tensors: dict[str, np.ndarray]) -> str:
    """Add the tiny byte-level BPE tokenizer and the F32 tensors to GGUFWriter `w`; write it."""
    import gguf

    tokens, merges, types = tiny_bpe_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types(types)
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for name, arr in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama_quantize(src: str, dst: str, qtype: str) -> str:
    """Re-type a GGUF with llama.cpp's own quantizer (K-quants included); "F32" from a
    quantized file is llama.cpp's own dequantization of every tensor."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = LLAMA_FTYPES[qtype]
    params.allow_requantize = True
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params)
    assert rc == 0, f"llama_model_quantize({qtype}) failed with {rc}"
    return dst


def llama_cpp_logits(path: str, tokens: list[int], n_ctx: int = 512) -> np.ndarray:
    """All-position logits from llama.cpp (f32 KV cache, so nothing is rounded to f16 there)."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                          logits_all=True, n_threads=2, verbose=False, type_k=0, type_v=0,
                          flash_attn=False)
    llm.eval(tokens)
    out = np.array(llm.scores[: len(tokens)], dtype=np.float32)
    llm.close() if hasattr(llm, "close") else None
    return out


def our_logits(path: str, tokens: list[int]) -> np.ndarray:
    import mlx.core as mx

    from mlxtoy.io.gguf_read import load_gguf
    from mlxtoy.loading import build_model

    cfg, weights, _ = load_gguf(path, mx.float32)
    model = build_model(cfg, weights)
    logits = model(mx.array([tokens]))
    return np.array(logits[0].astype(mx.float32))


def compare(ours: np.ndarray, ref: np.ndarray) -> dict:
    """Max |diff|, the logit range, and where argmax differs outside a true tie."""
    diff = float(np.abs(ours - ref).max())
    rng = float(ref.max() - ref.min())
    mism = []
    for pos in np.nonzero(ours.argmax(-1) != ref.argmax(-1))[0]:
        top2 = np.sort(ref[pos])[-2:]
        if top2[1] - top2[0] > 1e-3 * max(1.0, rng):
            mism.append(int(pos))
    return {"max_abs_diff": diff, "range": rng, "rel": diff / max(rng, 1e-9),
            "argmax_agree": float((ours.argmax(-1) == ref.argmax(-1)).mean()), "mismatch": mism}


def env_check() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "2")
