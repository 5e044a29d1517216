"""Training by epochs, early stopping on the validation loss, and RUN/best."""

from __future__ import annotations

import json
import os

import mlx.core as mx
import numpy as np
import pytest
import yaml

from helpers_train import qa_rows, run_cli, run_training, write_jsonl, write_tiny_model_folder
from mlxtoy.config import TrainConfig
from mlxtoy.errors import UserError
from mlxtoy.loading import load, load_run_model
from mlxtoy.rundir import locate, read_metrics
from mlxtoy.train.control import TrainControl
from mlxtoy.train.data import BatchStream
from mlxtoy.train.job import prepare, resume_config
from mlxtoy.train.step import Stepper


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("epochs")
    data = root / "data"
    write_jsonl(str(data / "train.jsonl"), qa_rows(50, seed=1))
    write_jsonl(str(data / "valid.jsonl"), qa_rows(8, seed=2))
    return {"model": write_tiny_model_folder(str(root / "model")), "data": str(data)}


def cfg_of(work, out, **kw) -> TrainConfig:
    base = dict(model=work["model"], data=work["data"], out=str(out), method="lora", steps=20,
                batch_size=4, seq_len=64, lr=5e-3, eval_every=2, eval_batches=1, save_every=2,
                keep_checkpoints=0, lora_targets=["q", "v"], seed=0)
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("epochs,grad_accum", [(1, 1), (2, 3)])
def test_epochs_resolve_to_whole_passes(tmp_path, work, pack, epochs, grad_accum):
    p = prepare(cfg_of(work, tmp_path / "run", epochs=epochs, grad_accum=grad_accum, pack=pack))
    try:
        steps = p.cfg.steps
        stream = BatchStream(p.dataset.train, 4, 64, 0, pack, True, 0)
        n = len(p.dataset.train)

        def seen(n_steps: int) -> np.ndarray:  # how often each training example is trained on
            count = np.zeros(n, int)
            for i in range(n_steps * grad_accum):
                for row in stream._rows_for(i):
                    count[row] += 1
            return count

        # the resolved steps give every example `epochs` passes; one step fewer does not
        assert seen(steps).min() >= epochs
        assert seen(steps - 1).min() < epochs
        if not pack:  # padded: one example a row, so this is arithmetic
            assert steps == -(-epochs * -(-n // 4) // grad_accum)
        saved = yaml.safe_load(open(os.path.join(p.run.path, "config.yaml")))
        assert saved["steps"] == steps and saved["epochs"] == epochs
    finally:
        p.run.unlock()


def test_packed_epochs_take_fewer_steps_than_padded(tmp_path, work):
    steps = {}
    for pack in (True, False):
        p = prepare(cfg_of(work, tmp_path / str(pack), epochs=1, pack=pack))
        p.run.unlock()
        steps[pack] = p.cfg.steps
    assert steps[True] < steps[False] == 13  # 50 examples, 4 a batch


def test_epochs_and_steps_flags_are_alternatives(tmp_path, work):
    r = run_cli("train", "--model", work["model"], "--data", work["data"], "--out", str(tmp_path / "r"),
                "--epochs", "1", "--steps", "5")
    assert r.returncode == 2 and "error: --epochs and --steps are alternatives" in r.stderr
    assert not (tmp_path / "r").exists()


# a scripted validation curve, by the number of updates done (evaluations every 2 steps):
# patience 3 with delta 0.1 stops at the 3rd evaluation without a 0.1 drop from 2.0 (step 4),
# i.e. step 10; 1.95 at step 8 is a new minimum (best/) that is not a 0.1 improvement
CURVE = {0: 3.0, 2: 2.5, 4: 2.0, 6: 2.1, 8: 1.95, 10: 2.2, 12: 2.3, 14: 1.0, 16: 2.5, 18: 2.6, 20: 2.7}


def expected_stop(curve: dict[int, float], patience: int, delta: float) -> tuple[int, int]:
    """(step it stops at, step of the minimum so far), the rule written out independently."""
    ref, bad, best = None, 0, None
    for step in sorted(curve):
        v = curve[step]
        if best is None or v < curve[best]:
            best = step
        if ref is None or v < ref - delta:
            ref, bad = v, 0
        else:
            bad += 1
        if bad >= patience:
            return step, best
    return max(curve), best


@pytest.fixture
def scripted(monkeypatch):
    def evaluate(self, stream, n_batches):
        return CURVE[int(self.optimizer.step.item())], 1, {}

    monkeypatch.setattr(Stepper, "evaluate", evaluate)


def test_early_stop_on_a_scripted_curve_and_best_is_the_minimum(tmp_path, work, scripted):
    stop, best = expected_stop(CURVE, 3, 0.1)
    assert (stop, best) == (10, 8)
    res = run_training(cfg_of(work, tmp_path / "run", early_stop=3, early_stop_delta=0.1), handle_sigint=False)
    assert res.reason == "early_stopped" and res.step == stop and os.path.exists(res.final_path)
    evals = [(e["step"], e["val_loss"]) for e in read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
             if e["event"] == "eval"]
    assert evals == [(s, CURVE[s]) for s in sorted(CURVE) if s <= stop]
    state = json.load(open(tmp_path / "run" / "best" / "state.json"))
    assert state["step"] == best and state["val_loss"] == min(v for _, v in evals)
    # best/ holds the weights of step 8 (the checkpoint written then), not the last ones
    a = mx.load(str(tmp_path / "run" / "best" / "trainable.safetensors"))
    b = mx.load(str(tmp_path / "run" / "checkpoints" / "step_8" / "trainable.safetensors"))
    c = mx.load(str(tmp_path / "run" / "checkpoints" / "step_10" / "trainable.safetensors"))
    assert set(a) == set(b)
    for k in a:
        np.testing.assert_array_equal(np.array(a[k]), np.array(b[k]))
    assert any(not np.array_equal(np.array(a[k]), np.array(c[k])) for k in a)
    # RUN/best is a checkpoint for everything that loads a run
    run, ckpt = locate(str(tmp_path / "run" / "best"))
    assert run.path == str(tmp_path / "run") and ckpt.endswith("best")
    x = mx.array([[5, 6, 7, 8, 9]])
    m_best, _ = load_run_model(str(tmp_path / "run" / "best"))
    m_8, _ = load_run_model(str(tmp_path / "run" / "checkpoints" / "step_8"))
    m_last, _ = load(str(tmp_path / "run"))
    m_as_model, _ = load(str(tmp_path / "run" / "best"))
    np.testing.assert_allclose(np.array(m_best(x)), np.array(m_8(x)), atol=1e-6)
    np.testing.assert_allclose(np.array(m_as_model(x)), np.array(m_8(x)), atol=1e-6)
    assert not np.allclose(np.array(m_best(x)), np.array(m_last(x)), atol=1e-5)
    gguf = tmp_path / "best.gguf"
    r = run_cli("export", str(tmp_path / "run" / "best"), "--out", str(gguf), "--dtype", "f32")
    assert r.returncode == 0, r.stderr
    for model in (["--model", str(tmp_path / "run" / "best")],
                  ["--model", work["model"], "--adapter", str(tmp_path / "run" / "best")]):
        r = run_cli("generate", *model, "--prompt", "12+1", "--max-tokens", "3")
        assert r.returncode == 0, r.stderr
    texts = {}
    for src in ("best", "checkpoints/step_8"):
        r = run_cli("generate", "--model", str(tmp_path / "run" / src), "--prompt", "12+1", "--max-tokens", "6")
        texts[src] = r.stdout
    assert texts["best"] == texts["checkpoints/step_8"]
    r = run_cli("taps", work["model"], "--adapter", str(tmp_path / "run" / "best"), "--prompt", "12+1")
    assert r.returncode == 0, r.stderr


def test_without_early_stop_the_run_finishes_and_best_is_still_the_minimum(tmp_path, work, scripted):
    res = run_training(cfg_of(work, tmp_path / "run"), handle_sigint=False)
    assert res.reason == "finished" and res.step == 20
    state = json.load(open(tmp_path / "run" / "best" / "state.json"))
    assert state["step"] == 14 and state["val_loss"] == 1.0 == min(CURVE.values())


def test_resume_keeps_patience_and_best(tmp_path, work, scripted):
    kw = dict(early_stop=3, early_stop_delta=0.1)
    part = run_training(cfg_of(work, tmp_path / "run", **kw), control=TrainControl(stop_at=8),
                        handle_sigint=False)
    assert part.reason == "stopped" and part.step == 8
    state = json.load(open(tmp_path / "run" / "checkpoints" / "step_8" / "state.json"))
    assert state["bad_evals"] == 2 and state["best_step"] == 8 and state["patience_best"] == 2.0
    rest = run_training(resume_config(str(tmp_path / "run"), {}), resume=True, handle_sigint=False)
    # a resumed run that forgot its patience would go on past step 10 (2.2 would be its first
    # evaluation) and would make step 10 its best
    assert rest.reason == "early_stopped" and rest.step == 10
    assert json.load(open(tmp_path / "run" / "best" / "state.json"))["step"] == 8


def test_early_stop_needs_evaluations(tmp_path, work):
    with pytest.raises(UserError, match="eval_every"):
        cfg_of(work, tmp_path / "r", early_stop=2, eval_every=0).validate()
    with pytest.raises(UserError, match="no best checkpoint yet"):
        os.makedirs(tmp_path / "r2")
        open(tmp_path / "r2" / "config.yaml", "w").write("{}")
        locate(str(tmp_path / "r2" / "best"))
