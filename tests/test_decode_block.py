"""The fused decode block (`mlxtoy_kernels.decode_block`: one kernel per layer per decoded
token) against the model's own uncached forward (GEMMs and the grouped attention, a path that
shares none of its code) and the unfused kernels, over the Llama options it takes (GQA, q/k/v
biases, partial and traditional RoPE, RoPE scalings); its fall-back where a block is not plain;
its input checks; and the threaded logsumexp that gives each decoded token its log-probability."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest

import mlxtoy  # noqa: F401  (fast BLAS before mlx.core)
import mlx.core as mx
import mlxtoy_kernels as K
from mlx.utils import tree_flatten, tree_map

from mlxtoy import generate as generate_module
from mlxtoy.generate import decoder_for, generate_tokens
from mlxtoy.loading import build_model
from mlxtoy.model_config import ModelConfig
from mlxtoy.models import fastmath
from mlxtoy.models import prefill as prefill_module
from mlxtoy.models.cache import make_cache
from mlxtoy.models.fused_weights import ROW_PASSES
from mlxtoy.models.lora import apply_lora
from mlxtoy.models.quant import QUANTIZED_TYPES, QuantPlan, install_quantized, quantize_dense

pytestmark = pytest.mark.kernels  # the kernels themselves: skipped under MLXTOY_KERNELS=0 (conftest)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = dict(vocab_size=300, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, d_head=16, d_ff=96,
            rope_base=10000.0, context_length=512, tie_embeddings=True)
VARIANTS = {
    "gqa": dict(arch="llama", n_heads=6, n_kv_heads=2),
    "mha-qkv-bias": dict(arch="qwen2", n_kv_heads=4, qkv_bias=True),
    "partial-traditional-rope": dict(arch="llama", rope_dims=8, rope_traditional=True),
    "llama3-scaling": dict(arch="llama", rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 64}),
    "linear-scaling": dict(arch="llama", rope_scaling={"type": "linear", "factor": 2.0}),
}
PROMPT = [5, 17, 200, 33, 90, 41, 7, 128, 250, 3, 64, 11, 99]


def tiny(variant: dict, seed: int = 0):
    mx.random.seed(seed)
    model = build_model(ModelConfig(**(BASE | variant)))
    for layer in model.layers:
        layer.attn_norm.weight = 1 + 0.1 * mx.random.normal(layer.attn_norm.weight.shape)
        layer.ffn_norm.weight = 1 + 0.1 * mx.random.normal(layer.ffn_norm.weight.shape)
        for proj in (layer.attn.q, layer.attn.k, layer.attn.v):
            if "bias" in proj:  # biases start at zero: make them matter
                proj.bias = 0.5 * mx.random.normal(proj.bias.shape)
    model.tok_embeddings.weight = 2.0 * model.tok_embeddings.weight  # greedy choices far from ties
    mx.eval(model.parameters())
    return model


def graph_text(*outputs: mx.array) -> str:
    f = io.StringIO()
    mx.export_to_dot(f, *outputs)
    return f.getvalue()


def decode_steps(model, n: int, fused: bool, prompt: list[int] = PROMPT) -> tuple[list[np.ndarray], list[str], list]:
    """Prefill PROMPT into a KV cache, then n greedy steps through the compiled decoder ->
    (each step's logits, each step's graph, the cache); the tokens fed are the argmaxes of the
    logits before."""
    fastmath.FUSED_DECODE = fused
    try:
        object.__setattr__(model, "mlxtoy_decoder", None)  # a trace of this setting
        cache = make_cache(model)
        logits = model(mx.array([prompt]), cache=cache)[:, -1]
        step = decoder_for(model)
        out, graphs = [], []
        for _ in range(n):
            token = mx.argmax(logits, axis=-1).astype(mx.uint32)
            logits = step(token[None], cache)
            graphs.append(graph_text(logits))
            mx.eval(logits)
            out.append(np.array(logits[0]))
        return out, graphs, cache
    finally:
        fastmath.FUSED_DECODE = True
        object.__setattr__(model, "mlxtoy_decoder", None)


def uncached_logits(model, steps: list[np.ndarray], prompt: list[int] = PROMPT) -> list[np.ndarray]:
    """The same steps by one uncached forward over the prompt and the tokens fed."""
    first = int(np.argmax(np.array(model(mx.array([prompt]))[0, -1])))
    fed = [first] + [int(np.argmax(s)) for s in steps[:-1]]
    logits = np.array(model(mx.array([prompt + fed]))[0])
    return [logits[len(prompt) + i] for i in range(len(steps))]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_fused_decode_matches_the_uncached_forward_and_the_unfused_kernels(name):
    model = tiny(VARIANTS[name])
    fused, graphs, cache = decode_steps(model, 6, fused=True)
    # the fused path really ran: one block primitive per layer, no per-op slice update of the cache
    assert graphs[-1].count("MlxtoyDecodeBlock") == len(model.layers)
    assert "SliceUpdate" not in graphs[-1]
    for i, (got, ref) in enumerate(zip(fused, uncached_logits(model, fused))):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4, err_msg=f"{name}: step {i}")
    unfused, unfused_graphs, unfused_cache = decode_steps(model, 6, fused=False)
    assert "MlxtoyDecodeBlock" not in unfused_graphs[-1]  # positive control: the other path
    for got, ref in zip(fused, unfused):
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)
    # the caches hold the same keys and values at every written slot (the fused kernel writes in place)
    n = cache[0].offset
    assert n == unfused_cache[0].offset == len(PROMPT) + 6
    for c, u in zip(cache, unfused_cache):
        np.testing.assert_allclose(np.array(c.keys[..., :n, :]), np.array(u.keys[..., :n, :]), atol=1e-6)
        np.testing.assert_allclose(np.array(c.values[..., :n, :]), np.array(u.values[..., :n, :]), atol=1e-6)


def test_fused_decode_deep_in_the_cache():
    """Past 512 cached positions the attention runs over the cache in two parts per KV head
    (combined afterwards): still the uncached forward's logits, and the unfused kernels' bits."""
    model = tiny(VARIANTS["gqa"] | dict(context_length=1024))
    prompt = [int(t) for t in np.random.default_rng(5).integers(0, 300, 700)]
    fused, graphs, _ = decode_steps(model, 3, fused=True, prompt=prompt)
    assert graphs[-1].count("MlxtoyDecodeBlock") == len(model.layers)
    for got, ref in zip(fused, uncached_logits(model, fused, prompt)):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
    unfused, _, _ = decode_steps(model, 3, fused=False, prompt=prompt)
    for got, ref in zip(fused, unfused):
        np.testing.assert_array_equal(got, ref)


ADAPTERS = {"lora": dict(), "dora": dict(dora=True), "per-head-q": dict(per_head_q=True)}


@pytest.mark.parametrize("kind", list(ADAPTERS))
def test_blocks_with_adapters_decode_fused_from_their_merged_weights(kind):
    """A block whose projections carry LoRA/DoRA adapters (a policy sampling its GRPO rollouts)
    takes the fused step with the merged weights: the uncached forward through the adapters'
    own modules gives the same logits. Controls: the adapters change the logits; an adapter
    with dropout in training mode, or switched off, is not merged."""
    model = tiny(VARIANTS["gqa"])
    base_logits = uncached_logits(model, decode_steps(model, 4, fused=True)[0])
    apply_lora(model, ["q", "v", "down"], 4, 8.0, **ADAPTERS[kind])
    for layer in model.layers:  # adapters that change the output
        for m in (layer.attn.q, layer.attn.v, layer.ffn.down):
            m.lora_b = 0.1 * mx.random.normal(m.lora_b.shape)
    mx.eval(model.parameters())
    steps, graphs, _ = decode_steps(model, 4, fused=True)
    assert graphs[-1].count("MlxtoyDecodeBlock") == len(model.layers)
    ref = uncached_logits(model, steps)
    for got, want in zip(steps, ref):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert max(np.abs(a - b).max() for a, b in zip(ref, base_logits)) > 1e-2
    assert all(sorted(layer.decode_packs()) == ["1", "3", "8"] for layer in model.layers)  # q, v, down merged

    model.layers[0].attn.q.disabled = True
    assert "1" not in model.layers[0].decode_packs()
    model.layers[0].attn.q.disabled = False
    dropped = tiny(VARIANTS["gqa"])
    apply_lora(dropped, ["q"], 4, 8.0, dropout=0.1)
    dropped.train()
    assert dropped.layers[0].fused_modules() is None  # (its wrapper is not a plain projection)
    assert all(layer.decode_packs() == {} for layer in dropped.layers)


def quantized_base(model, bits: int | str = 4):
    """The model's block matrices kept in MLX's affine layout, groups of 32 (float16 scales and
    biases), as a QLoRA base holds them (4 bits), or a Q8_0 GGUF's (8); "mixed": q, v, o and up in
    8 bits, the others in 4 (as a GGUF may mix its types); the embeddings and norms dense."""
    weights = dict(tree_flatten(model.parameters()))
    for name, w in weights.items():
        if name.startswith("layers.") and name.endswith(".weight") and w.ndim >= 2:
            wide = bits == 8 or (bits == "mixed" and name.split(".")[-2] in ("q", "v", "o", "up"))
            weights[name] = quantize_dense(w.reshape(-1, w.shape[-1]), QuantPlan(8 if wide else 4, 32))[0]
    install_quantized(model, weights)
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("name,bits", [("gqa", 4), ("mha-qkv-bias", 4), ("gqa", 8), ("mha-qkv-bias", "mixed")])
def test_a_quantized_base_decodes_fused_reading_its_matrices_as_they_are(name, bits):
    """A quantized base's blocks take the fused step, which reads each 4- or 8-bit matrix as it is
    (no float32 copy, no pack) by the quantized GEMV's integer form (8 bits: VNNI's), a block's
    4- and 8-bit matrices each with the input laid out for it: its logits are the unfused
    quantized GEMVs' (the same products) and, within what rounding x to 16 bits a group moves,
    the uncached forward's (dequantized slabs and the SGEMM on the float x). Positive control: the
    float32 model before quantizing is beyond that tolerance."""
    if not all(K.quant_integer_form(64, 32, b) for b in ((4, 8) if bits == "mixed" else (bits,))):
        pytest.skip(f"no integer form of the {bits}-bit GEMV on this CPU")
    dense = tiny(VARIANTS[name])
    dense_steps, _, _ = decode_steps(dense, 6, fused=True)
    model = quantized_base(tiny(VARIANTS[name]), bits)
    assert sum(isinstance(m, QUANTIZED_TYPES) for _, m in model.named_modules()) == 7 * len(model.layers)
    fused, graphs, cache = decode_steps(model, 6, fused=True)
    assert graphs[-1].count("MlxtoyDecodeBlock") == len(model.layers)
    assert all(layer.decode_packs() == {} for layer in model.layers)  # nothing copied or packed
    unfused, unfused_graphs, _ = decode_steps(model, 6, fused=False)
    assert "MlxtoyDecodeBlock" not in unfused_graphs[-1]
    for got, ref in zip(fused, unfused):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    for i, (got, ref) in enumerate(zip(fused, uncached_logits(model, fused))):
        np.testing.assert_allclose(got, ref, rtol=2e-3, atol=2e-3, err_msg=f"{name}: step {i}")
    # control: the tolerance tells the quantized model from the float32 one it was made from (by
    # 10x: 8 bits are closer to it than 4)
    assert max(np.abs(a - b).max() for a, b in zip(fused, dense_steps)) > 10 * 2e-3


ALL_TARGETS = ["q", "k", "v", "o", "gate", "up", "down"]


@pytest.mark.parametrize("targets,kind,fused", [(["q", "v"], "lora", True), (["q", "down"], "lora", True),
                                                (ALL_TARGETS, "lora", True), (["q", "o"], "per-head-q", True),
                                                (["q", "down"], "dora", True), (ALL_TARGETS, "dora", True)])
def test_a_qlora_run_decodes_fused_with_its_updates_added(targets, kind, fused):
    """LoRA or DoRA on a 4-bit base's matrices, any of the seven (a QLoRA run, unmerged;
    Unsloth's default targets all): the fused step reads the 4-bit matrices as they are and adds
    each adapter's update B (A v) to its product inside the call (no float32 copy merged), then
    DoRA's rescale, made once for the generation (`lora.rescales_fixed`). The logits are the unfused
    path's within what rounding x to 16 bits a group moves (the update's sums come in another
    order than MLX's two products, and the next products round x again), and the uncached
    forward's. Control: the adapters change the logits by far more."""
    if not K.quant_integer_form(64, 32, 4):
        pytest.skip("no integer form of the 4-bit GEMV on this CPU")
    model = quantized_base(tiny(VARIANTS["gqa"]))
    base_steps, _, _ = decode_steps(model, 4, fused=True)
    apply_lora(model, targets, 4, 8.0, **ADAPTERS[kind])
    for layer in model.layers:  # adapters that change the output
        for name in targets:
            m = getattr(layer.attn, name, None) or getattr(layer.ffn, name)
            m.lora_b = 0.1 * mx.random.normal(m.lora_b.shape)
    mx.eval(model.parameters())
    steps, graphs, _ = decode_steps(model, 4, fused=True)
    assert graphs[-1].count("MlxtoyDecodeBlock") == (len(model.layers) if fused else 0)
    assert all(layer.decode_packs() == {} for layer in model.layers)  # nothing merged or packed
    unfused, _, _ = decode_steps(model, 4, fused=False)
    for got, ref in zip(steps, unfused):
        np.testing.assert_allclose(got, ref, rtol=2e-3, atol=2e-3)
    for got, ref in zip(steps, uncached_logits(model, steps)):
        np.testing.assert_allclose(got, ref, rtol=2e-3, atol=2e-3)
    assert max(np.abs(a - b).max() for a, b in zip(steps, base_steps)) > 0.05


def test_a_generation_makes_each_dora_rescale_once(monkeypatch):
    """Decoding op by op (the path Metal and CUDA run) applies each DoRA adapter's rescale
    m / ||W + scale B A||_row made once for the generation, constant while its weights are: the
    decode step's graph holds no norm (made every token, a 4-bit base's DoRA dequantizes each
    adapted matrix for it), and the logits are the uncached forward's; after the weights change
    (a training step) the next generation's rescales are the new ones. Controls: without the
    rescales fixed, the step's graph makes the norms (a Sqrt per DoRA adapter); the change moves
    the logits."""
    model = tiny(VARIANTS["gqa"])
    apply_lora(model, ["q", "v"], 4, 8.0, dora=True)
    for layer in model.layers:
        for m in (layer.attn.q, layer.attn.v):
            m.lora_b = 0.1 * mx.random.normal(m.lora_b.shape)
    mx.eval(model.parameters())
    steps, graphs, _ = decode_steps(model, 4, fused=False)
    assert graphs[-1].count("Sqrt") == 0
    for got, ref in zip(steps, uncached_logits(model, steps)):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
    for layer in model.layers:  # a training step's new magnitudes
        layer.attn.v.magnitude = 1.5 * layer.attn.v.magnitude
    mx.eval(model.parameters())
    after, _, _ = decode_steps(model, 4, fused=False)
    for got, ref in zip(after, uncached_logits(model, after)):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
    assert max(np.abs(a - b).max() for a, b in zip(after, steps)) > 0.05
    monkeypatch.setattr(generate_module, "rescales_fixed", lambda adapters, rescales: contextlib.nullcontext())
    _, graphs, _ = decode_steps(model, 1, fused=False)
    assert graphs[-1].count("Sqrt") >= 2 * len(model.layers)


def test_low_rank_updates_in_the_block_match_numpy():
    """The kernel's own low-rank additions on a float32 block, every matrix with one, a bank of 3
    slots read by rows, DoRA's rescale on v, o and down: against numpy float64 (the block op by op
    with y = (W v + B[s] (A[s] v)) k[s] after each product). Controls: the updates move the
    output; a slot outside the bank gives NaNs."""
    rng = np.random.default_rng(3)
    B, D, H, KV, Dh, F, S, r = 3, 64, 4, 2, 16, 96, 3, 4
    w = {"attn_norm": 1 + 0.1 * rng.standard_normal(D), "q": rng.standard_normal((H, Dh, D)) / 8,
         "k": rng.standard_normal((KV, Dh, D)) / 8, "v": rng.standard_normal((KV, Dh, D)) / 8,
         "o": rng.standard_normal((D, H * Dh)) / 8, "ffn_norm": 1 + 0.1 * rng.standard_normal(D),
         "gate": rng.standard_normal((F, D)) / 8, "up": rng.standard_normal((F, D)) / 8,
         "down": rng.standard_normal((D, F)) / 10}
    dims = {"q": (D, H * Dh), "k": (D, KV * Dh), "v": (D, KV * Dh), "o": (H * Dh, D), "gate": (D, F), "up": (D, F),
            "down": (F, D)}
    low = {n: (rng.standard_normal((S, r, i)) / 4, rng.standard_normal((S, o, r)) / 4,
               1 + 0.2 * rng.standard_normal((S, o)) if n in ("v", "o", "down") else None)
           for n, (i, o) in dims.items()}
    ids = np.array([2, 0, 1], dtype=np.int32)
    x = rng.standard_normal((B, 1, D))
    names = list(w)
    f32 = {n: mx.array(v.astype(np.float32)) for n, v in w.items()}

    def run(updates, slots):
        keys, values = mx.zeros((B, KV, 8, Dh)), mx.zeros((B, KV, 8, Dh))
        inv = mx.array((1.0 / 10000 ** (np.arange(0, Dh, 2) / Dh)).astype(np.float32))
        y, _, _ = K.decode_block(mx.array(x.astype(np.float32)), [f32[n] for n in names], [], keys, values,
                                 mx.array([0], dtype=mx.int32), inv, Dh, False, 1e-5, Dh ** -0.5, 1.0,
                                 low_rank=[mx.array(f.astype(np.float32)) for n in names if n in updates
                                           for f in updates[n] if f is not None],
                                 low_rank_of=sum(1 << i for i, n in enumerate(names) if n in updates),
                                 dora_of=sum(1 << i for i, n in enumerate(names) if n in updates
                                             and updates[n][2] is not None),
                                 ids=mx.array(slots))
        return np.array(y)

    def reference():  # one token at position 0: attention is its own v
        def norm(v, g):
            return v / np.sqrt((v * v).mean(-1, keepdims=True) + 1e-5) * g

        def product(name, v):
            a, b, k = low[name]
            out = v @ w[name].reshape(-1, v.shape[-1]).T + np.stack([b[s] @ (a[s] @ v[i]) for i, s in enumerate(ids)])
            return out if k is None else out * k[ids]
        h = x[:, 0]
        xn = norm(h, w["attn_norm"])
        v = product("v", xn).reshape(B, KV, Dh)
        product("q", xn), product("k", xn)  # (their values do not reach the output at position 0)
        att = np.repeat(v, H // KV, axis=1).reshape(B, H * Dh)
        h = h + product("o", att)
        hn = norm(h, w["ffn_norm"])
        g, u = product("gate", hn), product("up", hn)
        return (h + product("down", g / (1 + np.exp(-g)) * u))[:, None]

    got = run(low, ids)
    np.testing.assert_allclose(got, reference(), rtol=1e-4, atol=1e-4)
    assert np.abs(got - run({}, ids)).max() > 0.1  # control: the updates move the output
    assert np.isnan(run(low, np.array([2, 0, 3], dtype=np.int32))).all()  # slot 3 of a bank of 3
    with pytest.raises(ValueError, match="low_rank"):  # B of the wrong width
        K.decode_block(mx.zeros((B, 1, D)), [f32[n] for n in names], [], mx.zeros((B, KV, 8, Dh)),
                       mx.zeros((B, KV, 8, Dh)), mx.array([0], dtype=mx.int32), mx.ones((Dh // 2,)), Dh, False,
                       1e-5, 1.0, 1.0, low_rank=[mx.zeros((1, r, D)), mx.zeros((1, H * Dh + 1, r))], low_rank_of=1 << 1)


def test_blocks_that_are_not_plain_decode_unfused_and_still_right():
    qk_norm = tiny(dict(arch="qwen3", qk_norm=True))
    steps, graphs, _ = decode_steps(qk_norm, 3, fused=True)
    assert "MlxtoyDecodeBlock" not in graphs[-1]
    for got, ref in zip(steps, uncached_logits(qk_norm, steps)):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


def test_generation_crosses_a_cache_growth_with_the_fused_blocks():
    """Past KVCache.step positions the buffers grow (a new trace, the old slots copied over)."""
    model = tiny(VARIANTS["gqa"])
    prompt = PROMPT * 19  # 247 tokens: decoding crosses position 256
    tokens = [t for t, _ in generate_tokens(model, prompt, max_tokens=20)]
    logits = np.array(model(mx.array([prompt + tokens[:-1]]))[0, len(prompt) - 1:])
    ref = logits.argmax(-1).tolist()
    for i, (a, b) in enumerate(zip(tokens, ref)):
        top2 = np.sort(logits[i])[-2:]
        assert a == b or top2[1] - top2[0] < 1e-3, f"step {i}: {a} vs {b}"


Q4_1 = gguf.GGMLQuantizationType.Q4_1
Q8_0 = gguf.GGMLQuantizationType.Q8_0
MATRICES = (1, 2, 3, 4, 6, 7, 8)  # the matrices among the block's weights (the rest are norms)


def q4_grid(w: np.ndarray, qtype=Q4_1) -> np.ndarray:
    """w on a Q4_1 (or `qtype`) grid, by gguf-py's own quantizer and dequantizer: what a GGUF of
    that type loads as."""
    flat = np.ascontiguousarray(w, dtype=np.float32).reshape(-1, w.shape[-1])
    return gguf.quants.dequantize(gguf.quants.quantize(flat, qtype), qtype).reshape(w.shape).astype(np.float32)


def q4_model(variant: dict, seed: int = 0, qtype=Q4_1, head=False):
    """`tiny` with every block matrix on a Q4_1 (or `qtype`) grid; with `head`, the (tied) output
    matrix on a Q8_0 grid too."""
    model = tiny(variant, seed)
    for layer in model.layers:
        for m in (layer.attn.q, layer.attn.k, layer.attn.v, layer.attn.o, layer.ffn.gate, layer.ffn.up, layer.ffn.down):
            m.weight = mx.array(q4_grid(np.array(m.weight), qtype))
    if head:
        model.tok_embeddings.weight = mx.array(q4_grid(np.array(model.tok_embeddings.weight), Q8_0))
    mx.eval(model.parameters())
    return model


def block_args(D=32, H=4, KV=2, Dh=8, F=48, S=16, bias=False, seed=0, q4=False):
    """decode_block's arguments for a random block; q4: its matrices "packed" (on a Q4_1 grid,
    packed losslessly) or "affine" / "affine8" (MLX's affine 4- or 8-bit layout, groups of 32,
    float16 scales and biases: a quantized base's, given as they are)."""
    r = np.random.default_rng(seed)
    a = lambda *shape: mx.array(r.standard_normal(shape).astype(np.float32) / np.sqrt(shape[-1]))  # noqa: E731
    weights = [1 + a(D), a(H, Dh, D), a(KV, Dh, D), a(KV, Dh, D), a(D, H * Dh), 1 + a(D), a(F, D), a(F, D), a(D, F)]
    extra = {}
    if q4 in (True, "packed"):  # the matrices on a Q4_1 grid, packed
        weights = [K.pack(mx.array(q4_grid(np.array(w))), "q4")[0] if i in MATRICES else w for i, w in enumerate(weights)]
    elif q4 in ("affine", "affine8"):
        affine = []
        for i in MATRICES:
            words, scales, biases = mx.quantize(weights[i].reshape(-1, weights[i].shape[-1]), 32,
                                                8 if q4 == "affine8" else 4)
            weights[i] = words.reshape(*weights[i].shape[:-1], -1)
            affine += [scales.astype(mx.float16), biases.astype(mx.float16)]
        extra = dict(affine=affine)
    biases = [a(H, Dh), a(KV, Dh), a(KV, Dh)] if bias else []
    return extra | dict(x=a(1, 1, D), weights=weights, biases=biases, keys=a(1, KV, S, Dh), values=a(1, KV, S, Dh),
                offset=mx.array([5], dtype=mx.int32), inv_freqs=mx.array(10000.0 ** (-np.arange(0, Dh, 2) / Dh),
                                                                            dtype=mx.float32),
                rope_dims=Dh, traditional=False, eps=1e-5, attn_scale=Dh**-0.5, rope_scale=1.0)


def test_decode_block_input_checks():
    good = block_args()
    y, k, v = K.decode_block(**good)  # positive control: a well-formed call runs
    mx.eval(y, k, v)
    assert np.isfinite(np.array(y)).all()
    bad = {
        "no tokens": dict(x=mx.zeros((1, 0, 32))),
        "rows the cache has not": dict(x=mx.zeros((2, 1, 32))),
        "H not a multiple of KV": dict(weights=[good["weights"][0], mx.zeros((3, 8, 32))] + good["weights"][2:]),
        "o of the wrong width": dict(weights=good["weights"][:4] + [mx.zeros((32, 24))] + good["weights"][5:]),
        "cache of other heads": dict(keys=mx.zeros((1, 3, 16, 8)), values=mx.zeros((1, 3, 16, 8))),
        "offset not int32": dict(offset=mx.array([5], dtype=mx.int64)),
        "odd rope dims": dict(rope_dims=7),
        "two biases": dict(biases=[mx.zeros((4, 8)), mx.zeros((2, 8))]),
        "float16 weights": dict(weights=[w.astype(mx.float16) for w in good["weights"]]),
        "packed of the wrong width": dict(weights=good["weights"][:6] + [mx.zeros((48, 23), dtype=mx.uint8)]
                                          + good["weights"][7:]),
    }
    if K.quant_integer_form(32, 32, 4):  # affine 4-bit matrices: a well-formed call, then bad ones
        affine = block_args(F=64, q4="affine")
        mx.eval(K.decode_block(**affine))
        words, scales = affine["weights"], affine["affine"]
        bad |= {
            "affine without its scales": dict(weights=words, affine=scales[:-2]),
            "affine scales to spare": dict(weights=words, affine=scales + scales[:2]),
            "affine scales of the wrong width": dict(weights=words, affine=[s[:, :-1] for s in scales]),
            "affine scales and biases of two dtypes": dict(weights=words, affine=[s.astype(mx.float32) if j % 2
                                                                                  else s for j, s in enumerate(scales)]),
            "affine words of neither 4 nor 8 bits": dict(weights=words[:6] + [words[6][:, :-1]] + words[7:],
                                                         affine=scales),
        }
    if K.quant_integer_form(32, 32, 8):  # and 8-bit ones, well-formed
        mx.eval(K.decode_block(**block_args(F=64, q4="affine8")))
    for what, change in bad.items():
        with pytest.raises(ValueError, match="decode_block"):
            K.decode_block(**(good | change))
    # a slot past the cache's capacity is never written: NaNs instead
    before = np.array(good["keys"])
    y, k, _ = K.decode_block(**(good | dict(offset=mx.array([16], dtype=mx.int32))))
    assert np.isnan(np.array(y)).all() and np.array_equal(np.array(k), before)
    # nor are a prompt's slots past it (two tokens from slot 15 of 16)
    y, k, _ = K.decode_block(**(good | dict(x=mx.ones((1, 2, 32)), offset=mx.array([15], dtype=mx.int32))))
    assert np.isnan(np.array(y)).all() and np.array_equal(np.array(k), before)


@pytest.mark.parametrize("q4", [False, "packed", "affine", "affine8"],
                         ids=["float32", "q4-packed", "affine-4-bit", "affine-8-bit"])
def test_decode_block_rows_of_a_left_padded_batch_each_get_what_they_get_alone(q4):
    """B rows in one call, row b's history in columns starts[b]..offset - 1 of the batch's cache
    (left padding before it, filled with large values a wrong mask would let through): each row's
    output and new k/v equal the row's own B = 1 call on its history alone (position offset -
    starts[b]), to float32 summation order (several rows take the several-rows GEMV; a packed
    matrix is unpacked for them; an affine 4- or 8-bit one's rows are each rounded and multiplied
    alone). Positive control: the batch read from column 0 differs."""
    bits = {"affine": 4, "affine8": 8}.get(q4)
    if bits and not K.quant_integer_form(64, 32, bits):
        pytest.skip(f"no integer form of the {bits}-bit GEMV on this CPU")
    D, H, KV, Dh, F, S = 64, 4, 2, 16, 96, 24
    base = block_args(D=D, H=H, KV=KV, Dh=Dh, F=F, S=S, bias=True, seed=7, q4=q4)
    r = np.random.default_rng(3)
    starts, off = [0, 6, 3], 11
    x = r.standard_normal((3, 1, D)).astype(np.float32)
    keys = 50.0 * r.standard_normal((3, KV, S, Dh)).astype(np.float32)  # the padding: far off any real key
    values = 50.0 * r.standard_normal((3, KV, S, Dh)).astype(np.float32)
    for b, start in enumerate(starts):  # each row's history, at its own columns
        keys[b, :, start:off] = r.standard_normal((KV, off - start, Dh))
        values[b, :, start:off] = r.standard_normal((KV, off - start, Dh))
    batch = base | dict(x=mx.array(x), keys=mx.array(keys), values=mx.array(values),
                        offset=mx.array([off], dtype=mx.int32), starts=mx.array(starts, dtype=mx.int32))
    y, k, v = K.decode_block(**batch)
    mx.eval(y, k, v)
    y, k, v = np.array(y), np.array(k), np.array(v)
    for b, start in enumerate(starts):
        alone_k = np.zeros((1, KV, S, Dh), np.float32)
        alone_v = np.zeros((1, KV, S, Dh), np.float32)
        alone_k[0, :, :off - start] = keys[b, :, start:off]
        alone_v[0, :, :off - start] = values[b, :, start:off]
        ya, ka, va = K.decode_block(**(base | dict(x=mx.array(x[b:b + 1]), keys=mx.array(alone_k),
                                                   values=mx.array(alone_v),
                                                   offset=mx.array([off - start], dtype=mx.int32))))
        mx.eval(ya, ka, va)
        np.testing.assert_allclose(y[b], np.array(ya)[0], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(k[b, :, off], np.array(ka)[0, :, off - start], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(v[b, :, off], np.array(va)[0, :, off - start], rtol=1e-5, atol=1e-5)
    # control: every row reading from column 0 (its padding included) is not what it gets alone
    y0, _, _ = K.decode_block(**(batch | dict(keys=mx.array(keys), values=mx.array(values),
                                              starts=mx.zeros((3,), dtype=mx.int32))))
    assert np.allclose(np.array(y0)[0], y[0], rtol=1e-5, atol=1e-5)  # row 0 has no padding
    assert not np.allclose(np.array(y0)[1], y[1], rtol=1e-3, atol=1e-3)
    # a start past the offset (a row with no column) gives NaNs; starts of another length are refused
    bad, _, _ = K.decode_block(**(batch | dict(starts=mx.array([0, off + 1, 3], dtype=mx.int32))))
    assert np.isnan(np.array(bad)).all()
    with pytest.raises(ValueError, match="starts"):
        K.decode_block(**(batch | dict(starts=mx.zeros((2,), dtype=mx.int32))))


def ref_logsumexp(x: np.ndarray) -> np.ndarray:
    """float64 logsumexp over the last axis of finite x."""
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))[..., 0]


def test_logsumexp_kernel_vs_float64():
    r = np.random.default_rng(1)
    for shape in [(49152,), (3, 20000), (2, 1), (4, 8193)]:  # one block, several, a tail of one
        x = (5 * r.standard_normal(shape)).astype(np.float32)
        got = np.array(K.logsumexp(mx.array(x)), dtype=np.float64).reshape(shape[:-1] or (1,))
        np.testing.assert_allclose(got, ref_logsumexp(x).reshape(got.shape), rtol=1e-6, atol=1e-6)
        # more accurate than MLX's own float sum over the row, and what fastmath.logsumexp gives
        np.testing.assert_array_equal(np.array(fastmath.logsumexp(mx.array(x))).reshape(got.shape), got)
    x = np.array([[-np.inf] * 5, [0.0, -np.inf, 0.0, -np.inf, -np.inf]], dtype=np.float32)
    got = np.array(K.logsumexp(mx.array(x)))
    assert got[0] == -np.inf and abs(got[1] - np.log(2.0)) < 1e-6  # masked entries add nothing


def test_argmax_kernel_is_numpys_first_index_of_the_largest():
    """The threaded argmax that picks each greedy token: numpy's and MLX's index on rows of
    every length class (a vector tail, 49K, 3-D), the first of tied maxima (placed after the
    first vector of eight and at the end), -inf entries, a row of -inf (index 0), and NaN
    entries, which are never taken; fastmath.argmax and the greedy sampler give the same."""
    r = np.random.default_rng(2)
    for shape in [(49152,), (3, 20001), (2, 1), (2, 3, 37)]:
        x = (5 * r.standard_normal(shape)).astype(np.float32)
        got = np.array(K.argmax(mx.array(x))).reshape(shape[:-1] or ())
        np.testing.assert_array_equal(got, x.argmax(-1))
        np.testing.assert_array_equal(got, np.array(mx.argmax(mx.array(x), axis=-1)))
        np.testing.assert_array_equal(np.array(fastmath.argmax(mx.array(x))), got)
    x = r.standard_normal((4, 1003)).astype(np.float32)
    x[0, [9, 500, 1002]] = 7.0  # ties: the first
    x[1, :] = -np.inf
    x[2, 40] = np.nan
    x[2, 41] = 9.0  # a NaN before the largest is not taken
    x[3, ::2] = -np.inf
    got = np.array(K.argmax(mx.array(x)))
    assert got.dtype == np.uint32 and got.tolist() == [9, 0, 41, int(np.nanargmax(x[3]))]


DECODE_SCRIPT = """
import sys, numpy as np
sys.path.insert(0, "tests")
import mlxtoy, mlx.core as mx, mlxtoy_kernels as K
from test_decode_block import block_args
y, k, v = K.decode_block(**block_args(D=96, H=6, KV=2, Dh=16, F=400, S=64, bias=True, seed=4))
yq, _, _ = K.decode_block(**block_args(D=96, H=6, KV=2, Dh=16, F=416, S=64, bias=True, seed=4, q4=True))
x = np.random.default_rng(5).standard_normal((3, 30000)).astype(np.float32)
np.savez(sys.argv[1], y=np.array(y), k=np.array(k), v=np.array(v), yq=np.array(yq), lse=np.array(K.logsumexp(mx.array(x))),
         threads=K.threads(), openmp=K.openmp())
"""


@pytest.mark.parametrize("env", [{"MLXTOY_KERNEL_THREADS": "1"}, {"MLXTOY_KERNEL_POOL": "own"},
                                 {"MLXTOY_KERNEL_POOL": "own", "MLXTOY_KERNEL_THREADS": "3"}],
                         ids=["one-thread", "own-pool", "own-pool-3"])
def test_decode_block_same_bits_on_any_team(tmp_path, env):
    """The phases are split head by head and row chunk by row chunk, first come first served,
    with barriers between them: one thread, the own pool's spin barrier (also with more threads
    than cores) and MKL's OpenMP team give the same bits."""
    out = tmp_path / "out.npz"
    proc = subprocess.run([sys.executable, "-c", DECODE_SCRIPT, str(out)], cwd=REPO, env=os.environ | env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = np.load(out)
    assert int(got["threads"]) == int(env.get("MLXTOY_KERNEL_THREADS", K.threads()))
    if "MLXTOY_KERNEL_POOL" in env:
        assert not bool(got["openmp"])
    y, k, v = K.decode_block(**block_args(D=96, H=6, KV=2, Dh=16, F=400, S=64, bias=True, seed=4))
    np.testing.assert_array_equal(got["y"], np.array(y))
    np.testing.assert_array_equal(got["k"], np.array(k))
    np.testing.assert_array_equal(got["v"], np.array(v))
    yq, _, _ = K.decode_block(**block_args(D=96, H=6, KV=2, Dh=16, F=416, S=64, bias=True, seed=4, q4=True))
    np.testing.assert_array_equal(got["yq"], np.array(yq))
    x = np.random.default_rng(5).standard_normal((3, 30000)).astype(np.float32)
    np.testing.assert_array_equal(got["lse"], np.array(K.logsumexp(mx.array(x))))
    np.testing.assert_allclose(got["lse"], ref_logsumexp(x), rtol=1e-6)  # positive control: right, not merely alike


# --- decoding from 4-bit weights -------------------------------------------------------------

def unpack_q4(packed: np.ndarray, K: int) -> np.ndarray:
    """The packed rows back to weights, read from the documented layout: per block of 32, float32
    d and m, then 16 bytes whose low nibble is weight j and high nibble weight j + 16."""
    rows = packed.reshape(-1, K // 32, 24)
    d = rows[..., 0:4].copy().view(np.float32)[..., 0]
    m = rows[..., 4:8].copy().view(np.float32)[..., 0]
    qs = rows[..., 8:]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.float32)
    return (d[..., None] * q + m[..., None]).reshape(-1, K).astype(np.float32)


def test_pack_q4_is_lossless_on_a_q4_1_grid_and_refuses_anything_else():
    r = np.random.default_rng(7)
    w = r.standard_normal((40, 96)).astype(np.float32)
    grid = q4_grid(w)
    grid[3, :32] = 0.25  # a constant block (d = 0)
    packed, ok = K.pack(mx.array(grid), "q4")
    assert int(ok.item()) == 1 and packed.shape == (40, 96 // 32 * 24) and packed.dtype == mx.uint8
    np.testing.assert_array_equal(unpack_q4(np.array(packed), 96), grid)  # every weight, to the bit
    assert fastmath.pack_lossless(mx.array(grid)) is not None
    off = grid.copy()
    off[17, 50] = np.nextafter(off[17, 50], np.float32(10))  # one weight one ulp off the grid
    assert int(K.pack(mx.array(off), "q4")[1].item()) == 0 and fastmath.pack_lossless(mx.array(off)) is None
    assert fastmath.pack_lossless(mx.array(w)) is None  # float weights: not a grid
    assert fastmath.pack_lossless(mx.array(grid[:, :80])) is None  # K not a multiple of 32


def unpack_q8(packed: np.ndarray, K: int) -> np.ndarray:
    """The packed rows back to weights, read from the documented layout: per block of 32, float32
    d of weights 0..15 and d of 16..31, then 32 signed bytes q; weight = d * q."""
    rows = packed.reshape(-1, K // 32, 40)
    d = rows[..., 0:8].copy().view(np.float32)  # (rows, blocks, 2)
    q = rows[..., 8:].copy().view(np.int8).astype(np.float32).reshape(*d.shape[:-1], 2, 16)
    return (d[..., None] * q).reshape(-1, K).astype(np.float32)


def test_pack_q8_is_lossless_on_a_q8_0_grid_and_neither_packs_a_non_finite_weight():
    r = np.random.default_rng(8)
    grid = q4_grid(r.standard_normal((24, 128)).astype(np.float32), Q8_0)
    grid[5, 64:96] = 0.0  # an all-zero block (d = 0)
    packed, ok = K.pack(mx.array(grid), "q8")
    assert int(ok.item()) == 1 and packed.shape == (24, 128 // 32 * 40)
    np.testing.assert_array_equal(unpack_q8(np.array(packed), 128), grid)
    assert int(K.pack(mx.array(grid), "q4")[1].item()) == 0  # a Q8_0 grid is no 4-bit one
    q4 = q4_grid(r.standard_normal((8, 64)).astype(np.float32))
    q4_0 = q4_grid(r.standard_normal((8, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q4_0)
    for form, w in (("q4", q4), ("q8", grid), ("q4_0", q4_0), ("q8_0", grid)):
        assert int(K.pack(mx.array(w), form)[1].item()) == 1  # positive control
        for bad in (np.nan, np.inf, -np.inf):
            v = w.copy()
            v[2, 40] = bad  # inside a block whose other weights set its range
            assert int(K.pack(mx.array(v), form)[1].item()) == 0, (form, bad)



@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q4_0, Q8_0], ids=["q4_0", "q8_0"])
def test_pack_keeps_a_q4_0_or_q8_0_grid_as_the_gguf_s_own_blocks(qtype):
    """Weights a Q4_0 (or Q8_0) GGUF dequantizes to pack into that file's own blocks (float16 d,
    then the nibbles or bytes): byte for byte what gguf-py's quantizer writes, an all-zero block
    and blocks whose extreme is positive (a negative d) included. pack_lossless takes that form
    (18 or 34 bytes a block, where the float32-d forms take 24 or 40). A Q4_1 grid, a d that is
    no float16 value, and a weight one ulp off are refused (positive controls)."""
    r = np.random.default_rng(14)
    w = r.standard_normal((40, 576)).astype(np.float32)
    w[3, 32:64] = 0.0
    w[4, 64:96] = np.abs(w[4, 64:96])  # a block whose extreme is positive
    blocks = gguf.quants.quantize(w, qtype)
    grid = gguf.quants.dequantize(blocks, qtype).reshape(w.shape).astype(np.float32)
    form, block_bytes = ("q4_0", 18) if qtype == gguf.GGMLQuantizationType.Q4_0 else ("q8_0", 34)
    packed, ok = K.pack(mx.array(grid), form)
    assert int(ok.item()) == 1 and packed.shape == (40, 576 // 32 * block_bytes)
    np.testing.assert_array_equal(np.array(packed), np.asarray(blocks).reshape(40, -1))
    assert fastmath.pack_lossless(mx.array(grid)).shape == packed.shape
    assert int(K.pack(mx.array(q4_grid(w)), form)[1].item()) == 0  # Q4_1: d q + m
    assert int(K.pack(mx.array(grid * np.float32(1 + 2 ** -13)), form)[1].item()) == 0  # d no float16
    off = grid.copy()
    off[17, 50] = np.nextafter(off[17, 50], np.float32(10))
    assert int(K.pack(mx.array(off), form)[1].item()) == 0


def q6_k_grid(rows: int, K_: int, seed: int) -> np.ndarray:
    """Weights as a Q6_K GGUF loads them from random blocks with a tame d: a signed 8-bit scale
    for each 16 weights, q in -32..31."""
    qtype = gguf.GGMLQuantizationType.Q6_K
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    r = np.random.default_rng(seed)
    data = r.integers(0, 256, (rows * K_ // 256, type_size), dtype=np.uint8)
    data[:, -2:] = (np.abs(r.standard_normal((data.shape[0], 1))) * 1e-4 + 1e-5).astype(np.float16).view(np.uint8)
    return gguf.quants.dequantize(data, qtype).reshape(rows, K_).astype(np.float32)


def q4_k_grid(rows: int, K_: int, seed: int) -> np.ndarray:
    """Weights as a Q4_K GGUF loads them (gguf-py's dequantizer) from random blocks with tame
    scales, each group of 32 using q = 0 (as the quantizer's groups whose minimum is their own)."""
    qtype = gguf.GGMLQuantizationType.Q4_K
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    r = np.random.default_rng(seed)
    data = r.integers(0, 256, (rows * K_ // 256, type_size), dtype=np.uint8)
    data[:, :4] = (np.abs(r.standard_normal((data.shape[0], 2))) * 0.01 + 1e-3).astype(np.float16).view(np.uint8)
    qs = data[:, 16:].reshape(-1, 4, 32)  # 4 x 32 bytes: group 2i in the low nibbles, 2i + 1 in the high
    qs[:, :, 0] &= 0xF0
    qs[:, :, 1] &= 0x0F
    data[:, 16:] = qs.reshape(-1, 128)
    return gguf.quants.dequantize(data, qtype).reshape(rows, K_).astype(np.float32)


def q5_k_grid(rows: int, K_: int, seed: int) -> np.ndarray:
    """Weights as a Q5_K GGUF loads them from random blocks with tame scales, each group of 32
    using q = 0 (as q4_k_grid's): q's low 4 bits as Q4_K's, its fifth bit g of qh's byte e for
    element e of group g."""
    qtype = gguf.GGMLQuantizationType.Q5_K
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    r = np.random.default_rng(seed)
    data = r.integers(0, 256, (rows * K_ // 256, type_size), dtype=np.uint8)
    data[:, :4] = (np.abs(r.standard_normal((data.shape[0], 2))) * 0.01 + 1e-3).astype(np.float16).view(np.uint8)
    data[:, 16:18] = 0  # qh's bytes 0 and 1: elements 0 and 1 of every group below 16
    qs = data[:, 48:].reshape(-1, 4, 32)
    qs[:, :, 0] &= 0xF0
    qs[:, :, 1] &= 0x0F
    data[:, 48:] = qs.reshape(-1, 128)
    return gguf.quants.dequantize(data, qtype).reshape(rows, K_).astype(np.float32)


def unpack_q5(packed: np.ndarray, K: int) -> np.ndarray:
    """The packed rows back to weights, read from the documented layout: per block of 32, float32
    d and m, 16 bytes of low nibbles as a Q4 block's, then a little-endian uint32 whose bit j is
    weight j's fifth bit; weight = d * q + m."""
    rows = packed.reshape(-1, K // 32, 28)
    d = rows[..., 0:4].copy().view(np.float32)[..., 0]
    m = rows[..., 4:8].copy().view(np.float32)[..., 0]
    qs = rows[..., 8:24]
    qh = rows[..., 24:28].copy().view("<u4")[..., 0]
    fifth = (qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1
    q = (np.concatenate([qs & 15, qs >> 4], axis=-1) | (fifth << 4)).astype(np.float32)
    return (d[..., None] * q + m[..., None]).reshape(-1, K).astype(np.float32)


def test_pack_takes_the_grids_of_q4_0_q5_0_q5_1_q4_k_q5_k_and_q6_k():
    """Q4_0 (d (q - 8): its span used from one end only) and Q4_K's groups (d q - m, each group's
    own d and m) pack 4-bit; Q5_1 and Q5_K's groups (32 levels above a minimum) 5-bit; Q5_0
    (d (q - 16)) and Q6_K (a scale per 16) 8-bit; every weight to the bit. Q5_1 fits no 4-bit
    grid, and 64 levels above an offset (6 bits, asymmetric) fit none: they stay float32
    (positive controls)."""
    r = np.random.default_rng(10)
    w = r.standard_normal((24, 576)).astype(np.float32)
    for name, grid in (("Q4_0", q4_grid(w, gguf.GGMLQuantizationType.Q4_0)), ("Q4_K", q4_k_grid(24, 512, 11))):
        packed, ok = K.pack(mx.array(grid), "q4")
        assert int(ok.item()) == 1, name
        np.testing.assert_array_equal(unpack_q4(np.array(packed), grid.shape[1]), grid, err_msg=name)
    q5 = q4_grid(w, gguf.GGMLQuantizationType.Q5_0)
    assert int(K.pack(mx.array(q5), "q4")[1].item()) == 0
    for name, grid in (("Q5_0", q5), ("Q6_K", q6_k_grid(24, 512, 12))):
        packed, ok = K.pack(mx.array(grid), "q8")
        assert int(ok.item()) == 1, name
        np.testing.assert_array_equal(unpack_q8(np.array(packed), grid.shape[1]), grid, err_msg=name)
    q51 = q4_grid(w, gguf.GGMLQuantizationType.Q5_1)
    assert int(K.pack(mx.array(q51), "q4")[1].item()) == 0
    for name, grid in (("Q5_1", q51), ("Q5_K", q5_k_grid(24, 512, 13))):
        packed, ok = K.pack(mx.array(grid), "q5")
        assert int(ok.item()) == 1, name
        assert packed.shape == (24, grid.shape[1] // 32 * 28)
        np.testing.assert_array_equal(unpack_q5(np.array(packed), grid.shape[1]), grid, err_msg=name)
        assert fastmath.pack_lossless(mx.array(grid)).shape == packed.shape
    d = np.float32(np.float16(0.0123))
    six_bits = (d * r.integers(0, 64, (24, 576)).astype(np.float32) + np.float32(np.float16(-0.377))).astype(np.float32)
    six_bits[:, ::32] = np.float32(np.float16(-0.377))  # each block's minimum, 63 steps below its top
    six_bits[:, 1::32] = d * np.float32(63) + np.float32(np.float16(-0.377))
    assert fastmath.pack_lossless(mx.array(six_bits)) is None


@pytest.mark.parametrize("qtype", [Q4_1, Q8_0, gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q6_K,
                                   gguf.GGMLQuantizationType.Q5_1, gguf.GGMLQuantizationType.Q5_K],
                         ids=["q4_1", "q8_0", "q4_0", "q6_k", "q5_1", "q5_k"])
def test_rows_against_packed_weights_multiply_the_weights_to_the_bit(qtype):
    """Rows against a packed matrix (AVX-512, AVX2 or portable; one row, a few read from the
    blocks as they are, more from the blocks unpacked): every weight must be made exactly
    (fl(fl(d q) + m), two roundings, as the grid has them) and summed in the float32 GEMV's
    order, so the products are the float32 matrix's own, bit for bit, in every row."""
    r = np.random.default_rng(9)
    for K_ in (96, 576):
        made = {gguf.GGMLQuantizationType.Q6_K: q6_k_grid, gguf.GGMLQuantizationType.Q5_K: q5_k_grid}
        if qtype in made:  # gguf-py does not quantize to it: made blocks, K rounded up to 256s
            w = made[qtype](203, -(-K_ // 256) * 256, K_)
        else:
            w = q4_grid(r.standard_normal((203, K_)).astype(np.float32), qtype)
        K_ = w.shape[1]
        forms = {Q4_1: ["q4"], gguf.GGMLQuantizationType.Q4_0: ["q4_0", "q4"], Q8_0: ["q8_0", "q8"],
                 gguf.GGMLQuantizationType.Q5_1: ["q5"], gguf.GGMLQuantizationType.Q5_K: ["q5"]}.get(qtype, ["q8"])
        for form in forms:
            packed, ok = K.pack(mx.array(w), form)
            assert int(ok.item()) == 1, form
            # one row of x: at every rows a pass of W the kernels can be set to (choose_row_passes)
            for rows, passes in [(1, p) for p in ROW_PASSES] + [(n, 0) for n in (2, 3, 5, 8, 9, 13)]:
                x = r.standard_normal((rows, K_)).astype(np.float32)
                K.set_packed_row_pass(form, passes)
                try:
                    y = np.array(K.gemv_packed(mx.array(x), packed))
                finally:
                    K.set_packed_row_pass(form, 0)
                np.testing.assert_array_equal(y, np.array(K.gemv(mx.array(x), mx.array(w))),
                                              err_msg=f"{form}, K = {K_}, {rows} rows, {passes} a pass")
                # float32 sums: within a few eps of sum |x_k w_k| (Q5_K's made weights run to ~20)
                bound = 1e-6 * (np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T)
                assert (np.abs(y - x.astype(np.float64) @ w.astype(np.float64).T) <= bound).all()

@pytest.mark.parametrize("qtype", [Q4_1, gguf.GGMLQuantizationType.Q5_1], ids=["q4_1", "q5_1"])
def test_decode_from_packed_weights_matches_the_uncached_forward(qtype):
    """Decoding from a Q4_1 (or Q5_1) grid's packs (4-bit or 5-bit blocks): the uncached forward's
    logits, and the float32 matrices' through the same kernel to the bit (each sum the float32
    GEMV's chain over the weights the blocks were packed from)."""
    model = q4_model(VARIANTS["gqa"], qtype=qtype)
    assert all(sorted(layer.decode_packs()) == [str(i) for i in MATRICES] for layer in model.layers)
    block_bytes = 24 if qtype == Q4_1 else 28
    for layer in model.layers:  # the blocks the grid holds: 4-bit, or 5-bit
        weights = layer.fused_weights()
        assert all(p.shape[-1] * 32 == weights[int(i)].shape[-1] * block_bytes for i, p in layer.decode_packs().items())
    packed, graphs, _ = decode_steps(model, 6, fused=True)
    assert graphs[-1].count("MlxtoyDecodeBlock") == len(model.layers)
    for got, ref in zip(packed, uncached_logits(model, packed)):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
    layer = model.layers[0]  # positive control: the decode reads the packs (other weights' packs, other logits)
    weights, packs = vars(layer)["mlxtoy_packs"]
    object.__setattr__(layer, "mlxtoy_packs", (weights, dict(packs, **{"1": fastmath.pack_lossless(2 * weights[1])})))
    other, _, _ = decode_steps(model, 1, fused=True)
    assert not np.array_equal(other[0], packed[0])
    fastmath.PACKED_DECODE = False  # the float32 matrices through the same kernel
    try:
        for layer in model.layers:
            object.__setattr__(layer, "mlxtoy_packs", None)
        assert all(layer.decode_packs() == {} for layer in model.layers)
        plain, _, _ = decode_steps(model, 6, fused=True)
    finally:
        fastmath.PACKED_DECODE = True
        for layer in model.layers:
            object.__setattr__(layer, "mlxtoy_packs", None)
    for got, ref in zip(packed, plain):
        np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("batch", [3, 10])  # rows a pass read from the blocks as they are; unpacked
def test_a_row_decoded_in_a_batch_against_packs_gets_the_bits_it_gets_alone(batch):
    """A served or GRPO row must not depend on the rows beside it: the same prompt decoded alone and
    among other rows (`BatchDecoder`), from Q4_1 blocks and a Q8_0 output matrix, step by step, bit
    for bit (the decode steps: prompts prefilled together may take other products' routes). (The packed GEMV once summed one row as d (x . q) + m sum(x) a block and several rows
    over the unpacked weights: 3e-5 apart in SmolLM2's logits.)"""
    from mlxtoy.engine import BatchDecoder, Request

    model = q4_model(VARIANTS["gqa"], qtype=Q4_1, head=True)
    assert sorted(model.layers[0].decode_packs()) == [str(i) for i in MATRICES] and model.decode_head_pack() is not None
    r = np.random.default_rng(3)
    others = [r.integers(1, 250, len(PROMPT)).tolist() for _ in range(batch - 1)]

    def steps(prompts: list[list[int]]) -> list[np.ndarray]:
        eng = BatchDecoder(model)
        for p in prompts:  # each prefilled alone (a prompt's rows in a product of other sizes take other routes)
            eng.add_many([(Request(p, 8), 1)])
        out = []
        for _ in range(6):
            eng.step()
            out.append(np.array(eng.rows[0].logits))
        return out

    alone, among = steps([PROMPT]), steps([PROMPT] + others)
    for a, b in zip(alone, among):
        np.testing.assert_array_equal(a, b)


def test_a_matrix_off_its_grid_leaves_the_others_of_its_block_packed():
    """A K-quant file mixes block types: one matrix that packs no grid (a Q5_K's 32 levels; here
    a weight one ulp off) stays float32 while the others beside it pack; the decode reads both
    forms in one block and gives the uncached forward's logits."""
    model = q4_model(VARIANTS["gqa"])
    q = model.layers[0].attn.q
    w = np.array(q.weight)
    w[0, 0] = np.nextafter(w[0, 0], np.float32(10))
    q.weight = mx.array(w)
    packs = model.layers[0].decode_packs()
    assert sorted(packs) == [str(i) for i in MATRICES if i != 1]  # (the build before packed none of this block)
    assert sorted(model.layers[1].decode_packs()) == [str(i) for i in MATRICES]  # control: an untouched block
    packed, graphs, _ = decode_steps(model, 4, fused=True)
    assert graphs[-1].count("MlxtoyDecodeBlock") == len(model.layers)
    for got, ref in zip(packed, uncached_logits(model, packed)):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)

def test_decode_from_q8_0_weights_and_a_packed_output_matrix():
    model = q4_model(VARIANTS["mha-qkv-bias"], qtype=Q8_0, head=True)
    packs = model.layers[0].decode_packs()
    assert sorted(packs) == [str(i) for i in MATRICES]
    assert packs["1"].shape[-1] == 64 // 32 * 34  # Q8_0's own blocks (a Q8_0 grid is no 4-bit one)
    head = model.decode_head_pack()
    assert head is not None and head.shape == (300, 64 // 32 * 34)
    x = mx.random.normal((1, 64))
    np.testing.assert_allclose(np.array(fastmath.linear_packed(x, head)),
                               np.array(x @ model.tok_embeddings.weight.T), rtol=1e-5, atol=1e-5)
    packed, graphs, _ = decode_steps(model, 6, fused=True)
    assert graphs[-1].count("MlxtoyDecodeBlock") == len(model.layers)
    for got, ref in zip(packed, uncached_logits(model, packed)):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="gemv_packed"):
        K.gemv_packed(mx.zeros((1, 64)), mx.zeros((300, 50), dtype=mx.uint8))


def test_decoding_from_packs_gives_the_same_bits_at_every_rows_a_pass(monkeypatch):
    """The rows of a packed matrix one row of x takes a pass (what `choose_row_passes` measures
    and sets) change only the order the rows are read in: every setting decodes the same logits to
    the bit, through the fused blocks and the packed output matrix, and the uncached forward's."""
    model = q4_model(VARIANTS["gqa"], qtype=Q8_0, head=True)
    runs = []
    for passes in ROW_PASSES:
        monkeypatch.setattr(generate_module, "choose_row_passes",
                            lambda layers, packs, n=passes: K.set_packed_row_pass("q8_0", n))
        try:
            logits, graphs, _ = decode_steps(model, 4, fused=True)
        finally:
            K.set_packed_row_pass("q8_0", 0)
        assert graphs[-1].count("MlxtoyDecodeBlock") == len(model.layers)
        runs.append(logits)
    for logits in runs[1:]:
        for got, want in zip(logits, runs[0]):
            np.testing.assert_array_equal(got, want)
    for got, ref in zip(runs[0], uncached_logits(model, runs[0])):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


def test_packs_follow_the_weights():
    """A generation after the weights change never decodes from the old packs: weights scaled by 2
    (still a grid: packed again), then moved off the grid (float32 again); checked against the
    uncached forward each time."""
    model = q4_model(VARIANTS["gqa"])
    prompt = PROMPT * 2

    def check() -> list[int]:
        tokens = [t for t, _ in generate_tokens(model, prompt, max_tokens=8)]
        logits = np.array(model(mx.array([prompt + tokens[:-1]]))[0, len(prompt) - 1:])
        for i, (a, b) in enumerate(zip(tokens, logits.argmax(-1).tolist())):
            top2 = np.sort(logits[i])[-2:]
            assert a == b or top2[1] - top2[0] < 1e-3, f"step {i}: {a} vs {b}"
        return tokens

    first = check()
    packs = model.layers[0].decode_packs()
    assert len(packs) == len(MATRICES)
    assert check() == first and model.layers[0].decode_packs() is packs  # kept across generations (and traces)
    model.update(tree_map(lambda p: p * 2.0, model.parameters()))
    mx.eval(model.parameters())
    doubled = check()
    again = model.layers[0].decode_packs()
    assert len(again) == len(MATRICES) and all(again[k] is not packs[k] for k in packs)
    r = np.random.default_rng(3)
    model.update(tree_map(lambda p: p + mx.array(1e-3 * r.standard_normal(p.shape).astype(np.float32)),
                          model.parameters()))
    mx.eval(model.parameters())
    moved = check()
    assert model.layers[0].decode_packs() == {}
    assert len({tuple(first), tuple(doubled), tuple(moved)}) >= 2  # positive control: the changes show
    model = q4_model(VARIANTS["gqa"], seed=1)  # packed, then given adapters: q and v merged, the rest packed
    check()
    assert model.layers[0].decode_packs()
    apply_lora(model, ["q", "v"], 4, 8.0)
    for layer in model.layers:
        layer.attn.v.lora_b = 0.2 * mx.random.normal(layer.attn.v.lora_b.shape)
    mx.eval(model.parameters())
    check()
    packs = model.layers[0].decode_packs()
    assert sorted(packs) == [str(i) for i in MATRICES]
    assert [k for k, w in packs.items() if w.dtype == mx.float32] == ["1", "3"]


def test_packs_stay_pinned_when_rows_join_the_batch(monkeypatch):
    """Rows joining a batch make the compiled decode trace again (another row count), which hands
    the model new objects for the same weights; the packs are then pinned to them, so the next
    join's prefill does not compare every weight by value (a whole model read per join)."""
    from mlxtoy.engine import BatchDecoder, Request
    from mlxtoy.models import fused_weights
    from mlxtoy.sampling import SamplingParams

    model = q4_model(VARIANTS["gqa"])
    compared = []
    equal = mx.array_equal
    monkeypatch.setattr(fused_weights.mx, "array_equal", lambda a, b: compared.append(1) or equal(a, b))
    engine = BatchDecoder(model)
    for joins in range(4):
        engine.add_many([(Request(PROMPT[: 3 + joins], 12, SamplingParams(), frozenset(), 0), 1)])
        for _ in range(3):
            engine.step()
        assert model.layers[0].mlxtoy_packs  # (the blocks decode from packs)
    assert engine.rows and len(compared) == 0
    # positive control: the same weights in new objects (as a trace hands over) are compared
    model.update(tree_map(lambda p: p + 0.0, model.parameters()))
    model.layers[0].decode_packs()
    assert len(compared) > 0


def prefill(model, rows: list[list[int]], history: int = 0) -> tuple[np.ndarray, list, str]:
    """Rows left-padded (`mlxtoy.engine`'s batch: starts, its mask), the first `history` columns
    read op by op, the rest in one call of the model's blocks with a KVCache -> (the hidden
    states of each row's real tokens in that call, the cache, the graph of that call)."""
    from mlxtoy.engine import padded_causal_mask

    width = max(map(len, rows))
    starts = mx.array([width - len(r) for r in rows], dtype=mx.int32)
    tokens = mx.array([[0] * (width - len(r)) + r for r in rows], dtype=mx.uint32)
    cache = make_cache(model)
    for c in cache:
        c.starts = starts
    mask = padded_causal_mask(starts, width)
    with fastmath.inference():
        if history:
            saved, prefill_module.PREFILL_FUSED_ROWS = prefill_module.PREFILL_FUSED_ROWS, 0
            try:
                mx.eval(model.hidden(tokens[:, :history], mask[..., :history, :history], cache))
            finally:
                prefill_module.PREFILL_FUSED_ROWS = saved
        h = model.hidden(tokens[:, history:], mask[..., history:, :], cache)
        graph = graph_text(h)
        mx.eval(h, [c.state for c in cache])
    h = np.array(h)
    # row b's real tokens among this call's: its last min(len, width - history)
    return [h[b, h.shape[1] - min(len(r), width - history):] for b, r in enumerate(rows)], cache, graph


@pytest.mark.parametrize("q4", [False, True], ids=["float32", "q4-packed"])
def test_a_short_prompt_is_prefilled_by_the_fused_blocks(q4, monkeypatch):
    """T tokens of each row in one call of each block (a short prompt, PREFILL_FUSED_ROWS): every
    real token's hidden state is the uncached forward's of its row alone, after a history read
    op by op too; the cache then decodes on. Rows of a left-padded batch (padding columns that
    see only themselves) each get what they get alone. Positive control: with the fused prefill
    off, the op-by-op blocks give the same values, and the graph shows which path ran."""
    # the fused call taken unmeasured (which is faster is test_routes's; here only its values)
    monkeypatch.setattr(prefill_module, "PREFILL_UNMEASURED_ROWS", prefill_module.PREFILL_FUSED_ROWS)
    model = q4_model(VARIANTS["mha-qkv-bias"]) if q4 else tiny(VARIANTS["gqa"])
    rows = [PROMPT, PROMPT[:5], PROMPT[3:12]]
    for history in (0, 3):
        got, cache, graph = prefill(model, rows, history)
        assert graph.count("MlxtoyDecodeBlock") == len(model.layers)
        for r, g in zip(rows, got):
            want = np.array(model.hidden(mx.array([r])))[0, len(r) - len(g):]
            np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-4)
        saved, prefill_module.PREFILL_FUSED_ROWS = prefill_module.PREFILL_FUSED_ROWS, 0
        try:
            ref, ref_cache, ref_graph = prefill(model, rows, history)
        finally:
            prefill_module.PREFILL_FUSED_ROWS = saved
        assert "MlxtoyDecodeBlock" not in ref_graph
        for g, w in zip(got, ref):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
        n, start = cache[0].offset, np.array(cache[0].starts)
        for c, u in zip(cache, ref_cache):  # the same keys and values at every real column
            for b, s0 in enumerate(start):
                np.testing.assert_allclose(np.array(c.keys[b, :, s0:n]), np.array(u.keys[b, :, s0:n]), atol=1e-4)
                np.testing.assert_allclose(np.array(c.values[b, :, s0:n]), np.array(u.values[b, :, s0:n]),
                                           atol=1e-4)
    # generation (whose prompt goes through the fused prefill) still decodes what the uncached model says
    tokens = [t for t, _ in generate_tokens(model, PROMPT, max_tokens=6)]
    logits = np.array(model(mx.array([PROMPT + tokens[:-1]]))[0, len(PROMPT) - 1:])
    for i, (a, b) in enumerate(zip(tokens, logits.argmax(-1).tolist())):
        assert a == b or np.sort(logits[i])[-1] - np.sort(logits[i])[-2] < 1e-3, f"step {i}"
