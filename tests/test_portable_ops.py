"""The ops Metal and CUDA run, checked on this CPU against the path the CPU takes.

On a GPU mlxtoy's model code dispatches to `mx.fast.scaled_dot_product_attention` (with the
causal, packing and sliding-window masks), `mx.fast.rms_norm`, `mx.fast.rope`, MLX's own SiLU
and `mx.quantized_matmul`; on the CPU the same calls take the x86 kernels (where built) or the
MLX-only forms in `fastmath` (a grouped attention with a polynomial exp, dequantized slabs for a
quantized base). `gpu_dispatch` below makes this process take the GPU's branches while MLX still
computes on the CPU, so the two sides differ only in which ops the code picks: forward values
and gradients must agree at float32 tolerance, through the compiled training step too. (What
this cannot check is Metal's or CUDA's own kernels for those ops: MLX tests those.)

CI runs these twice (`core`): with the kernels, and with MLXTOY_KERNELS=0.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import mlxtoy  # noqa: F401  (fast BLAS before mlx.core)
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxtoy import backend
from mlxtoy.config import TrainConfig
from mlxtoy.model_config import ModelConfig
from mlxtoy.models import attention, fastmath
from mlxtoy.models.llama import LlamaModel, block_causal_mask, window_mask
from mlxtoy.models.quant import QuantizedLinear, QuantPlan, quantize_dense, quantized_module

pytestmark = pytest.mark.core

B, H, KV, D = 2, 4, 2, 16


@pytest.fixture
def gpu_dispatch(monkeypatch):
    """Returns a function that switches this process to the branches a GPU takes (for the rest
    of the test): no CPU kernels, MLX's own exp/SiLU, mx.fast attention, mx.quantized_matmul."""
    def switch() -> dict[str, int]:
        """-> calls of each GPU op from now on (the branches did switch)."""
        monkeypatch.setattr(backend.INFO, "device", "cuda")  # every module asks this one object
        monkeypatch.setattr(backend.INFO, "kernels", None)
        calls = dict.fromkeys(GPU_OPS, 0)
        for name in GPU_OPS:
            owner = mx if name == "quantized_matmul" else mx.fast
            monkeypatch.setattr(owner, name, _counted(getattr(owner, name), name, calls))
        return calls

    return switch


GPU_OPS = ("scaled_dot_product_attention", "rms_norm", "rope", "quantized_matmul")


def _counted(f, name: str, calls: dict[str, int]):
    def wrapper(*args, **kwargs):
        calls[name] += 1
        return f(*args, **kwargs)
    return wrapper


def _qkv(T: int, S: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = mx.array(rng.standard_normal((B, H, T, D)).astype(np.float32))
    k = mx.array(rng.standard_normal((B, KV, S, D)).astype(np.float32))
    v = mx.array(rng.standard_normal((B, KV, S, D)).astype(np.float32))
    return q, k, v


def _segments(T: int) -> mx.array:
    # two documents in row 0, three in row 1 (one of them a single token)
    rows = [[0] * 13 + [1] * (T - 13), [0] * 5 + [1] + [2] * (T - 6)]
    return mx.array(np.array(rows, dtype=np.int32))


def _masks(T: int):
    """name -> (T, S, mask, offset) as the model builds them."""
    S = 24
    return {
        "causal": (T, T, "causal"),
        "packing": (T, T, block_causal_mask(_segments(T))),
        "window": (T, T, window_mask(None, 0, T, T, 8)),
        "window_and_packing": (T, T, window_mask(block_causal_mask(_segments(T)), 0, T, T, 8)),
        "chunk_after_cache": (4, S, "causal"),  # a prefill chunk: the last 4 of 24 positions
        "window_chunk_after_cache": (4, S, window_mask(None, S - 4, 4, S, 8)),
        "decode": (1, S, None),
        "decode_window": (1, S, window_mask(None, S - 1, 1, S, 8)),
    }


@pytest.mark.parametrize("name", list(_masks(32)))
def test_attention_equals_mx_fast_sdpa(name):
    """This process's attention (kernels, or the MLX-only grouped form) against the op Metal and
    CUDA call, forward and gradients, grouped-query heads."""
    T, S, mask = _masks(32)[name]
    q, k, v = _qkv(T, S)
    scale = D ** -0.5
    cot = mx.array(np.random.default_rng(1).standard_normal((B, H, T, D)).astype(np.float32))

    def ours(q, k, v):
        return (attention.attention(q, k, v, scale, mask) * cot).sum()

    def theirs(q, k, v):
        return (mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask) * cot).sum()

    a_out = attention.attention(q, k, v, scale, mask)
    b_out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    np.testing.assert_allclose(np.array(a_out), np.array(b_out), atol=2e-5, rtol=0)
    ga = mx.grad(ours, argnums=(0, 1, 2))(q, k, v)
    gb = mx.grad(theirs, argnums=(0, 1, 2))(q, k, v)
    for x, y, what in zip(ga, gb, "qkv"):
        np.testing.assert_allclose(np.array(x), np.array(y), atol=5e-5, rtol=0, err_msg=f"d{what}")
    # the masks matter here: with none the result differs (positive control)
    if not (isinstance(mask, str) or mask is None):
        plain = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal" if T == S else None)
        assert mx.abs(plain - b_out).max().item() > 1e-2


def _tiny(window: int | None = None, seed: int = 0) -> LlamaModel:
    cfg = ModelConfig(arch="llama", vocab_size=97, d_model=64, n_layers=2, n_heads=H, n_kv_heads=KV,
                      d_head=D, d_ff=128, norm_eps=1e-5, rope_base=10000.0, tie_embeddings=False,
                      context_length=256, sliding_window=window)
    model = LlamaModel(cfg)
    rng = np.random.default_rng(seed)
    params = []
    for name, p in tree_flatten(model.parameters()):
        if name.endswith("norm.weight"):
            v = 1.0 + 0.1 * rng.standard_normal(p.shape)
        elif p.ndim == 1:
            v = 0.1 * rng.standard_normal(p.shape)
        else:
            v = (1.0 if "embeddings" in name else 0.5 / math.sqrt(p.shape[-1])) * rng.standard_normal(p.shape)
        params.append((name, mx.array(v.astype(np.float32))))
    model.load_weights(params)
    mx.eval(model.parameters())
    return model


def _loss_and_grads(model: LlamaModel, tokens: mx.array, mask) -> tuple[float, dict]:
    def loss(tokens):
        logits = model(tokens[:, :-1], mask)
        return nn.losses.cross_entropy(logits, tokens[:, 1:]).mean()

    value, grads = nn.value_and_grad(model, loss)(tokens)
    mx.eval(value, grads)
    return value.item(), dict(tree_flatten(grads))


@pytest.mark.parametrize("window,packed", [(None, False), (None, True), (8, True)])
def test_model_on_the_gpu_branches_equals_this_path(gpu_dispatch, window, packed):
    """A tiny Llama (RMSNorm, RoPE, GQA attention, SwiGLU; with packing and a sliding window):
    the loss and every weight's gradient on this path and on the GPU's branches (compiled: the
    training step's test below)."""
    model = _tiny(window)
    model.unfreeze()
    tokens = mx.array(np.random.default_rng(2).integers(0, 97, (B, 33)).astype(np.int32))
    mask = block_causal_mask(_segments(32)) if packed else None
    here, grads_here = _loss_and_grads(model, tokens, mask)
    calls = gpu_dispatch()
    there, grads_there = _loss_and_grads(model, tokens, mask)
    assert all(calls[op] for op in ("scaled_dot_product_attention", "rms_norm", "rope")), calls
    assert abs(here - there) <= 1e-5 * abs(here)
    for name, g in grads_here.items():
        scale = max(np.abs(np.array(g)).max(), 1e-6)
        diff = np.abs(np.array(g) - np.array(grads_there[name])).max() / scale
        assert diff < 1e-4, (name, diff)


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 64), (8, 32)])
def test_quantized_product_equals_mx_quantized_matmul(gpu_dispatch, bits, group):
    """A quantized base's product and input gradient on this path (the kernels, or dequantized
    slabs) and on the GPU's (`mx.quantized_matmul`), per-head projection included."""
    rng = np.random.default_rng(3)
    w = mx.array(rng.standard_normal((48, 128)).astype(np.float32) / 8)
    packed, _ = quantize_dense(w, QuantPlan(bits, group))
    x = mx.array(rng.standard_normal((3, 5, 128)).astype(np.float32))
    cot = mx.array(rng.standard_normal((3, 5, 48)).astype(np.float32))
    layer = QuantizedLinear.of(packed.weight, packed.scales, packed.biases, group, bits)
    from mlxtoy.models.llama import HeadProjection

    heads = quantized_module(HeadProjection(128, 6, 8), packed)

    def run():
        f = lambda x: (layer(x) * cot).sum() + (heads(x).reshape(cot.shape) * cot).sum()  # noqa: E731
        y = layer(x)
        dx = mx.grad(f)(x)
        mx.eval(y, dx)
        return np.array(y), np.array(dx)

    y_here, dx_here = run()
    calls = gpu_dispatch()
    y_there, dx_there = run()
    assert calls["quantized_matmul"], calls
    dense = np.array(x) @ np.array(packed.dense()).T
    np.testing.assert_allclose(y_here, dense, atol=1e-4, rtol=0)
    np.testing.assert_allclose(y_here, y_there, atol=1e-4, rtol=0)
    np.testing.assert_allclose(dx_here, dx_there, atol=2e-4, rtol=0)


def test_compiled_lora_step_on_the_gpu_branches(gpu_dispatch):
    """The compiled training step (forward, fused loss, backward, clipping, AdamW) with LoRA on a
    packed batch: the same loss, gradient norm and adapters after two steps either way."""
    from mlxtoy.train.build import make_trainable
    from mlxtoy.train.data import Batch
    from mlxtoy.train.step import Stepper, make_optimizer

    rng = np.random.default_rng(4)
    x = rng.integers(0, 97, (B, 33)).astype(np.int32)
    weights = np.ones((B, 32), np.float32)
    segs = np.array(_segments(32))
    batch = Batch(x[:, :-1], x[:, 1:], weights, segs, 0, int(weights.sum()))

    def two_steps():
        model = _tiny(8)
        cfg = TrainConfig(method="lora", lora_targets=["q", "v", "down"], lora_rank=4, lr=1e-2, steps=2,
                          warmup=0, grad_clip=1.0, seed=0)
        mx.random.seed(0)
        make_trainable(model, cfg)
        opt = make_optimizer(cfg)
        opt.init(model.trainable_parameters())
        stepper = Stepper(model, opt, cfg, packed=True)
        out = []
        for _ in range(2):
            loss, gnorm = stepper([batch])
            mx.eval(loss, gnorm)
            out.append((loss.item(), gnorm.item()))
        return out, {k: np.array(v) for k, v in tree_flatten(model.trainable_parameters())}

    here, adapters_here = two_steps()
    calls = gpu_dispatch()
    there, adapters_there = two_steps()
    assert all(calls[op] for op in ("scaled_dot_product_attention", "rms_norm", "rope")), calls
    np.testing.assert_allclose(np.array(here), np.array(there), rtol=1e-5)
    assert here[1][0] != here[0][0]  # the first step changed the adapters
    for name, a in adapters_here.items():
        np.testing.assert_allclose(a, adapters_there[name], atol=1e-5, rtol=0, err_msg=name)


def test_decoding_on_the_gpu_branches_reads_the_cache_unmasked(gpu_dispatch, monkeypatch):
    """Generation on a GPU builds each one-token step over the cache's exact length with no
    mask (CUDA's one-query attention kernel takes no array mask), where the CPU runs a compiled
    step over the cache's whole buffer with a mask: the same greedy tokens and logprobs."""
    from mlxtoy.generate import generate_tokens

    model = _tiny(None)
    prompt = [int(t) for t in np.random.default_rng(5).integers(0, 97, 17)]
    here = list(generate_tokens(model, prompt, max_tokens=12))
    gpu_dispatch()
    seen = []  # (query positions, key positions, mask) of each attention call
    sdpa = mx.fast.scaled_dot_product_attention

    def recording(q, k, v, *, scale, mask=None, **kwargs):
        seen.append((q.shape[2], k.shape[2], mask))
        return sdpa(q, k, v, scale=scale, mask=mask, **kwargs)

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", recording)
    there = list(generate_tokens(model, prompt, max_tokens=12))
    assert [t for t, _ in there] == [t for t, _ in here]
    np.testing.assert_allclose([p for _, p in there], [p for _, p in here], atol=1e-4)
    steps = [(keys, mask) for queries, keys, mask in seen if queries == 1]
    assert all(mask is None for _, mask in steps), [type(m) for _, m in steps]
    layers = len(model.layers)
    assert sorted({keys for keys, _ in steps}) == list(range(len(prompt) + 1, len(prompt) + 12))
    assert len(steps) == 11 * layers


def test_a_gguf_base_built_for_the_gpu_holds_its_scales_in_the_compute_dtype(tmp_path, monkeypatch, gpu_dispatch):
    """Built for a GPU, a Q8_0 GGUF's quantized projections hold their float16 scales and biases
    in the compute dtype, so no product casts them (the embedding's lookup keeps its own, as on
    the CPU); the logits are those of the same file built on the CPU, whose products cast them
    each time, bit for bit."""
    from helpers_export import write_tiny_gguf

    from mlxtoy.loading import load

    path = write_tiny_gguf(str(tmp_path / "tiny-q8_0.gguf"), _tiny(None), "q8_0")
    tokens = mx.array([[3, 14, 15, 92, 65, 35, 89, 79]])
    cpu_built, _ = load(path, quant=QuantPlan(), dtype=mx.bfloat16)
    kept = [m for _, m in cpu_built.named_modules() if hasattr(m, "scales")]
    assert kept and all(m.scales.dtype == mx.float16 for m in kept)
    calls = gpu_dispatch()
    want = cpu_built(tokens)
    assert calls["quantized_matmul"]
    gpu_built, _ = load(path, quant=QuantPlan(), dtype=mx.bfloat16)
    held = [m for n, m in gpu_built.named_modules() if hasattr(m, "scales") and n != "tok_embeddings"]
    assert len(held) == len(kept) - 1 and all(m.scales.dtype == m.biases.dtype == mx.bfloat16 for m in held)
    scale_shapes = {m.scales.shape for m in held}
    casts = []  # the projections' scales or biases cast in a forward (the embedding's lookup aside)
    astype = mx.array.astype
    monkeypatch.setattr(mx.array, "astype", lambda a, *args, **kw: (
        casts.append(a.shape) if a.dtype == mx.float16 and a.shape in scale_shapes else None) or astype(a, *args, **kw))
    cpu_built(tokens)
    assert len(casts) == 2 * len(held), "the control: built on the CPU, each product casts both"
    casts.clear()
    got = gpu_built(tokens)
    assert not casts, casts
    assert got.dtype == mx.bfloat16 and mx.array_equal(got, want).item()


@pytest.mark.parametrize("slab_rows,qmm_calls", [(0, True), (8, False), (64, True)])
def test_gpu_slab_rows_sends_many_rows_through_dequantized_slabs(gpu_dispatch, monkeypatch, slab_rows, qmm_calls):
    """MLXTOY_GPU_SLAB_ROWS (an experiment for GPUs): products of at least that many rows, and
    their input gradients, dequantize slabs into the dense matmul instead of calling
    mx.quantized_matmul, with the same values; fewer rows (15 here, against 64) keep it."""
    from mlxtoy.models import quant

    rng = np.random.default_rng(6)
    w = mx.array(rng.standard_normal((48, 128)).astype(np.float32) / 8)
    packed, _ = quantize_dense(w, QuantPlan(4, 32))
    layer = QuantizedLinear.of(packed.weight, packed.scales, packed.biases, 32, 4)
    x = mx.array(rng.standard_normal((3, 5, 128)).astype(np.float32))
    cot = mx.array(rng.standard_normal((3, 5, 48)).astype(np.float32))
    calls = gpu_dispatch()
    monkeypatch.setattr(quant, "GPU_SLAB_ROWS", slab_rows)
    y, dx = layer(x), mx.grad(lambda x: (layer(x) * cot).sum())(x)
    mx.eval(y, dx)
    assert bool(calls["quantized_matmul"]) == qmm_calls, calls
    dense = np.array(packed.dense(), np.float64)
    np.testing.assert_allclose(np.array(y), np.array(x, np.float64) @ dense.T, atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.array(dx), np.array(cot, np.float64) @ dense, atol=2e-4, rtol=0)
