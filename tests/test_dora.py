"""DoRA (`--method dora`): a magnitude per output row times the normalised LoRA-updated weight,
    W' = m * (W + s B A) / ||W + s B A||_row.

Checked against an independent numpy W', finite differences (the norm is in the gradient),
PEFT and mlx-lm loading our adapter exports, llama.cpp running our merged GGUF, transformers
our merged HF folder; the trainer: step 0 is the base, exact resume, a tiny overfit through
the CLI, DPO's reference, the QLoRA branch, and the adapter-GGUF refusal.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

import mlxtoy  # noqa: F401  (fast BLAS before mlx.core)
import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import peft
import torch
import transformers
from mlx.utils import tree_flatten

import llama_cpp  # noqa: F401  (declared test dependency: fail, not skip, without it)
from helpers_export import (VOCAB, argmax_agreement, llama_cpp_logits, max_rel_diff, our_logits, randomize,
                            tiny_model, tiny_tokenizer_metadata, tokens_128, write_tiny_tokenizer)
from helpers_parity import llama_quantize
from helpers_train import qa_rows, run_training, write_jsonl, write_tiny_model_folder
from mlxtoy.cli import main as cli_main
from mlxtoy.config import TrainConfig, check_given
from mlxtoy.export import export_model, lora_from_model
from mlxtoy.io.tokenizer import Tokenizer
from mlxtoy.loading import adapter_weights, build_model, load
from mlxtoy.model_config import LoadedMeta, ModelConfig
from mlxtoy.models import lora as lora_mod
from mlxtoy.models.llama import LlamaModel
from mlxtoy.models.lora import apply_lora, dense_weight, lora_modules, merge_lora
from mlxtoy.rundir import read_metrics
from mlxtoy.train.control import TrainControl
from mlxtoy.train.job import prepare, resume_config
from mlxtoy.train.preference import adapters_disabled

ALL = ("q", "k", "v", "o", "gate", "up", "down")
LOG2 = float(np.log(np.float32(2.0)))


def _tokenizer(model) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(model.meta.metadata, source=model.meta.source)


def _as_trained(model, seed: int = 0) -> None:
    """A trained-looking DoRA: B away from zero, each magnitude off ||W|| by ~20%."""
    rng = np.random.default_rng(seed + 100)
    for _, m in lora_modules(model):
        m.lora_b = mx.array((0.3 * rng.standard_normal(m.lora_b.shape)).astype(np.float32))
        m.magnitude = m.magnitude * mx.array((1 + 0.2 * rng.standard_normal(m.magnitude.shape)).astype(np.float32))
    mx.eval(model.parameters())


def _dora_model(name: str, targets=ALL, per_head_q: bool = True, layers=None, seed: int = 0):
    """(base model, DoRA-wrapped copy with trained-looking adapters, tokenizer)."""
    base = tiny_model(name, seed)
    model = tiny_model(name, seed)
    mx.random.seed(seed)  # A's Gaussian init
    apply_lora(model, targets, rank=4, alpha=8.0, per_head_q=per_head_q, layers=layers, dora=True)
    _as_trained(model, seed)
    return base, model, _tokenizer(base)


def _numpy_dora_weight(m) -> np.ndarray:
    """W' = m * (W + s B A) / ||W + s B A||_row in float64, from the wrapper's tensors alone;
    per-head Q: head h's rows get B_h @ A_h."""
    W = np.array(dense_weight(m.base).astype(mx.float32), dtype=np.float64)
    shape = W.shape
    W = W.reshape(-1, shape[-1])
    A = np.array(m.lora_a, dtype=np.float64)
    B = np.array(m.lora_b, dtype=np.float64)
    if A.ndim == 3:  # per head
        BA = np.concatenate([B[h] @ A[h] for h in range(A.shape[0])], axis=0)
    else:
        BA = B @ A
    V = W + m.scale * BA
    Wp = np.array(m.magnitude, dtype=np.float64)[:, None] * V / np.linalg.norm(V, axis=1, keepdims=True)
    return Wp.reshape(shape)


# ---- the layer ------------------------------------------------------------------------------

@pytest.mark.parametrize("name,per_head_q", [("llama_gqa", True), ("qwen2_bias", False)])
@pytest.mark.core
def test_step0_equals_base_exactly(name, per_head_q):
    base = tiny_model(name)
    model = tiny_model(name)
    x = mx.array([tokens_128()])
    apply_lora(model, ALL, rank=4, alpha=8.0, per_head_q=per_head_q, dora=True)
    assert mx.array_equal(model(x), base(x)).item()
    trainable = [k for k, _ in tree_flatten(model.trainable_parameters())]
    assert len(trainable) == 3 * 7 * 2  # A, B, magnitude x 7 targets x 2 layers
    assert all(k.endswith((".lora_a", ".lora_b", ".magnitude")) for k in trainable)
    q = model.layers[0].attn.q
    H, Dh, D = q.base.weight.shape
    assert q.magnitude.shape == (H * Dh,) and model.layers[0].ffn.down.magnitude.shape == (D,)
    np.testing.assert_allclose(np.array(q.magnitude), np.linalg.norm(np.array(q.base.weight).reshape(H * Dh, D), axis=1),
                               rtol=1e-6)
    _as_trained(model)
    assert max_rel_diff(our_logits(model, tokens_128()), our_logits(base, tokens_128())) > 1e-2
    with adapters_disabled(model):  # DPO's reference: the base alone
        assert mx.array_equal(model(x), base(x)).item()


@pytest.mark.parametrize("name,per_head_q", [("llama_gqa", True), ("qwen2_bias", False)])
@pytest.mark.core
def test_forward_equals_numpy_dora_weight(name, per_head_q):
    """Each wrapper's output and the whole model equal a plain model carrying numpy's W'."""
    _, model, _ = _dora_model(name, per_head_q=per_head_q)
    plain = tiny_model(name)
    x = mx.array(np.random.default_rng(5).standard_normal((2, 7, model.config.d_model)).astype(np.float32))
    weights = []
    for path, m in lora_modules(model):
        Wp = _numpy_dora_weight(m)
        weights.append((path + ".weight", mx.array(Wp.astype(np.float32))))
        if m.base.weight.ndim == 3:  # per-head projection: (B, T, H, Dh)
            want = np.einsum("btd,hkd->bthk", np.array(x, dtype=np.float64), Wp)
            inp = x
        else:
            inp = mx.array(np.random.default_rng(6).standard_normal((2, 7, Wp.shape[1])).astype(np.float32))
            want = np.array(inp, dtype=np.float64) @ Wp.T
        if "bias" in m.base:
            want = want + np.array(m.base.bias, dtype=np.float64)
        np.testing.assert_allclose(np.array(m(inp)), want, rtol=1e-4, atol=1e-5, err_msg=path)
        np.testing.assert_allclose(np.array(m.merged_weight()), Wp, rtol=1e-5, atol=1e-6, err_msg=path)
    plain.load_weights(weights, strict=False)
    tokens = tokens_128()
    assert max_rel_diff(our_logits(model, tokens), our_logits(plain, tokens)) <= 1e-5
    merged = our_logits(merge_lora(model), tokens)
    assert max_rel_diff(merged, our_logits(plain, tokens)) <= 1e-5


def _fd_errors(model, loss_of, names, eps, n_coords=3):
    """(gradient, central difference) at the largest-gradient coordinates of each name."""
    _, grads = nn.value_and_grad(model, loss_of)(model)
    grads = dict(tree_flatten(grads))
    params = dict(tree_flatten(model.parameters()))
    out = []
    for name in names:
        p = np.array(params[name])
        g = np.array(grads[name]).ravel()
        for idx in np.argsort(-np.abs(g))[:n_coords]:
            vals = []
            for sign in (+1, -1):
                q = p.ravel().copy()
                q[idx] += sign * eps
                model.load_weights([(name, mx.array(q.reshape(p.shape), dtype=params[name].dtype))], strict=False)
                vals.append(loss_of(model).item())
            model.load_weights([(name, params[name])], strict=False)
            out.append((name, g[idx], (vals[0] - vals[1]) / (2 * eps)))
    return out


@pytest.mark.core
def test_gradients_equal_finite_differences(monkeypatch):
    """The wrappers alone in float64 (no fused float32 kernels: tight), then the whole model
    (MLX's fused RMSNorm / attention work in float32 inside: eps 1e-2, 2%). B and m are away
    from their start; the norm's own gradient is included, so a detached norm (PEFT's and
    mlx-lm's training shortcut) does not match the differences."""
    model = tiny_model("qwen2_bias")
    mx.random.seed(0)
    apply_lora(model, ALL, rank=2, alpha=4.0, per_head_q=True, dora=True)
    _as_trained(model)
    model.set_dtype(mx.float64)
    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((2, 5, model.config.d_model)), dtype=mx.float64)
    xf = mx.array(rng.standard_normal((2, 5, model.config.d_ff)), dtype=mx.float64)
    layers = {"q": model.layers[0].attn.q, "k": model.layers[0].attn.k, "down": model.layers[1].ffn.down}
    worst = 0.0
    for t, m in layers.items():
        inp = xf if t == "down" else x
        r = mx.array(rng.standard_normal(m(inp).shape), dtype=mx.float64)

        def loss_of(m, inp=inp, r=r):
            return (m(inp) * r).sum()

        for name, g, fd in _fd_errors(m, loss_of, ["lora_a", "lora_b", "magnitude"], eps=1e-6):
            worst = max(worst, abs(fd - g) / abs(g))
            assert abs(fd - g) <= 1e-6 * abs(g) + 1e-9, (t, name, g, fd)
    print(f"DoRA layer gradients vs finite differences (float64): max relative error {worst:.1e}")

    # the detached norm is a different gradient (for A and B; m's is the same)
    m, inp = layers["k"], x
    r = mx.array(rng.standard_normal(m(inp).shape), dtype=mx.float64)
    true = _fd_errors(m, lambda m: (m(inp) * r).sum(), ["lora_b"], eps=1e-6)
    norm = lora_mod.dora_norm
    monkeypatch.setattr(lora_mod, "dora_norm", lambda *a: mx.stop_gradient(norm(*a)))
    detached = _fd_errors(m, lambda m: (m(inp) * r).sum(), ["lora_b"], eps=1e-6)
    monkeypatch.undo()
    assert max(abs(g - fd) / abs(fd) for _, g, fd in detached) > 1e-2
    assert max(abs(g - fd) / abs(fd) for _, g, fd in true) < 1e-6

    tok = mx.array(rng.integers(0, VOCAB, (2, 10)).astype(np.int32))
    y = mx.array(rng.integers(0, VOCAB, (2, 10)).astype(np.int32))

    def model_loss(model):
        return nn.losses.cross_entropy(model(tok).astype(mx.float64), y).mean()

    names = [f"layers.0.attn.q.{p}" for p in ("lora_a", "lora_b", "magnitude")]
    names += ["layers.1.attn.k.magnitude", "layers.1.ffn.down.lora_b"]
    worst = 0.0
    for name, g, fd in _fd_errors(model, model_loss, names, eps=1e-2, n_coords=2):
        worst = max(worst, abs(fd - g) / abs(g))
        assert abs(fd - g) <= 1e-4 + 2e-2 * abs(g), (name, g, fd)
    print(f"DoRA model gradients vs finite differences: max relative error {worst:.1e}")


# ---- adapters in PEFT, mlx-lm; merged in llama.cpp and transformers --------------------------

def _hf_logits(folder: str, tokens, adapter: str | None = None) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if adapter:
        model = peft.PeftModel.from_pretrained(model, adapter)
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].numpy()


@pytest.mark.parametrize("name,per_head,targets,layers", [
    ("llama_gqa", True, ALL, None),            # per-head Q as one rank H*r adapter; q/k rows permuted
    ("qwen2_bias", False, ("q", "v", "gate"), None),  # biases are not scaled by m / ||.||
    ("llama_untied", True, ("q", "k", "down"), [1]),  # layers_to_transform
])
def test_peft_loads_dora_adapters(tmp_path, name, per_head, targets, layers):
    base, model, tok = _dora_model(name, targets, per_head, layers)
    tokens = tokens_128()
    hf = export_model(base, tok, str(tmp_path / "base-hf"), "hf", "f32")
    out = export_model(model, tok, str(tmp_path / "peft"), "peft", "f32")
    with open(os.path.join(out, "adapter_config.json")) as f:
        assert json.load(f)["use_dora"] is True
    theirs = _hf_logits(hf, tokens, out)
    diff = max_rel_diff(theirs, our_logits(model, tokens))
    print(f"{name}: PEFT DoRA vs ours: max relative logit difference {diff:.2e}")
    assert diff <= 1e-4
    assert max_rel_diff(theirs, our_logits(base, tokens)) > 1e-2  # the adapter matters


@pytest.mark.parametrize("name,per_head,targets,layers", [
    ("llama_gqa", True, ALL, None),
    ("qwen2_bias", False, ("q", "k", "o", "down"), [0]),  # layer 1 padded: zero B, m = ||W||
])
def test_mlx_lm_loads_dora_adapters(tmp_path, name, per_head, targets, layers):
    base, model, tok = _dora_model(name, targets, per_head, layers)
    tokens = tokens_128()
    hf = export_model(base, tok, str(tmp_path / "base-hf"), "hf", "f32")
    out = export_model(model, tok, str(tmp_path / "mlx-lm"), "mlx-lm", "f32")
    with open(os.path.join(out, "adapter_config.json")) as f:
        assert json.load(f)["fine_tune_type"] == "dora"
    theirs, _ = mlx_lm.load(hf, adapter_path=out)
    diff = max_rel_diff(np.array(theirs(mx.array([tokens]))[0]), our_logits(model, tokens))
    print(f"{name}: mlx-lm DoRA vs ours: max relative logit difference {diff:.2e}")
    assert diff <= 1e-4


def _phi3_folder(root) -> str:
    """A tiny random Phi-3 (fused qkv_proj and gate_up_proj) saved by transformers."""
    config = transformers.Phi3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                     num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=256,
                                     partial_rotary_factor=0.5, tie_word_embeddings=False, bos_token_id=0,
                                     eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for pname, p in ref.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape))
            else:
                p.copy_(0.5 * torch.randn(p.shape) / math.sqrt(p.shape[-1]) if p.ndim > 1 and "embed" not in pname
                        else torch.randn(p.shape))
    folder = str(root / "phi3")
    ref.save_pretrained(folder)
    write_tiny_tokenizer(folder)
    return folder


def test_fused_outside_tensors_take_the_base_norm_for_unadapted_parts(tmp_path):
    """Phi-3 fuses q | k | v and gate | up: with DoRA on q and up only, the k, v and gate rows
    of the fused adapters carry m = ||W||_row (unchanged), in PEFT and mlx-lm alike."""
    folder = _phi3_folder(tmp_path)
    model, tok = load(folder)
    apply_lora(model, ("q", "up"), rank=4, alpha=8.0, per_head_q=True, dora=True)
    _as_trained(model)
    tokens = tokens_128()
    ours = our_logits(model, tokens)
    assert max_rel_diff(ours, our_logits(load(folder)[0], tokens)) > 1e-2  # the adapter matters
    out = export_model(model, tok, str(tmp_path / "peft"), "peft", "f32")
    assert max_rel_diff(_hf_logits(folder, tokens, out), ours) <= 1e-4
    out = export_model(model, tok, str(tmp_path / "mlx-lm"), "mlx-lm", "f32")
    theirs, _ = mlx_lm.load(folder, adapter_path=out)
    assert max_rel_diff(np.array(theirs(mx.array([tokens]))[0]), ours) <= 1e-4


@pytest.mark.parametrize("name", ["llama_gqa", "qwen2_bias"])
def test_merged_gguf_and_hf_equal_the_adapted_model(tmp_path, name):
    _, model, tok = _dora_model(name)
    tokens = tokens_128()
    ours = our_logits(model, tokens)
    path = export_model(model, tok, str(tmp_path / "m.gguf"), "gguf", "f32")
    diff = max_rel_diff(llama_cpp_logits(path, tokens), ours)
    print(f"{name}: llama.cpp merged DoRA GGUF vs ours: max relative logit difference {diff:.2e}")
    assert diff <= 1e-4
    path = export_model(model, tok, str(tmp_path / "m8.gguf"), "gguf", "q8_0")
    assert argmax_agreement(llama_cpp_logits(path, tokens), ours) >= 0.99
    hf = export_model(model, tok, str(tmp_path / "hf"), "hf", "f32")
    assert max_rel_diff(_hf_logits(hf, tokens), ours) <= 1e-4
    assert lora_from_model(model).dora


def test_merged_k_quant_is_llama_cpps_quantizer_on_the_merged_f16(tmp_path):
    """--dtype q6_k of a DoRA model: the bytes of llama.cpp's quantizer run on our merged F16,
    and close to our adapted model (rows of 256, so every matrix takes the K-quant)."""
    cfg = ModelConfig(arch="llama", vocab_size=VOCAB, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, d_head=64,
                      d_ff=512, norm_eps=1e-5, rope_base=10000.0, context_length=256)
    model = randomize(LlamaModel(cfg), 0)
    model.meta = LoadedMeta(source="tiny-256", format="gguf", metadata=tiny_tokenizer_metadata())
    mx.random.seed(0)
    apply_lora(model, ALL, rank=4, alpha=8.0, per_head_q=True, dora=True)
    _as_trained(model)
    tok = _tokenizer(model)
    q6 = export_model(model, tok, str(tmp_path / "q6.gguf"), "gguf", "q6_k")
    f16 = export_model(model, tok, str(tmp_path / "f16.gguf"), "gguf", "f16")
    with open(q6, "rb") as a, open(llama_quantize(f16, str(tmp_path / "direct.gguf"), "Q6_K"), "rb") as b:
        assert a.read() == b.read()
    tokens = tokens_128()
    ours, theirs = our_logits(model, tokens), llama_cpp_logits(q6, tokens)
    assert argmax_agreement(theirs, ours) >= 0.95 and max_rel_diff(theirs, ours) <= 0.03


# ---- the trainer ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A tiny HF model folder (byte-level tokenizer), a small chat dataset, preference pairs."""
    root = tmp_path_factory.mktemp("dora")
    model = write_tiny_model_folder(str(root / "model"))
    data = root / "data"
    write_jsonl(str(data / "train.jsonl"), qa_rows(120, seed=1))
    write_jsonl(str(data / "valid.jsonl"), qa_rows(16, seed=2))
    pairs = root / "pairs"
    rows = [{"prompt": f"{a}+1", "chosen": str(a + 1), "rejected": str(a + 2)} for a in range(10, 50)]
    write_jsonl(str(pairs / "train.jsonl"), rows[:32])
    write_jsonl(str(pairs / "valid.jsonl"), rows[32:])
    return {"root": root, "model": model, "data": str(data), "pairs": str(pairs)}


def _cfg(work, out, **kw) -> TrainConfig:
    base = dict(model=work["model"], data=work["data"], out=str(out), method="dora", steps=8,
                batch_size=2, seq_len=64, lr=5e-3, eval_every=4, eval_batches=2, save_every=4,
                lora_targets=["q", "v"], seed=0)
    base.update(kw)
    return TrainConfig(**base)


def _steps(run, key="loss") -> list[float]:
    return [e[key] for e in read_metrics(os.path.join(str(run), "metrics.jsonl")) if e["event"] == "step"]


@pytest.mark.core
def test_resume_equals_uninterrupted(tmp_path, work):
    kw = dict(steps=12, grad_accum=2, lr=1e-2, warmup=2, save_every=0, eval_every=3, lora_dropout=0.2,
              lora_targets=["q", "v", "down"], lora_per_head_q=True)
    full = run_training(_cfg(work, tmp_path / "full", **kw), handle_sigint=False)
    part = run_training(_cfg(work, tmp_path / "part", **kw), control=TrainControl(stop_at=6), handle_sigint=False)
    assert part.reason == "stopped" and part.step == 6
    rest = run_training(resume_config(str(tmp_path / "part"), {}), resume=True, handle_sigint=False)
    assert rest.reason == "finished" and rest.step == 12
    np.testing.assert_allclose(_steps(tmp_path / "part"), full.losses, atol=1e-6, rtol=0)
    weights, info = adapter_weights(str(tmp_path / "part"))
    assert info["method"] == "dora" and "layers.0.attn.q.magnitude" in weights
    want, _ = adapter_weights(str(tmp_path / "full"))
    for k, v in want.items():
        np.testing.assert_allclose(np.array(weights[k]), np.array(v), atol=1e-6, err_msg=k)


def test_cli_overfit_then_generate_taps_and_exports(tmp_path, capsys):
    """`mlxtoy train --method dora` on a GGUF base lowers the loss; the run loads back (generate,
    taps), its merged export runs in llama.cpp with our logits, PEFT's config says use_dora, and
    the llama.cpp adapter GGUF is refused in one line."""
    base = tiny_model("llama_gqa")
    base_path = export_model(base, _tokenizer(base), str(tmp_path / "base.gguf"), "gguf", "f32")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"the rain in spain number {i % 4} falls on the plain"}) + "\n"
                            for i in range(40)))
    run = str(tmp_path / "run")
    assert cli_main(["train", "--model", base_path, "--data", str(data), "--out", run, "--method", "dora",
                     "--steps", "30", "--batch-size", "2", "--seq-len", "32", "--lora-rank", "4",
                     "--lora-targets", "q,v,o,down", "--lora-per-head-q", "--lr", "1e-2", "--eval-every", "0",
                     "--schedule", "constant", "--save-every", "0"]) == 0
    losses = _steps(run)
    assert len(losses) == 30 and np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5]), losses
    with open(os.path.join(run, "adapter_config.json")) as f:
        assert json.load(f)["method"] == "dora"
    capsys.readouterr()
    assert cli_main(["generate", "--model", base_path, "--adapter", run, "--prompt", "the rain",
                     "--max-tokens", "4"]) == 0
    assert cli_main(["taps", base_path, "--adapter", run, "--prompt", "the rain", "--json"]) == 0
    tokens = tokens_128()
    ours = our_logits(load(base_path, adapter=run)[0], tokens)
    assert max_rel_diff(ours, our_logits(base, tokens)) > 1e-3  # training changed something
    merged = str(tmp_path / "merged.gguf")
    assert cli_main(["export", run, "--out", merged]) == 0
    assert max_rel_diff(llama_cpp_logits(merged, tokens), ours) <= 1e-4
    assert cli_main(["export", run, "--out", str(tmp_path / "peft"), "--format", "peft"]) == 0
    with open(tmp_path / "peft" / "adapter_config.json") as f:
        assert json.load(f)["use_dora"] is True
    capsys.readouterr()
    assert cli_main(["export", run, "--out", str(tmp_path / "a.gguf"), "--format", "adapter-gguf"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "DoRA" in err and "--format gguf" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "a.gguf").exists()


def test_dpo_reference_is_the_base(tmp_path, work):
    res = run_training(_cfg(work, tmp_path / "dpo", data=work["pairs"], objective="dpo", steps=2, batch_size=4,
                            eval_every=0, save_every=0, lora_targets=["q", "v", "down"]), handle_sigint=False)
    assert res.reason == "finished"
    first = _steps(tmp_path / "dpo")
    assert first[0] == float(np.float32(LOG2)) and first[1] != first[0]
    assert _steps(tmp_path / "dpo", "reward_margin")[0] == 0.0


@pytest.mark.core
def test_qlora_base(tmp_path, work):
    """The quantized-base branch (forced on): m starts at the dequantized weight's row norms, so
    step 0 is the quantized base exactly; training runs."""
    p = prepare(_cfg(work, tmp_path / "q", qlora="on", lora_targets=["q", "o", "down"]))
    o = p.model.layers[0].attn.o
    assert isinstance(o.base, nn.QuantizedLinear)
    np.testing.assert_allclose(np.array(o.magnitude), np.linalg.norm(np.array(dense_weight(o.base)), axis=1),
                               rtol=1e-6)
    x = mx.array(np.random.default_rng(0).integers(0, 259, (1, 16)).astype(np.int32))
    with adapters_disabled(p.model):
        want = p.model(x)
    assert mx.array_equal(p.model(x), want).item()
    res = run_training(_cfg(work, tmp_path / "q2", qlora="on", steps=4, eval_every=0,
                            lora_targets=["q", "o", "down"]), handle_sigint=False)
    assert res.reason == "finished" and all(math.isfinite(v) for v in res.losses)


def test_config_and_help(capsys):
    cfg = TrainConfig(method="dora", data="d.jsonl", out="o", lora_targets=["q", "x"])
    with pytest.raises(Exception, match="unknown LoRA target"):
        cfg.validate()
    assert TrainConfig(method="dora", lora_rank=4).validate().adapters
    with pytest.raises(Exception, match="lora_rank"):
        TrainConfig(method="dora", lora_rank=0).validate()
    TrainConfig(method="full", lora_rank=0).validate()  # LoRA options do not apply
    with pytest.raises(Exception, match="lora_rank applies to method lora or dora only"):
        check_given(TrainConfig(method="full", lora_rank=4), ["lora_rank"])  # given, they are refused
    check_given(TrainConfig(method="full"), ["lora_rank"])  # control: at its default it is no change
    with pytest.raises(SystemExit):
        cli_main(["train", "--help"])
    out = capsys.readouterr().out
    assert "dora" in out and "[lora/dora]" in out


def test_build_model_is_plain_after_merge():
    _, model, _ = _dora_model("llama_gqa", ("q", "down"))
    merged = merge_lora(model)
    assert not lora_modules(merged)
    fresh = build_model(merged.config)
    assert {k for k, _ in tree_flatten(fresh.parameters())} == {k for k, _ in tree_flatten(merged.parameters())}
