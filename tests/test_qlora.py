"""QLoRA bases that stay quantized: GGUF blocks mapped to MLX's affine layout bit for bit, the
CPU product (dequantized slabs + the float32 GEMM) against numpy float64, a QLoRA model against
the dequantized model and finite differences, and a streaming load whose peak memory is bounded
(with an eager float32 load as the positive control)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import gguf
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from mlxtoy.io import gguf_file
from mlxtoy.io.gguf_file import GGUFTensor, affine_blocks
from mlxtoy.io.gguf_read import load_gguf
from mlxtoy.io.gguf_write import write_gguf
from mlxtoy.io.quantize import quantize_gguf
from mlxtoy.loading import build_model, planned_model
from mlxtoy.models import fastmath, quant
from mlxtoy.models.lora import apply_lora, lora_parameters
from mlxtoy.train.logprobs import output_layer, token_losses
from mlxtoy.models.quant import (PackedMatrix, QuantizedHeadProjection, QuantizedLinear, QuantPlan,
                                 quantized_linear)
from tests.helpers_export import tiny_model as export_model, write_tiny_gguf
from tests.helpers_train import byte_tokenizer, tiny_model

Q = gguf.GGMLQuantizationType
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tensor(arr: np.ndarray, qtype) -> GGUFTensor:
    data = gguf.quants.quantize(arr.astype(np.float32), qtype)
    return GGUFTensor("t", tuple(reversed(arr.shape)), qtype, data)


def _packed(t: GGUFTensor) -> PackedMatrix:
    w, scales, biases, bits = affine_blocks(t)
    return PackedMatrix(mx.array(w), mx.array(scales), mx.array(biases), 32, bits)


@pytest.mark.core
@pytest.mark.parametrize("reader", ["default", "numpy"])
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
@pytest.mark.parametrize("rows", [48, 777])  # numpy's reader splits 777 rows over the cores
def test_gguf_blocks_map_to_mlx_bit_exactly(qtype, reader, rows, monkeypatch):
    """Both readers of the blocks (the kernels' threaded one where they are on, numpy's)."""
    if reader == "numpy":
        monkeypatch.setattr(gguf_file, "mlxtoy_kernels", None)
    rng = np.random.default_rng(0)
    arr = (rng.standard_normal((rows, 128)) * rng.uniform(0.01, 3, (rows, 1))).astype(np.float32)
    t = _tensor(arr, qtype)
    want = gguf.quants.dequantize(t.data, qtype).reshape(arr.shape)  # GGML's own values
    got = np.array(_packed(t).dense())
    assert got.dtype == np.float32 and np.array_equal(got, want)
    # positive control: one changed nibble / byte in the file is seen
    bad = t.data.copy()
    bad[3, -1] ^= 0x11
    assert not np.array_equal(np.array(_packed(GGUFTensor("t", t.shape, qtype, bad)).dense()), want)


def test_other_types_are_not_mapped():
    assert affine_blocks(_tensor(np.ones((2, 32), np.float32), Q.Q5_0)) is None


@pytest.mark.core
@pytest.mark.parametrize("path", ["kernels", "mlx", "mlx-slabs"])
@pytest.mark.parametrize("bits,group", [(4, 32), (8, 64)])
def test_cpu_product_and_input_gradient_match_numpy(monkeypatch, path, bits, group):
    """Both CPU products: the kernels' (dequantized slabs inside one primitive, the BLAS's SGEMM)
    and MLX's ops (`slab_product`), there with several slabs too (a big output layer's case)."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((96, 128)).astype(np.float32)
    if path == "kernels" and not fastmath.kernels_on():
        pytest.skip(f"the CPU kernels are off here: {fastmath.kernels_status()}")
    if path == "mlx-slabs":  # the last slab short
        monkeypatch.setattr(quant, "SLAB_BYTES", 26 * 128 * 4)
        assert len(quant.slabs(96, 128)) == 4
    packed, _ = quant.quantize_dense(mx.array(w), QuantPlan(bits, group))
    dense = np.array(packed.dense()).astype(np.float64)
    x = rng.standard_normal((3, 5, 128)).astype(np.float32)
    dy = rng.standard_normal((3, 5, 96)).astype(np.float32)

    def f(x):
        args = (x, packed.weight, packed.scales, packed.biases, group, bits)
        return quant.quant_linear(*args) if path == "kernels" else quant.slab_product(group, bits)(*args[:4])

    y, vjp = mx.vjp(f, [mx.array(x)], [mx.array(dy)])
    np.testing.assert_allclose(np.array(y[0]), x.astype(np.float64) @ dense.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(vjp[0]), dy.astype(np.float64) @ dense, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def q8_model(tmp_path_factory):
    """A tiny llama (GQA, d_model 64) with a byte-level BPE vocabulary llama.cpp reads, as Q8_0."""
    root = tmp_path_factory.mktemp("qlora")
    model = export_model("llama_gqa", seed=3)
    return write_tiny_gguf(str(root / "tiny-q8_0.gguf"), model, "q8_0")


def _load(path, plan):
    cfg, weights, meta = load_gguf(path, mx.float32, quant=plan)
    return build_model(cfg, weights), weights


@pytest.mark.core
def test_qlora_model_equals_the_dequantized_model(q8_model):
    qmodel, weights = _load(q8_model, QuantPlan())
    dmodel, _ = _load(q8_model, None)
    attn, ffn = qmodel.layers[0].attn, qmodel.layers[0].ffn
    assert isinstance(attn.q, QuantizedHeadProjection) and isinstance(attn.k, QuantizedHeadProjection)
    assert isinstance(attn.o, QuantizedLinear) and isinstance(ffn.down, QuantizedLinear)
    assert type(qmodel.tok_embeddings).__name__ == "QuantizedEmbedding"  # the file's Q8_0 table, exact
    # the same weights bit for bit: per head, and as the loader's dense path reads them
    assert mx.array_equal(attn.q.dense_weight(), dmodel.layers[0].attn.q.weight).item()
    down = quant.dequantize(ffn.down.weight, ffn.down.scales, ffn.down.biases, ffn.down.group_size, ffn.down.bits)
    assert mx.array_equal(down, dmodel.layers[0].ffn.down.weight).item()
    tokens = mx.array(np.random.default_rng(0).integers(0, 259, (2, 24)).astype(np.int32))
    np.testing.assert_allclose(np.array(qmodel(tokens)), np.array(dmodel(tokens)), rtol=1e-4, atol=1e-4)
    quantized_bytes = sum(v.nbytes for _, v in tree_flatten(qmodel.parameters()))
    dense_bytes = sum(v.nbytes for _, v in tree_flatten(dmodel.parameters()))
    assert quantized_bytes < 0.5 * dense_bytes
    assert quant.parameter_count(qmodel) == quant.parameter_count(dmodel) == sum(
        v.size for _, v in tree_flatten(dmodel.parameters()))


@pytest.mark.core
def test_qlora_adapter_gradients_match_finite_differences(q8_model):
    model, _ = _load(q8_model, QuantPlan())
    apply_lora(model, ["q", "k", "v", "o", "gate", "up", "down"], 4, 8.0)
    rng = np.random.default_rng(2)
    # B != 0, so every adapter carries gradient
    model.update(tree_unflatten([(k, mx.array(rng.standard_normal(v.shape).astype(np.float32) * 0.05))
                                 for k, v in lora_parameters(model).items()]))
    tokens = mx.array(rng.integers(0, 259, (1, 16)).astype(np.int32))

    def loss(params):
        model.update(params)
        return mx.mean(mx.logsumexp(model(tokens), axis=-1))

    params = model.trainable_parameters()
    grads = dict(tree_flatten(mx.grad(loss)(params)))
    flat = dict(tree_flatten(params))
    assert set(grads) == set(lora_parameters(model))  # the frozen quantized base has none
    for name in ["layers.0.attn.q.lora_a", "layers.1.attn.k.lora_b", "layers.0.ffn.down.lora_a",
                 "layers.1.attn.o.lora_b"]:
        base = np.array(flat[name])
        for idx in [(0, 0), (1, 3)]:
            eps = 1e-2
            up, down = base.copy(), base.copy()
            up[idx] += eps
            down[idx] -= eps
            lo = loss(tree_unflatten(list((flat | {name: mx.array(down)}).items()))).item()
            hi = loss(tree_unflatten(list((flat | {name: mx.array(up)}).items()))).item()
            fd = (hi - lo) / (2 * eps)
            assert abs(fd - np.array(grads[name])[idx]) < 2e-3 + 2e-2 * abs(fd), (name, idx, fd)
        model.update(tree_unflatten(list(flat.items())))


@pytest.mark.core
def test_fused_loss_through_a_quantized_output_layer_matches_autograd(q8_model):
    """The tied Q8_0 table as the output layer takes the chunked fused loss (the logits of a
    chunk at a time, its own input gradient); its per-token losses and the adapters' gradients
    equal MLX's autograd through the whole logits (the reference, outside the fused code)."""
    model, _ = _load(q8_model, QuantPlan())
    assert isinstance(output_layer(model), quant.QuantizedEmbedding)
    apply_lora(model, ["q", "v", "down"], 4, 8.0)
    rng = np.random.default_rng(4)
    model.update(tree_unflatten([(k, mx.array(rng.standard_normal(v.shape).astype(np.float32) * 0.05))
                                 for k, v in lora_parameters(model).items()]))
    inputs = mx.array(rng.integers(0, 259, (2, 40)).astype(np.int32))
    targets = mx.array(rng.integers(0, 259, (2, 40)).astype(np.int32))
    weights = mx.array(rng.uniform(0.5, 1.5, (2, 40)).astype(np.float32))

    def fused(params):
        model.update(params)
        return (token_losses(model, inputs, targets) * weights).sum()

    def reference(params):
        model.update(params)
        logits = model(inputs)
        picked = mx.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        return ((mx.logsumexp(logits, axis=-1) - picked) * weights).sum()

    params = model.trainable_parameters()
    (fl, fg), (rl, rg) = mx.value_and_grad(fused)(params), mx.value_and_grad(reference)(params)
    np.testing.assert_allclose(fl.item(), rl.item(), rtol=1e-5)
    np.testing.assert_allclose(np.array(token_losses(model, inputs, targets, train=False)),
                               np.array(token_losses(model, inputs, targets)), rtol=0, atol=0)
    fg, rg = dict(tree_flatten(fg)), dict(tree_flatten(rg))
    assert set(fg) == set(rg) == set(lora_parameters(model))
    for name in fg:
        np.testing.assert_allclose(np.array(fg[name]), np.array(rg[name]), rtol=2e-4, atol=2e-6, err_msg=name)
    # positive control: the same comparison sees an output layer's gradient left out
    def hidden_only(params):
        model.update(params)
        return (model.hidden(inputs) ** 2).sum()

    h_only = mx.grad(hidden_only)(params)
    assert not np.allclose(np.array(dict(tree_flatten(h_only))["layers.0.attn.q.lora_b"]),
                           np.array(rg["layers.0.attn.q.lora_b"]), rtol=2e-4, atol=2e-6)


@pytest.mark.core
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_quantized_table_gives_rows_in_the_compute_dtype(q8_model, dtype):
    cfg, weights, _ = load_gguf(q8_model, dtype, quant=QuantPlan())
    model = build_model(cfg, weights)
    rows = model.tok_embeddings(mx.array([[1, 2, 3]]))
    assert rows.dtype == dtype == model.norm.weight.dtype
    dense = quant.dequantize(model.tok_embeddings.weight, model.tok_embeddings.scales,
                             model.tok_embeddings.biases, 32, model.tok_embeddings.bits)[mx.array([1, 2, 3])]
    np.testing.assert_allclose(np.array(rows[0].astype(mx.float32)), np.array(dense), rtol=1e-2, atol=1e-3)


@pytest.mark.core
@pytest.mark.parametrize("tables", [False, True])
def test_tables_are_quantized_at_load_only_on_request(tmp_path, tables):
    """A float32 file: its embedding table stays dense unless the plan asks (--qlora-tables);
    either way the header's plan (the memory preflight's) has the loaded model's arrays, and
    the 8-bit model stays close to the float one."""
    src = export_model("llama_gqa", seed=5)
    path = write_tiny_gguf(str(tmp_path / "tiny-f32.gguf"), src, "f32")
    plan = QuantPlan(8, 32, tables)
    qmodel, _ = _load(path, plan)
    dmodel, _ = _load(path, None)
    assert isinstance(qmodel.tok_embeddings, quant.QuantizedEmbedding) == tables
    assert isinstance(qmodel.layers[0].ffn.down, QuantizedLinear)
    shapes = {k: (v.shape, v.dtype) for k, v in tree_flatten(qmodel.parameters())}
    assert {k: (v.shape, v.dtype) for k, v in tree_flatten(planned_model(path, mx.float32, plan).parameters())} == shapes
    tokens = mx.array(np.random.default_rng(0).integers(0, 259, (1, 24)).astype(np.int32))
    want = np.array(dmodel(tokens))
    np.testing.assert_allclose(np.array(qmodel(tokens)), want, atol=0.05 * np.abs(want).max())


def test_q4_0_gguf_from_llama_cpp_loads_quantized(q8_model, tmp_path):
    f32 = str(tmp_path / "f32.gguf")
    cfg, weights, meta = load_gguf(q8_model, mx.float32)
    tok = byte_tokenizer(tmp_path)
    write_gguf(f32, cfg, weights, tok.to_gguf_metadata(), dtype="f32")
    q4 = quantize_gguf(f32, str(tmp_path / "q4_0.gguf"), "q4_0")
    qmodel, _ = _load(q4, QuantPlan())
    dmodel, _ = _load(q4, None)
    assert qmodel.layers[1].attn.v.bits == 4
    tokens = mx.array(np.arange(20, dtype=np.int32)[None])
    np.testing.assert_allclose(np.array(qmodel(tokens)), np.array(dmodel(tokens)), rtol=1e-4, atol=1e-4)


_MEASURE = r"""
import json, sys
import mlx.core as mx
from mlxtoy.io.gguf_read import load_gguf
from mlxtoy.models.quant import PackedMatrix, QuantPlan

def status(key):  # kB lines of /proc/self/status
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key))

path, mode = sys.argv[1], sys.argv[2]
mx.eval(mx.zeros(1))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak resident set (VmHWM) starts again from now
before = status("VmRSS:")
cfg, weights, meta = load_gguf(path, mx.float32, quant=QuantPlan() if mode == "stream" else None)
peak = status("VmHWM:")
final = sum(v.nbytes for v in weights.values())
largest = max((v.shape[0] * v.shape[1] if isinstance(v, PackedMatrix) else v.size) * 4 for v in weights.values())
print(json.dumps({"before": before, "peak": peak, "final": final, "largest_f32": largest}))
"""


def _measure(path: str, mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _MEASURE, path, mode], capture_output=True, text=True,
                         cwd=REPO, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_streaming_load_peak_memory_is_bounded(tmp_path):
    """A 4-layer, d_model 512 Q8_0 file (~80 MB in float32): the quantized load grows the
    process by about its final size plus one float32 tensor; the eager float32 load (the
    positive control) by at least the float32 model."""
    tok = byte_tokenizer(tmp_path)
    model = tiny_model(0, vocab_size=tok.vocab_size, d_model=512, n_layers=4, n_heads=8, n_kv_heads=4,
                       d_head=64, d_ff=2048)
    path = str(tmp_path / "m.gguf")
    write_gguf(path, model.config, dict(tree_flatten(model.parameters())), tok.to_gguf_metadata(), dtype="q8_0")
    del model
    stream, eager = _measure(path, "stream"), _measure(path, "eager")
    grown, grown_eager = stream["peak"] - stream["before"], eager["peak"] - eager["before"]
    bound = stream["final"] + 2 * stream["largest_f32"] + (8 << 20)
    assert grown <= bound, (grown, stream)
    assert grown_eager >= eager["final"] > 3 * stream["final"], (grown_eager, eager)


def test_too_large_a_model_is_refused_before_loading(q8_model, tmp_path, monkeypatch):
    """Under a memory budget the float32 weights exceed but QLoRA fits: one error naming
    `--qlora on`, raised from the header alone (the loader is never called), no run written."""
    from mlxtoy.config import TrainConfig
    from mlxtoy.errors import UserError
    from mlxtoy.train import build, job, memory
    from tests.helpers_train import qa_rows, write_jsonl

    data = write_jsonl(str(tmp_path / "data.jsonl"), qa_rows(8))
    cfg = TrainConfig(model=q8_model, data=data, out=str(tmp_path / "run"), method="lora", steps=1,
                      batch_size=1, seq_len=8, lora_targets=["q", "v"], qlora="off")
    dense = planned_model(q8_model, mx.float32)
    build.make_trainable(dense, cfg)
    qlora = planned_model(q8_model, mx.float32, QuantPlan())
    build.make_trainable(qlora, cfg)
    weights, q_peak = memory.estimate(cfg, dense).weights, memory.estimate(cfg, qlora).peak
    assert q_peak < weights  # the budget below sits between them
    monkeypatch.setenv(memory.MEMORY_ENV, str((weights + q_peak) / 2 / memory.GB))

    def never(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(build, "load_weights", never)
    with pytest.raises(UserError) as err:
        job.prepare(cfg)
    message = str(err.value)
    assert "\n" not in message and "does not fit" in message and "--qlora on" in message, message
    assert not os.path.exists(cfg.out)
    # positive control: with room for the dense weights it goes on to load
    monkeypatch.setenv(memory.MEMORY_ENV, "64")
    with pytest.raises(AssertionError, match="was loaded"):
        job.prepare(cfg)


@pytest.fixture(scope="module")
def text_data(tmp_path_factory):
    from tests.helpers_train import write_jsonl

    root = tmp_path_factory.mktemp("qlora-data")
    rows = [{"text": f"{a} plus one is {a + 1}. " * 4} for a in range(10, 60)]
    write_jsonl(str(root / "train.jsonl"), rows[:44])
    write_jsonl(str(root / "valid.jsonl"), rows[44:])
    return str(root)


def _qlora_cfg(model, data, out, **kw):
    from mlxtoy.config import TrainConfig

    base = dict(model=model, data=data, out=str(out), method="lora", steps=6, batch_size=2, seq_len=48,
                lr=1e-2, warmup=1, eval_every=3, eval_batches=1, save_every=0, qlora="on", seed=0,
                lora_targets=["q", "k", "v", "o", "down"], lora_dropout=0.1)
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.core
def test_qlora_run_resumes_exactly_and_exports_what_llama_cpp_runs(q8_model, text_data, tmp_path):
    from mlxtoy.loading import load_run_model
    from mlxtoy.rundir import read_metrics
    from mlxtoy.train.control import TrainControl
    from mlxtoy.train.job import resume_config
    from tests.helpers_export import llama_cpp_logits, max_rel_diff
    from tests.helpers_train import run_cli, run_training

    full = run_training(_qlora_cfg(q8_model, text_data, tmp_path / "full"), handle_sigint=False)
    assert full.reason == "finished"
    facts = (tmp_path / "full" / "config.yaml").read_text()
    assert "qlora: true" in facts and "8-bit/g32" in facts
    part = run_training(_qlora_cfg(q8_model, text_data, tmp_path / "part"), control=TrainControl(stop_at=3),
                        handle_sigint=False)
    assert part.step == 3
    rest = run_training(resume_config(str(tmp_path / "part"), {}), resume=True, handle_sigint=False)
    assert rest.reason == "finished" and rest.step == 6
    curve = [e["loss"] for e in read_metrics(str(tmp_path / "part" / "metrics.jsonl")) if e["event"] == "step"]
    np.testing.assert_allclose(curve, full.losses, atol=1e-6, rtol=0)
    assert full.losses[-1] < full.losses[0]

    gguf_out = str(tmp_path / "merged.gguf")
    res = run_cli("export", str(tmp_path / "full"), "--out", gguf_out, "--dtype", "f32")
    assert res.returncode == 0, res.stderr
    model, _ = load_run_model(str(tmp_path / "full"))
    tokens = list(range(40, 90))
    ours = np.array(model(mx.array([tokens]))[0])
    theirs = llama_cpp_logits(gguf_out, tokens)
    assert max_rel_diff(ours, theirs) < 1e-4
    # `generate --adapter RUN` alone runs on the base that run trained (not the built-in model)
    res = run_cli("generate", "--adapter", str(tmp_path / "full"), "--prompt", "12 plus one is", "--max-tokens", "4",
                  "--temp", "0")
    assert res.returncode == 0 and "error" not in res.stderr, res.stderr
    # the trained adapters changed the model: the base's logits differ
    base = np.array(_load(q8_model, None)[0](mx.array([tokens]))[0])
    assert max_rel_diff(base, theirs) > 1e-3


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 64), (8, 32), (8, 64)])
def test_kernel_dequantize_equals_mlx(bits, group):
    if not fastmath.kernels_on():
        pytest.skip(f"the CPU kernels are off here: {fastmath.kernels_status()}")
    w = mx.random.normal((40, 256), key=mx.random.key(bits + group))
    q, scales, biases = mx.quantize(w, group, bits)
    scales, biases = scales.astype(mx.float16), biases.astype(mx.float16)
    want = mx.dequantize(q, scales.astype(mx.float32), biases.astype(mx.float32), group, bits)
    got = quant.dequantize_affine(q, scales, biases, group, bits)
    assert got.dtype == mx.float32 and mx.array_equal(got, want).item()
    assert not mx.array_equal(quant.dequantize_affine(q, scales * 2, biases, group, bits), want).item()
