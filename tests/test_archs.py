"""The architectures added as specs (mlxtoy.arch): tiny random transformers models built here
are the reference for loading, llama.cpp for our GGUF exports, PEFT for our adapters.

One parametrized set of checks per architecture variant (tied / untied, head_dim != d_model /
n_heads, sliding windows shorter than the sequences):
- the HF folder loads with transformers' logits; our f32 GGUF runs in llama.cpp with
  transformers' logits and reads back bit-exact, with llama.cpp's own tensor names;
- LoRA, DoRA and full fine-tuning lower the loss; PEFT loads our adapters with our logits;
  llama.cpp's base GGUF + our adapter GGUF equals our merged GGUF;
- cached decoding equals uncached 64 tokens past the sliding window.
"""

from __future__ import annotations

import json
import math
import os
import re

import numpy as np
import pytest

import mlxtoy  # noqa: F401  (fast BLAS before mlx.core)
import gguf
import mlx.core as mx
import mlx_lm
import peft
import torch
import transformers
from safetensors import safe_open

from helpers_export import VOCAB, argmax_agreement, llama_cpp_logits, max_rel_diff, write_tiny_tokenizer
from helpers_train import run_training, write_jsonl
from mlxtoy.arch.registry import spec_of
from mlxtoy.config import TrainConfig
from mlxtoy.export import export, export_model
from mlxtoy.generate import generate_tokens
from mlxtoy.io.gguf_read import load_gguf
from mlxtoy.io.hf import load_hf
from mlxtoy.loading import build_model, load
from mlxtoy.models.cache import make_cache
from mlxtoy.models.lora import apply_lora, lora_modules

SEQ = 96  # longer than every window below
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
            bos_token_id=0, eos_token_id=0, pad_token_id=None)

LONGROPE = dict(rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.3, 1.7, 2.5],
                             "long_factor": [1.0, 2.0, 4.0, 8.0]})

# name -> (transformers config class, its keywords)
VARIANTS = {
    "qwen3_tied_wide_heads": ("Qwen3Config", dict(num_hidden_layers=2, head_dim=32, tie_word_embeddings=True,
                                                  rope_theta=1000000.0)),
    "qwen3_untied": ("Qwen3Config", dict(num_hidden_layers=2, head_dim=16, tie_word_embeddings=False)),
    "mistral_window": ("MistralConfig", dict(num_hidden_layers=2, head_dim=16, sliding_window=16,
                                             tie_word_embeddings=False)),
    "mistral_full": ("MistralConfig", dict(num_hidden_layers=2, head_dim=32, sliding_window=None,
                                           tie_word_embeddings=True)),
    "phi3_partial_rotary": ("Phi3Config", dict(num_hidden_layers=2, partial_rotary_factor=0.5,
                                                tie_word_embeddings=False, pad_token_id=0)),
    "phi3_tied_gqa": ("Phi3Config", dict(num_hidden_layers=2, partial_rotary_factor=0.75,
                                         tie_word_embeddings=True, pad_token_id=0)),
    # the default pattern (every 6th layer global, local base 10000); query_pre_attn_scalar =
    # head_dim, the one scale llama.cpp's gemma3 has
    "gemma3_window": ("Gemma3TextConfig", dict(num_hidden_layers=6, head_dim=32, num_key_value_heads=1,
                                               sliding_window=16, query_pre_attn_scalar=32,
                                               hidden_activation="gelu_pytorch_tanh", pad_token_id=0)),
    # an own layer pattern, sliding base and linear scaling on the global layers
    "gemma3_pattern": ("Gemma3TextConfig", dict(
        num_hidden_layers=3, head_dim=16, sliding_window=12, query_pre_attn_scalar=16, pad_token_id=0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0}})),
    # LongRoPE within the original context (96 tokens < 512; llama.cpp's 256 < 512): short
    # factors, attention factor sqrt(1 + ln 2 / ln 512) from max_position_embeddings 1024 / 512
    "phi3_longrope": ("Phi3Config", dict(num_hidden_layers=2, partial_rotary_factor=0.5, tie_word_embeddings=False,
                                         pad_token_id=0, **LONGROPE, original_max_position_embeddings=512,
                                         max_position_embeddings=1024)),
}


def _windowed(name: str) -> int | None:
    return VARIANTS[name][1].get("sliding_window")


def _gguf_tokens(name: str, tokens: list[int]) -> list[int]:
    """The tokens llama.cpp can check: all of them where its GGUF arch has the window (gemma3),
    else those within the window (Mistral's GGUF is llama: ours declares context = window)."""
    if _windowed(name) and not name.startswith("gemma3"):
        return tokens[:_windowed(name)]
    return tokens


def _randomize(model, seed: int) -> None:
    """Logits that spread: matrices 0.5 N(0, 1/fan_in), norms 1 + 0.1 N (Gemma's stored
    offsets 0.1 N), embeddings N(0, 1); an untied head is the embeddings plus noise."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        emb = None
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                gemma = isinstance(model, transformers.Gemma3ForCausalLM)  # stores w of 1 + w
                v = (0.0 if gemma else 1.0) + 0.1 * torch.randn(p.shape, generator=g)
            elif "embed_tokens" in name:
                v = torch.randn(p.shape, generator=g)
                emb = v
            elif name == "lm_head.weight":
                v = emb + 0.5 * torch.randn(p.shape, generator=g)
            else:
                v = 0.5 * torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1])
            p.copy_(v)


@pytest.fixture(scope="module", params=list(VARIANTS))
def hf_case(request, tmp_path_factory):
    """(variant name, HF folder written by transformers, transformers model, tokens)."""
    name = request.param
    cls, kw = VARIANTS[name]
    config = getattr(transformers, cls)(**{**BASE, **kw})
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(ref, seed=1)
    ref.eval()
    folder = str(tmp_path_factory.mktemp(name) / "hf")
    ref.save_pretrained(folder)
    write_tiny_tokenizer(folder)
    tokens = np.random.default_rng(2).integers(0, VOCAB, SEQ).tolist()
    return name, folder, ref, tokens


def _theirs(ref, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return ref(torch.tensor([tokens])).logits[0].float().numpy()


def _ours(model, tokens: list[int]) -> np.ndarray:
    return np.array(model(mx.array([tokens]))[0].astype(mx.float32))


@pytest.mark.core
def test_hf_folder_matches_transformers(hf_case):
    name, folder, ref, tokens = hf_case
    model, _ = load(folder)
    theirs, ours = _theirs(ref, tokens), _ours(model, tokens)
    assert max_rel_diff(ours, theirs) <= 1e-4, name
    assert argmax_agreement(ours, theirs) == 1.0, name
    assert (theirs.max() - theirs.min()) > 5.0  # logits spread: argmax is decisive
    if _windowed(name):  # the window matters at this length: full attention differs
        cfg, weights, _ = load_hf(folder)
        cfg.sliding_window = None
        full = build_model(cfg, weights)
        assert max_rel_diff(_ours(full, tokens), theirs) > 1e-2


@pytest.mark.core
def test_gguf_export_runs_in_llama_cpp(hf_case, tmp_path):
    name, folder, ref, tokens = hf_case
    out = export(folder, str(tmp_path / "m.gguf"), "gguf", "f32")
    spec_cfg, hf_weights, _ = load_hf(folder)
    gguf_arch = spec_of(spec_cfg.arch).gguf_arch
    # llama.cpp's own names for this architecture (gguf-py's tables are llama.cpp's)
    arch_enum = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == gguf_arch)
    allowed = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[arch_enum]}
    ours = {t.name for t in gguf.GGUFReader(out).tensors}
    names = {re.sub(r"^blk\.\d+\.", "blk.{bid}.", n.rsplit(".", 1)[0]) for n in ours}
    assert names <= allowed, names - allowed
    # and each HF tensor becomes the GGUF tensor llama.cpp's converter maps it to
    tmap = gguf.get_tensor_name_map(arch_enum, spec_cfg.n_layers)
    with safe_open(os.path.join(folder, "model.safetensors"), "np") as f:
        hf_names = list(f.keys())
    mapped = {tmap.get_name(n, try_suffixes=(".weight", ".bias")) for n in hf_names}
    assert mapped == ours - {n for n in ours if n.startswith("rope_factors")}, mapped ^ ours
    short = len(_gguf_tokens(name, tokens)) < len(tokens)
    tokens = _gguf_tokens(name, tokens)
    theirs = _theirs(ref, tokens)
    cpp = llama_cpp_logits(out, tokens)
    assert max_rel_diff(cpp, theirs) <= 1e-3, name
    assert argmax_agreement(cpp, theirs) == 1.0, name
    cfg, weights, meta = load_gguf(out)
    assert meta.metadata[f"{gguf_arch}.context_length"] == (len(tokens) if short else ref.config.max_position_embeddings)
    assert set(weights) == set(hf_weights)
    for k, v in weights.items():
        assert mx.array_equal(v, hf_weights[k]).item(), k
    model, _ = load(out)
    assert max_rel_diff(_ours(model, tokens), cpp) <= 1e-4


def _lora_copy(folder: str, targets, seed: int = 3):
    base, tok = load(folder)
    model, _ = load(folder)
    apply_lora(model, targets, rank=4, alpha=8.0, per_head_q=True,
               paths=spec_of(model.config.arch).lora_targets)
    rng = np.random.default_rng(seed)
    for _, m in lora_modules(model):
        m.lora_b = mx.array((0.3 * rng.standard_normal(m.lora_b.shape)).astype(np.float32))
    mx.eval(model.parameters())
    return base, model, tok


@pytest.mark.parametrize("targets", [("q", "k", "v", "o", "gate", "up", "down"), ("q", "down")])
def test_peft_and_llama_cpp_adapters(hf_case, tmp_path, targets):
    name, folder, ref, tokens = hf_case
    base, model, tok = _lora_copy(folder, targets)
    ours = _ours(model, tokens)
    assert max_rel_diff(ours, _ours(base, tokens)) > 1e-2  # the adapter matters
    adapter = export_model(model, tok, str(tmp_path / "peft"), "peft", "f32")
    fresh = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)  # PEFT wraps in place
    with torch.no_grad():
        lora_logits = peft.PeftModel.from_pretrained(fresh, adapter)(torch.tensor([tokens])).logits[0].numpy()
    assert max_rel_diff(lora_logits, ours) <= 1e-4, name
    tokens = _gguf_tokens(name, tokens)
    base_gguf = export_model(base, tok, str(tmp_path / "base.gguf"), "gguf", "f32")
    merged = export_model(model, tok, str(tmp_path / "merged.gguf"), "gguf", "f32")
    lora_gguf = export_model(model, tok, str(tmp_path / "adapter.gguf"), "adapter-gguf", "f32")
    with_lora = llama_cpp_logits(base_gguf, tokens, lora_path=lora_gguf)
    assert max_rel_diff(with_lora, llama_cpp_logits(merged, tokens)) <= 1e-4, name
    assert max_rel_diff(with_lora, _ours(model, tokens)) <= 1e-3, name


def test_mlx_lm_loads_our_hf_export_and_adapters(hf_case, tmp_path):
    name, folder, _, tokens = hf_case
    if name == "mistral_window":
        pytest.skip("mlx-lm's llama windows no layer of a Mistral config (full attention)")
    if name == "phi3_longrope":
        pytest.skip("mlx-lm's SuScaledRoPE applies the long factors within the original context")
    base, model, tok = _lora_copy(folder, ("q", "k", "v", "o", "gate", "up", "down"))
    hf = export_model(base, tok, str(tmp_path / "hf"), "hf", "f32")
    adapters = export_model(model, tok, str(tmp_path / "mlx-lm"), "mlx-lm", "f32")
    with torch.no_grad():  # our HF export in transformers
        back = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
        assert max_rel_diff(back(torch.tensor([tokens])).logits[0].numpy(), _ours(base, tokens)) <= 1e-4, name
    theirs, _ = mlx_lm.load(hf)
    assert max_rel_diff(np.array(theirs(mx.array([tokens]))[0]), _ours(base, tokens)) <= 1e-4, name
    theirs, _ = mlx_lm.load(hf, adapter_path=adapters)
    assert max_rel_diff(np.array(theirs(mx.array([tokens]))[0]), _ours(model, tokens)) <= 1e-4, name


@pytest.mark.parametrize("method", ["lora", "dora", "full"])
@pytest.mark.core
def test_fine_tuning_lowers_the_loss(hf_case, tmp_path, method):
    name, folder, _, _ = hf_case
    data = write_jsonl(str(tmp_path / "d" / "train.jsonl"),
                       [{"text": "the rain in spain falls mainly on the plain"}] * 8)
    cfg = TrainConfig(model=folder, data=data, out=str(tmp_path / "run"), method=method,
                      steps=12, batch_size=2, seq_len=32, lr=1e-3 if method == "full" else 3e-3,
                      lora_targets=["q", "v", "down"], eval_every=0, save_every=0, seed=0)
    losses = []
    run_training(cfg, on_event=lambda e: losses.append(e.loss) if e.event == "step" else None)
    assert len(losses) == 12 and losses[-1] < 0.7 * losses[0], (name, losses)


@pytest.mark.core
def test_cached_decoding_equals_uncached(hf_case):
    """64 tokens past the window, greedily through the compiled decode step and step by step
    through the KV cache: each equals the uncached forward."""
    name, folder, _, tokens = hf_case
    model, _ = load(folder)
    window = _windowed(name) or 16
    prompt = tokens[:8]
    new = [t for t, _ in generate_tokens(model, prompt, max_tokens=window + 64 - len(prompt))]
    seq = prompt + new
    full = _ours(model, seq)
    assert full[len(prompt) - 1:-1].argmax(-1).tolist() == new
    cache = make_cache(model)
    model(mx.array([prompt]), cache=cache)
    stepped = [np.array(model(mx.array([[t]]), cache=cache)[0, -1]) for t in seq[len(prompt):]]
    assert np.abs(np.stack(stepped) - full[len(prompt):]).max() <= 1e-4 * np.abs(full).max()


def test_taps_keep_their_meaning(hf_case):
    """attn_norm / ffn_out / resid_post on every architecture; Gemma's ffn_out is after its
    post-FFN norm (unit RMS once its weight is divided out); per-head taps (explicit attention,
    windows included) leave the logits unchanged."""
    name, folder, _, tokens = hf_case
    model, _ = load(folder)
    taps: dict = {"_heads": True}
    with_taps = np.array(model(mx.array([tokens]), taps=taps)[0])
    np.testing.assert_allclose(with_taps, _ours(model, tokens), rtol=0, atol=1e-4 * np.abs(with_taps).max())
    n = model.config.n_layers
    assert {(i, s) for i in range(n) for s in ("attn_norm", "ffn_out", "resid_post", "attn_entropy")} <= set(taps)
    for i in range(1, n):  # resid_post = previous stream + attention part + ffn_out
        attn_part = taps[(i, "resid_post")] - taps[(i - 1, "resid_post")] - taps[(i, "ffn_out")]
        assert float(mx.abs(attn_part).max()) > 0
    if name.startswith("gemma3"):
        w = model.layers[0].post_ffn_norm.weight
        rms = mx.sqrt(((taps[(0, "ffn_out")] / w) ** 2).mean(-1))
        assert float(mx.abs(rms - 1).max()) < 1e-2


@pytest.mark.parametrize("hf_case", ["qwen3_untied"], indirect=True)  # one variant is enough
def test_unknown_architecture_and_missing_field_exit_2(hf_case, tmp_path):
    name, folder, _, _ = hf_case
    import shutil
    import subprocess
    import sys

    with open(os.path.join(folder, "config.json")) as f:
        raw = json.load(f)
    for label, edit, needles in [
        ("unknown", lambda c: c | {"architectures": ["FalconForCausalLM"], "model_type": "falcon"},
         ("unknown architecture", "FalconForCausalLM", "Gemma3ForCausalLM", "Qwen3ForCausalLM")),
        ("missing", lambda c: {k: v for k, v in c.items() if k != "hidden_size"},
         ("config.json", "missing field hidden_size")),
    ]:
        bad = str(tmp_path / label)
        shutil.copytree(folder, bad)
        with open(os.path.join(bad, "config.json"), "w") as f:
            json.dump(edit(raw), f)
        proc = subprocess.run([sys.executable, "-m", "mlxtoy", "inspect", bad], capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
        assert all(n in lines[0] for n in needles), lines[0]


def test_longrope_past_the_original_context(tmp_path):
    """96 tokens past a 64-token original context: long factors in transformers (by the
    sequence) and in llama.cpp (by its context), and in our export's round trip."""
    config = transformers.Phi3Config(**{**BASE, **LONGROPE, "num_hidden_layers": 2, "partial_rotary_factor": 0.5,
                                        "pad_token_id": 0, "original_max_position_embeddings": 64})
    ref = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(ref, seed=4)
    ref.eval()
    folder = str(tmp_path / "hf")
    ref.save_pretrained(folder)
    write_tiny_tokenizer(folder)
    tokens = np.random.default_rng(5).integers(0, VOCAB, SEQ).tolist()
    theirs = _theirs(ref, tokens)
    model, _ = load(folder)
    assert max_rel_diff(_ours(model, tokens), theirs) <= 1e-4
    out = export(folder, str(tmp_path / "m.gguf"), "gguf", "f32")
    cpp = llama_cpp_logits(out, tokens)
    assert max_rel_diff(cpp, theirs) <= 1e-3 and argmax_agreement(cpp, theirs) == 1.0
    back, _ = load(out)
    assert max_rel_diff(_ours(back, tokens), cpp) <= 1e-4


@pytest.mark.parametrize("hf_case", ["qwen3_untied"], indirect=True)  # one tokenizer source is enough
@pytest.mark.parametrize("arch", ["qwen3", "mistral", "phi3", "gemma3"])
def test_scratch_model_exports_as_its_architecture(hf_case, tmp_path, arch):
    """A model trained from scratch takes the fields its architecture fixes (RoPE layout, q/k
    norm, tied output) and so runs in llama.cpp as that architecture."""
    name, folder, _, tokens = hf_case
    data = write_jsonl(str(tmp_path / "d" / "train.jsonl"), [{"text": "the rain in spain"}] * 8)
    run = str(tmp_path / "run")
    cfg = TrainConfig(method="scratch", arch=arch, tokenizer=folder, data=data, out=run, steps=2,
                      batch_size=2, seq_len=32, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                      d_head=16, d_ff=128, eval_every=0, save_every=0, seed=0)
    run_training(cfg)
    model, _ = load(run)
    assert model.config.arch == arch and spec_of(arch).scratch.items() <= model.config.to_dict().items()
    out = export(run, str(tmp_path / "m.gguf"), "gguf", "f32")
    tokens = tokens[:32]
    assert max_rel_diff(llama_cpp_logits(out, tokens), _ours(model, tokens)) <= 1e-3


def test_reading_a_model_leaves_the_rng_alone(hf_case):
    """Readers build the module lazily for its shapes; a seeded run must draw the same LoRA
    init whether or not a file was read in between (the golden loss curves rely on it)."""
    _, folder, _, _ = hf_case
    mx.random.seed(7)
    want = np.array(mx.random.normal((4,)))
    mx.random.seed(7)
    cfg, _, _ = load_hf(folder)
    assert np.array_equal(np.array(mx.random.normal((4,))), want)
    mx.random.seed(7)
    spec_of(cfg.arch).model(cfg)  # positive control: building draws from the RNG
    assert not np.array_equal(np.array(mx.random.normal((4,))), want)
