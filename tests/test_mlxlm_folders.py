"""mlx-lm's quantized folders (`mlx_lm.convert(..., quantize=True)`: config.json's
`quantization`, packed `<name>.weight` beside `<name>.scales` / `<name>.biases`) load as they
are: with a QuantPlan (QLoRA) each packed matrix is kept exactly as stored, tables included;
without one it is dequantized to the compute dtype. The reference is mlx-lm's own model on the
same folder (`mlx_lm.load`), and llama.cpp for the GGUF a QLoRA run on such a folder exports.

The folder: a tiny random Llama written by transformers (untied, GQA), converted by mlx-lm with
4 bits / group 64, v_proj overridden to 8 bits / group 32, and layer 1's down_proj left float.
"""

from __future__ import annotations

import math
import os
import shutil

import numpy as np
import pytest

import mlxtoy  # noqa: F401  (fast BLAS before mlx.core)
import mlx.core as mx
import torch
import transformers

from helpers_export import VOCAB, llama_cpp_logits, max_rel_diff, write_tiny_tokenizer
from mlxtoy.arch.spec import neox_to_interleaved
from mlxtoy.errors import UserError
from mlxtoy.io.hf import hf_source_size, load_hf, planned_quantized, quantization_of
from mlxtoy.loading import build_model
from mlxtoy.models.quant import QUANTIZED_TYPES, PackedMatrix, QuantizedEmbedding, QuantPlan

SEQ = 48
N_HEADS, N_KV = 4, 2


def _randomize(model, seed: int) -> None:
    """Logits that spread: matrices 0.5 N(0, 1/fan_in), norms 1 + 0.1 N, embeddings N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed" in name or "lm_head" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.5 * torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))


def _save(ref, folder: str) -> str:
    """The transformers model's HF folder with the tiny tokenizer (mlx-lm loads one)."""
    ref.save_pretrained(folder)
    write_tiny_tokenizer(folder)
    return folder


def _predicate(path: str, module) -> bool | dict:
    if path == "model.layers.1.mlp.down_proj":
        return False  # stays float in the folder
    if path.endswith("v_proj"):
        return {"group_size": 32, "bits": 8, "mode": "affine"}
    return True


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(the float HF folder, mlx-lm's quantized folder of it)."""
    from mlx_lm import convert

    root = tmp_path_factory.mktemp("mlxlm")
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                      num_attention_heads=N_HEADS, num_key_value_heads=N_KV, num_hidden_layers=2,
                                      max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
                                      bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(config)
    _randomize(ref, seed=1)
    hf = _save(ref, str(root / "hf"))
    q = str(root / "q4")
    convert(hf, q, quantize=True, q_bits=4, q_group_size=64, dtype="float16", quant_predicate=_predicate)
    return hf, q


def _tokens() -> list[int]:
    return np.random.default_rng(3).integers(0, VOCAB, SEQ).tolist()


def _mlx_lm_logits(folder: str, tokens: list[int]) -> np.ndarray:
    import mlx_lm

    model, _ = mlx_lm.load(folder)
    model.set_dtype(mx.float32)  # its float16 scales, biases and norms, exactly, in float32
    return np.array(model(mx.array([tokens]))[0].astype(mx.float32))


def _our_logits(folder: str, tokens: list[int], quant: QuantPlan | None) -> tuple[np.ndarray, object]:
    cfg, weights, meta = load_hf(folder, mx.float32, quant=quant)
    model = build_model(cfg, weights)
    return np.array(model(mx.array([tokens]))[0]), model


@pytest.mark.core
def test_packed_matrices_are_kept_as_stored(folders):
    _, q = folders
    stored = {}
    for f in sorted(os.listdir(q)):
        if f.endswith(".safetensors"):
            stored.update(mx.load(os.path.join(q, f)))
    cfg, weights, meta = load_hf(q, mx.float32, quant=QuantPlan(bits=4, group_size=32))
    assert cfg.tie_embeddings is False
    emb, head = weights["tok_embeddings.weight"], weights["output.weight"]
    assert isinstance(emb, PackedMatrix) and isinstance(head, PackedMatrix)
    assert (emb.bits, emb.group_size, head.bits, head.group_size) == (4, 64, 4, 64)
    assert mx.array_equal(emb.weight, stored["model.embed_tokens.weight"]).item()
    assert mx.array_equal(head.scales, stored["lm_head.scales"]).item()
    for i in range(2):
        v = weights[f"layers.{i}.attn.v.weight"]
        assert (v.bits, v.group_size) == (8, 32), "the per-module override"
        for ours, theirs in (("attn.v", "self_attn.v_proj"), ("attn.o", "self_attn.o_proj"), ("ffn.up", "mlp.up_proj")):
            w = weights[f"layers.{i}.{ours}.weight"]
            for leaf in ("weight", "scales", "biases"):
                assert mx.array_equal(getattr(w, leaf), stored[f"model.layers.{i}.{theirs}.{leaf}"]).item()
        # q/k rows permuted for our RoPE layout (HF's NEOX halves -> adjacent pairs), packed as stored
        for ours, theirs, heads in (("attn.q", "self_attn.q_proj", N_HEADS), ("attn.k", "self_attn.k_proj", N_KV)):
            w = weights[f"layers.{i}.{ours}.weight"]
            assert w.bits == 4 and w.group_size == 64
            want = neox_to_interleaved(stored[f"model.layers.{i}.{theirs}.weight"], heads)
            assert mx.array_equal(w.weight, want).item()
    # the float down_proj of layer 1 is quantized at load as the plan says, its error reported
    down = weights["layers.1.ffn.down.weight"]
    assert (down.bits, down.group_size) == (4, 32)
    assert list(meta.quantization_errors) == ["model.layers.1.mlp.down_proj.weight"]
    # the model holds them as quantized modules (the embedding too)
    model = build_model(cfg, weights)
    assert isinstance(model.tok_embeddings, QuantizedEmbedding)
    assert isinstance(model.layers[0].attn.q, QUANTIZED_TYPES)


@pytest.mark.core
def test_logits_match_mlx_lm(folders, tmp_path):
    _, q = folders
    tokens = _tokens()
    theirs = _mlx_lm_logits(q, tokens)
    assert theirs.max() - theirs.min() > 5.0  # logits spread
    quantized, qmodel = _our_logits(q, tokens, QuantPlan(bits=4, group_size=64))
    assert any(isinstance(m, QUANTIZED_TYPES) for _, m in qmodel.named_modules())
    dense, model = _our_logits(q, tokens, None)  # dequantized to float32
    assert not any(isinstance(m, QUANTIZED_TYPES) for _, m in model.named_modules())
    assert max_rel_diff(dense, theirs) < 1e-5
    assert (dense.argmax(-1) == theirs.argmax(-1)).all()
    # layer 1's down_proj is float in the folder: the QLoRA load quantizes it, as mlx-lm does
    # not (a stated error); with that one layer float again, the packed model is mlx-lm's
    assert max_rel_diff(quantized, theirs) < 0.05
    qmodel.layers[1].ffn.down = model.layers[1].ffn.down
    packed = np.array(qmodel(mx.array([tokens]))[0])
    assert max_rel_diff(packed, theirs) < 1e-5
    # the public API gives the dequantized model
    from mlxtoy import load

    api, _ = load(q)
    np.testing.assert_array_equal(np.array(api(mx.array([tokens]))[0]), dense)

    # positive control: one scale of one group wrong, and the same comparison sees it
    bad = str(tmp_path / "bad")
    shutil.copytree(q, bad)
    tensors = mx.load(os.path.join(bad, "model.safetensors"))
    scales = np.array(tensors["model.layers.0.self_attn.o_proj.scales"])
    scales[3, 0] *= 3.0
    tensors["model.layers.0.self_attn.o_proj.scales"] = mx.array(scales)
    mx.save_safetensors(os.path.join(bad, "model.safetensors"), tensors, metadata={"format": "mlx"})
    corrupted, _ = _our_logits(bad, tokens, None)
    assert max_rel_diff(corrupted, theirs) > 1e-3


@pytest.mark.core
def test_header_size_and_planned_layouts(folders):
    hf, q = folders
    n_float, quantized = hf_source_size(hf)
    assert not quantized
    n_q, quantized = hf_source_size(q)
    assert quantized and n_q == n_float  # a packed matrix counts rows x inputs
    plan = QuantPlan(bits=4, group_size=32)
    planned = planned_quantized(q, plan)
    _, weights, _ = load_hf(q, mx.float32, quant=plan)
    packed = {k: v for k, v in weights.items() if isinstance(v, PackedMatrix)}
    assert set(planned) == set(packed)
    for k, p in planned.items():
        w = packed[k]
        assert (p.bits, p.group_size, p.weight.shape, p.scales.shape, p.scales.dtype) == \
            (w.bits, w.group_size, w.weight.shape, w.scales.shape, w.scales.dtype), k


def test_other_quantizers_are_refused_in_one_line():
    with pytest.raises(UserError, match="gptq"):
        quantization_of({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "m")
    assert quantization_of({"quantization_config": {"group_size": 64, "bits": 4}}, "m") == {"group_size": 64, "bits": 4}
    assert quantization_of({}, "m") is None


@pytest.fixture(scope="module")
def text_data(tmp_path_factory):
    from helpers_train import write_jsonl

    root = tmp_path_factory.mktemp("mlxlm-data")
    rows = [{"text": f"{a} plus one is {a + 1}. " * 3} for a in range(10, 40)]
    write_jsonl(str(root / "train.jsonl"), rows[:26])
    write_jsonl(str(root / "valid.jsonl"), rows[26:])
    return str(root)


def _cfg(model, data, out, **kw):
    from mlxtoy.config import TrainConfig

    base = dict(model=model, data=data, out=str(out), method="lora", steps=3, batch_size=2, seq_len=32,
                lr=1e-2, warmup=0, eval_every=0, save_every=0, seed=0, lora_targets=["q", "v", "down"])
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.core
def test_qlora_trains_on_the_folder_and_exports_what_llama_cpp_runs(folders, text_data, tmp_path):
    from helpers_train import run_cli, run_training
    from mlxtoy.loading import load_run_model

    _, q = folders
    run = tmp_path / "qlora"
    done = run_training(_cfg(q, text_data, run, qlora="on"), handle_sigint=False)
    assert done.reason == "finished" and all(np.isfinite(done.losses))
    facts = (run / "config.yaml").read_text()
    assert "qlora: true" in facts and "4-bit/g64" in facts and "8-bit/g32" in facts

    # merged to dense and written as GGUF: llama.cpp runs it with our logits
    out = str(tmp_path / "merged.gguf")
    res = run_cli("export", str(run), "--out", out, "--dtype", "f32")
    assert res.returncode == 0, res.stderr
    model, _ = load_run_model(str(run))
    tokens = _tokens()
    ours = np.array(model(mx.array([tokens]))[0])
    assert max_rel_diff(ours, llama_cpp_logits(out, tokens)) < 1e-4


def test_qlora_off_dequantizes(folders, text_data, tmp_path):
    from helpers_train import run_training

    _, q = folders
    run = tmp_path / "lora"
    done = run_training(_cfg(q, text_data, run, qlora="off", steps=2), handle_sigint=False)
    assert done.reason == "finished" and all(np.isfinite(done.losses))
    assert "qlora: true" not in (run / "config.yaml").read_text()
    _, weights, _ = load_hf(q, mx.float32)
    assert not any(isinstance(w, PackedMatrix) for w in weights.values())


@pytest.mark.core
def test_tied_qwen2_folder_matches_mlx_lm(tmp_path):
    """A second architecture and the common small-model case: Qwen2 (q/k/v biases, NEOX RoPE
    kept as it is), tied output (the quantized embedding table is the output layer too)."""
    from mlx_lm import convert

    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                      num_attention_heads=N_HEADS, num_key_value_heads=N_KV, num_hidden_layers=2,
                                      max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=True,
                                      bos_token_id=0, eos_token_id=0,
                                      # mlx-lm's qwen2 reads a top-level rope_theta (default 1e6), which
                                      # transformers 5 no longer writes: the base both read alike
                                      rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    torch.manual_seed(0)
    ref = transformers.Qwen2ForCausalLM(config)
    _randomize(ref, seed=2)
    hf, q = _save(ref, str(tmp_path / "hf")), str(tmp_path / "q4")
    convert(hf, q, quantize=True, q_bits=4, q_group_size=64, dtype="bfloat16")
    tokens = _tokens()
    theirs = _mlx_lm_logits(q, tokens)
    assert theirs.max() - theirs.min() > 5.0
    for plan in (None, QuantPlan(bits=8, group_size=32)):  # the folder's 4-bit/g64 is kept, not the plan's
        ours, model = _our_logits(q, tokens, plan)
        assert model.config.tie_embeddings and model.config.qkv_bias
        assert isinstance(model.tok_embeddings, QuantizedEmbedding) == (plan is not None)
        if plan is not None:
            assert (model.layers[0].attn.q.bits, model.layers[0].attn.q.group_size) == (4, 64)
        assert max_rel_diff(ours, theirs) < 1e-5, plan


# name -> (transformers config class, model class, keywords): Phi-3's fused q|k|v and gate|up
# split from packed rows, Gemma 3's norm offsets and 6-layer window pattern (mlx-lm's needs 6)
ARCHS = {
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(partial_rotary_factor=0.5, pad_token_id=0, tie_word_embeddings=False)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(num_hidden_layers=6, head_dim=16, sliding_window=16,
                                                             query_pre_attn_scalar=16, pad_token_id=0)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(head_dim=16, sliding_window=None, tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16, tie_word_embeddings=False)),
}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_other_architectures_match_mlx_lm(arch, tmp_path):
    from mlx_lm import convert

    config_cls, model_cls, kw = ARCHS[arch]
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=N_HEADS,
              num_key_value_heads=N_KV, num_hidden_layers=2, max_position_embeddings=256, rms_norm_eps=1e-6,
              bos_token_id=0, eos_token_id=0) | kw
    torch.manual_seed(0)
    ref = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kw))
    _randomize(ref, seed=2)
    hf, q = _save(ref, str(tmp_path / "hf")), str(tmp_path / "q4")
    convert(hf, q, quantize=True, q_bits=4, q_group_size=64)
    tokens = _tokens()
    theirs = _mlx_lm_logits(q, tokens)
    for plan in (None, QuantPlan(bits=4, group_size=64)):
        ours, model = _our_logits(q, tokens, plan)
        assert any(isinstance(m, QUANTIZED_TYPES) for _, m in model.named_modules()) == (plan is not None)
        assert max_rel_diff(ours, theirs) < 1e-5, plan
