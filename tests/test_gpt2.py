"""GPT-2: logits against llama.cpp and transformers on a tiny random gpt2 GGUF, KV-cache
decoding, taps, LoRA / full fine-tuning and export back to GGUF."""

from __future__ import annotations

import os

import numpy as np
import pytest

import mlxtoy  # noqa: F401  (fast BLAS before mlx.core)
import mlx.core as mx

from helpers_parity import compare, finish_tiny_gguf, llama_cpp_logits, tiny_bpe_vocab

# llama.cpp's CPU GELU looks its result up in a float16 table (GGML_GELU_FP16): x and GELU(x)
# are both rounded to float16. With the FFN switched off the two engines agree to ~3e-7 of
# the logit range; with it, to ~1e-4. Against transformers (float32 GELU) we hold 1e-5.
LLAMA_CPP_GELU_REL = 5e-4
EXACT_REL = 1e-5


def write_tiny_gpt2_gguf(path: str, *, d_model: int = 128, n_layers: int = 2, n_heads: int = 4,
                         d_ff: int = 512, n_ctx: int = 256, untied: bool = False,
                         tied_copy: bool = False, seed: int = 0, drop: str | None = None,
                         zero_ffn: bool = False) -> str:
    """A random F32 gpt2 GGUF with the tiny byte-level BPE tokenizer.

    untied: a distinct output.weight; tied_copy: output.weight == token_embd (what llama.cpp's
    converter writes for GPT-2); drop: leave out one tensor (bad-input tests).
    """
    import gguf

    V, D, F = len(tiny_bpe_vocab()[0]), d_model, d_ff
    rng = np.random.default_rng(seed)

    def mat(r: int, c: int) -> np.ndarray:
        return (rng.standard_normal((r, c)) / np.sqrt(c)).astype(np.float32)

    def vec(n: int, s: float = 0.1) -> np.ndarray:
        return (s * rng.standard_normal(n)).astype(np.float32)

    t = {"token_embd.weight": (0.5 * rng.standard_normal((V, D))).astype(np.float32),
         "position_embd.weight": (0.1 * rng.standard_normal((n_ctx, D))).astype(np.float32)}
    for i in range(n_layers):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"], t[p + "attn_norm.bias"] = 1 + vec(D), vec(D)
        t[p + "attn_qkv.weight"], t[p + "attn_qkv.bias"] = mat(3 * D, D), vec(3 * D)
        t[p + "attn_output.weight"], t[p + "attn_output.bias"] = mat(D, D), vec(D)
        t[p + "ffn_norm.weight"], t[p + "ffn_norm.bias"] = 1 + vec(D), vec(D)
        t[p + "ffn_up.weight"], t[p + "ffn_up.bias"] = mat(F, D), vec(F)
        t[p + "ffn_down.weight"], t[p + "ffn_down.bias"] = mat(D, F), vec(D)
        if zero_ffn:
            t[p + "ffn_up.weight"][:] = 0
            t[p + "ffn_up.bias"][:] = 0
    t["output_norm.weight"], t["output_norm.bias"] = 1 + vec(D), vec(D)
    if untied:
        t["output.weight"] = mat(V, D)
    elif tied_copy:
        t["output.weight"] = t["token_embd.weight"].copy()
    if drop:
        del t[drop]
    w = gguf.GGUFWriter(path, "gpt2")
    w.add_name("tiny-gpt2")
    w.add_context_length(n_ctx)
    w.add_embedding_length(D)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(F)
    w.add_head_count(n_heads)
    w.add_layer_norm_eps(1e-5)
    return finish_tiny_gguf(w, path, t)


def _tokens(n: int, seed: int = 1) -> list[int]:
    V = len(tiny_bpe_vocab()[0])
    return [int(t) for t in np.random.default_rng(seed).integers(0, V, n)]


def _load(path: str):
    from mlxtoy.io.gguf_read import load_gguf
    from mlxtoy.loading import build_model

    cfg, weights, meta = load_gguf(path, mx.float32)
    return build_model(cfg, weights), cfg, weights, meta


def _logits(model, tokens: list[int]) -> np.ndarray:
    return np.array(model(mx.array([tokens]))[0].astype(mx.float32))


@pytest.fixture(scope="module")
def gpt2_gguf(tmp_path_factory) -> str:
    return write_tiny_gpt2_gguf(str(tmp_path_factory.mktemp("gpt2") / "gpt2.gguf"))


# --------------------------------------------------------------------------- parity


@pytest.mark.parametrize("variant", ["tied", "untied", "tied-copy"])
@pytest.mark.core
def test_gpt2_llama_cpp_parity(tmp_path, variant):
    path = write_tiny_gpt2_gguf(str(tmp_path / "m.gguf"), untied=variant == "untied",
                                tied_copy=variant == "tied-copy", seed=2)
    model, cfg, _, _ = _load(path)
    assert cfg.arch == "gpt2" and cfg.tie_embeddings == (variant != "untied")
    assert cfg.context_length == 256 and cfg.d_head == 32 and cfg.qkv_bias
    tokens = _tokens(120)
    r = compare(_logits(model, tokens), llama_cpp_logits(path, tokens, n_ctx=256))
    print(variant, r)
    assert r["mismatch"] == [] and r["rel"] < LLAMA_CPP_GELU_REL, r


def test_gpt2_llama_cpp_parity_without_gelu(tmp_path):
    """With the FFN's GELU input held at 0, llama.cpp's float16 GELU table plays no part and
    everything else (LayerNorm, fused QKV split, biases, positions) must agree tightly."""
    path = write_tiny_gpt2_gguf(str(tmp_path / "m.gguf"), zero_ffn=True, seed=3)
    model, *_ = _load(path)
    tokens = _tokens(100, seed=4)
    r = compare(_logits(model, tokens), llama_cpp_logits(path, tokens, n_ctx=256))
    assert r["mismatch"] == [] and r["rel"] < EXACT_REL, r


@pytest.mark.core
def test_gpt2_transformers_parity(tmp_path, gpt2_gguf):
    """Same weights in transformers' GPT2LMHeadModel (via our HF export), and back through our
    HF loader: transformers agrees to float32 precision, and our two loaders agree exactly."""
    import torch
    import transformers
    from mlxtoy.io.hf import load_hf as load_gpt2_hf, save_hf as save_gpt2_hf
    from mlxtoy.loading import build_model

    from mlxtoy.io.tokenizer import Tokenizer

    model, cfg, weights, meta = _load(gpt2_gguf)
    folder = str(tmp_path / "hf")
    tok = Tokenizer.from_gguf_metadata(meta.metadata, source=gpt2_gguf)
    save_gpt2_hf(folder, cfg, weights, tok)
    tokens = _tokens(100, seed=5)
    ours = _logits(model, tokens)
    hf = transformers.GPT2LMHeadModel.from_pretrained(folder, torch_dtype=torch.float32)
    hf.eval()
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0].numpy()
    r = compare(ours, ref)
    assert r["mismatch"] == [] and r["rel"] < EXACT_REL, r

    cfg2, weights2, meta = load_gpt2_hf(folder, mx.float32)
    assert meta.format == "hf" and cfg2.to_dict() == cfg.to_dict()
    assert np.array_equal(_logits(build_model(cfg2, weights2), tokens), ours)
    # and through the front door, tokenizer included
    loaded, tok2 = mlxtoy.load(folder)
    assert np.array_equal(_logits(loaded, tokens), ours)
    assert tok2.encode("the sea at the harbour") == tok.encode("the sea at the harbour")


def test_gpt2_hf_folder_from_transformers(tmp_path):
    """A folder written by transformers itself (its own naming, Conv1D layout, tied head)."""
    import torch
    import transformers
    from mlxtoy.io.hf import load_hf as load_gpt2_hf
    from mlxtoy.loading import build_model

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=300, n_positions=64, n_embd=64, n_layer=2,
                                     n_head=4, n_inner=None, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    hf = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # make biases and norms non-trivial
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    folder = str(tmp_path / "hf")
    hf.save_pretrained(folder, safe_serialization=True)
    tokens = [int(t) for t in np.random.default_rng(6).integers(0, 300, 60)]
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0].numpy()
    cfg, weights, _ = load_gpt2_hf(folder, mx.float32)
    assert (cfg.d_ff, cfg.context_length, cfg.tie_embeddings) == (256, 64, True)
    r = compare(_logits(build_model(cfg, weights), tokens), ref)
    assert r["mismatch"] == [] and r["rel"] < EXACT_REL, r


# --------------------------------------------------------------------------- decoding


def test_gpt2_cached_decoding_matches_uncached(gpt2_gguf):
    from mlxtoy.models.cache import make_cache

    model, *_ = _load(gpt2_gguf)
    tokens = _tokens(40, seed=7)
    full = _logits(model, tokens)
    cache = make_cache(model)
    parts = [np.array(model(mx.array([tokens[:25]]), cache=cache)[0])]
    for t in tokens[25:]:  # one-token decode steps: positions continue at the cache offset
        parts.append(np.array(model(mx.array([[t]]), cache=cache)[0]))
    assert cache[0].offset == 40
    stepped = np.concatenate(parts)
    assert np.abs(stepped - full).max() < 1e-4 * (full.max() - full.min())


def test_gpt2_greedy_generation_matches_recompute(gpt2_gguf):
    from mlxtoy.generate import generate_tokens
    from mlxtoy.sampling import SamplingParams

    model, *_ = _load(gpt2_gguf)
    prompt = _tokens(12, seed=8)
    got = [t for t, _ in generate_tokens(model, prompt, sampling=SamplingParams(temp=0.0),
                                         max_tokens=16)]
    seq = list(prompt)
    for _ in range(16):  # no cache: the whole sequence each step
        seq.append(int(_logits(model, seq)[-1].argmax()))
    assert got == seq[len(prompt):]


def test_gpt2_positions_past_the_table_are_a_user_error(gpt2_gguf):
    from mlxtoy.errors import UserError

    model, cfg, *_ = _load(gpt2_gguf)
    with pytest.raises(UserError, match="position"):
        model(mx.zeros((1, cfg.context_length + 1), dtype=mx.int32))


def test_gpt2_taps(gpt2_gguf):
    model, cfg, *_ = _load(gpt2_gguf)
    taps = {"_heads": True}
    model(mx.array([_tokens(10)]), taps=taps)
    for i in range(cfg.n_layers):
        for site in ("attn_norm", "ffn_out", "resid_post"):
            assert taps[(i, site)].shape == (1, 10, cfg.d_model)
        assert taps[(i, "attn_entropy")].shape == (cfg.n_heads,)


# --------------------------------------------------------------------------- bad input


def test_gpt2_missing_tensor(tmp_path):
    from mlxtoy.errors import UserError

    path = write_tiny_gpt2_gguf(str(tmp_path / "m.gguf"), drop="blk.1.attn_qkv.bias")
    with pytest.raises(UserError, match=r"missing tensor blk\.1\.attn_qkv\.bias"):
        _load(path)


def test_gpt2_unsupported_hf_activation(tmp_path):
    import json

    from mlxtoy.errors import UserError
    from mlxtoy.io.hf import load_hf as load_gpt2_hf

    os.makedirs(tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_text(json.dumps(
        {"model_type": "gpt2", "activation_function": "relu", "n_embd": 64, "n_head": 4,
         "n_layer": 1, "vocab_size": 10}))
    with pytest.raises(UserError, match="activation_function 'relu'"):
        load_gpt2_hf(str(tmp_path / "hf"))


# --------------------------------------------------------------------------- training, export


def _train(tmp_path, gguf_path: str, method: str, **kw):
    from mlxtoy.config import TrainConfig
    from helpers_train import run_training as run

    data = tmp_path / "train.txt"
    if not data.exists():
        data.write_text("the sea at the harbour, the light on the rock. " * 60)
    cfg = TrainConfig(method=method, model=gguf_path, data=str(data), out=str(tmp_path / method),
                      steps=8, batch_size=2, seq_len=64, lr=3e-3, eval_every=0, save_every=0,
                      seed=0, **kw)
    result = run(cfg, handle_sigint=False)
    assert result.reason == "finished"
    return result


@pytest.mark.parametrize("method", ["lora", "full"])
def test_gpt2_fine_tunes_and_exports(tmp_path, gpt2_gguf, method):
    """LoRA (q, v, o, up, down) and full fine-tuning run on GPT-2, lower the loss, and the
    run exports to a gpt2 GGUF that llama.cpp reads with the same logits as the run's model."""
    from mlxtoy.export import export
    from mlxtoy.loading import load_run_model

    kw = {"lora_targets": ["q", "v", "o", "up", "down"], "lora_rank": 4} if method == "lora" else {}
    result = _train(tmp_path, gpt2_gguf, method, **kw)
    assert result.losses[-1] < result.losses[0]
    model, tok = load_run_model(str(tmp_path / method))
    assert type(model).__name__ == "GPT2Model"
    tokens = tok.encode("the light on the harbour rock")
    ours = _logits(model, tokens)
    base, *_ = _load(gpt2_gguf)
    assert np.abs(ours - _logits(base, tokens)).max() > 1e-3  # training changed the model
    out = export(str(tmp_path / method), str(tmp_path / f"{method}.gguf"), fmt="gguf")
    exported, cfg, *_ = _load(out)
    assert cfg.arch == "gpt2"
    assert np.abs(_logits(exported, tokens) - ours).max() < 1e-4 * (ours.max() - ours.min())
    r = compare(ours, llama_cpp_logits(out, tokens, n_ctx=256))
    assert r["mismatch"] == [] and r["rel"] < LLAMA_CPP_GELU_REL, r


def test_gpt2_gguf_round_trip_is_lossless(tmp_path, gpt2_gguf):
    from mlxtoy.io.gguf_write import write_gguf as write_gpt2_gguf

    model, cfg, weights, meta = _load(gpt2_gguf)
    out = write_gpt2_gguf(str(tmp_path / "rt.gguf"), cfg, weights, meta.metadata, dtype="f32")
    _, cfg2, weights2, meta2 = _load(out)
    assert cfg2.to_dict() == cfg.to_dict()
    assert all(np.array_equal(np.array(weights[k]), np.array(weights2[k])) for k in weights)
    assert meta2.metadata["tokenizer.ggml.tokens"] == meta.metadata["tokenizer.ggml.tokens"]
    f16 = write_gpt2_gguf(str(tmp_path / "f16.gguf"), cfg, weights, meta.metadata, dtype="f16")
    tokens = _tokens(50)
    r = compare(_logits(_load(f16)[0], tokens), _logits(model, tokens))
    assert r["rel"] < 1e-3


def test_gpt2_lora_gate_target_is_a_user_error(tmp_path, gpt2_gguf):
    from mlxtoy.errors import UserError
    from mlxtoy.models.lora import apply_lora

    model, *_ = _load(gpt2_gguf)
    with pytest.raises(UserError):
        apply_lora(model, ["gate"], 4, 8.0)
