"""--report-to: TensorBoard and W&B sinks beside metrics.jsonl, read back with their own readers."""

from __future__ import annotations

import glob
import json
import os
import struct
import time

import numpy as np
import pytest
import wandb
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from wandb.proto import wandb_internal_pb2 as wandb_pb

from helpers_train import qa_rows, run_cli, write_jsonl, write_tiny_model_folder
from mlxtoy import dashboards
from mlxtoy.config import TrainConfig
from mlxtoy.errors import UserError
from mlxtoy.rundir import read_metrics
from mlxtoy.train.job import run_job


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("dash")
    data = root / "data"
    write_jsonl(str(data / "train.jsonl"), qa_rows(40, seed=1))
    write_jsonl(str(data / "valid.jsonl"), qa_rows(8, seed=2))
    return {"model": write_tiny_model_folder(str(root / "model")), "data": str(data)}


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def cfg_of(work, out, **kw) -> TrainConfig:
    base = dict(model=work["model"], data=work["data"], out=str(out), steps=6, batch_size=2, seq_len=64,
                eval_every=2, eval_batches=1, save_every=0, taps_every=3, sample_every=3, sample_tokens=4,
                lora_targets=["q", "v"], lr=5e-3)
    base.update(kw)
    return TrainConfig(**base)


def wandb_records(path: str) -> list:
    """The protobuf records of a .wandb file: LevelDB's log format (32 KiB blocks of chunks,
    each with a 7-byte header: crc32, length, type full/first/middle/last) after a 7-byte
    ":W&B" file header; written out here, independently of wandb."""
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, buf, out = 7, b"", []
    while pos + 7 <= len(data):
        room = 32768 - pos % 32768
        if room < 7:  # a block's tail too short for a header is padding
            pos += room
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind == 1:
            out.append(chunk)
        elif kind == 2:
            buf = chunk
        elif kind == 3:
            buf += chunk
        elif kind == 4:
            out.append(buf + chunk)
    records = []
    for raw in out:
        r = wandb_pb.Record()
        r.ParseFromString(raw)
        records.append(r)
    return records


def wandb_history(run_dir: str) -> dict[int, dict]:
    [path] = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))
    # W&B's service process may still be flushing the file after run.finish() returns (a CI run
    # once read a record cut short): read it once its size has held for a moment
    size, deadline = -1, time.monotonic() + 20
    while os.path.getsize(path) != size and time.monotonic() < deadline:
        size = os.path.getsize(path)
        time.sleep(0.5)
    rows: dict[int, dict] = {}
    for r in wandb_records(path):
        if r.WhichOneof("record_type") == "history":
            row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
            rows.setdefault(int(row["_step"]), {}).update(row)
    return rows


def test_tensorboard_and_wandb_hold_what_metrics_jsonl_holds(tmp_path, work, offline):
    run = tmp_path / "run"
    job = run_job(lambda: (cfg_of(work, run, report_to=["tensorboard", "wandb"]), False), handle_sigint=False)
    assert job.result.reason == "finished"
    events = read_metrics(str(run / "metrics.jsonl"))
    steps = {e["step"]: e for e in events if e["event"] == "step"}
    evals = {e["step"]: e for e in events if e["event"] == "eval"}
    taps = [e for e in events if e["event"] == "taps"]
    assert sorted(steps) == [1, 2, 3, 4, 5, 6] and sorted(evals) == [0, 2, 4, 6] and len(taps) == 2

    ea = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    ea.Reload()
    tb = lambda tag: {e.step: e.value for e in ea.Scalars(tag)}
    for tag, field, source in (("train/loss", "loss", steps), ("train/lr", "lr", steps),
                               ("train/tokens_per_sec", "tokens_per_sec", steps),
                               ("train/peak_memory_gb", "peak_memory_gb", steps),
                               ("val/loss", "val_loss", evals), ("val/ppl", "val_ppl", evals)):
        got = tb(tag)
        assert sorted(got) == sorted(source), tag
        np.testing.assert_allclose([got[s] for s in sorted(source)], [source[s][field] for s in sorted(source)],
                                   rtol=1e-6, err_msg=tag)  # TensorBoard keeps float32
    stat = taps[0]["stats"][0]
    tag = f"taps/{stat['site']}/layer{stat['layer']}"
    hist = {h.step: h.histogram_value for h in ea.Histograms(tag)}
    assert sorted(hist) == [3, 6]
    assert list(hist[3].bucket) == stat["hist"] and hist[3].num == sum(stat["hist"])
    assert ea.Tensors("samples/text_summary")

    hist_w = wandb_history(str(run))
    assert {s for s, row in hist_w.items() if "train/loss" in row} == set(steps)
    assert {s for s, row in hist_w.items() if "val/loss" in row} == set(evals)
    for s, e in steps.items():
        assert hist_w[s]["train/loss"] == pytest.approx(e["loss"], rel=1e-12)
        assert hist_w[s]["train/lr"] == pytest.approx(e["lr"], rel=1e-12)
    for s, e in evals.items():
        assert hist_w[s]["val/loss"] == pytest.approx(e["val_loss"], rel=1e-12)
        assert hist_w[s]["val/ppl"] == pytest.approx(e["val_ppl"], rel=1e-12)
    assert hist_w[3][tag + "/values"] == stat["hist"] and hist_w[3]["samples/_type"] == "table-file"


def test_preference_metrics_reach_the_dashboards():
    from mlxtoy.events import EvalEvent, StepEvent

    ev = StepEvent(step=3, loss=0.5, lr=1e-3, tokens=10, tokens_per_sec=1.0, elapsed=1.0, eta=1.0,
                   peak_memory_gb=0.1, reward_chosen=0.2, reward_rejected=-0.1, reward_margin=0.3,
                   pref_accuracy=0.75)
    got = dashboards.scalars(ev)
    assert got["train/pref_accuracy"] == 0.75 and got["train/reward_margin"] == 0.3
    assert "train/grad_norm" not in got  # None: not sent
    got = dashboards.scalars(EvalEvent(step=4, val_loss=1.0, val_ppl=float(np.e), val_tokens=3,
                                       pref_accuracy=0.5, reward_margin=0.1))
    assert got == {"val/loss": 1.0, "val/ppl": float(np.e), "val/pref_accuracy": 0.5, "val/reward_margin": 0.1}


def test_a_dashboard_not_installed_is_one_error_before_anything_is_written(tmp_path, work, monkeypatch):
    real = dashboards.importlib.util.find_spec
    monkeypatch.setattr(dashboards.importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboardX" else real(name, *a))
    with pytest.raises(UserError, match=r"tensorboardX is not installed \(pip install 'mlxtoy\[tensorboard\]'\)"):
        run_job(lambda: (cfg_of(work, tmp_path / "run", report_to=["tensorboard"]), False), handle_sigint=False)
    assert not (tmp_path / "run").exists()


def test_a_dashboard_that_cannot_start_stops_the_job_before_step_1(tmp_path, work, monkeypatch):
    def no_login(**kw):
        raise wandb.errors.UsageError("api_key not configured (no-tty)")

    monkeypatch.setattr(wandb, "init", no_login)
    monkeypatch.setenv("WANDB_MODE", "online")
    with pytest.raises(UserError, match="W&B did not start .*api_key not configured.*WANDB_MODE=offline"):
        run_job(lambda: (cfg_of(work, tmp_path / "run", report_to=["wandb"]), False), handle_sigint=False)
    assert not [e for e in read_metrics(str(tmp_path / "run" / "metrics.jsonl")) if e["event"] == "step"]
    assert not os.path.exists(tmp_path / "run" / "adapters.safetensors")


def test_a_dashboard_failing_mid_run_does_not_stop_training(tmp_path, work, monkeypatch, capfd):
    calls = []

    def broken(self, ev):
        calls.append(ev)
        raise OSError("disk full")

    monkeypatch.setattr(dashboards.TensorBoardSink, "__call__", broken)
    job = run_job(lambda: (cfg_of(work, tmp_path / "run", report_to=["tensorboard"]), False), handle_sigint=False)
    assert job.result.reason == "finished" and len(calls) == 1
    assert capfd.readouterr().err.count("--report-to tensorboard stopped (OSError: disk full)") == 1


def test_cli_report_to(tmp_path, work):
    common = ["train", "--model", work["model"], "--data", work["data"], "--steps", "2", "--seq-len", "64",
              "--batch-size", "2", "--eval-every", "1", "--eval-batches", "1", "--save-every", "0"]
    r = run_cli(*common, "--out", str(tmp_path / "bad"), "--report-to", "tensorboard,mlflow")
    assert r.returncode == 2 and "unknown dashboard 'mlflow'" in r.stderr
    assert not (tmp_path / "bad").exists()
    r = run_cli(*common, "--out", str(tmp_path / "run"), "--report-to", "tensorboard")
    assert r.returncode == 0, r.stderr
    ea = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    ea.Reload()
    assert [e.step for e in ea.Scalars("train/loss")] == [1, 2]
    assert [e.step for e in ea.Scalars("val/loss")] == [0, 1, 2]


def test_resumed_run_redoes_steps_in_tensorboard_once(tmp_path, work):
    """A run that died after step 3 with its newest checkpoint at step 2 redoes step 3: the
    TensorBoard history holds each step once, with the resumed run's values."""
    import shutil

    from mlxtoy.train.control import TrainControl
    from mlxtoy.train.job import resume_config

    run = tmp_path / "run"
    kw = dict(report_to=["tensorboard"], save_every=2, taps_every=0, sample_every=0, lora_dropout=0.3)
    part = run_job(lambda: (cfg_of(work, run, **kw), False), control=TrainControl(stop_at=3), handle_sigint=False)
    assert part.result.step == 3
    shutil.rmtree(run / "checkpoints" / "step_3")  # as if killed before that checkpoint
    ea = EventAccumulator(str(run / "tensorboard"))
    ea.Reload()
    first = {e.step: e.value for e in ea.Scalars("train/loss")}
    assert sorted(first) == [1, 2, 3]
    rest = run_job(lambda: (resume_config(str(run), {}), True), handle_sigint=False)
    assert rest.result.reason == "finished"
    steps = {e["step"]: e["loss"] for e in read_metrics(str(run / "metrics.jsonl")) if e["event"] == "step"}
    ea = EventAccumulator(str(run / "tensorboard"))
    ea.Reload()
    got = [(e.step, e.value) for e in ea.Scalars("train/loss")]
    assert [s for s, _ in got] == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose([v for _, v in got], [steps[s] for s in range(1, 7)], rtol=1e-6)
    assert [e.step for e in ea.Scalars("val/loss")] == [0, 2, 4, 6]
