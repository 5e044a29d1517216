"""Optimizers by name (mlx.optimizers): each trains, and each one's state resumes exactly."""

from __future__ import annotations

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
import pytest

from helpers_train import qa_rows, run_training, tiny_model, write_jsonl, write_tiny_model_folder
from mlxtoy.config import OPTIMIZERS, TrainConfig
from mlxtoy.errors import UserError
from mlxtoy.rundir import read_metrics
from mlxtoy.train.checkpoint import load_checkpoint
from mlxtoy.train.control import TrainControl
from mlxtoy.train.data import Batch
from mlxtoy.train.job import resume_config
from mlxtoy.train.step import MatrixMuon, Stepper, make_optimizer

# a learning rate each optimizer overfits one batch with in 30 steps (lion: sign updates)
LR = {"adamw": 1e-2, "adam": 1e-2, "sgd": 0.1, "adafactor": 1e-2, "lion": 5e-3, "muon": 1e-2}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("optim")
    data = root / "data"
    write_jsonl(str(data / "train.jsonl"), qa_rows(60, seed=1))
    write_jsonl(str(data / "valid.jsonl"), qa_rows(8, seed=2))
    return {"model": write_tiny_model_folder(str(root / "model")), "data": str(data)}


def test_every_choice_has_a_learning_rate_here():
    assert set(LR) == set(OPTIMIZERS)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_optimizer_overfits_one_batch(name):
    model = tiny_model(0)
    model.unfreeze()
    cfg = TrainConfig(method="scratch", steps=30, lr=LR[name], schedule="constant", grad_clip=0,
                      optimizer=name).validate()
    opt = make_optimizer(cfg)
    opt.init(model.trainable_parameters())
    stepper = Stepper(model, opt, cfg, packed=True)
    x = np.random.default_rng(0).integers(0, 256, (2, 17)).astype(np.int32)
    batch = Batch(x[:, :-1], x[:, 1:], np.ones((2, 16), np.float32), np.zeros((2, 16), np.int32), 32, 32)
    losses = []
    for _ in range(30):
        loss, _ = stepper([batch])
        losses.append(loss.item())
    # uniform over 259 tokens is ln 259 = 5.56; every optimizer must at least halve it
    assert losses[0] > 5.0 and losses[-1] < 0.5 * losses[0], (name, losses[0], losses[-1])


@pytest.mark.parametrize("method", ["scratch", "lora"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_optimizer_resume_equals_uninterrupted(tmp_path, work, name, method):
    kw = dict(model=work["model"], data=work["data"], method=method, optimizer=name, lr=LR[name] / 2,
              steps=6, warmup=1, batch_size=2, seq_len=48, eval_every=3, eval_batches=1, save_every=0,
              d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_head=8, d_ff=64, seed=0,
              weight_decay=0.0 if name == "adam" else 0.01, lora_targets=["q", "v", "down"],
              lora_per_head_q=True, lora_dropout=0.2)
    full = run_training(TrainConfig(out=str(tmp_path / "full"), **kw), handle_sigint=False)
    part = run_training(TrainConfig(out=str(tmp_path / "part"), **kw), control=TrainControl(stop_at=3),
                        handle_sigint=False)
    assert part.reason == "stopped" and part.step == 3
    _, _, saved = load_checkpoint(part.last_checkpoint)
    # the optimizer's own state is in the checkpoint, not zeros (momentum / moments after 3 steps)
    moments = [k for k in saved if not k.endswith(("step", "learning_rate"))]
    assert moments and any(float(mx.abs(saved[k]).max()) > 0 for k in moments), sorted(saved)[:5]
    rest = run_training(resume_config(str(tmp_path / "part"), {}), resume=True, handle_sigint=False)
    assert rest.reason == "finished" and rest.step == 6
    curve = [e["loss"] for e in read_metrics(str(tmp_path / "part" / "metrics.jsonl")) if e["event"] == "step"]
    assert len(curve) == 6 and curve[-1] < curve[0]
    np.testing.assert_allclose(curve, full.losses, atol=1e-6, rtol=0)
    vals = lambda p: [e["val_loss"] for e in read_metrics(str(p / "metrics.jsonl")) if e["event"] == "eval"]
    np.testing.assert_allclose(vals(tmp_path / "part"), vals(tmp_path / "full"), atol=1e-6, rtol=0)


def test_muon_orthogonalises_stacked_heads_as_one_matrix():
    """A (heads, d_head, d_model) weight is updated as the (heads*d_head, d_model) matrix: the
    first update (no momentum history) is lr times an orthogonal-ish matrix of that shape,
    whose singular values Newton-Schulz pushes towards 1 (checked with numpy's SVD)."""
    g = mx.array(np.random.default_rng(0).normal(size=(4, 8, 32)).astype(np.float32))
    p = mx.zeros((4, 8, 32))
    opt = MatrixMuon(learning_rate=1.0, momentum=0.0, weight_decay=0.0, nesterov=False)
    opt.init({"w": p})
    new = opt.apply_gradients({"w": g}, {"w": p})["w"]
    s = np.linalg.svd(-np.array(new).reshape(32, 32), compute_uv=False)
    assert s.min() > 0.5 and s.max() < 1.5, s
    # positive control: MLX's Muon flattens to (4, 256) rows, which as the 32x32 matrix is
    # far from orthogonal
    base = optim.Muon(learning_rate=1.0, momentum=0.0, weight_decay=0.0, nesterov=False)
    base.init({"w": p})
    flat = np.linalg.svd(-np.array(base.apply_gradients({"w": g}, {"w": p})["w"]).reshape(32, 32),
                         compute_uv=False)
    assert flat.min() < 0.5 or flat.max() > 1.5, flat


@pytest.mark.parametrize("kw,msg", [(dict(optimizer="adam", weight_decay=0.1), "adam has no weight decay"),
                                    (dict(optimizer="sgd", momentum=0.0, nesterov=True), "nesterov"),
                                    (dict(optimizer="rmsprop"), "optimizer must be one of")])
def test_optimizer_options_are_checked(kw, msg):
    with pytest.raises(UserError, match=msg):
        TrainConfig(**kw).validate()


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_nonfinite_step_leaves_weights_and_optimizer_state_untouched(name):
    from mlx.utils import tree_flatten

    model = tiny_model(0)
    model.unfreeze()
    cfg = TrainConfig(method="scratch", steps=5, lr=LR[name], schedule="constant", optimizer=name).validate()
    opt = make_optimizer(cfg)
    opt.init(model.trainable_parameters())
    stepper = Stepper(model, opt, cfg, packed=True)
    x = np.random.default_rng(0).integers(0, 256, (2, 17)).astype(np.int32)
    w = np.ones((2, 16), np.float32)
    batch = lambda w: Batch(x[:, :-1], x[:, 1:], w, np.zeros((2, 16), np.int32), 32, 32)
    snap = lambda: {k: np.array(v) for k, v in tree_flatten([model.trainable_parameters(), opt.state])}
    for _ in range(2):
        stepper([batch(w)])
    before = snap()
    bad = w.copy()
    bad[0, 3] = np.nan
    loss, _ = stepper([batch(bad)])
    assert not np.isfinite(loss.item())
    after = snap()
    assert set(after) == set(before)
    for k in before:
        np.testing.assert_array_equal(after[k], before[k], err_msg=k)
    # positive control: a good step changes them
    stepper([batch(w)])
    assert any(not np.array_equal(snap()[k], before[k]) for k in before if "step" not in k)
