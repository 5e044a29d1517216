"""Loading and computing exactly: our logits against llama.cpp, transformers and ourselves."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from helpers_parity import (compare, llama_cpp_logits, llama_quantize, our_logits,
                            random_gguf_tensors, tiny_config, write_tiny_gguf)
from helpers_gguf import copy_gguf_metadata, retype_gguf_to_f32 as retype_to_f32

ENGLISH = (
    "The history of the lighthouse is a story of people trying to make the sea a little less "
    "dangerous. Long before electric lamps, keepers burned wood, coal and whale oil in open fires "
    "at the top of stone towers. In 1822 the French physicist Augustin Fresnel designed a lens made "
    "of concentric rings of glass prisms, which gathered the light of a single flame into a narrow "
    "beam that could be seen more than twenty miles away. His design spread quickly along the "
    "coasts of Europe and America, and many of those lenses are still in use today. Keeping a "
    "light was lonely work: the keeper trimmed the wick, wound the clockwork that turned the lens, "
    "and wrote the weather in a log book every few hours through the night."
)


def _tokens(n: int, vocab: int, seed: int = 1) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab, n)]


VARIANTS = {
    "llama-gqa": dict(),
    "llama-mha-untied": dict(n_kv_heads=4, tie_embeddings=False),
    "llama-wide-heads": dict(n_heads=8, n_kv_heads=2, d_head=64),  # 8*64 != d_model 256
    "qwen2-bias": dict(arch="qwen2", qkv_bias=True, rope_base=1e6),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.core
def test_tiny_llama_cpp_parity(tmp_path, variant):
    cfg = tiny_config(**VARIANTS[variant])
    path = write_tiny_gguf(str(tmp_path / "m.gguf"), cfg, random_gguf_tensors(cfg, seed=3))
    tokens = _tokens(96, cfg.vocab_size)
    r = compare(our_logits(path, tokens), llama_cpp_logits(path, tokens))
    print(variant, r)
    assert r["mismatch"] == [] and r["rel"] < 1e-5


def test_tiny_llama3_rope_freqs(tmp_path):
    """llama3 RoPE scaling arrives in GGUF as a rope_freqs tensor of per-frequency factors."""
    from mlxtoy.models.llama import llama3_rope_freqs

    cfg = tiny_config(rope_base=500000.0, context_length=512)
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    dims = cfg.d_head
    base = cfg.rope_base ** (np.arange(0, dims, 2) / dims)
    factors = np.array(llama3_rope_freqs(dims, cfg.rope_base, scaling)) / base
    assert factors.max() > 1.5  # the scaling really changes some frequencies
    path = write_tiny_gguf(str(tmp_path / "m.gguf"), cfg,
                           random_gguf_tensors(cfg, seed=4, freq_factors=factors))
    tokens = _tokens(200, cfg.vocab_size)
    r = compare(our_logits(path, tokens), llama_cpp_logits(path, tokens))
    assert r["mismatch"] == [] and r["rel"] < 1e-5, r


def test_tiny_linear_rope_scaling(tmp_path):
    cfg = tiny_config()
    path = write_tiny_gguf(str(tmp_path / "m.gguf"), cfg, random_gguf_tensors(cfg, seed=5),
                           rope_scaling_linear=4.0)
    tokens = _tokens(128, cfg.vocab_size)
    r = compare(our_logits(path, tokens), llama_cpp_logits(path, tokens))
    assert r["mismatch"] == [] and r["rel"] < 1e-5, r


@pytest.mark.parametrize("qtype", ["F16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
@pytest.mark.core
def test_tiny_tensor_types(tmp_path, qtype):
    """Dequantization is exact (our logits on the quantized file equal those on its F32
    re-typing) and the result agrees with llama.cpp's run of that F32 re-typing."""
    import gguf

    cfg = tiny_config()
    f32 = write_tiny_gguf(str(tmp_path / "m.gguf"), cfg, random_gguf_tensors(cfg, seed=6))
    quant = llama_quantize(f32, str(tmp_path / f"m-{qtype}.gguf"), qtype)
    types = {t.tensor_type.name for t in gguf.GGUFReader(quant).tensors}
    assert qtype in types, types
    retyped = retype_to_f32(quant, str(tmp_path / f"m-{qtype}-f32.gguf"))
    tokens = _tokens(96, cfg.vocab_size)
    ours_q = our_logits(quant, tokens)
    assert np.array_equal(ours_q, our_logits(retyped, tokens))
    r = compare(ours_q, llama_cpp_logits(retyped, tokens))
    assert r["mismatch"] == [] and r["rel"] < 1e-5, r


@pytest.mark.parametrize("qtype", ["F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K",
                                   "Q4_K", "Q5_K", "Q6_K"])
def test_dequantization_equals_llama_cpps_own(tmp_path, qtype):
    """Every supported type: our dequantization of a file llama.cpp quantized is bit-equal to
    llama.cpp's own dequantization of it (its F32 re-typing), tensor by tensor."""
    import gguf

    from mlxtoy.io.gguf_file import dequantize_tensor, open_gguf

    cfg = tiny_config()
    f32 = write_tiny_gguf(str(tmp_path / "m.gguf"), cfg, random_gguf_tensors(cfg, seed=8))
    quant = llama_quantize(f32, str(tmp_path / f"m-{qtype}.gguf"), qtype)
    theirs = {t.name: t for t in gguf.GGUFReader(llama_quantize(quant, str(tmp_path / "back.gguf"), "F32")).tensors}
    reader = open_gguf(quant)
    assert qtype in {t.tensor_type.name for t in reader.tensors}
    for t in reader.tensors:
        ref = theirs[t.name]
        assert ref.tensor_type.name == "F32"
        want = np.asarray(ref.data, dtype=np.float32).reshape(tuple(reversed(ref.shape.tolist())))
        got = dequantize_tensor(t, quant)
        assert got.shape == want.shape and np.array_equal(got.view(np.uint32), want.view(np.uint32)), (
            t.name, t.tensor_type.name)


def test_bf16_read_exactly(tmp_path):
    """BF16 tensors are widened bit-exactly (mx.load would go through float16 and overflow)."""
    import gguf

    from mlxtoy.io.gguf_read import load_gguf

    cfg = tiny_config()
    tensors = random_gguf_tensors(cfg, seed=7)
    tensors["blk.0.ffn_norm.weight"][:4] = [1e30, -3e38, 65504.0 * 4, 1.5]  # beyond float16
    bf16 = {}
    for name, arr in tensors.items():
        bits = arr.astype(np.float32).view(np.uint32)
        bf16[name] = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # RNE
    path = str(tmp_path / "bf16.gguf")
    w = gguf.GGUFWriter(path, "llama")
    f32 = write_tiny_gguf(str(tmp_path / "f32.gguf"), cfg, tensors)
    copy_gguf_metadata(gguf.GGUFReader(f32), w)
    for name, arr in bf16.items():
        w.add_tensor(name, arr, raw_shape=arr.shape, raw_dtype=gguf.GGMLQuantizationType.BF16)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    _, weights, meta = load_gguf(path)
    got = np.array(weights["layers.0.ffn_norm.weight"])
    expect = (bf16["blk.0.ffn_norm.weight"].astype(np.uint32) << 16).view(np.float32)
    assert meta.tensor_types["blk.0.ffn_norm.weight"] == "BF16"
    assert np.array_equal(got, expect) and np.isfinite(got).all() and got[1] < -1e38


def test_gguf_and_hf_folder_agree(tmp_path):
    import mlx.core as mx

    from mlxtoy.io.gguf_read import load_gguf
    from mlxtoy.io.hf import load_hf, save_hf
    from mlxtoy.loading import build_model

    for variant in ("llama-gqa", "qwen2-bias", "llama-mha-untied"):
        cfg = tiny_config(**VARIANTS[variant])
        path = write_tiny_gguf(str(tmp_path / f"{variant}.gguf"), cfg, random_gguf_tensors(cfg, seed=8))
        cfg1, w1, _ = load_gguf(path)
        save_hf(str(tmp_path / variant), cfg1, w1)
        cfg2, w2, _ = load_hf(str(tmp_path / variant))
        assert cfg2.tie_embeddings == cfg1.tie_embeddings and cfg2.qkv_bias == cfg1.qkv_bias
        tokens = mx.array([_tokens(64, cfg.vocab_size)])
        a = build_model(cfg1, w1)(tokens)
        b = build_model(cfg2, w2)(tokens)
        assert mx.array_equal(a, b).item(), variant


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-bias"])
@pytest.mark.core
def test_hf_folder_matches_transformers(tmp_path, variant):
    import torch
    import transformers
    import mlx.core as mx

    from mlxtoy.io.gguf_read import load_gguf
    from mlxtoy.io.hf import load_hf, save_hf
    from mlxtoy.loading import build_model

    cfg = tiny_config(**VARIANTS[variant])
    path = write_tiny_gguf(str(tmp_path / "m.gguf"), cfg, random_gguf_tensors(cfg, seed=9))
    cfg1, w1, _ = load_gguf(path)
    folder = str(tmp_path / "hf")
    save_hf(folder, cfg1, w1)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    ref.eval()
    tokens = _tokens(64, cfg.vocab_size)
    with torch.no_grad():
        expect = ref(torch.tensor([tokens])).logits[0].numpy()
    cfg2, w2, _ = load_hf(folder)
    got = np.array(build_model(cfg2, w2)(mx.array([tokens]))[0])
    r = compare(got, expect)
    assert r["mismatch"] == [] and r["rel"] < 1e-5, r


# ---- the real model -------------------------------------------------------------------------

@pytest.mark.real
@pytest.mark.core
def test_smollm2_parity_with_llama_cpp(smollm2_path, smollm2_f32_path):
    from mlxtoy import load

    _, tokenizer = load(smollm2_path)
    tokens = tokenizer.encode(ENGLISH)
    assert len(tokens) >= 128
    ours_f32 = our_logits(smollm2_f32_path, tokens)
    ref_f32 = llama_cpp_logits(smollm2_f32_path, tokens)
    r = compare(ours_f32, ref_f32)
    print(f"\nSmolLM2 F32 vs llama.cpp over {len(tokens)} tokens: max |logit diff| "
          f"{r['max_abs_diff']:.2e} over a logit range of {r['range']:.1f} ({r['rel']:.1e} of it); "
          f"argmax agreement {r['argmax_agree']:.3f}")
    assert r["mismatch"] == []
    assert r["rel"] <= 1e-3

    # Exact dequantization: the Q4_1 file computes exactly what its F32 re-typing does.
    ours_q = our_logits(smollm2_path, tokens)
    assert np.array_equal(ours_q, ours_f32)

    # llama.cpp's own Q4_1 run rounds activations to 8 bits; we agree with it at least as
    # often as it agrees with itself on F32.
    ref_q = llama_cpp_logits(smollm2_path, tokens)
    self_agree = float((ref_q.argmax(-1) == ref_f32.argmax(-1)).mean())
    ours_agree = float((ours_q.argmax(-1) == ref_q.argmax(-1)).mean())
    print(f"argmax agreement with llama.cpp Q4_1: ours {ours_agree:.3f}, llama.cpp F32 {self_agree:.3f}")
    assert ours_agree >= self_agree


# ---- bad input ------------------------------------------------------------------------------

def _inspect(path: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlxtoy", "inspect", path],
                          capture_output=True, text=True, timeout=300)


def _assert_user_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    cfg = tiny_config()
    d = tmp_path_factory.mktemp("bad")
    return cfg, write_tiny_gguf(str(d / "ok.gguf"), cfg, random_gguf_tensors(cfg, seed=10))


def _rewrite(src: str, dst: str, arch: str | None = None, drop: str | None = None,
             reshape: str | None = None, retype: str | None = None) -> str:
    import gguf

    reader = gguf.GGUFReader(src)
    arch = arch or reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(dst, arch)
    copy_gguf_metadata(reader, w, reader.fields["general.architecture"].contents(), arch)
    for t in reader.tensors:
        if t.name == drop:
            continue
        arr = np.array(t.data).reshape([int(n) for n in reversed(t.shape.tolist())])
        if t.name == reshape:
            arr = arr[:, :-32]
        if t.name == retype:
            # IQ4_NL blocks: 32 values in 18 bytes; gguf-py takes the byte shape
            raw = np.zeros((arr.shape[0], arr.shape[1] // 32 * 18), dtype=np.uint8)
            w.add_tensor(t.name, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)
            continue
        w.add_tensor(t.name, np.ascontiguousarray(arr))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return dst


def test_error_missing_file(tmp_path):
    _assert_user_error(_inspect(str(tmp_path / "nope.gguf")), "nope.gguf", "no such file")


def test_error_wrong_magic(tmp_path):
    p = tmp_path / "fake.gguf"
    p.write_bytes(b"GGML" + os.urandom(100))
    _assert_user_error(_inspect(str(p)), "fake.gguf", "not a GGUF file")


def test_error_truncated(tmp_path, tiny_gguf):
    data = open(tiny_gguf[1], "rb").read()
    for cut in (len(data) // 2, 200):
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(data[:cut])
        _assert_user_error(_inspect(str(p)), p.name)


def test_error_corrupt(tmp_path, tiny_gguf):
    data = bytearray(open(tiny_gguf[1], "rb").read())
    data[8:24] = b"\xff" * 16  # absurd tensor / key-value counts
    p = tmp_path / "corrupt.gguf"
    p.write_bytes(bytes(data))
    _assert_user_error(_inspect(str(p)), "corrupt.gguf")


def test_error_unknown_architecture(tmp_path, tiny_gguf):
    p = _rewrite(tiny_gguf[1], str(tmp_path / "arch.gguf"), arch="falcon")
    _assert_user_error(_inspect(p), "arch.gguf", "unknown architecture", "falcon")


def test_error_missing_tensor(tmp_path, tiny_gguf):
    p = _rewrite(tiny_gguf[1], str(tmp_path / "missing.gguf"), drop="blk.1.ffn_up.weight")
    _assert_user_error(_inspect(p), "missing.gguf", "blk.1.ffn_up.weight")


def test_error_wrong_shape(tmp_path, tiny_gguf):
    p = _rewrite(tiny_gguf[1], str(tmp_path / "shape.gguf"), reshape="blk.0.attn_k.weight")
    _assert_user_error(_inspect(p), "shape.gguf", "blk.0.attn_k.weight", "shape")


def test_error_unsupported_tensor_type(tmp_path, tiny_gguf):
    p = _rewrite(tiny_gguf[1], str(tmp_path / "type.gguf"), retype="blk.0.ffn_gate.weight")
    _assert_user_error(_inspect(p), "type.gguf", "blk.0.ffn_gate.weight", "IQ4_NL")


def test_inspect_reports_model(tiny_gguf):
    proc = _inspect(tiny_gguf[1])
    assert proc.returncode == 0, proc.stderr
    assert "llama" in proc.stdout and "2 layers" in proc.stdout and "F32" in proc.stdout
