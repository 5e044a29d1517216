"""Training: LoRA, full and from-scratch; data handling; exact resume; atomic checkpoints; CLI."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import time

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from helpers_train import (REPO, run_training, byte_tokenizer, qa_rows, run_cli, tiny_model,
                           unigram_entropy_nats, write_jsonl, write_tiny_model_folder)
from mlxtoy.config import TrainConfig
from mlxtoy.errors import UserError
from mlxtoy.events import Command, LogEvent
from mlxtoy.fsutil import is_temp_name
from mlxtoy.rundir import RunDir, read_metrics
from mlxtoy.models.lora import (LoRAHeadProjection, LoRALinear, apply_lora, merge_lora)
from mlxtoy.loading import adapter_weights, load_run_model
from mlxtoy.train.build import set_trainable
from mlxtoy.train.checkpoint import load_checkpoint
from mlxtoy.train.control import TrainControl
from mlxtoy.train.job import prepare, resume_config
from mlxtoy.train.loop import train
from mlxtoy.train.step import Stepper, make_optimizer, make_schedule, token_losses
from mlxtoy.train.data import BatchStream, Renderer, load_dataset, tokenize
from mlxtoy.train.records import Record, read_data

ALL_TARGETS = ["q", "k", "v", "o", "gate", "up", "down"]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A tiny HF model folder (byte-level tokenizer) and a small chat dataset folder."""
    root = tmp_path_factory.mktemp("train")
    model = write_tiny_model_folder(str(root / "model"))
    data = root / "data"
    write_jsonl(str(data / "train.jsonl"), qa_rows(120, seed=1))
    write_jsonl(str(data / "valid.jsonl"), qa_rows(16, seed=2))
    write_jsonl(str(data / "test.jsonl"), qa_rows(8, seed=3))
    return {"root": root, "model": model, "data": str(data)}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return byte_tokenizer(tmp_path_factory.mktemp("tok"))


def tiny_cfg(work, out, **kw) -> TrainConfig:
    base = dict(model=work["model"], data=work["data"], out=str(out), method="lora", steps=8,
                batch_size=2, seq_len=64, lr=5e-3, eval_every=4, eval_batches=2, save_every=4,
                lora_targets=["q", "v"], d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                d_head=8, d_ff=64, seed=0)
    base.update(kw)
    return TrainConfig(**base)


def tokens_batch(seed=0, B=2, T=12, V=259):
    rng = np.random.default_rng(seed)
    return mx.array(rng.integers(0, V, (B, T)).astype(np.int32))


def randomize_lora_b(model, seed=1, scale=0.1):
    k = mx.random.key(seed)
    for i, (_, m) in enumerate(sorted(model.named_modules(), key=lambda t: t[0])):
        if isinstance(m, (LoRAHeadProjection, LoRALinear)):
            m.lora_b = scale * mx.random.normal(m.lora_b.shape, key=mx.random.split(k, 64)[i % 64])
    mx.eval(model.parameters())


# ------------------------------------------------------------------------------------- LoRA


@pytest.mark.parametrize("per_head_q", [False, True])
@pytest.mark.core
def test_lora_step0_equals_base_exactly(per_head_q):
    model = tiny_model(0)
    x = tokens_batch()
    base = model(x)
    apply_lora(model, ALL_TARGETS, rank=4, alpha=8, per_head_q=per_head_q)
    assert mx.array_equal(model(x), base).item()
    trainable = [k for k, _ in tree_flatten(model.trainable_parameters())]
    assert trainable and all(k.endswith((".lora_a", ".lora_b")) for k in trainable)
    assert len(trainable) == 2 * 7 * 2  # 7 targets x 2 layers x (A, B)
    q = model.layers[0].attn.q
    if per_head_q:  # the seed's adapter: A_h (r x d_model), B_h (d_head x r) per Q head
        assert q.lora_a.shape == (4, 4, 32) and q.lora_b.shape == (4, 8, 4)
    else:
        assert q.lora_a.shape == (4, 32) and q.lora_b.shape == (32, 4)


@pytest.mark.parametrize("per_head_q", [False, True])
@pytest.mark.core
def test_merged_lora_equals_unmerged(per_head_q):
    model = tiny_model(0)
    apply_lora(model, ALL_TARGETS, rank=4, alpha=8, per_head_q=per_head_q)
    randomize_lora_b(model)
    x = tokens_batch()
    unmerged = model(x)
    base_changed = not mx.allclose(unmerged, tiny_model(0)(x), atol=1e-3).item()
    merge_lora(model)
    assert base_changed
    assert not any(isinstance(m, (LoRAHeadProjection, LoRALinear)) for _, m in model.named_modules())
    np.testing.assert_allclose(np.array(model(x)), np.array(unmerged), atol=2e-5, rtol=1e-5)


def test_per_head_q_is_per_head():
    """Per-head adapter == a loop over heads of B_h @ A_h applied to x."""
    model = tiny_model(0)
    apply_lora(model, ["q"], rank=3, alpha=3, per_head_q=True)
    randomize_lora_b(model)
    q = model.layers[0].attn.q
    x = mx.random.normal((2, 5, 32), key=mx.random.key(3))
    got = q.delta(x)
    for h in range(4):
        want = (x @ q.lora_a[h].T) @ q.lora_b[h].T
        np.testing.assert_allclose(np.array(got[:, :, h]), np.array(want), atol=1e-6)


def test_lora_layers_and_unknown_target():
    model = tiny_model(0)
    apply_lora(model, ["o", "down"], rank=2, alpha=2, layers=[-1])
    assert isinstance(model.layers[1].attn.o, LoRALinear)
    assert not isinstance(model.layers[0].attn.o, LoRALinear)
    with pytest.raises(UserError, match="unknown LoRA target 'x'"):
        apply_lora(tiny_model(0), ["q", "x"], rank=2, alpha=2)


# -------------------------------------------------------------------------------- gradients


def _fd_check(model, loss_of, names, n_coords=3, eps=3e-3, seed=0):
    """Central finite differences at the largest-gradient coordinates of `names`.

    float64 weights, but MLX's fused RMSNorm and attention kernels work in float32 inside, so
    the loss carries ~1e-7 relative noise: eps = 3e-3 and a 2% tolerance.
    """
    loss_and_grad = nn.value_and_grad(model, loss_of)
    _, grads = loss_and_grad(model)
    grads = dict(tree_flatten(grads))
    params = dict(tree_flatten(model.parameters()))
    checked = 0
    for name in names:
        g = np.array(grads[name]).ravel()
        for idx in np.argsort(-np.abs(g))[:n_coords]:
            p = np.array(params[name])
            flat = p.ravel().copy()
            vals = []
            for sign in (+1, -1):
                flat2 = flat.copy()
                flat2[idx] += sign * eps
                model.load_weights([(name, mx.array(flat2.reshape(p.shape)))], strict=False)
                vals.append(loss_of(model).item())
            model.load_weights([(name, mx.array(p))], strict=False)
            fd = (vals[0] - vals[1]) / (2 * eps)
            assert abs(fd - g[idx]) <= 1e-4 + 2e-2 * abs(g[idx]), (name, idx, fd, g[idx])
            checked += 1
    return checked


def _packed_loss(x, y, w, segs):
    def loss_of(model):
        ce = token_losses(model, x, y, segs)
        return (ce * w).sum() / w.sum()
    return loss_of


@pytest.mark.parametrize("method", ["lora", "full", "scratch"])
@pytest.mark.core
def test_gradients_match_finite_differences(method):
    model = tiny_model(0, dtype=mx.float64)
    x = tokens_batch(0, T=10)
    y = tokens_batch(1, T=10)
    segs = mx.array([[0] * 4 + [1] * 6, [0] * 10], dtype=mx.int32)
    w = mx.array(np.random.default_rng(0).integers(0, 2, (2, 10)).astype(np.float64))
    if method == "lora":
        apply_lora(model, ALL_TARGETS, rank=2, alpha=4, per_head_q=True)
        randomize_lora_b(model)  # at B = 0 the gradient of A is zero: test a trained state
        model.set_dtype(mx.float64)
        names = ["layers.0.attn.q.lora_a", "layers.0.attn.q.lora_b", "layers.1.attn.v.lora_a",
                 "layers.1.ffn.down.lora_b"]
    else:
        set_trainable(model, TrainConfig(method=method, train_norm=True, train_embeddings=True))
        names = ["layers.0.attn.q.weight", "layers.1.attn.k.weight", "layers.0.ffn.gate.weight",
                 "layers.1.attn_norm.weight", "norm.weight", "tok_embeddings.weight"]
    assert _fd_check(model, _packed_loss(x, y, w, segs), names) == 3 * len(names)


# --------------------------------------------------------------------------------- packing


def test_packed_row_equals_documents_one_by_one():
    model = tiny_model(0)
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 256, n).astype(np.int32) for n in (6, 9, 5)]
    row = np.concatenate([d[:-1] for d in docs])
    tgt = np.concatenate([d[1:] for d in docs])
    segs = np.concatenate([[i] * (len(d) - 1) for i, d in enumerate(docs)])
    T = 24  # with padding at the end
    pad = T - len(row)
    row = np.concatenate([row, np.zeros(pad, np.int32)])[None]
    tgt = np.concatenate([tgt, np.zeros(pad, np.int32)])[None]
    segs = np.concatenate([segs, -np.ones(pad, np.int32)])[None]
    packed = np.array(token_losses(model, mx.array(row), mx.array(tgt), mx.array(segs)))[0]
    start = 0
    for d in docs:
        single = np.array(token_losses(model, mx.array(d[None, :-1]), mx.array(d[None, 1:])))[0]
        np.testing.assert_allclose(packed[start: start + len(d) - 1], single, atol=2e-5)
        start += len(d) - 1


def test_batch_stream_packs_deterministically(tok):
    recs = [Record(f"x:{i}", "text", "ab" * (3 + i % 7)) for i in range(40)]
    examples, stats = tokenize(recs, tok, seq_len=32)
    s1 = BatchStream(examples, 3, 32, seed=5)
    s2 = BatchStream(examples, 3, 32, seed=5)
    for i in (0, 1, 7, 30):
        b1, b2 = s1.batch(i), s2.batch(i)
        assert np.array_equal(b1.inputs, b2.inputs) and np.array_equal(b1.segments, b2.segments)
        assert b1.inputs.shape[0] == 3 and b1.inputs.shape[1] <= 32
    rows = s1.rows
    assert sorted(i for r in rows for i in r) == list(range(len(examples)))  # each once
    assert len(rows) < len(examples)  # several examples per row
    assert not np.array_equal(s1.batch(0).inputs, BatchStream(examples, 3, 32, seed=6).batch(0).inputs)


# ------------------------------------------------------------------------------------ data


def test_formats_and_loss_masks(tmp_path, tok):
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "u1"},
            {"role": "assistant", "content": "A1"}, {"role": "user", "content": "u2"},
            {"role": "assistant", "content": "A2"}]
    r = Renderer(tok)
    ids, loss = r.chat(chat, "x:1")
    trained = tok.decode([t for t, m in zip(ids, loss) if m])
    # every assistant turn (with its end token), and nothing else
    assert trained == "A1<|im_end|>\nA2<|im_end|>\n"
    ids, loss = Renderer(tok, mask_prompt=False).chat(chat, "x:1")
    assert all(loss)
    ids, loss = r.completion("What?", "Yes", "x:2")
    assert tok.decode([t for t, m in zip(ids, loss) if m]) == "Yes<|im_end|>\n"
    ids, loss = r.text("hello")
    assert tok.decode(ids) == "hello<|im_end|>" and all(loss)
    # files: text, completions, txt stream in windows; long ones truncated and counted
    p = write_jsonl(str(tmp_path / "t.jsonl"), [{"text": "x" * 10}, {"text": "y" * 200}])
    exs, stats = tokenize(read_data(p).train, tok, seq_len=50)
    assert stats.truncated == 1 and max(len(e) for e in exs) == 50
    txt = tmp_path / "c.txt"
    txt.write_text("abcdefghij" * 30)
    exs, _ = tokenize(read_data(str(txt)).train, tok, seq_len=64)
    assert len(exs) == math.ceil(300 / 64) and all(len(e) <= 64 for e in exs)
    assert sum(len(e) for e in exs) == 300  # every token predicted once (301 with EOS, minus 1)


@pytest.mark.real
def test_loss_masks_with_a_real_bpe_tokenizer(smollm2_path):
    """With SmolLM2's byte-level BPE (merges, and a template whose turns merge across
    boundaries), the trained tokens are exactly each assistant turn and its end-of-turn, and
    the untrained ones exactly the rest: checked by decoding both parts independently."""
    from mlxtoy.loading import load_tokenizer

    tok = load_tokenizer(smollm2_path)
    chat = [{"role": "user", "content": "What is the capital of France? Answer briefly."},
            {"role": "assistant", "content": " Paris, the capital since 987."},
            {"role": "user", "content": "And of Italy?"},
            {"role": "assistant", "content": "Rome.\n\nIt has been since 1871!"}]
    ids, loss = Renderer(tok).chat(chat, "x:1")
    full = tok.decode(ids)
    assert full == tok.apply_chat_template(chat, add_generation_prompt=False)
    assert len(ids) > 40 and any(len(tok.decode([t])) > 2 for t in ids)  # real merges at work
    runs, cur = [], []
    for t, m in zip(ids, loss):
        if m:
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    assert runs == [" Paris, the capital since 987.<|im_end|>\n", "Rome.\n\nIt has been since 1871!<|im_end|>\n"]
    # where BPE merges across the boundary ("\n" + " " is one token here, since digits split
    # alone), that one token is trained: it carries the completion's first character
    ids, loss = Renderer(tok).completion("2+2=", " 4", "x:2")
    cut = loss.index(True)
    assert all(loss[cut:]) and not any(loss[:cut])
    prompt, trained = tok.decode(ids[:cut]), tok.decode(ids[cut:])
    assert prompt + trained == tok.decode(ids)
    assert trained in (" 4<|im_end|>\n", "\n 4<|im_end|>\n"), trained


def test_single_file_split_is_deterministic(tmp_path, tok):
    p = write_jsonl(str(tmp_path / "all.jsonl"), qa_rows(50))
    a = load_dataset(p, tok, 64, seed=3)
    b = load_dataset(p, tok, 64, seed=3)
    c = load_dataset(p, tok, 64, seed=4)
    assert len(a.valid) == 5 and len(a.train) == 45
    assert [e.where for e in a.valid] == [e.where for e in b.valid]
    assert [e.where for e in a.valid] != [e.where for e in c.valid]
    assert not {e.where for e in a.valid} & {e.where for e in a.train}


@pytest.mark.parametrize("rows,msg", [
    (['{"text": "ok"}', '{"text": "broken'], r"bad\.jsonl:2: invalid JSON"),
    (['{"prompt": "p"}'], r"bad\.jsonl:1: missing field 'completion'"),
    (['{"foo": 1}'], r"bad\.jsonl:1: missing field"),
    (['{"messages": [{"role": "user"}]}'], r"bad\.jsonl:1: message 0 needs 'role' and 'content'"),
    ([], r"empty dataset"),
])
def test_data_errors_name_file_and_line(tmp_path, rows, msg):
    p = write_jsonl(str(tmp_path / "bad.jsonl"), rows)
    with pytest.raises(UserError, match=msg):
        read_data(p)


# ------------------------------------------------------------------------------- training


def test_schedules():
    at = lambda cfg: [round(make_schedule(cfg)(mx.array(i, dtype=mx.uint64)).item(), 4)
                      for i in range(cfg.steps)]
    # warm-up: the k-th update uses lr * k / warmup (none at lr 0), then the decay
    assert at(TrainConfig(lr=1.0, warmup=4, steps=10, min_lr=0.1))[:5] == [0.25, 0.5, 0.75, 1.0, 1.0]
    cos = at(TrainConfig(lr=1.0, steps=5, min_lr=0.0))
    assert cos[0] == 1.0 and all(a > b for a, b in zip(cos, cos[1:]))
    assert at(TrainConfig(lr=1.0, steps=4, schedule="linear")) == [1.0, 0.75, 0.5, 0.25]
    assert at(TrainConfig(lr=0.5, steps=3, schedule="constant")) == [0.5, 0.5, 0.5]


def test_tiny_model_overfits_one_batch():
    model = tiny_model(0)
    cfg = TrainConfig(method="scratch", steps=150, lr=1e-2, schedule="constant", grad_clip=0)
    model.unfreeze()
    opt = make_optimizer(cfg)
    opt.init(model.trainable_parameters())
    stepper = Stepper(model, opt, cfg, packed=True)
    rng = np.random.default_rng(0)
    from mlxtoy.train.data import Batch
    x = rng.integers(0, 256, (2, 17)).astype(np.int32)
    batch = Batch(x[:, :-1], x[:, 1:], np.ones((2, 16), np.float32), np.zeros((2, 16), np.int32),
                  32, 32)
    first = None
    for _ in range(150):
        loss, _ = stepper([batch])
        mx.eval(loss)
        first = first if first is not None else loss.item()
    assert first > 4.5 and loss.item() < 0.05


def test_scratch_beats_unigram_entropy_on_bundled_corpus(tmp_path, work, tok):
    corpus = os.path.join(REPO, "assets", "corpus", "fables.txt")
    cfg = tiny_cfg(work, tmp_path / "run", method="scratch", data=corpus, steps=300, lr=3e-3,
                   warmup=20, batch_size=8, seq_len=64, eval_every=0, eval_batches=-1,
                   save_every=0, d_model=64, n_heads=4, n_kv_heads=4, d_head=16, d_ff=192)
    res = run_training(cfg)
    assert res.reason == "finished"
    ids = tok.encode(open(corpus).read())
    h = unigram_entropy_nats(ids)
    assert h > 2.5  # English characters
    assert res.val_loss < 0.8 * h, (res.val_loss, h)


@pytest.mark.parametrize("method", ["lora", "scratch"])
@pytest.mark.core
def test_resume_equals_uninterrupted(tmp_path, work, method):
    kw = dict(method=method, steps=12, grad_accum=2, lr=1e-2, warmup=2, save_every=0,
              eval_every=3, lora_dropout=0.2, lora_targets=["q", "v", "down"], lora_per_head_q=True)
    full = run_training(tiny_cfg(work, tmp_path / "full", **kw), handle_sigint=False)
    part = run_training(tiny_cfg(work, tmp_path / "part", **kw),
                       control=TrainControl(stop_at=6), handle_sigint=False)
    assert part.reason == "stopped" and part.step == 6
    assert part.last_checkpoint.endswith("step_6")
    rest = run_training(resume_config(str(tmp_path / "part"), {}), resume=True,
                       handle_sigint=False)
    assert rest.reason == "finished" and rest.step == 12
    curve = [e["loss"] for e in read_metrics(str(tmp_path / "part" / "metrics.jsonl"))
             if e["event"] == "step"]
    np.testing.assert_allclose(curve, full.losses, atol=1e-6, rtol=0)
    vals = lambda p: [e["val_loss"] for e in read_metrics(str(p / "metrics.jsonl")) if e["event"] == "eval"]
    np.testing.assert_allclose(vals(tmp_path / "part"), vals(tmp_path / "full"), atol=1e-6, rtol=0)


def test_resume_via_cli_to_more_steps(tmp_path, work):
    out = tmp_path / "run"
    common = ["--model", work["model"], "--data", work["data"], "--seq-len", "64",
              "--batch-size", "2", "--schedule", "constant", "--lr", "1e-2", "--eval-every", "0",
              "--save-every", "0", "--lora-targets", "q,v"]
    full = run_cli("train", *common, "--out", str(tmp_path / "full"), "--steps", "8")
    assert full.returncode == 0, full.stderr
    a = run_cli("train", *common, "--out", str(out), "--steps", "4")
    assert a.returncode == 0, a.stderr
    b = run_cli("train", "--resume", str(out), "--steps", "8")
    assert b.returncode == 0, b.stderr
    assert json.loads(b.stdout.strip().splitlines()[-1])["step"] == 8
    loss = lambda p: [e["loss"] for e in read_metrics(str(p / "metrics.jsonl")) if e["event"] == "step"]
    np.testing.assert_allclose(loss(out), loss(tmp_path / "full"), atol=1e-6, rtol=0)


def test_grad_accum_and_checkpointing_match(tmp_path, work):
    """grad_accum=2 of batch 2 == batch 4 (token-weighted), and gradient checkpointing changes
    nothing but memory."""
    a = run_training(tiny_cfg(work, tmp_path / "a", steps=3, batch_size=4, eval_every=0, save_every=0,
                             method="full"), handle_sigint=False)
    b = run_training(tiny_cfg(work, tmp_path / "b", steps=3, batch_size=4, eval_every=0, save_every=0,
                             method="full", grad_checkpoint=True), handle_sigint=False)
    np.testing.assert_allclose(a.losses, b.losses, atol=1e-5)
    model = tiny_model(0)
    model.unfreeze()
    cfg = TrainConfig(method="scratch", lr=1e-3, grad_clip=1e6)  # norm computed, never clips
    from mlxtoy.train.data import Batch
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (4, 17)).astype(np.int32)
    w = rng.integers(0, 2, (4, 16)).astype(np.float32)
    segs = np.zeros((4, 16), np.int32)
    mk = lambda s: Batch(x[s, :-1], x[s, 1:], w[s], segs[s], 0, int(w[s].sum()))
    losses = []
    for parts in ([slice(0, 4)], [slice(0, 2), slice(2, 4)]):
        m = tiny_model(0)
        m.unfreeze()
        opt = make_optimizer(cfg)
        opt.init(m.trainable_parameters())
        st = Stepper(m, opt, cfg, packed=True)
        loss, gn = st([mk(s) for s in parts])
        mx.eval(loss, m.parameters())
        losses.append((loss.item(), gn.item(), np.array(m.layers[0].attn.q.weight)))
    assert abs(losses[0][0] - losses[1][0]) < 1e-5 and abs(losses[0][1] - losses[1][1]) < 1e-5
    np.testing.assert_allclose(losses[0][2], losses[1][2], atol=1e-6)


def test_run_results_load_back(tmp_path, work):
    from mlxtoy import load

    x = tokens_batch()
    for method in ("lora", "full", "scratch"):
        res = run_training(tiny_cfg(work, tmp_path / method, method=method, steps=4, save_every=2,
                                   lora_targets=ALL_TARGETS), handle_sigint=False)
        assert res.reason == "finished" and os.path.exists(res.final_path)
        m1, _ = load_run_model(res.run_dir)
        m2, _ = load_run_model(os.path.join(res.run_dir, "checkpoints", "step_4"))
        np.testing.assert_allclose(np.array(m1(x)), np.array(m2(x)), atol=2e-5)
        if method != "scratch":
            m3, _ = load(work["model"], adapter=res.run_dir)
            np.testing.assert_allclose(np.array(m3(x)), np.array(m1(x)), atol=2e-5)
            base, _ = load(work["model"])
            assert not np.allclose(np.array(base(x)), np.array(m1(x)), atol=1e-4)
    weights, info = adapter_weights(str(tmp_path / "lora"))
    assert info["rank"] == 8 and info["targets"] == ALL_TARGETS and info["step"] == 4
    assert weights["layers.0.attn.q.lora_a"].shape == (8, 32)
    assert weights["layers.1.ffn.down.lora_b"].shape == (32, 8)
    cfg, resolved = RunDir(str(tmp_path / "lora")).read_config()
    assert cfg.method == "lora" and resolved.model_config["d_model"] == 32


def test_events_and_metrics(tmp_path, work):
    seen = []
    run_training(tiny_cfg(work, tmp_path / "r", steps=4, eval_every=2, sample_every=2,
                               sample_tokens=4, save_every=2, taps_every=2),
                      on_event=seen.append, taps_hook=lambda m, s: LogEvent(message=f"taps {s}"),
                      handle_sigint=False)
    kinds = [e.event for e in seen]
    assert kinds[0] == "start" and kinds[-1] == "done"
    for k in ("step", "eval", "sample", "checkpoint"):
        assert k in kinds
    assert [e.message for e in seen if e.event == "log" and e.message.startswith("taps")] == ["taps 2", "taps 4"]
    on_disk = read_metrics(str(tmp_path / "r" / "metrics.jsonl"))
    assert [e["event"] for e in on_disk] == kinds
    step = next(e for e in on_disk if e["event"] == "step")
    assert step["tokens_per_sec"] > 0 and step["lr"] > 0 and "grad_norm" in step


def test_cli_taps_every_writes_taps_events(tmp_path, work):
    out = tmp_path / "run"
    r = run_cli("train", "--model", work["model"], "--data", work["data"], "--out", str(out),
                "--steps", "2", "--taps-every", "1", "--eval-every", "0", "--seq-len", "64")
    assert r.returncode == 0, r.stderr
    taps = [e for e in read_metrics(str(out / "metrics.jsonl")) if e["event"] == "taps"]
    assert [e["step"] for e in taps] == [1, 2] and taps[0]["stats"]


def test_control_pause_stop_and_requests(tmp_path, work):
    import threading

    control = TrainControl()
    seen = []

    def on_event(ev):
        seen.append(ev)
        if ev.event == "step" and ev.step == 2:
            control.pause()
            control.apply(Command.SAMPLE)
            control.apply(Command.CHECKPOINT)
            threading.Timer(0.3, control.resume).start()
        if ev.event == "step" and ev.step == 3:
            control.stop()

    res = run_training(tiny_cfg(work, tmp_path / "r", steps=50, eval_every=0, save_every=0,
                               sample_tokens=3), on_event=on_event, control=control,
                      handle_sigint=False)
    assert res.reason == "stopped" and res.step == 3
    # requests made while handling step 2 are served before step 3; stopping saves step 3
    assert [e.step for e in seen if e.event == "checkpoint"] == [2, 3]
    assert {e.step for e in seen if e.event == "sample"} == {2}


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path, work):
    cfg = tiny_cfg(work, tmp_path / "r", method="full", steps=20, save_every=2, eval_every=0)
    p = prepare(cfg)
    calls = {"n": 0}
    orig = Stepper.__call__

    def poisoned(self, batches):
        calls["n"] += 1
        if calls["n"] == 4:
            self.model.layers[0].attn.o.weight = self.model.layers[0].attn.o.weight * mx.array(float("nan"))
        return orig(self, batches)

    Stepper.__call__ = poisoned
    try:
        res = train(p.cfg, p.model, p.tokenizer, p.dataset, p.run, facts=p.facts,
                            handle_sigint=False)
    finally:
        Stepper.__call__ = orig
    assert res.reason == "nan" and res.step == 4
    assert res.last_checkpoint.endswith("step_2")
    assert [s for s, _ in p.run.checkpoints()] == [2]
    assert "last good checkpoint" in res.message
    load_checkpoint(res.last_checkpoint)


# `mlxtoy train` whose checkpoint writer pauses after each file of trainable weights, so that a
# kill lands in the middle of writing a checkpoint
SLOW_CHECKPOINT_TRAIN = """
import sys, time
import mlxtoy
import mlx.core as mx
from mlxtoy import cli
from mlxtoy.rundir import CKPT_TRAINABLE
save = mx.save_safetensors
def slow_save(path, *args, **kwargs):
    save(path, *args, **kwargs)
    if path.endswith(CKPT_TRAINABLE):
        time.sleep(2)
mx.save_safetensors = slow_save
raise SystemExit(cli.main(sys.argv[1:]))
"""


def test_kill_during_checkpoint_write_keeps_previous(tmp_path, work):
    out = tmp_path / "run"
    args = [sys.executable, "-c", SLOW_CHECKPOINT_TRAIN, "train", "--model", work["model"], "--data",
            work["data"], "--out", str(out), "--steps", "40", "--save-every", "2", "--eval-every", "0",
            "--batch-size", "2", "--seq-len", "64"]
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    ckdir = out / "checkpoints"
    deadline = time.time() + 120
    try:
        while time.time() < deadline:  # wait until step_2 is complete and step_4 is being written
            names = os.listdir(ckdir) if ckdir.exists() else []
            if "step_2" in names and any(n.startswith(".step_4.") and is_temp_name(n) for n in names):
                break
            time.sleep(0.05)
        else:
            pytest.fail("the checkpoint writer never reached step 4")
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    names = os.listdir(ckdir)
    assert "step_2" in names and "step_4" not in names
    state, trainable, opt = load_checkpoint(str(ckdir / "step_2"))
    assert state.step == 2 and trainable and opt
    load_run_model(str(out))  # falls back to the newest complete checkpoint
    r = run_cli("train", "--resume", str(out), "--steps", "4", "--save-every", "0")
    assert r.returncode == 0, r.stderr
    assert not any(is_temp_name(n) for n in os.listdir(ckdir))
    assert sorted(os.listdir(ckdir)) == ["step_2", "step_4"]


def test_ctrl_c_writes_checkpoint_and_exits_cleanly(tmp_path, work):
    out = tmp_path / "run"
    args = [sys.executable, "-m", "mlxtoy", "train", "--model", work["model"], "--data", work["data"],
            "--out", str(out), "--steps", "100000", "--save-every", "0", "--eval-every", "0",
            "--batch-size", "2", "--seq-len", "64"]
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline:
        if metrics.exists() and sum(1 for e in read_metrics(str(metrics)) if e["event"] == "step") >= 3:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "--resume" in stderr
    done = read_metrics(str(metrics))[-1]
    assert done["event"] == "done" and done["reason"] == "interrupted"
    steps = RunDir(str(out)).checkpoints()
    assert steps and steps[-1][0] == done["step"]
    assert json.loads(stdout.strip().splitlines()[-1])["reason"] == "interrupted"


@pytest.mark.core
def test_qlora_branch_trains_on_a_quantized_base(tmp_path, work):
    """The Metal/CUDA QLoRA path (forced on here): o/gate/up/down quantized, adapters train."""
    res = run_training(tiny_cfg(work, tmp_path / "q", qlora="on", steps=4, eval_every=0,
                               lora_targets=["q", "o", "down"]), handle_sigint=False)
    assert res.reason == "finished" and all(math.isfinite(l) for l in res.losses)
    p = prepare(tiny_cfg(work, tmp_path / "q2", qlora="on", lora_targets=["q", "o", "down"]))
    assert isinstance(p.model.layers[0].attn.o.base, nn.QuantizedLinear)
    assert isinstance(p.model.layers[0].ffn.gate, nn.QuantizedLinear)
    trainable = [k for k, _ in tree_flatten(p.model.trainable_parameters())]
    assert trainable and all(k.endswith((".lora_a", ".lora_b")) for k in trainable)
    model, _ = load_run_model(str(tmp_path / "q"))  # loads back on a dense (dequantized) base
    assert model(tokens_batch()).shape == (2, 12, 259)


def test_mixed_precision_keeps_float32_masters(tmp_path, work):
    res = run_training(tiny_cfg(work, tmp_path / "mp", method="scratch", dtype="bfloat16", steps=30,
                               lr=1e-2, eval_every=0), handle_sigint=False)
    assert res.reason == "finished" and res.losses[-1] < res.losses[0] - 1.0
    w = mx.load(res.final_path)
    assert all(v.dtype == mx.float32 for v in w.values())


# ------------------------------------------------------------------------------ CLI errors


def _tree_digest(path) -> str:
    h = hashlib.sha256()
    for root, _, files in sorted(os.walk(path)):
        for f in sorted(files):
            p = os.path.join(root, f)
            h.update(p.encode())
            with open(p, "rb") as fh:
                h.update(fh.read())
    return h.hexdigest()


def test_cli_bad_inputs_exit_2_and_touch_nothing(tmp_path, work):
    from mlxtoy.cli import main

    data = tmp_path / "bad"
    cases = {
        "malformed": (["--data", write_jsonl(str(data / "m.jsonl"), ['{"text": "a"}', "{nope"])],
                      "m.jsonl:2: invalid JSON"),
        "missing": (["--data", write_jsonl(str(data / "f.jsonl"), ['{"prompt": "a"}'])],
                    "f.jsonl:1: missing field 'completion'"),
        "empty": (["--data", write_jsonl(str(data / "e.jsonl"), [])], "empty dataset"),
        "too_long": (["--data", write_jsonl(str(data / "l.jsonl"), [{"prompt": "z" * 300, "completion": "a"}] * 3),
                      "--seq-len", "32"], "every example (3) is longer than seq_len 32"),
        "target": (["--data", work["data"], "--lora-targets", "q,x"], "unknown LoRA target 'x'"),
        "rank": (["--data", work["data"], "--lora-rank", "0"], "lora_rank must be > 0"),
        "lr": (["--data", work["data"], "--lr", "0"], "lr must be > 0"),
        "lr_neg": (["--data", work["data"], "--lr=-1e-3"], "lr must be > 0"),
    }
    # an earlier run that none of this may overwrite
    earlier = tmp_path / "earlier"
    assert run_cli("train", "--model", work["model"], "--data", work["data"], "--out", str(earlier),
                   "--steps", "2", "--eval-every", "0").returncode == 0
    digest = _tree_digest(earlier)
    cases["existing_run"] = (["--data", work["data"], "--out", str(earlier)], "already holds a training run")
    for name, (extra, msg) in cases.items():
        out = ["--out", str(tmp_path / f"out_{name}")] if "--out" not in extra else []
        args = ["train", "--model", work["model"], *out, "--steps", "2", *extra]
        import io
        from contextlib import redirect_stderr, redirect_stdout

        err, so = io.StringIO(), io.StringIO()
        with redirect_stderr(err), redirect_stdout(so):
            code = main(args)
        lines = err.getvalue().strip().splitlines()
        assert code == 2, (name, err.getvalue())
        assert len(lines) == 1 and lines[0].startswith("error: ") and msg in lines[0], (name, lines)
        assert not (tmp_path / f"out_{name}").exists(), name
    assert _tree_digest(earlier) == digest
    # and through a real process: exit status 2, one line
    r = run_cli("train", "--model", work["model"], "--data", work["data"], "--out", str(earlier))
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "already holds" in r.stderr
    assert _tree_digest(earlier) == digest


def test_yaml_config_and_flag_override(tmp_path, work):
    from mlxtoy.commands.train import build_config
    from mlxtoy.cli import build_parser

    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("method: dora\nsteps: 7\nlr: 0.001\nlora_targets: [q, k]\nseq_len: 99\n")
    args = build_parser().parse_args(["train", "--config", str(cfg_file), "--data", "d", "--out", "o",
                                      "--steps", "9", "--lora-targets", "q,v,o", "--no-pack"])
    cfg, resume = build_config(args)
    assert (cfg.method, cfg.steps, cfg.lr, cfg.seq_len, cfg.pack) == ("dora", 9, 1e-3, 99, False)
    assert cfg.lora_targets == ["q", "v", "o"] and not resume
    # an option given for another method is refused, not dropped (issue 46)
    with pytest.raises(UserError, match="lora_targets applies to method lora or dora only"):
        build_config(build_parser().parse_args(["train", "--config", str(cfg_file), "--data", "d", "--out", "o",
                                                "--method", "full"]))
    cfg_file.write_text("stepz: 3\n")
    with pytest.raises(UserError, match="unknown key 'stepz'"):
        TrainConfig.from_yaml(str(cfg_file))
    cfg_file.write_text("lora_rank: -1\n")
    with pytest.raises(UserError, match="lora_rank must be > 0"):
        TrainConfig.from_yaml(str(cfg_file)).validate()


# ------------------------------------------------------------------------------- real model


@pytest.mark.real
@pytest.mark.slow
def test_smollm2_lora_demo_improves_held_out_accuracy(tmp_path):
    """The README's demo: LoRA on assets/demo lifts held-out exact-match accuracy from ~0."""
    out = tmp_path / "demo"
    r = run_cli("train", "--config", os.path.join(REPO, "assets", "demo", "lora.yaml"),
                "--out", str(out), "--accuracy-examples", "40", timeout=1200)
    assert r.returncode == 0, r.stderr[-2000:]
    acc = json.load(open(out / "accuracy.json"))
    before, after = acc["before"]["accuracy"], acc["after"]["accuracy"]
    assert before <= 0.1 and after >= before + 0.5, (before, after)


def test_train_help_documents_every_flag():
    """Every flag of `mlxtoy train --help` has help text; a field with choices shows them all
    and the flag's default is TrainConfig's."""
    r = run_cli("train", "--help")
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split("options:", 1)[1].split())  # the option list, not the usage
    squeezed = "".join(text.split())  # argparse wraps lines, also at hyphens
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        assert flag in text, flag
        meta = f.metadata
        assert meta.get("help"), f"{f.name} has no help"
        assert "".join(meta["help"].split()) in squeezed, f"{flag}'s help is not shown"
        for choice in meta.get("choices") or ():
            assert choice in text.split(flag, 1)[1][:400], (flag, choice)
    assert "(default: 512)" in text.split("--seq-len SEQ_LEN", 1)[1][:100]
    assert "{lora,dora,full,scratch}" in text.split("--method", 1)[1][:30]


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(TrainConfig) if f.metadata.get("choices")])
def test_every_choice_field_refuses_an_unknown_value(name):
    """validate() checks each field's choices from its metadata, for the method it applies to
    (the method itself first: an unknown method must not skip the other checks)."""
    f = next(f for f in dataclasses.fields(TrainConfig) if f.name == name)
    method = f.metadata["methods"][0]
    good = TrainConfig(method=method)
    good.validate()  # positive control: the defaults pass
    bad = TrainConfig(**{"method": method, name: ["q", "zz"] if isinstance(getattr(good, name), list) else "zz"})
    with pytest.raises(UserError, match=r"zz"):
        bad.validate()


# Golden loss curves: the first six losses of a fixed tiny run (tests/helpers_train.py's tiny
# llama with the byte tokenizer, seed 0, the `work` data, batch 4 x 64, packed).
# Provenance: recorded on 2026-11-22 from mlxtoy at commit d8c2006 on Linux x86_64, MLX CPU,
# float32, by running this very config once. Step 1 is the untrained model's mean token loss:
# near ln(259) = 5.557, as it must be for a near-uniform random model over 259 tokens (a loss
# summed instead of averaged would be hundreds). The later steps pin the optimizer, schedule
# and update (an update applied twice, or a changed normalisation, cannot pass).
GOLDEN = {
    "lora": [5.53186, 5.478509, 5.484188, 5.456271, 5.455787, 5.418136],
    "full": [5.53186, 5.448748, 5.420957, 5.378108, 5.362946, 5.345584],
}


@pytest.mark.parametrize("method", ["lora", "full"])
def test_golden_loss_curve(tmp_path, work, method):
    cfg = tiny_cfg(work, tmp_path / method, method=method, steps=6, batch_size=4, seq_len=64,
                   lr=5e-3 if method == "lora" else 1e-3, eval_every=0, save_every=0)
    res = run_training(cfg, handle_sigint=False)
    assert abs(res.losses[0] - math.log(259)) < 0.1  # the untrained model is near uniform
    np.testing.assert_allclose(res.losses, GOLDEN[method], atol=1e-5, rtol=0)
