"""K-quant and Q4_0 / Q5_0 GGUF export through llama.cpp's own quantizer.

Every file is read back by llama.cpp (llama-cpp-python) and by gguf-py's GGUFReader; its
bytes are compared with llama.cpp's quantizer run directly on our F16 export, and its logits
with the F32 model's on an English text (SmolLM2, under `real`).
"""

from __future__ import annotations

import os
import stat
import sys

import gguf
import numpy as np
import pytest

import mlxtoy  # noqa: F401  (fast BLAS before mlx.core)
from helpers_export import (TEXT, VOCAB, argmax_agreement, llama_cpp_logits, max_rel_diff, randomize,
                            tiny_tokenizer_metadata)
from helpers_parity import llama_quantize
from mlxtoy.cli import main as cli_main
from mlxtoy.errors import UserError
from mlxtoy.export import export, export_model
from mlxtoy.io.quantize import find_quantizer
from mlxtoy.loading import load_tokenizer
from mlxtoy.model_config import LoadedMeta, ModelConfig
from mlxtoy.models.llama import LlamaModel

# our --dtype -> (llama.cpp's name in tests/helpers_parity, the types its big matrices get)
KQ = {"Q4_K", "Q5_K", "Q6_K"}
TYPES = {"q4_k_m": ("Q4_K", KQ), "q5_k_m": ("Q5_K", {"Q5_K", "Q6_K"}), "q6_k": ("Q6_K", {"Q6_K"}),
         "q4_0": ("Q4_0", {"Q4_0", "Q4_1", "Q6_K"}), "q5_0": ("Q5_0", {"Q5_0", "Q5_1", "Q6_K"})}


def tiny_256(seed: int = 0) -> LlamaModel:
    """A tiny random llama whose rows are multiples of 256 (the K-quant super-block), so every
    matrix can take a K-quant type (narrower rows make llama.cpp fall back to Q5_0 / Q8_0)."""
    cfg = ModelConfig(arch="llama", vocab_size=VOCAB, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2,
                      d_head=64, d_ff=512, norm_eps=1e-5, rope_base=10000.0, context_length=256)
    model = randomize(LlamaModel(cfg), seed)
    model.meta = LoadedMeta(source="tiny-256", format="gguf", metadata=tiny_tokenizer_metadata())
    return model


def tensor_types(path: str) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    model = tiny_256()
    f32 = export_model(model, None, str(d / "f32.gguf"), "gguf", "f32")
    f16 = export_model(model, None, str(d / "f16.gguf"), "gguf", "f16")
    tokens = np.random.default_rng(1).integers(0, VOCAB, 160).tolist()
    ref = llama_cpp_logits(f32, tokens)
    # positive control for the logit check: another random model is far off. (Not for argmax:
    # a random tied model's argmax is mostly the input token, whichever the weights.)
    other = export_model(tiny_256(seed=1), None, str(d / "other.gguf"), "gguf", "f32")
    assert max_rel_diff(llama_cpp_logits(other, tokens), ref) > 0.3
    return model, f32, f16, tokens, ref


@pytest.mark.parametrize("dtype", list(TYPES))
def test_tiny_quantized_export_is_llama_cpps_own(tmp_path, tiny, dtype):
    """Bytes equal llama.cpp's quantizer on our F16 file; matrices get the quant types; it loads
    in llama.cpp and its argmax follows the F32 model's; no temp file is left behind."""
    model, f32, f16, tokens, ref = tiny
    out = export_model(model, None, str(tmp_path / f"m-{dtype}.gguf"), "gguf", dtype)
    assert os.listdir(tmp_path) == [f"m-{dtype}.gguf"]  # the F16 intermediate is gone
    name, allowed = TYPES[dtype]
    direct = llama_quantize(f16, str(tmp_path.parent / f"direct-{dtype}.gguf"), name)
    with open(out, "rb") as a, open(direct, "rb") as b:
        assert a.read() == b.read()
    types = tensor_types(out)
    big = {n: t for n, t in types.items() if n.endswith(".weight") and "norm" not in n}
    assert len(big) == 1 + 2 * 7  # token_embd + 7 matrices per block
    assert set(big.values()) <= allowed, big
    assert big["blk.0.attn_q.weight"] == name  # the type asked for, where llama.cpp keeps it
    assert all(t == "F32" for n, t in types.items() if "norm" in n)
    # the tokenizer and chat template carry over unchanged
    fields = gguf.GGUFReader(out).fields
    for key, value in tiny_tokenizer_metadata().items():
        if key.startswith("tokenizer."):
            got = fields[key].contents()
            assert got == value, key
    q = llama_cpp_logits(out, tokens)
    assert argmax_agreement(q, ref) >= 0.95
    assert max_rel_diff(q, ref) <= 0.03  # measured 0.7-1.0% of the largest logit


def test_cli_export_q4_k_m_stdout_and_size(tmp_path, tiny, capfd):
    model, f32, *_ = tiny
    out = str(tmp_path / "q.gguf")
    capfd.readouterr()
    assert cli_main(["export", f32, "--out", out, "--dtype", "q4_k_m"]) == 0
    captured = capfd.readouterr()  # file descriptors too: llama.cpp's C code writes there
    assert captured.out == out + "\n"  # stdout: the product only
    assert "q4_k_m" in captured.err
    # Q4_K is 4.5 bits a weight: a quarter of F16 give or take the F32 norms and Q6_K layers
    assert os.path.getsize(out) < 0.45 * os.path.getsize(tiny[2])


def test_quantized_needs_gguf_format(tmp_path, tiny):
    with pytest.raises(UserError, match="--format gguf"):
        export(tiny[1], str(tmp_path / "a.gguf"), "adapter-gguf", "q4_k_m")
    with pytest.raises(UserError, match="f32 or f16"):
        export(tiny[1], str(tmp_path / "h"), "hf", "q4_k_m")


def test_no_quantizer_is_one_clear_error(tmp_path, tiny, monkeypatch, capsys):
    """Neither llama-cpp-python nor llama-quantize: one error line naming both, exit 2, nothing
    written. Positive control: the same call works with the binary on PATH (next test)."""
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` now fails
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    out = tmp_path / "q.gguf"
    assert cli_main(["export", tiny[1], "--out", str(out), "--dtype", "q4_k_m"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --dtype q4_k_m needs llama.cpp's quantizer")
    assert "mlxtoy[gguf]" in err[0] and "llama-quantize" in err[0]
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if p.endswith(".gguf")]


def test_llama_quantize_binary_on_path(tmp_path, tiny, monkeypatch):
    """Without llama-cpp-python in the process, a `llama-quantize` on PATH is used with its
    command line (IN OUT TYPE THREADS). The stand-in runs llama.cpp's quantizer itself, in its
    own process, and records its arguments."""
    model, f32, f16, *_ = tiny
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "argv.txt"
    script = bindir / "llama-quantize"
    script.write_text(
        f"#!{sys.executable}\n"
        "import sys, llama_cpp\n"
        f"open({str(log)!r}, 'w').write(' '.join(sys.argv[1:]))\n"
        "src, dst, name = sys.argv[1:4]\n"
        "p = llama_cpp.llama_model_quantize_default_params()\n"
        "p.ftype = getattr(llama_cpp, 'LLAMA_FTYPE_MOSTLY_' + name)\n"
        "p.nthread = int(sys.argv[4])\n"
        "sys.exit(llama_cpp.llama_model_quantize(src.encode(), dst.encode(), p))\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    monkeypatch.setenv("PATH", str(bindir))
    assert find_quantizer("q4_k_m").kind == "binary"
    out = export(f32, str(tmp_path / "out" / "m.gguf"), "gguf", "q4_k_m")
    args = log.read_text().split()
    assert args[2:] == ["Q4_K_M", str(os.cpu_count())] and args[1].startswith(str(tmp_path / "out"))
    monkeypatch.delitem(sys.modules, "llama_cpp")
    direct = llama_quantize(f16, str(tmp_path / "direct.gguf"), "Q4_K")
    with open(out, "rb") as a, open(direct, "rb") as b:
        assert a.read() == b.read()
    assert os.listdir(tmp_path / "out") == ["m.gguf"]


def test_failed_quantizer_keeps_the_old_file(tmp_path, tiny, monkeypatch):
    """A quantizer that fails: one error, the previous file at the target stays, no temp left."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    script = bindir / "llama-quantize"
    script.write_text("#!/bin/sh\necho 'llama_model_quantize: failed to quantize: out of cheese' >&2\nexit 1\n")
    script.chmod(0o755)
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    monkeypatch.setenv("PATH", str(bindir))
    target = tmp_path / "out" / "m.gguf"
    target.parent.mkdir()
    target.write_bytes(b"previous export")
    with pytest.raises(UserError, match="out of cheese"):
        export(tiny[1], str(target), "gguf", "q4_k_m")
    assert target.read_bytes() == b"previous export"
    assert os.listdir(target.parent) == ["m.gguf"]


@pytest.mark.real
def test_smollm2_q4_k_m(tmp_path, smollm2_path, smollm2_f32_path):
    """SmolLM2 as Q4_K_M: exactly llama.cpp's bytes, K-quant matrices where llama.cpp allows
    them, and its argmax against the F32 model (the dequantized weights) on 128 tokens of English.

    SmolLM2-135M's width is 576, not a multiple of 256, so llama.cpp gives the matrices with
    576-wide rows its fallback types (Q5_0 / Q8_0); ffn_down (1536-wide rows) is K-quant.
    Measured here: 87.5% argmax agreement over all 128 positions (112/128), 100% at the 94
    positions whose F32 top-2 gap is >= 0.5, the F32 argmax in Q4_K_M's top 2 at 96.9%. Every
    miss is a near tie. This is llama.cpp's own Q4_K_M (the same bytes): its Q8_0 of this model
    agrees 94.5% (test_export), its Q5_K_M 86%; 90% over all positions is out of its reach here."""
    tokens = load_tokenizer(smollm2_path).encode(TEXT)[:128]
    assert len(tokens) == 128
    out = str(tmp_path / "s-q4_k_m.gguf")
    assert cli_main(["export", smollm2_path, "--out", out, "--dtype", "q4_k_m"]) == 0
    f16 = export(smollm2_path, str(tmp_path / "s-f16.gguf"), "gguf", "f16")
    direct = llama_quantize(f16, str(tmp_path / "direct.gguf"), "Q4_K")
    with open(out, "rb") as a, open(direct, "rb") as b:
        assert a.read() == b.read()
    reader = gguf.GGUFReader(out)
    for t in reader.tensors:
        if t.name.endswith(".weight") and "norm" not in t.name:
            ncols = int(t.shape[0])
            if ncols % 256 == 0:
                assert t.tensor_type.name in KQ, (t.name, t.tensor_type.name)
            else:
                assert t.tensor_type.name in ("Q5_0", "Q5_1", "Q8_0"), (t.name, t.tensor_type.name)
    kq = [t.name for t in reader.tensors if t.tensor_type.name in KQ]
    assert len([n for n in kq if "ffn_down" in n]) == 30
    ref = llama_cpp_logits(smollm2_f32_path, tokens)
    q = llama_cpp_logits(out, tokens)
    top2 = np.sort(ref, axis=-1)[:, -2:]
    decisive = (top2[:, 1] - top2[:, 0]) >= 0.5
    in_top2 = float(np.mean([r in o[-2:] for r, o in zip(ref.argmax(-1), np.argsort(q, axis=-1))]))
    agree = argmax_agreement(q, ref)
    print(f"SmolLM2 Q4_K_M vs F32 on {len(tokens)} tokens: argmax agreement {agree:.3f}, "
          f"{argmax_agreement(q[decisive], ref[decisive]):.3f} at {decisive.sum()} decisive positions, "
          f"F32 argmax in Q4_K_M top-2 {in_top2:.3f}")
    assert decisive.sum() >= 64
    assert argmax_agreement(q[decisive], ref[decisive]) >= 0.99
    assert in_top2 >= 0.95
    assert agree >= 0.85
    # positive control: the F16 export (no 4-bit rounding) agrees everywhere
    assert argmax_agreement(llama_cpp_logits(f16, tokens), ref) == 1.0
