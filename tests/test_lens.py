"""The projection lens: a frozen donor embedding table of another width and a trained W_proj,
folded exactly into a standard embedding on export (llama.cpp reads the same logits)."""

from __future__ import annotations

import os

import numpy as np
import pytest

import mlxtoy  # noqa: F401  (fast BLAS before mlx.core)
import mlx.core as mx

from helpers_parity import compare, llama_cpp_logits, random_gguf_tensors, tiny_config, write_tiny_gguf

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(REPO, "assets", "corpus", "lighthouse.txt")


@pytest.fixture(scope="module")
def donor_gguf(tmp_path_factory) -> str:
    """A tiny 256-wide llama GGUF with the tiny BPE tokenizer: its token table is the donor."""
    cfg = tiny_config()
    path = str(tmp_path_factory.mktemp("donor") / "donor.gguf")
    return write_tiny_gguf(path, cfg, random_gguf_tensors(cfg, seed=11))


def _donor_table(path: str) -> np.ndarray:
    from mlxtoy.loading import load_donor

    table, _ = load_donor(path)
    return np.array(table)


def _new_model(vocab: int, d_model: int = 64, seed: int = 0):
    from mlxtoy.model_config import ModelConfig
    from mlxtoy.loading import build_model

    mx.random.seed(seed)
    return build_model(ModelConfig(arch="llama", vocab_size=vocab, d_model=d_model, n_layers=2,
                                   n_heads=4, n_kv_heads=2, d_head=16, d_ff=128,
                                   context_length=256))


def test_lens_embeds_through_the_fold(donor_gguf):
    from mlxtoy.models.lens import ProjectionLens, apply_lens, fold, fold_lens, has_lens

    donor = mx.array(_donor_table(donor_gguf))
    model = _new_model(donor.shape[0])
    apply_lens(model, donor)
    lens = model.tok_embeddings
    assert isinstance(lens, ProjectionLens) and has_lens(model)
    assert lens.proj.shape == (256, 64) and lens.d_in == 256
    # only W_proj trains: the donor is frozen
    trainable = {k for k, _ in mlxtoy_flatten(lens.trainable_parameters())}
    assert trainable == {"proj"}
    tokens = mx.array([[1, 5, 200, 7, 7, 266]])
    w = np.array(lens.w_proj)  # W_proj = gain * proj, gain a constant of the donor
    assert np.allclose(w, lens.gain * np.array(lens.proj)) and lens.gain > 0
    eff = np.array(donor) @ w  # embed_eff[v, r] = sum_c donor[v, c] W_proj[c, r]
    assert np.allclose(np.array(lens(tokens))[0], eff[[1, 5, 200, 7, 7, 266]], atol=1e-5)
    assert np.allclose(np.array(fold(donor, lens.w_proj)), eff, atol=1e-5)
    h = mx.random.normal((1, 3, 64))
    assert np.allclose(np.array(lens.as_linear(h)), np.array(h) @ eff.T, atol=1e-4)
    before = np.array(model(tokens))
    fold_lens(model)
    assert not has_lens(model) and model.tok_embeddings.weight.shape == (267, 64)
    assert np.allclose(np.array(model(tokens)), before, atol=1e-4)


def test_pca_init_keeps_the_donor_geometry(donor_gguf):
    from mlxtoy.models.lens import initial_projection

    donor = _donor_table(donor_gguf)
    w = np.array(initial_projection(donor, 64))
    gram = w.T @ w
    assert np.allclose(gram, gram[0, 0] * np.eye(64), atol=1e-4 * gram[0, 0])  # orthogonal columns
    assert abs((donor @ w).std() - 0.02) < 1e-4  # the from-scratch embedding scale
    w = w / np.sqrt(gram[0, 0])
    centered = donor - donor.mean(0)
    kept = np.linalg.norm(centered @ w) ** 2 / np.linalg.norm(centered) ** 2
    rnd = np.linalg.qr(np.random.default_rng(0).standard_normal((256, 64)))[0]
    assert kept > np.linalg.norm(centered @ rnd) ** 2 / np.linalg.norm(centered) ** 2


def mlxtoy_flatten(tree):
    from mlx.utils import tree_flatten

    return tree_flatten(tree)


@pytest.mark.parametrize("tied", [True, False])
def test_lens_trained_exports_to_llama_cpp(tmp_path, donor_gguf, tied):
    """Train from scratch with a lens (donor 256 wide -> model 64 wide), export the run to
    GGUF, and read the same logits back in llama.cpp as the in-memory lens model gives."""
    from mlxtoy.config import TrainConfig
    from mlxtoy.export import export
    from mlxtoy.io.gguf_read import load_gguf
    from mlxtoy.models.lens import fold, has_lens
    from mlxtoy.loading import load_run_model
    from helpers_train import run_training as run

    data = tmp_path / "train.txt"
    data.write_text(open(CORPUS, encoding="utf-8").read()[:6000])
    out = str(tmp_path / "run")
    cfg = TrainConfig(method="scratch", arch="llama", lens=donor_gguf, tokenizer=donor_gguf,
                      data=str(data), out=out, steps=6, batch_size=2, seq_len=64, lr=1e-2,
                      d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_head=16, d_ff=128,
                      eval_every=0, save_every=3, seed=0, tie_embeddings=tied)
    result = run(cfg, handle_sigint=False)
    assert result.reason == "finished"

    model, tok = load_run_model(out, merge=False)
    assert has_lens(model)
    donor = np.array(model.tok_embeddings.donor)
    assert np.array_equal(donor, _donor_table(donor_gguf))  # frozen: untouched by training
    proj = model.tok_embeddings.w_proj
    from mlxtoy.models.lens import initial_projection
    assert not np.allclose(np.array(proj), np.array(initial_projection(donor, 64)))  # trained

    tokens = tok.encode("The keeper trimmed the wick at dusk, and the sea was calm.")
    ours = np.array(model(mx.array([tokens]))[0])
    gguf_path = export(out, str(tmp_path / "lens.gguf"), fmt="gguf")
    cfg2, weights, _ = load_gguf(gguf_path)
    assert cfg2.d_model == 64 and cfg2.vocab_size == donor.shape[0] and cfg2.tie_embeddings == tied
    assert np.allclose(np.array(weights["tok_embeddings.weight"]),
                       np.array(fold(mx.array(donor), proj)), atol=1e-6)
    r = compare(ours, llama_cpp_logits(gguf_path, tokens))
    assert r["mismatch"] == [] and r["rel"] < 1e-5, r

    # a checkpoint (trainable weights only: W_proj, not the donor) reloads the same lens
    ckpt = os.path.join(out, "checkpoints", "step_6")
    m2, _ = load_run_model(ckpt, merge=False)
    assert np.array_equal(np.array(m2.tok_embeddings.w_proj), np.array(proj))
    folded, _ = load_run_model(out)  # merge=True folds it
    assert not has_lens(folded)
    assert np.allclose(np.array(folded(mx.array([tokens]))[0]), ours, atol=1e-4)


# --------------------------------------------------------------------------- bad input


def test_donor_vocab_must_match_the_tokenizer(tmp_path, donor_gguf):
    from mlxtoy.config import TrainConfig
    from mlxtoy.errors import UserError
    from mlxtoy.io.char_tokenizer import CharTokenizer
    from mlxtoy.models.lens import apply_lens
    from helpers_train import run_training as run

    donor = mx.array(_donor_table(donor_gguf))
    tok = CharTokenizer.from_text("abc")
    with pytest.raises(UserError, match=r"donor table has 267 rows but the tokenizer has 5 tokens"):
        apply_lens(_new_model(5), donor, tok)
    with pytest.raises(UserError, match=r"donor table has 267 rows but the model's vocabulary is 300"):
        apply_lens(_new_model(300), donor)
    with pytest.raises(UserError, match="2-D"):
        apply_lens(_new_model(267), donor[0])
    # through the trainer: a char tokenizer (5 tokens) with a 267-row donor
    data = tmp_path / "t.txt"
    data.write_text("abc " * 200)
    cfg = TrainConfig(method="scratch", arch="tiny", tokenizer="char", lens=donor_gguf,
                      data=str(data), out=str(tmp_path / "run"), steps=1, batch_size=1,
                      seq_len=16, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, d_head=16, d_ff=64)
    with pytest.raises(UserError, match="the lens needs the donor's own vocabulary"):
        run(cfg, handle_sigint=False)
    assert not os.path.exists(tmp_path / "run" / "config.yaml")  # nothing created on bad input


def test_unknown_arch_is_a_clear_error():
    from mlxtoy.config import TrainConfig
    from mlxtoy.model_config import ModelConfig
    from mlxtoy.errors import UserError

    with pytest.raises(UserError, match=r"unknown architecture 'gpt5'"):
        ModelConfig(arch="gpt5")
    with pytest.raises(UserError, match=r"unknown arch 'gpt5'"):
        TrainConfig(method="scratch", arch="gpt5", data="x", out="y").validate()
    with pytest.raises(UserError, match="lens .* needs method scratch"):
        TrainConfig(method="lora", lens="donor.gguf", data="x", out="y").validate()


def test_lens_on_a_model_without_embeddings():
    import mlx.nn as nn

    from mlxtoy.errors import UserError
    from mlxtoy.models.lens import apply_lens

    with pytest.raises(UserError, match="needs a model with a token embedding"):
        apply_lens(nn.Linear(2, 2), mx.zeros((4, 3)))


@pytest.mark.real
def test_smollm2_donor_into_a_256_wide_model(tmp_path, smollm2_path):
    """SmolLM2's 576-wide table into a new 256-wide llama; the export reads the same in llama.cpp."""
    from mlxtoy.export import export_model
    from mlxtoy.loading import attach_lens

    from mlxtoy.loading import load_tokenizer

    tok = load_tokenizer(smollm2_path)
    model = _new_model(tok.vocab_size, d_model=256)
    info = attach_lens(model, smollm2_path, tok)
    assert info["d_in"] == 576 and model.tok_embeddings.proj.shape == (576, 256)
    tokens = tok.encode("The lighthouse keeper wrote the weather in a log book.")
    ours = np.array(model(mx.array([tokens]))[0])
    path = export_model(model, tok, str(tmp_path / "lens.gguf"))
    r = compare(ours, llama_cpp_logits(path, tokens))
    assert r["mismatch"] == [] and r["rel"] < 1e-5, r
