"""Taps: each site equals the intermediate recomputed by hand; drift; saved taps; bad input."""

from __future__ import annotations


import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest

from mlxtoy.errors import UserError
from mlxtoy.model_config import ModelConfig
from mlxtoy.models.llama import LlamaModel
from mlxtoy.models.lora import apply_lora
from mlxtoy.taps import capture, drift, load_taps, save_taps, summarize


def tiny_model(seed: int = 0, **kw) -> LlamaModel:
    mx.random.seed(seed)
    cfg = ModelConfig(**(dict(arch="llama", vocab_size=97, d_model=32, n_layers=3, n_heads=4,
                              n_kv_heads=2, d_head=8, d_ff=48, norm_eps=1e-5) | kw))
    model = LlamaModel(cfg)
    # non-trivial norms so the hand computation exercises them
    for layer in model.layers:
        layer.attn_norm.weight = 1 + 0.1 * mx.random.normal(layer.attn_norm.weight.shape)
        layer.ffn_norm.weight = 1 + 0.1 * mx.random.normal(layer.ffn_norm.weight.shape)
    mx.eval(model.parameters())
    return model


def _np(a) -> np.ndarray:
    return np.array(a, dtype=np.float64)


def _rms_norm(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope_adjacent(x, base):
    """GGML 'normal' RoPE: rotate adjacent pairs (x0, x1), (x2, x3), ... x: (H, T, D)."""
    _, T, D = x.shape
    inv = base ** (-np.arange(0, D, 2) / D)
    ang = np.arange(T)[:, None] * inv[None, :]
    cos, sin = np.cos(ang), np.sin(ang)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * cos - x1 * sin
    out[..., 1::2] = x0 * sin + x1 * cos
    return out


def hand_forward(model: LlamaModel, tokens: list[int]) -> dict[tuple[int, str], np.ndarray]:
    """The seed's per-head block, head by head, in float64 numpy."""
    cfg = model.config
    x = _np(model.tok_embeddings.weight)[tokens]
    T = len(tokens)
    out = {}
    for i, layer in enumerate(model.layers):
        h = _rms_norm(x, _np(layer.attn_norm.weight), cfg.norm_eps)
        wq, wk, wv = (_np(p.weight) for p in (layer.attn.q, layer.attn.k, layer.attn.v))
        keys = [_rope_adjacent((h @ wk[g].T)[None], cfg.rope_base)[0] for g in range(cfg.n_kv_heads)]
        vals = [h @ wv[g].T for g in range(cfg.n_kv_heads)]
        heads = []
        for q in range(cfg.n_heads):
            kv = q // cfg.group_size
            Q = _rope_adjacent((h @ wq[q].T)[None], cfg.rope_base)[0]
            scores = Q @ keys[kv].T / np.sqrt(cfg.d_head)
            scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
            attn = np.exp(scores - scores.max(-1, keepdims=True))
            attn /= attn.sum(-1, keepdims=True)
            heads.append(attn @ vals[kv])
        x = x + np.concatenate(heads, -1) @ _np(layer.attn.o.weight).T
        f = _rms_norm(x, _np(layer.ffn_norm.weight), cfg.norm_eps)
        gate = f @ _np(layer.ffn.gate.weight).T
        ffn_out = ((gate / (1 + np.exp(-gate))) * (f @ _np(layer.ffn.up.weight).T)) @ _np(layer.ffn.down.weight).T
        x = x + ffn_out
        out[(i, "attn_norm")], out[(i, "ffn_out")], out[(i, "resid_post")] = h, ffn_out, x
    return out


def test_taps_equal_hand_computation():
    model = tiny_model()
    tokens = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
    taps = capture(model, mx.array([tokens]))
    ref = hand_forward(model, tokens)
    assert set(taps) == set(ref)
    for key, expect in ref.items():
        got = _np(taps[key][0])
        err = np.abs(got - expect).max() / (np.abs(expect).max() + 1e-9)
        assert err < 1e-5, (key, err)


def test_head_views_and_stats():
    model = tiny_model()
    taps = capture(model, mx.array([[1, 2, 3, 4, 5, 6]]), heads=True)
    ent = np.array(taps[(0, "attn_entropy")])
    assert ent.shape == (4,) and (ent >= 0).all() and (ent <= np.log(6) + 1e-5).all()
    # taps with head views on must not change the block's output
    plain = capture(model, mx.array([[1, 2, 3, 4, 5, 6]]))
    assert np.allclose(np.array(plain[(2, "resid_post")]), np.array(taps[(2, "resid_post")]), atol=1e-5)
    stats, heads = summarize(taps)
    s = stats[0]
    a = np.array(taps[(s["layer"], s["site"])]).ravel()
    assert abs(s["rms"] - np.sqrt((a * a).mean())) < 1e-5 and abs(s["max_abs"] - np.abs(a).max()) < 1e-6
    assert sum(s["hist"]) == a.size
    assert len(heads) == 2 * model.config.n_layers


def test_self_drift_is_zero_and_later_layers_drift():
    model = tiny_model()
    tokens = mx.array([[5, 6, 7, 8, 9, 10, 11]])
    base = capture(model, tokens)
    assert all(r["drift"] == 0 for r in drift(base, capture(model, tokens)))
    # change only layer 1's attention output: layer 0 and layer 1's attn_norm stay put
    model.layers[1].attn.o.weight = model.layers[1].attn.o.weight * 1.5
    rows = {(r["layer"], r["site"]): r["drift"] for r in drift(base, capture(model, tokens))}
    assert rows[(0, "attn_norm")] == rows[(0, "resid_post")] == rows[(1, "attn_norm")] == 0
    assert rows[(1, "ffn_out")] > 0 and rows[(1, "resid_post")] > 0 and rows[(2, "attn_norm")] > 0


def test_bad_requests(tmp_path):
    model = tiny_model()
    tokens = mx.array([[1, 2, 3]])
    with pytest.raises(UserError, match="unknown tap site"):
        capture(model, tokens, sites=["mlp_out"])
    with pytest.raises(UserError, match="out of range"):
        capture(model, tokens, layers=[7])
    path = str(tmp_path / "taps.safetensors")
    save_taps(path, capture(model, tokens), model, [1, 2, 3])
    loaded, _, toks = load_taps(path, model)
    assert toks == [1, 2, 3] and len(loaded) == 9
    with pytest.raises(UserError, match="different architecture"):
        load_taps(path, tiny_model(n_layers=2))


def test_one_lora_step_on_later_layers_drifts_only_downstream():
    """After one LoRA step on layers L.. only, attn_norm of layers < L (and of L itself, which is
    computed before L's adapters act) does not move; sites from L's attention on do."""
    model = tiny_model(seed=1)
    tokens = mx.array([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]])
    base = capture(model, tokens)
    L = 1
    apply_lora(model, ["q", "v", "o", "down"], rank=4, alpha=8.0, layers=range(L, 3))

    def loss_fn(m):
        logits = m(tokens[:, :-1])
        return nn.losses.cross_entropy(logits, tokens[:, 1:], reduction="mean")

    opt = optim.AdamW(learning_rate=1e-2)
    loss, grads = nn.value_and_grad(model, loss_fn)(model)
    opt.update(model, grads)
    mx.eval(model.parameters(), opt.state)
    rows = {(r["layer"], r["site"]): r["drift"] for r in drift(base, capture(model, tokens))}
    for site in ("attn_norm", "ffn_out", "resid_post"):
        assert rows[(0, site)] == 0, site
    assert rows[(L, "attn_norm")] == 0
    assert rows[(L, "ffn_out")] > 1e-6 and rows[(L, "resid_post")] > 1e-6
    assert rows[(2, "attn_norm")] > 1e-6
