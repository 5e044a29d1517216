"""Generation from a quantized base: the kernels' fused quantized GEMV (decoding's few rows of x)
against numpy float64 with a positive control, greedy generation from the quantized base equal to
generation from the dequantized float32 model (kernels and MLX-only paths), llama.cpp's top token
on a Q4_0 GGUF, and `generate --adapter RUN` of a QLoRA run keeping the base quantized with the
adapters unmerged on top."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxtoy import backend, cpublas, loading
from mlxtoy.generate import generate_tokens
from mlxtoy.inference import inference_quant
from mlxtoy.io.gguf_read import load_gguf
from mlxtoy.io.quantize import quantize_gguf
from mlxtoy.loading import build_model, kept_exactly, load, run_quant_plan, source_size
from mlxtoy.models import fastmath, quant
from mlxtoy.models.lora import LORA_TYPES
from mlxtoy.models.quant import QUANTIZED_TYPES, QuantPlan
from mlxtoy.train import memory
from tests.helpers_export import VOCAB, tiny_model as export_model, write_tiny_gguf
from tests.helpers_train import tiny_model

needs_kernels = pytest.mark.skipif(not fastmath.kernels_on(), reason=f"the CPU kernels are off here: "
                                                                f"{fastmath.kernels_status()}")


def _quantized(rows: int, d_in: int, bits: int, group: int, dtype, seed: int):
    w = mx.array(np.random.default_rng(seed).standard_normal((rows, d_in)).astype(np.float32))
    q, scales, biases = mx.quantize(w, group, bits)
    return q, scales.astype(dtype), biases.astype(dtype)


def _dense64(q, scales, biases, group, bits) -> np.ndarray:
    return np.array(mx.dequantize(q, scales.astype(mx.float32), biases.astype(mx.float32), group, bits)
                    ).astype(np.float64)


def _x_rounding_bound(x, q, scales, biases, group, bits: int = 4) -> np.ndarray:
    """The most that rounding x to 16 bits per group of 32 (the integer forms') can move each
    output: sum_g |scale_g| sum_k q_k max|x_g| / 65278, q the integer levels (0..2^bits - 1)."""
    s = np.array(scales.astype(mx.float32)).astype(np.float64)  # (N, groups)
    b = np.array(biases.astype(mx.float32)).astype(np.float64)
    dense = _dense64(q, scales, biases, group, bits)
    levels = np.rint((dense - np.repeat(b, group, 1)) / np.repeat(s, group, 1))  # (N, K)
    xmax = np.abs(x.reshape(x.shape[0], -1, group)).max(-1)  # (rows, groups)
    qsum = levels.reshape(levels.shape[0], -1, group).sum(-1)  # (N, groups)
    return (xmax / 65278) @ (np.abs(s) * qsum).T


def _rounds_x(bits: int, group: int) -> bool:
    """Whether the GEMV rounds x to 16 bits for this W here: 4 bits in groups of 32 in either
    integer form (AVX-512 VNNI, AVX2), 8 bits in groups of 32 in the VNNI form only."""
    if group != 32:
        return False
    return fastmath.quant_vnni() or (bits == 4 and fastmath.kernels_module().quant_x16_ok())


@needs_kernels
@pytest.mark.core
@pytest.mark.parametrize("bits,group", [(4, 32), (4, 64), (8, 32), (8, 64)])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_quantized_gemv_matches_numpy(bits, group, dtype):
    """1-4 rows of x (the GEMV; 67 rows of W: a tail past the passes of 4 rows; 20 groups of 32:
    a tail past the bias dot's 16 lanes) against float64, and one changed weight is seen. 4 bits
    in groups of 32 (a Q4_0/Q4_1 GGUF's) take the VNNI form where the CPU has it: x rounded to 16
    bits per group, within that rounding's bound, and so do 8 bits in groups of 32 (a Q8_0 output
    layer's) with VNNI; the rest float32 sums, within a few eps. Groups of 32 also at widths whose
    last VNNI block of 4 groups holds 1, 2 or 3 (544, 576 as SmolLM2's, 608)."""
    rng = np.random.default_rng(7)
    for width in (640, 544, 576, 608) if group == 32 else (640,):
        q, scales, biases = _quantized(67, width, bits, group, dtype, seed=bits + group)
        dense = _dense64(q, scales, biases, group, bits)
        for rows in (1, 2, 3, 4):
            x = rng.standard_normal((rows, width)).astype(np.float32)
            y = quant.quant_linear(mx.array(x[:, None]), q, scales, biases, group, bits)  # (rows, 1, 67)
            assert y.shape == (rows, 1, 67) and y.dtype == mx.float32
            # float32 sums of `width` terms: within a few eps of sum |x_k w_k|
            bound = 1e-6 * (np.abs(x).astype(np.float64) @ np.abs(dense).T)
            if _rounds_x(bits, group):
                bound = bound + _x_rounding_bound(x, q, scales, biases, group, bits)
            assert (np.abs(np.array(y)[:, 0] - x.astype(np.float64) @ dense.T) <= bound).all()
    # positive control: one word of row 66 (the tail) changed -> that output, and only it, moves
    bad = np.array(q)
    bad[66, 3] ^= 0x0F0F0F0F if bits == 4 else 0x7F7F7F7F
    y_bad = np.array(quant.quant_linear(mx.array(x), mx.array(bad), scales, biases, group, bits))
    y_ok = np.array(quant.quant_linear(mx.array(x), q, scales, biases, group, bits))
    assert np.abs(y_bad[:, 66] - y_ok[:, 66]).max() > 1e-2
    np.testing.assert_array_equal(y_bad[:, :66], y_ok[:, :66])


@needs_kernels
@pytest.mark.core
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("width", [640, 576])
def test_a_prompt_takes_the_rounded_gemv_at_inference(bits, symmetric, width):
    """At inference a prompt's rows (more than decoding's 4; 5 to 37: tails past the fours and the
    tiles of 16 rows of W) take the GEMV too (4 bits: the VNNI form, or AVX2's integer form; 8 bits:
    the VNNI form, else the float one; these products are too small to be measured against the
    slabs), within x's 16-bit rounding of float64, each row the bits it gets alone (decoded in a
    batch or not); outside inference, or past the most rows the form takes, the exact slab
    product; a changed weight moves its output only. 576: a partial last VNNI block (SmolLM2's
    width)."""
    q, scales, biases = _quantized(67, width, bits, 32, mx.float16, seed=11)
    if symmetric:  # Q4_0's / Q8_0's blocks: levels - 2^(bits - 1) times the scale
        biases = (-(2 ** (bits - 1)) * scales.astype(mx.float32)).astype(mx.float16)
    dense = _dense64(q, scales, biases, 32, bits)
    rng = np.random.default_rng(12)
    for rows in (5, 9, 37):
        x = rng.standard_normal((rows, width)).astype(np.float32)
        want = x.astype(np.float64) @ dense.T
        eps = 1e-6 * (np.abs(x).astype(np.float64) @ np.abs(dense).T)
        with fastmath.inference():
            y = np.array(quant.quant_linear(mx.array(x), q, scales, biases, 32, bits, symmetric))
            alone = [np.array(quant.quant_linear(mx.array(x[i:i + 1]), q, scales, biases, 32, bits, symmetric))
                     for i in range(rows)]
        np.testing.assert_array_equal(y, np.concatenate(alone))
        exact = np.array(quant.quant_linear(mx.array(x), q, scales, biases, 32, bits))  # slabs
        assert (np.abs(exact - want) <= eps).all()
        assert (np.abs(y - want) <= eps + _x_rounding_bound(x, q, scales, biases, 32, bits)).all()
        if _rounds_x(bits, 32):  # rounded: not the slab product's
            assert np.abs(y - exact).max() > 0
    most = fastmath.kernels_module().quant_gemv_max_rows(width, 32, bits)
    # a partial last block takes the form whole blocks take (VNNI's bound, not AVX2's)
    assert most == fastmath.kernels_module().quant_gemv_max_rows(640, 32, bits)
    if most > 4:  # past the most rows the rounded form takes: the slabs
        many = mx.array(rng.standard_normal((most + 1, width)).astype(np.float32))
        with fastmath.inference():
            y_many = quant.quant_linear(many, q, scales, biases, 32, bits, symmetric)
        np.testing.assert_array_equal(np.array(y_many), np.array(quant.quant_linear(many, q, scales, biases, 32, bits)))
    bad = np.array(q)
    bad[66, 3] ^= 0x0F0F0F0F if bits == 4 else 0x7F7F7F7F
    with fastmath.inference():
        y_bad = np.array(quant.quant_linear(mx.array(x), mx.array(bad), scales, biases, 32, bits, symmetric))
    assert np.abs(y_bad[:, 66] - y[:, 66]).max() > 1e-2
    np.testing.assert_array_equal(y_bad[:, :66], y[:, :66])


@needs_kernels
@pytest.mark.core
@pytest.mark.parametrize("bits,group", [(8, 64), (4, 64)])
def test_a_batch_s_rows_take_the_float_gemv_each_with_the_bits_it_gets_alone(bits, group):
    """At inference, rows past decoding's 4 (5 to 37: passes of 4 and a tail) against a W with no
    integer form (groups of 64, as mlx-lm quantizes; 8 bits in groups of 32, a Q8_0 layer's, where
    the CPU has no VNNI: test_a_prompt_takes_the_rounded_gemv_at_inference) take
    the float32 GEMV four rows a pass: each row's outputs are the bits that row gets alone, within
    float32 rounding of float64. Past the most rows it takes: the slabs. The slabs' SGEMM (outside
    inference, what these rows took before) sums in another order: the positive control."""
    q, scales, biases = _quantized(67, 640, bits, group, mx.float16, seed=bits + group)
    dense = _dense64(q, scales, biases, group, bits)
    rng = np.random.default_rng(13)
    for rows in (5, 9, 37):
        x = rng.standard_normal((rows, 640)).astype(np.float32)
        with fastmath.inference():
            y = np.array(quant.quant_linear(mx.array(x), q, scales, biases, group, bits))
            alone = [np.array(quant.quant_linear(mx.array(x[i:i + 1]), q, scales, biases, group, bits))
                     for i in range(rows)]
        np.testing.assert_array_equal(y, np.concatenate(alone))
        eps = 1e-6 * (np.abs(x).astype(np.float64) @ np.abs(dense).T)
        assert (np.abs(y - x.astype(np.float64) @ dense.T) <= eps).all()
        slabs = np.array(quant.quant_linear(mx.array(x), q, scales, biases, group, bits))
        assert not np.array_equal(slabs, y)
    most = fastmath.kernels_module().quant_gemv_max_rows(640, group, bits)
    assert most > 4
    many = mx.array(rng.standard_normal((most + 1, 640)).astype(np.float32))
    with fastmath.inference():
        y_many = quant.quant_linear(many, q, scales, biases, group, bits)
    np.testing.assert_array_equal(np.array(y_many), np.array(quant.quant_linear(many, q, scales, biases, group, bits)))


@needs_kernels
@pytest.mark.core
@pytest.mark.parametrize("dtype", [mx.float16, mx.float32])
def test_symmetric_gemv_leaves_the_biases_unread(dtype):
    """A Q4_0 / Q8_0 block's biases are -2^(bits - 1) scales; `symmetric` says so, and the GEMV
    then computes their part from the scales: equal to float64 within the same bound, and (the
    control) given wrong biases it still does, where the general form follows them."""
    for bits in (4, 8):
        rng = np.random.default_rng(bits)
        levels = rng.integers(0, 2 ** bits, (67, 640)).astype(np.float32)
        scales = rng.uniform(0.01, 0.05, (67, 640 // 32)).astype(np.float32)
        w = (levels - 2 ** (bits - 1)) * np.repeat(scales, 32, 1)  # exactly symmetric blocks
        # MLX's packing: element j of a uint32 at bits (j % (32 / bits)) * bits, little-endian
        u8 = levels.astype(np.uint8)
        q = mx.array((u8[:, 0::2] | (u8[:, 1::2] << 4) if bits == 4 else u8).copy().view("<u4"))
        s, b = mx.array(scales).astype(dtype), (-(2 ** (bits - 1)) * mx.array(scales)).astype(dtype)
        if dtype == mx.float16:
            w = (levels - 2 ** (bits - 1)) * np.repeat(np.array(s.astype(mx.float32)), 32, 1)
        dense = _dense64(q, s, b, 32, bits)
        np.testing.assert_allclose(dense, w, atol=1e-6)
        x = rng.standard_normal((1, 640)).astype(np.float32)
        want = x.astype(np.float64) @ dense.T
        bound = 1e-6 * (np.abs(x).astype(np.float64) @ np.abs(dense).T)
        if _rounds_x(bits, 32):
            bound = bound + _x_rounding_bound(x, q, s, b, 32, bits)
        y = np.array(quant.quant_linear(mx.array(x), q, s, b, 32, bits, symmetric=True))
        assert (np.abs(y - want) <= bound).all()
        wrong = b + 1.0
        general = np.array(quant.quant_linear(mx.array(x), q, s, wrong, 32, bits))
        sym = np.array(quant.quant_linear(mx.array(x), q, s, wrong, 32, bits, symmetric=True))
        assert np.abs(general - want).max() > 1.0  # the general form reads the biases
        if _rounds_x(bits, 32):  # the integer forms
            assert (np.abs(sym - want) <= bound).all()  # the symmetric one does not


@pytest.mark.core
def test_q4_0_and_q8_0_bases_are_marked_symmetric(gguf_models):
    """The loader marks the modules it kept from Q4_0 / Q8_0 blocks, and no others."""
    for kind in ("q4_0", "q8_0"):
        model, _ = load(gguf_models[kind], quant=QuantPlan())
        mods = [m for _, m in model.named_modules() if isinstance(m, QUANTIZED_TYPES)]
        assert mods and all(m.symmetric for m in mods)
    packed = quant.quantize_dense(mx.ones((8, 64)), QuantPlan())[0]
    assert not packed.symmetric


_FLOAT_FORM = r"""
import json, sys
import numpy as np, mlx.core as mx
import mlxtoy
from mlxtoy.models import quant
w = mx.array(np.random.default_rng(0).standard_normal((67, 640)).astype(np.float32))
q, s, b = mx.quantize(w, 32, 4)
x = mx.array(np.random.default_rng(1).standard_normal((1, 640)).astype(np.float32))
print(json.dumps(np.array(quant.quant_linear(x, q, s.astype(mx.float16), b.astype(mx.float16), 32, 4)).tolist()))
"""


@needs_kernels
def test_the_float_form_of_the_4_bit_gemv_is_exact_to_float32_rounding():
    """MLXTOY_KERNEL_VNNI=0 (read once, so in a process of its own): 4-bit/g32 decoding in float32
    sums, within a few eps of float64; the default (x rounded to 16 bits: VNNI where the CPU has it,
    else the AVX2 integer form) agrees within that rounding, and differs from the float form where
    either runs (the switch reached the kernel)."""
    import json
    import os
    import subprocess
    import sys

    def run(env):
        out = subprocess.run([sys.executable, "-c", _FLOAT_FORM], capture_output=True, text=True, check=True,
                             env=os.environ | env)
        return np.array(json.loads(out.stdout.strip().splitlines()[-1]))

    w = mx.array(np.random.default_rng(0).standard_normal((67, 640)).astype(np.float32))
    q, s, b = mx.quantize(w, 32, 4)
    s, b = s.astype(mx.float16), b.astype(mx.float16)
    x = np.random.default_rng(1).standard_normal((1, 640)).astype(np.float32)
    dense = _dense64(q, s, b, 32, 4)
    want = x.astype(np.float64) @ dense.T
    plain, default = run({"MLXTOY_KERNEL_VNNI": "0"}), run({})
    assert (np.abs(plain - want) <= 1e-6 * (np.abs(x) @ np.abs(dense).T)).all()
    assert (np.abs(default - want) <= 1e-6 * (np.abs(x) @ np.abs(dense).T) + _x_rounding_bound(x, q, s, b, 32)).all()
    if "avx2" in cpublas.cpu_features()[1]:
        assert not np.array_equal(plain, default)


@pytest.mark.core
@pytest.mark.parametrize("bits,group", [(4, 32), (8, 64)])
def test_mlx_only_decode_product_matches_numpy(bits, group):
    """The product decoding takes where the kernels are off (MLX's ops, slab by slab)."""
    q, scales, biases = _quantized(48, 256, bits, group, mx.float16, seed=3)
    x = np.random.default_rng(4).standard_normal((1, 1, 256)).astype(np.float32)
    y = quant.slab_product(group, bits)(mx.array(x), q, scales, biases)
    np.testing.assert_allclose(np.array(y)[0], x[0].astype(np.float64) @ _dense64(q, scales, biases, group, bits).T,
                               rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def gguf_models(tmp_path_factory):
    """A tiny llama (GQA, d_model 64) as Q8_0 (our writer) and as Q4_0 (llama.cpp's quantizer)."""
    root = tmp_path_factory.mktemp("qdecode")
    model = export_model("llama_gqa", seed=5)
    q8 = write_tiny_gguf(str(root / "tiny-q8_0.gguf"), model, "q8_0")
    f32 = write_tiny_gguf(str(root / "tiny-f32.gguf"), model, "f32")
    q4 = quantize_gguf(f32, str(root / "tiny-q4_0.gguf"), "q4_0")
    # widths that are multiples of 128 (the 4-bit GEMV's VNNI blocks of 4 groups)
    wide = tiny_model(9, vocab_size=VOCAB, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2,
                      d_head=32, d_ff=384)
    wide_f32 = write_tiny_gguf(str(root / "wide-f32.gguf"), wide, "f32")
    wide_q4 = quantize_gguf(wide_f32, str(root / "wide-q4_0.gguf"), "q4_0")
    return {"q8_0": q8, "q4_0": q4, "f32": f32, "wide-q4_0": wide_q4}


def _greedy(model, prompt, n=24):
    return [t for t, _ in generate_tokens(model, prompt, max_tokens=n)]


@pytest.mark.core
@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "wide-q4_0"])
def test_greedy_generation_from_the_quantized_base_equals_the_dequantized_model(gguf_models, kind, monkeypatch):
    path = gguf_models[kind]
    qmodel, _ = load(path, quant=QuantPlan())
    dmodel, _ = load(path)
    assert sum(isinstance(m, QUANTIZED_TYPES) for _, m in qmodel.named_modules()) >= 7 * qmodel.config.n_layers
    assert not any(isinstance(m, QUANTIZED_TYPES) for _, m in dmodel.named_modules())
    prompt = list(range(40, 60))
    want = _greedy(dmodel, prompt)
    # with the kernels, a 4-bit base's blocks decode fused, reading its matrices as they are, and
    # an 8-bit one's where the GEMV has its integer form (VNNI)
    bits = 8 if kind == "q8_0" else 4
    fused = fastmath.kernels_on() and fastmath.affine_decode_ok(qmodel.config.d_model, bits)
    assert (qmodel.layers[0].fused_modules() is not None) == fused
    assert _greedy(qmodel, prompt) == want
    # the same op by op (quant_linear's GEMV), and from the MLX-only product (slab_product: what
    # runs without the kernels)
    monkeypatch.setattr(fastmath, "FUSED_DECODE", False)
    assert _greedy(qmodel, prompt) == want
    monkeypatch.setattr(quant, "quant_linear_ok", lambda x: False)
    assert _greedy(qmodel, prompt) == want
    # positive control: another prompt gives another continuation (the comparison can fail)
    assert _greedy(dmodel, list(range(100, 120))) != want


@pytest.mark.core
@pytest.mark.parametrize("kind", ["q4_0", "wide-q4_0"])
def test_llama_cpp_top_token_agrees_on_a_q4_0_gguf(gguf_models, kind):
    """llama.cpp multiplies Q4_0 by 8-bit activations, so its logits differ from ours by a little:
    its top token agrees wherever ours leads by a clear margin, and our first decoded token (the
    quantized model's decode step) is its top token after the prompt."""
    from tests.helpers_export import llama_cpp_logits

    path = gguf_models[kind]
    qmodel, _ = load(path, quant=QuantPlan())
    tokens = list(range(40, 80))
    ours = np.array(qmodel(mx.array([tokens]))[0])
    theirs = llama_cpp_logits(path, tokens)
    top2 = np.sort(ours, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 0.02 * (ours.max(-1) - ours.min(-1))
    assert clear.sum() >= len(tokens) // 2
    np.testing.assert_array_equal(ours.argmax(-1)[clear], theirs.argmax(-1)[clear])
    assert np.abs(ours - theirs).max() < 0.05 * np.abs(theirs).max()
    first = _greedy(qmodel, tokens, n=1)[0]
    assert first == int(ours[-1].argmax())
    if clear[-1]:
        assert first == int(theirs[-1].argmax())


@pytest.mark.core
def test_generate_from_a_qlora_run_keeps_the_base_quantized(gguf_models, tmp_path):
    """`load(..., quant=<the run's plan>)` (what `generate --adapter RUN` takes by default for a QLoRA run):
    the base quantized as the run trained it, the adapters unmerged on top, the same logits as
    the dense merged model; `--quantized off` gives that dense model; the CLI runs both."""
    from mlxtoy.config import TrainConfig
    from tests.helpers_train import qa_rows, run_cli, run_training, write_jsonl

    data = write_jsonl(str(tmp_path / "data.jsonl"), qa_rows(16))
    run = str(tmp_path / "run")
    cfg = TrainConfig(model=gguf_models["q8_0"], data=data, out=run, method="lora", steps=3, batch_size=2,
                      seq_len=32, lr=1e-2, warmup=1, eval_every=0, save_every=0, qlora="on", seed=0,
                      lora_targets=["q", "v", "down"])
    assert run_training(cfg, handle_sigint=False).reason == "finished"
    plan = run_quant_plan(run)  # the run's bits and group size (the file's Q8_0 blocks keep their own)
    assert plan is not None and inference_quant(None, run) == plan
    assert inference_quant(None, run, "off") is None
    qmodel, _ = load(gguf_models["q8_0"], adapter=run, quant=plan)
    dense, _ = load(gguf_models["q8_0"], adapter=run)
    adapters = [m for _, m in qmodel.named_modules() if isinstance(m, LORA_TYPES)]
    assert len(adapters) == 3 * qmodel.config.n_layers
    assert all(isinstance(m.base, QUANTIZED_TYPES) for m in adapters)
    assert not any(isinstance(m, (*LORA_TYPES, *QUANTIZED_TYPES)) for _, m in dense.named_modules())
    tokens = mx.array([list(range(30, 62))])
    np.testing.assert_allclose(np.array(qmodel(tokens)), np.array(dense(tokens)), rtol=1e-4, atol=1e-4)
    prompt = list(range(30, 50))
    assert _greedy(qmodel, prompt, 12) == _greedy(dense, prompt, 12)
    for extra in ([], ["--quantized", "off"]):
        res = run_cli("generate", "--adapter", run, "--prompt", "12 plus one is", "--max-tokens", "4", *extra)
        assert res.returncode == 0 and "error" not in res.stderr, res.stderr


def test_a_dense_base_too_large_is_refused_before_loading(gguf_models, monkeypatch):
    """`--quantized off` on a model whose float32 weights exceed the memory: one error line naming
    `--quantized on`, from the header alone; auto keeps it quantized instead."""
    from mlxtoy.errors import UserError

    path = gguf_models["q4_0"]
    monkeypatch.setenv(memory.MEMORY_ENV, "0.0001")  # 100 kB
    with pytest.raises(UserError) as err:
        inference_quant(path, None, "off")
    assert "\n" not in str(err.value) and "--quantized on" in str(err.value)
    assert isinstance(inference_quant(path, None, "auto"), QuantPlan)
    monkeypatch.setenv(memory.MEMORY_ENV, "64")  # positive control: room enough, dense
    assert inference_quant(path, None, "auto") is None and inference_quant(path, None, "off") is None
    assert isinstance(inference_quant(path, None, "on"), QuantPlan)


@pytest.mark.core
def test_auto_keeps_a_file_s_own_blocks_quantized_where_that_decodes_faster(gguf_models, monkeypatch):
    """`--quantized auto` with room enough for the dense model: a file whose blocks load as they
    are (Q4_0, Q8_0) stays quantized on a CPU with the kernels once the model is large enough
    (the threshold lowered to the tiny model's size here); below it, without the kernels, or for
    a float file, the dense model."""
    monkeypatch.setenv(memory.MEMORY_ENV, "64")
    f32 = gguf_models["f32"]
    assert kept_exactly(gguf_models["q4_0"]) and kept_exactly(gguf_models["q8_0"]) and not kept_exactly(f32)
    params = source_size(gguf_models["q4_0"])[0]
    monkeypatch.setattr(loading, "QUANTIZED_DECODE_PARAMS", params + 1)  # just too small: dense
    assert inference_quant(gguf_models["q4_0"], None, "auto") is None
    monkeypatch.setattr(loading, "QUANTIZED_DECODE_PARAMS", params)
    for kind in ("q4_0", "q8_0"):
        plan = inference_quant(gguf_models[kind], None, "auto")
        assert isinstance(plan, QuantPlan) if fastmath.kernels_on() else plan is None
    assert inference_quant(f32, None, "auto") is None  # float weights: quantizing would change them
    assert inference_quant(gguf_models["q4_0"], None, "off") is None
    monkeypatch.setattr(backend.INFO, "kernels", None)  # MLX-only CPU: slabs per product, dense is faster
    assert inference_quant(gguf_models["q4_0"], None, "auto") is None
