"""Generation: KV cache == full forward, llama.cpp greedy parity, sampling, streaming, chat, CLI."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import mlxtoy  # noqa: F401  (fast BLAS before mlx.core)
import mlx.core as mx

from mlxtoy.errors import UserError
from mlxtoy.generate import ChatSession, StreamingDetokenizer, generate, generate_tokens, stream_generate
from mlxtoy.loading import build_model
from mlxtoy.model_config import ModelConfig
from mlxtoy.models.cache import KVCache, make_cache
from mlxtoy.sampling import (SamplingParams, apply_min_p, apply_repetition_penalty, apply_temperature,
                             apply_top_k, apply_top_p, make_sampler)

NEG_INF = float("-inf")


# --------------------------------------------------------------------------- tiny models

TINY = {
    "llama-mha": dict(arch="llama", n_heads=4, n_kv_heads=4),
    "llama-gqa": dict(arch="llama", n_heads=6, n_kv_heads=2),
    "qwen2-bias": dict(arch="qwen2", n_heads=4, n_kv_heads=2, qkv_bias=True,
                       rope_traditional=False),
}


def tiny_model(kind: str, seed: int = 0, **overrides):
    mx.random.seed(seed)
    cfg = ModelConfig(**(dict(vocab_size=300, d_model=64, n_layers=2, d_head=16, d_ff=128,
                              rope_base=10000.0, context_length=256) | TINY[kind] | overrides))
    model = build_model(cfg)
    if cfg.qkv_bias:  # biases start at zero: make them matter
        for layer in model.layers:
            for proj in (layer.attn.q, layer.attn.k, layer.attn.v):
                proj.bias = 0.5 * mx.random.normal(proj.bias.shape)
    # Sharper logits than the default init, so greedy choices are far from ties.
    model.tok_embeddings.weight = 2.0 * model.tok_embeddings.weight
    mx.eval(model.parameters())
    return model


def cached_greedy(model, prompt: list[int], n: int, chunk: int) -> tuple[list[int], np.ndarray]:
    """Chunked prefill + one-token steps through the KV cache; -> tokens, per-step logits."""
    cache = make_cache(model)
    pos = 0
    while len(prompt) - pos > chunk:
        model(mx.array([prompt[pos:pos + chunk]]), cache=cache)
        pos += chunk
    logits = model(mx.array([prompt[pos:]]), cache=cache)[0, -1]
    tokens, steps = [], []
    for _ in range(n):
        steps.append(np.array(logits))
        tokens.append(int(mx.argmax(logits).item()))
        logits = model(mx.array([[tokens[-1]]]), cache=cache)[0, -1]
    assert cache[0].offset == len(prompt) + n
    return tokens, np.stack(steps)


def full_forward_logits(model, prompt: list[int], new: list[int]) -> np.ndarray:
    """Uncached: one forward over prompt + new; the logits that predicted each new token."""
    logits = model(mx.array([prompt + new]))[0]
    return np.array(logits[len(prompt) - 1: len(prompt) - 1 + len(new)])


def assert_same_greedy(tokens: list[int], ref_logits: np.ndarray, tie: float = 1e-3) -> None:
    ref_tokens = ref_logits.argmax(-1).tolist()
    for i, (a, b) in enumerate(zip(tokens, ref_tokens)):
        if a != b:
            top2 = np.sort(ref_logits[i])[-2:]
            assert top2[1] - top2[0] < tie, f"step {i}: cached chose {a}, uncached {b}, not a tie"
            return


@pytest.mark.parametrize("kind", list(TINY))
@pytest.mark.core
def test_cached_equals_uncached_tiny(kind):
    model = tiny_model(kind)
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, 300, size=37)]
    tokens, cached_logits = cached_greedy(model, prompt, 64, chunk=8)
    ref = full_forward_logits(model, prompt, tokens)
    assert ref.argmax(-1).tolist() == tokens
    np.testing.assert_allclose(cached_logits, ref, atol=2e-4, rtol=1e-4)
    # and the library's pipelined decoder, with a chunked prefill, picks the same tokens
    got = [t for t, _ in generate_tokens(model, prompt, max_tokens=64, prefill_step=16)]
    assert got == tokens


def test_decode_trace_kept_while_the_structure_holds_and_remade_after_an_adapter():
    """The compiled decode step is kept on the model between generations: it must read new
    weight values, and a model given an adapter must get a new trace (a stale one would
    decode without the adapter). Checked against the uncached forward's logits."""
    from mlx.utils import tree_flatten, tree_map

    from mlxtoy.generate import decoder_for
    from mlxtoy.models.lora import apply_lora

    model = tiny_model("llama-gqa")
    prompt = [int(t) for t in np.random.default_rng(4).integers(0, 300, size=21)]

    def check() -> list[int]:
        out = list(generate_tokens(model, prompt, max_tokens=12))
        tokens = [t for t, _ in out]
        ref = full_forward_logits(model, prompt, tokens)
        assert_same_greedy(tokens, ref)
        ref_lp = ref - np.log(np.exp(ref - ref.max(-1, keepdims=True)).sum(-1, keepdims=True)) - ref.max(-1, keepdims=True)
        np.testing.assert_allclose([lp for _, lp in out], ref_lp[np.arange(12), tokens], atol=2e-4)
        return tokens

    first = check()
    trace = decoder_for(model)
    assert decoder_for(model) is trace  # kept
    model.update(tree_map(lambda p: p * 1.3, model.parameters()))  # new values, same structure
    scaled = check()
    assert decoder_for(model) is trace
    apply_lora(model, ["q", "v"], 4, 8.0)
    mx.random.seed(5)
    for layer in model.layers:
        for proj in (layer.attn.q, layer.attn.v):
            proj.lora_b = 0.3 * mx.random.normal(proj.lora_b.shape)
    assert any(k.endswith("lora_b") for k, _ in tree_flatten(model.parameters()))
    adapted = check()
    assert decoder_for(model) is not trace
    assert len({tuple(first), tuple(scaled), tuple(adapted)}) == 3  # positive control: each change shows


def test_decode_across_cache_steps_compiled_and_eager_agree():
    """Decoding past a KVCache.step boundary (the compiled step retraces there), from a cache
    trimmed to a non-multiple of the step, gives the uncached tokens with either decoder."""
    model = tiny_model("llama-gqa", context_length=1024)
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, 300, size=240)]
    outs = {}
    for compiled in (True, False):
        outs[compiled] = list(generate_tokens(model, prompt, max_tokens=40, prefill_step=100,
                                              compile_decode=compiled))
    tokens = [t for t, _ in outs[True]]
    assert tokens == [t for t, _ in outs[False]]
    np.testing.assert_allclose([lp for _, lp in outs[True]], [lp for _, lp in outs[False]], atol=1e-4)
    assert full_forward_logits(model, prompt, tokens).argmax(-1).tolist() == tokens
    # reuse: keep 250 cached positions (a trimmed, partly filled second step), decode on
    cache = make_cache(model)
    list(generate_tokens(model, prompt + tokens, cache=cache, max_tokens=1))
    for c in cache:
        c.trim(c.offset - 250)
    more = [t for t, _ in generate_tokens(model, prompt + tokens, cache=cache, max_tokens=300)]
    ref = full_forward_logits(model, prompt + tokens, more)
    assert_same_greedy(more, ref)
    assert cache[0].capacity >= cache[0].offset > 512


def test_kv_cache_grows_in_steps_and_trims():
    c = KVCache()
    k = mx.ones((1, 2, 3, 4))
    keys, values = c.update_and_fetch(k, 2 * k)
    assert c.offset == 3 and keys.shape == (1, 2, 3, 4) and c.keys.shape[2] == KVCache.step
    for _ in range(KVCache.step):
        keys, _ = c.update_and_fetch(k[:, :, :1], k[:, :, :1])
    assert c.offset == KVCache.step + 3 and c.keys.shape[2] == 2 * KVCache.step
    assert c.trim(10) == 10 and c.offset == KVCache.step - 7
    assert c.trim(10**6) == KVCache.step - 7 and c.offset == 0
    keys, values = c.update_and_fetch(3 * k, 4 * k)
    assert keys.shape == (1, 2, 3, 4) and float(values.max()) == 4.0


def test_generate_tokens_logprobs_are_model_logprobs():
    model = tiny_model("llama-gqa")
    prompt = [5, 6, 7, 8]
    out = list(generate_tokens(model, prompt, max_tokens=3))
    tokens = [t for t, _ in out]
    ref = full_forward_logits(model, prompt, tokens)
    ref_lp = ref - np.log(np.exp(ref - ref.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - ref.max(-1, keepdims=True)
    for i, (t, lp) in enumerate(out):
        assert lp == pytest.approx(ref_lp[i, t], abs=1e-4)


def test_generation_mid_training_has_no_dropout_and_keeps_training_mode():
    import mlx.nn as nn

    from mlxtoy.models.llama import LlamaModel

    class DropModel(LlamaModel):  # stands in for a model with LoRA dropout
        def __init__(self, cfg):
            super().__init__(cfg)
            self.drop = nn.Dropout(0.5)

        def embed(self, tokens, offset=0):
            return self.drop(super().embed(tokens, offset))

    base = tiny_model("llama-gqa")
    model = DropModel(base.config)
    model.update(base.parameters())
    model.train()
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    out = list(generate_tokens(model, prompt, max_tokens=16))
    assert model.training
    model.eval()
    got = [t for t, _ in out]
    ref = full_forward_logits(model, prompt, got)
    ref_lp = ref - np.log(np.exp(ref - ref.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - ref.max(-1, keepdims=True)
    assert ref.argmax(-1).tolist() == got
    np.testing.assert_allclose([lp for _, lp in out], ref_lp[np.arange(16), got], atol=1e-4)


def test_generation_on_a_lora_model_in_training_mode():
    """The trainer's sample generations: LoRA with dropout, train mode, compiled decode."""
    from mlxtoy.models.lora import apply_lora, lora_modules

    model = tiny_model("qwen2-bias")
    apply_lora(model, ["q", "v", "down"], rank=4, alpha=8.0, dropout=0.2)
    for _, m in lora_modules(model):
        m.lora_b = 0.5 * mx.random.normal(m.lora_b.shape)
    model.train()
    prompt = [7, 7, 1, 2, 3]
    outs = [list(generate_tokens(model, prompt, max_tokens=12, compile_decode=c)) for c in (True, False)]
    assert model.training
    model.eval()
    tokens = [t for t, _ in outs[0]]
    assert tokens == [t for t, _ in outs[1]]
    assert full_forward_logits(model, prompt, tokens).argmax(-1).tolist() == tokens
    np.testing.assert_allclose([lp for _, lp in outs[0]], [lp for _, lp in outs[1]], atol=1e-4)


# --------------------------------------------------------------------------- sampling


def keep_set(logits: mx.array) -> set[int]:
    return {i for i, v in enumerate(np.array(logits).tolist()) if v != NEG_INF}


def test_top_k_keeps_the_k_largest():
    logits = mx.array([1.0, 5.0, 3.0, 2.0, 4.0])
    assert keep_set(apply_top_k(logits, 2)) == {1, 4}
    assert keep_set(apply_top_k(logits, 1)) == {1}
    assert keep_set(apply_top_k(logits, 0)) == {0, 1, 2, 3, 4}  # off
    out = np.array(apply_top_k(logits, 3))
    assert out[1] == 5.0 and out[4] == 4.0 and out[2] == 3.0  # kept values untouched


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = np.array([0.15, 0.5, 0.05, 0.3])  # sorted: 0.5 (1), 0.3 (3), 0.15 (0), 0.05 (2)
    logits = mx.array(np.log(probs).astype(np.float32))
    assert keep_set(apply_top_p(logits, 0.5)) == {1}
    assert keep_set(apply_top_p(logits, 0.7)) == {1, 3}
    assert keep_set(apply_top_p(logits, 0.81)) == {1, 3, 0}
    assert keep_set(apply_top_p(logits, 0.99)) == {0, 1, 2, 3}
    assert keep_set(apply_top_p(logits, 0.01)) == {1}  # the top token always survives
    assert keep_set(apply_top_p(logits, 1.0)) == {0, 1, 2, 3}


def test_min_p_is_relative_to_the_top_token():
    logits = mx.array(np.log([0.15, 0.5, 0.05, 0.3]).astype(np.float32))
    assert keep_set(apply_min_p(logits, 0.25)) == {0, 1, 3}  # >= 0.125
    assert keep_set(apply_min_p(logits, 0.5)) == {1, 3}  # >= 0.25
    assert keep_set(apply_min_p(logits, 0.0)) == {0, 1, 2, 3}


def test_repetition_penalty_is_sign_aware_and_counts_each_token_once():
    logits = mx.array([2.0, -1.0, 0.5, 3.0])
    out = apply_repetition_penalty(logits, [0, 1, 1, 1], 2.0)
    np.testing.assert_allclose(np.array(out), [1.0, -2.0, 0.5, 3.0])
    np.testing.assert_allclose(np.array(apply_repetition_penalty(logits, [0], 1.0)), np.array(logits))
    # greedy with a strong penalty moves off the repeated token
    sampler = make_sampler(SamplingParams(repetition_penalty=2.0))
    assert sampler(logits[None], mx.array([3]), None).item() == 0  # 3.0/2 = 1.5 < 2.0


def test_temperature_scales_logits():
    logits = mx.array([1.0, -2.0, 0.5])
    np.testing.assert_allclose(np.array(apply_temperature(logits, 0.5)), [2.0, -4.0, 1.0])


def test_sampler_draws_from_the_filtered_renormalized_distribution():
    probs = np.array([0.4, 0.3, 0.2, 0.1])
    logits = mx.array(np.tile(np.log(probs).astype(np.float32), (20000, 1)))
    draws = np.array(make_sampler(SamplingParams(temp=1.0, top_k=3))(logits, mx.array([], mx.uint32),
                                                                      mx.random.key(0)))
    freq = np.bincount(draws, minlength=4) / len(draws)
    np.testing.assert_allclose(freq, [4 / 9, 3 / 9, 2 / 9, 0.0], atol=0.015)
    # a low temperature sharpens: p ~ probs ** 4
    draws = np.array(make_sampler(SamplingParams(temp=0.25))(logits, mx.array([], mx.uint32),
                                                             mx.random.key(1)))
    sharp = probs**4 / (probs**4).sum()
    np.testing.assert_allclose(np.bincount(draws, minlength=4) / len(draws), sharp, atol=0.015)


def test_seeded_sampling_is_reproducible():
    model = tiny_model("llama-gqa")
    prompt = [1, 2, 3, 4, 5]

    def run(seed):
        sp = SamplingParams(temp=1.0, top_p=0.95, min_p=0.01, repetition_penalty=1.1, seed=seed)
        return [t for t, _ in generate_tokens(model, prompt, sampling=sp, max_tokens=32)]

    a, b, c = run(7), run(7), run(8)
    assert a == b
    assert a != c


@pytest.mark.parametrize("bad, msg", [
    (dict(temp=-0.1), "temperature"), (dict(top_p=0.0), "top-p"), (dict(top_p=1.5), "top-p"),
    (dict(top_k=-1), "top-k"), (dict(min_p=1.0), "min-p"), (dict(repetition_penalty=0.0), "penalty"),
])
def test_bad_sampling_params(bad, msg):
    with pytest.raises(UserError, match=msg):
        SamplingParams(**bad).validate()


# --------------------------------------------------------------------------- streaming


class ByteTokenizer:
    """Token i < 256 is byte i; 256 is EOS; 257.. are multi-byte pieces given in `extra`."""

    def __init__(self, extra: list[bytes] = ()):
        self.pieces = [bytes([i]) for i in range(256)] + [b"</s>"] + list(extra)
        self.eos_ids = {256}
        self.eos_id, self.bos_id = 256, None
        self.chat_template = "chatml-ish"

    def encode(self, text: str, **_) -> list[int]:
        return list(text.encode("utf-8"))

    def decode_token_bytes(self, i: int) -> bytes:
        return self.pieces[i]

    def apply_chat_template(self, messages, add_generation_prompt=True) -> str:
        out = "".join(f"<{m['role']}>{m['content']}</{m['role']}>\n" for m in messages)
        return out + ("<assistant>" if add_generation_prompt else "")


TRICKY = "héllo wörld 👋🏽 naïve — 日本語 ok"


def test_streaming_detokenizer_never_splits_a_character():
    tok = ByteTokenizer()
    detok = StreamingDetokenizer(tok)
    pieces = [detok.add(b) for b in TRICKY.encode("utf-8")] + [detok.finish()]
    assert "".join(pieces) == TRICKY
    assert all("\ufffd" not in p for p in pieces)
    assert pieces[len("h")] == ""  # the first byte of é alone shows nothing


def test_streaming_detokenizer_holds_back_possible_stop_strings():
    tok = ByteTokenizer()
    detok = StreamingDetokenizer(tok, stop=["</s>", "STOP"])
    shown = [detok.add(b) for b in b"a </b> c ST! </s> never"]
    assert "".join(shown) == "a </b> c ST! " and detok.stopped
    detok = StreamingDetokenizer(tok, stop=["</s>"])
    shown = [detok.add(b) for b in b"tail </"]
    assert "".join(shown) == "tail " and detok.finish() == "</"  # not a stop after all


class ScriptedModel:
    """A 'model' that always predicts the next token of a script (to drive stream_generate)."""

    def __init__(self, script: list[int], vocab: int):
        self.script, self.vocab = script, vocab
        self.layers = [None]
        self.config = ModelConfig(vocab_size=vocab, d_model=8, n_layers=1, n_heads=1, n_kv_heads=1,
                                  d_head=8, d_ff=8, context_length=4096)
        self.prompt_len = None

    def __call__(self, tokens, cache=None):
        T = tokens.shape[1]
        if self.prompt_len is None:
            self.prompt_len = T
        cache[0].update_and_fetch(mx.zeros((1, 1, T, 1)), mx.zeros((1, 1, T, 1)))
        i = cache[0].offset - self.prompt_len
        nxt = self.script[i] if i < len(self.script) else 0
        return mx.where(mx.arange(self.vocab) == nxt, 10.0, 0.0)[None, None, :]


def run_script(text_tokens: list[int], tok, **kw):
    model = ScriptedModel(text_tokens, len(tok.pieces))
    return list(stream_generate(model, tok, [65], **kw))


def test_stream_generate_utf8_eos_stop_and_length():
    tok = ByteTokenizer(extra=["👋".encode()[:2], "👋".encode()[2:]])
    ids = list("é!".encode()) + [257, 258] + list(b" done") + [256] + list(b"more")
    chunks = run_script(ids, tok)
    assert "".join(c.text for c in chunks) == "é!👋 done"
    assert all("\ufffd" not in c.text for c in chunks)
    assert chunks[-1].finish_reason == "stop" and chunks[-1].token == 256
    assert chunks[-1].stats.generation_tokens == len(chunks)
    assert [c.finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    chunks = run_script(ids, tok, stop=[" do"])
    assert "".join(c.text for c in chunks) == "é!👋" and chunks[-1].finish_reason == "stop"
    chunks = run_script(ids, tok, max_tokens=3)
    assert len(chunks) == 3 and chunks[-1].finish_reason == "length"
    assert "".join(c.text for c in chunks) == "é!"
    chunks = run_script(ids, tok, max_tokens=4)  # ends inside the emoji: shown as U+FFFD
    assert "".join(c.text for c in chunks) == "é!\ufffd"


def test_stream_generate_bad_input():
    model = tiny_model("llama-mha")
    tok = ByteTokenizer()
    with pytest.raises(UserError, match="empty"):
        list(stream_generate(model, tok, []))
    with pytest.raises(UserError, match="max-tokens"):
        list(stream_generate(model, tok, [1, 2], max_tokens=0))
    with pytest.raises(UserError, match="context"):
        list(stream_generate(model, tok, list(range(256))))
    with pytest.raises(UserError, match="temperature"):
        list(stream_generate(model, tok, [1], temp=-1.0))
    # the context bounds the reply too: 250 + 6 = 256
    chunks = list(stream_generate(model, tok, [1] * 250, max_tokens=100))
    assert len(chunks) <= 6 and (chunks[-1].finish_reason in ("length", "stop"))


# --------------------------------------------------------------------------- chat


def test_chat_session_reuses_the_cache_and_matches_a_fresh_prefill():
    model = tiny_model("qwen2-bias", vocab_size=257)
    tok = ByteTokenizer()
    tok.eos_ids = set()  # let every turn run to max_tokens
    session = ChatSession(model, tok, system="be brief", max_tokens=12)
    session.say("hello there")
    prompt2 = session.prompt_tokens("and again?")
    reply2 = [c.token for c in session.send("and again?")]
    assert session.last_reused > 20  # the system message and turn 1 came from the cache
    fresh = [t for t, _ in generate_tokens(model, prompt2, max_tokens=12)]
    assert reply2 == fresh
    assert [m["role"] for m in session.messages] == ["system", "user", "assistant", "user", "assistant"]
    session.reset()
    assert session.messages == [{"role": "system", "content": "be brief"}]
    assert session.cached_tokens == []


# --------------------------------------------------------------------------- SmolLM2 (real)


@pytest.fixture(scope="session")
def smollm2_f32(smollm2_f32_path) -> str:
    """SmolLM2 re-typed to F32 once per session (the Q4_1 weights, exactly; conftest.py)."""
    return smollm2_f32_path


@pytest.fixture(scope="module")
def smollm2(smollm2_f32):
    from mlxtoy.loading import load

    return load(smollm2_f32)


CHAT_PROMPT = [{"role": "user", "content": "Write a short poem about the sea."}]


@pytest.mark.real
@pytest.mark.core
def test_cached_equals_uncached_smollm2(smollm2):
    from mlxtoy.generate import encode_chat

    model, tok = smollm2
    prompt = encode_chat(tok, CHAT_PROMPT)
    tokens, cached_logits = cached_greedy(model, prompt, 64, chunk=16)
    ref = full_forward_logits(model, prompt, tokens)
    assert_same_greedy(tokens, ref)
    np.testing.assert_allclose(cached_logits, ref, atol=2e-3, rtol=1e-4)


@pytest.mark.real
@pytest.mark.core
def test_greedy_matches_llama_cpp_token_for_token(smollm2, smollm2_f32):
    import llama_cpp

    from mlxtoy.generate import encode_chat

    model, tok = smollm2
    prompt = encode_chat(tok, CHAT_PROMPT)
    ours = [t for t, _ in generate_tokens(model, prompt, max_tokens=64)]
    llm = llama_cpp.Llama(model_path=smollm2_f32, n_ctx=512, logits_all=True, n_threads=2,
                          verbose=False)
    ref = []
    for t in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
        ref.append(int(t))
        if len(ref) == 64:
            break
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            logits = np.array(model(mx.array([prompt + ours[:i]]))[0, -1])
            top2 = np.sort(logits)[-2:]
            assert top2[1] - top2[0] < 1e-3, (
                f"token {i}: ours {a} ({tok.decode([a])!r}), llama.cpp {b} ({tok.decode([b])!r}); "
                f"top-2 logits differ by {top2[1] - top2[0]:.4g}, not a tie")
            return  # after a true tie the two continuations are different texts
    assert len(ours) == len(ref) == 64


@pytest.mark.real
def test_streaming_real_tokenizer_emoji_and_accents(smollm2):
    _, tok = smollm2
    text = "Emoji 👋🏽🇫🇷 and accents: crème brûlée, naïve, Ångström, 日本語, Ελληνικά"
    ids = tok.encode(text)
    detok = StreamingDetokenizer(tok)
    pieces = [detok.add(i) for i in ids] + [detok.finish()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids) == text
    assert any(p == "" for p in pieces)  # some characters did span several tokens


@pytest.mark.real
def test_chat_session_smollm2_matches_fresh_prefill(smollm2):
    model, tok = smollm2
    session = ChatSession(model, tok, max_tokens=24)
    first = session.say("What is the capital of France?")
    assert "Paris" in first
    prompt2 = session.prompt_tokens("And of Italy?")
    reply2 = [c.token for c in session.send("And of Italy?")]
    assert session.last_reused > 30
    fresh = [t for t, _ in generate_tokens(model, prompt2, max_tokens=len(reply2))]
    assert reply2 == fresh


# --------------------------------------------------------------------------- CLI


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """`python -m mlxtoy ...`; stdout/stderr decoded as UTF-8 without newline translation."""
    env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONIOENCODING="utf-8")
    r = subprocess.run([sys.executable, "-m", "mlxtoy", *args], capture_output=True,
                       input=stdin.encode() if stdin is not None else None, env=env, timeout=300)
    r.stdout, r.stderr = r.stdout.decode("utf-8"), r.stderr.decode("utf-8")
    return r


@pytest.mark.parametrize("args, msg", [
    (["--prompt", ""], "prompt is empty"),
    (["--prompt", "   "], "prompt is empty"),
    (["--prompt", "hi", "--max-tokens", "0"], "max-tokens must be > 0"),
    (["--prompt", "hi", "--max-tokens", "-3"], "max-tokens must be > 0"),
    (["--prompt", "hi", "--temp", "-0.5"], "temperature must be >= 0"),
    (["--prompt", "hi", "--top-p", "0"], "top-p must be in (0, 1]"),
    (["--prompt", "hi", "--top-p", "1.2"], "top-p must be in (0, 1]"),
    (["--prompt", "hi", "--max-tokens", "many"], "invalid int value"),
])
def test_cli_bad_input(args, msg):
    r = run_cli("generate", *args)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and msg in lines[0], r.stderr
    assert r.stdout == ""


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> str:
    from helpers_parity import random_gguf_tensors, tiny_config, write_tiny_gguf

    cfg = tiny_config(d_model=64, d_head=16, d_ff=128, context_length=32)
    path = tmp_path_factory.mktemp("tinygen") / "tiny.gguf"
    return write_tiny_gguf(str(path), cfg, random_gguf_tensors(cfg, seed=3))


def test_cli_prompt_longer_than_context(tiny_gguf):
    r = run_cli("generate", "--model", tiny_gguf, "--prompt", "the cat sat on the mat " * 10)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "context is 32" in lines[0]


def test_cli_prints_only_the_continuation(tiny_gguf):
    from mlxtoy.loading import load

    r = run_cli("generate", "--model", tiny_gguf, "--prompt", "the cat", "--max-tokens", "40",
                "--temp", "5.0", "--seed", "11")
    assert r.returncode == 0, r.stderr
    model, tok = load(tiny_gguf)
    n_prompt = len(tok.encode("the cat"))
    expected = generate(model, tok, "the cat", max_tokens=32 - n_prompt, temp=5.0, seed=11)
    assert r.stdout == expected and len(set(expected)) >= 2
    assert "clipped" in r.stderr and "tokens/s" in r.stderr  # visible truncation + stats


@pytest.mark.real
def test_cli_generate_and_chat_smollm2():
    r = run_cli("generate", "--prompt", "What is the capital of France?", "--chat",
                "--max-tokens", "16")
    assert r.returncode == 0 and "Paris" in r.stdout, r.stderr
    seeded = ["--prompt", "Once upon a time", "--temp", "0.9", "--seed", "5", "--max-tokens", "12"]
    a, b = run_cli("generate", *seeded), run_cli("generate", *seeded)
    assert a.returncode == 0 and a.stdout == b.stdout and a.stdout
    r = run_cli("chat", "--max-tokens", "24",
                stdin="What is the capital of France?\nAnd of Italy?\n/reset\n/quit\nignored\n")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 2 and "Paris" in lines[0]
    assert "reused 0 cached" in r.stderr and "conversation reset" in r.stderr
    reused = [int(s.split("reused ")[1].split()[0]) for s in r.stderr.splitlines() if "reused" in s]
    assert reused[1] > 30
