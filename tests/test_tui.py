"""The terminal UI, driven end to end with Textual's Pilot, and snapshots of every screen.

The end-to-end tests start the real trainer (`python -m mlxtoy.train.remote`) on a tiny random
GGUF model (byte-level BPE, 2 layers) and a small text dataset. Snapshot tests use fixed fake
data (tests/fake_trainer.py's fake_events, fixed clocks and file times) so they are deterministic;
update them with `pytest tests/test_tui.py --snapshot-update` and review the SVGs.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import random
import shutil
import sys
import time

import pytest

import textual  # noqa: F401,E402  (declared test dependency)
import textual_plotext  # noqa: F401,E402  (declared test dependency)

os.environ["TZ"] = "UTC"  # log timestamps and file times in snapshots
time.tzset()

from textual.widgets import DataTable, Input, Select, Static  # noqa: E402

from tui.app import MlxtoyApp  # noqa: E402
from fake_trainer import T0, fake_events  # noqa: E402
from tui.setup import parse_value  # noqa: E402
from tui.state import DONE, PAUSED, RUNNING, RunState, scan_runs  # noqa: E402
from tui.widgets import LossChart, TapsHeatmap  # noqa: E402

SIZE = (100, 32)
WORDS = "the cat sat on a mat and the dog ran in the sun at the park with a red ball".split()


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A tiny GGUF model, a text dataset, a malformed one, and two finished fake runs."""
    from helpers_parity import random_gguf_tensors, tiny_config, write_tiny_gguf

    root = tmp_path_factory.mktemp("tui")
    cfg = tiny_config()
    write_tiny_gguf(str(root / "tiny.gguf"), cfg, random_gguf_tensors(cfg, seed=1))
    rng = random.Random(0)
    with open(root / "data.jsonl", "w") as f:
        for _ in range(60):
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 24)))}) + "\n")
    (root / "datasets").mkdir()
    for name in ("train.jsonl", "valid.jsonl"):
        with open(root / "datasets" / name, "w") as f:
            for _ in range(10):
                f.write(json.dumps({"prompt": "say " + rng.choice(WORDS), "completion": " ok"}) + "\n")
    with open(root / "bad.jsonl", "w") as f:
        f.write('{"text": "fine"}\n{"text": "broken\n')
    with open(root / "corrupt.gguf", "wb") as f:  # passes the form's magic check, not the loader
        f.write(b"GGUF" + bytes(range(256)) * 4)
    runs = root / "runs"
    for name, steps in (("demo-a", 30), ("demo-b", 12)):
        d = runs / name
        d.mkdir(parents=True)
        with open(d / "metrics.jsonl", "w") as f:
            for ev in fake_events(steps=steps, n_layers=4, run_dir=str(d)):
                f.write(json.dumps(ev) + "\n")
        os.utime(d / "metrics.jsonl", (T0 + steps, T0 + steps))
    return root


@pytest.fixture
def in_assets(assets, monkeypatch):
    monkeypatch.chdir(assets)
    return assets


def run_async(fn):
    """Run an async test with asyncio (no pytest-asyncio needed); fixtures pass through."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return asyncio.run(fn(*args, **kwargs))

    return wrapper


async def wait_for(pilot, cond, timeout: float = 60.0, what: str = "") -> None:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or cond}")
        await pilot.pause(0.05)


async def set_field(pilot, app, name: str, value: str) -> None:
    inp = app.screen.query_one(f"#f-{name}", Input)
    inp.value = value
    await pilot.pause()


def error_text(app, name: str) -> str:
    label = app.screen.query_one(f"#e-{name}", Static)
    return str(label.render()) if label.display else ""


async def fill_setup(pilot, app, out: str, steps: int = 100_000) -> None:
    # by default a run no test lets finish: the tests that stop it must find it still running
    # however fast training gets (400 steps once finished before the stop)
    await wait_for(pilot, lambda: "data" not in app.screen.errors, 30, "the data preview")
    for name, value in (("out", out), ("steps", str(steps)), ("batch_size", "2"), ("seq_len", "64"),
                        ("lr", "0.001"), ("lora_rank", "4"), ("eval_every", "5"), ("eval_batches", "2"),
                        ("save_every", "0"),
                        ("sample_every", "0"), ("taps_every", "5")):
        await set_field(pilot, app, name, value)
    assert app.screen.errors == {}, app.screen.errors


# --------------------------------------------------------------------------- pure pieces


def test_parse_value():
    # the form parses with TrainConfig's own metadata: steps > 0, lr > 0, eval_every >= 0
    assert parse_value("steps", "8") == (8, None)
    assert parse_value("steps", "0")[1] == "must be > 0"
    assert "not a number" in parse_value("lr", "abc")[1]
    assert parse_value("eval_every", "0") == (0, None)
    assert "not a whole number" in parse_value("eval_every", "1.5")[1]
    assert parse_value("lora_targets", "q, v") == (["q", "v"], None)
    assert "unknown LoRA target" in parse_value("lora_targets", "q,x")[1]
    assert parse_value("lr", "nan")[1] is not None


def test_run_state_folds_events():
    state = RunState.from_events(list(fake_events(steps=30, n_layers=4)))
    assert state.status == DONE and state.done_reason == "finished"
    assert len(state.steps) == 30 and len(state.val_steps) == 3
    n_layers, sites, values = state.taps_grid()
    assert n_layers == 4 and sites == ["attn_norm", "ffn_out", "resid_post"] and len(values) == 12
    assert len(state.samples) == 2 and state.checkpoints


def test_run_state_folds_preference_metrics():
    state = RunState.from_events(list(fake_events(steps=30, n_layers=4, objective="dpo")))
    step_metrics, eval_metrics = state.metrics
    margins = state.series(step_metrics[1])
    assert step_metrics[1].label == "margin" and len(margins.values) == 30
    assert state.series(eval_metrics[1], of_eval=True).steps == [10, 20, 30]  # val acc
    assert state.summary()["acc"] == "100%" and state.summary()["margin"] == f"{margins.values[-1]:.3f}"
    plain = RunState.from_events(list(fake_events(steps=30, n_layers=4)))  # control: an SFT run
    assert "margin" not in plain.summary() and list(plain.step_series) == ["loss"]


def test_scan_runs(assets):
    runs = scan_runs(str(assets / "runs"))
    assert [r.name for r in runs] == ["demo-a", "demo-b"]
    assert runs[0].steps == "30/30" and runs[0].status == "finished"


def test_command_importable_without_textual():
    """`mlxtoy` must import (and list its commands) without pulling Textual in."""
    code = ("import sys; import mlxtoy.cli as c; c.build_parser(); "
            "assert 'textual' not in sys.modules, 'textual imported'; print('ok')")
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def _remote(config: dict, stdin: str = "", timeout: float = 120):
    import subprocess

    return subprocess.run([sys.executable, "-m", "mlxtoy.train.remote", "--config", json.dumps(config)],
                          input=stdin, capture_output=True, text=True, timeout=timeout)


def test_remote_bad_config_is_an_error_event():
    out = _remote({"model": "tiny.gguf", "bogus": 1})
    assert out.returncode == 2
    assert "unknown key 'bogus'" in out.stderr
    events = [json.loads(line) for line in out.stdout.splitlines()]  # stdout: only events
    assert events[-1]["event"] == "log" and events[-1]["level"] == "error"


def test_remote_commands_and_end_of_input(assets, tmp_path):
    """Commands on stdin act on the live run; stdin closing (the UI went away) stops and saves it."""
    import subprocess

    cfg = {"model": str(assets / "tiny.gguf"), "data": str(assets / "data.jsonl"), "out": str(tmp_path / "r"),
           "steps": 100000, "batch_size": 2, "seq_len": 64, "eval_every": 0, "save_every": 0,
           "taps_every": 2, "lr": 1e-3}
    proc = subprocess.Popen([sys.executable, "-m", "mlxtoy.train.remote", "--config", json.dumps(cfg)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    events = []
    try:
        sent = closed = False
        for line in proc.stdout:
            ev = json.loads(line)  # stdout carries only events
            events.append(ev)
            if ev["event"] == "step" and not sent:
                proc.stdin.write('{"cmd": "checkpoint"}\nsample\n{"cmd": "dance"}\n')
                proc.stdin.flush()
                sent = True
            kinds = {e["event"] for e in events}
            if sent and not closed and {"checkpoint", "sample", "taps"} <= kinds:
                proc.stdin.close()  # the front end goes away
                closed = True
        assert proc.wait(timeout=120) == 0, proc.stderr.read()
    finally:
        proc.kill()
    assert any(e["event"] == "log" and "unknown command" in e["message"] for e in events)
    done = events[-1]
    assert done["event"] == "done" and done["reason"] == "stopped" and done["step"] > 0
    assert os.path.exists(tmp_path / "r" / "checkpoints" / f"step_{done['step']}" / "state.json")
    from mlxtoy.rundir import read_metrics

    assert read_metrics(str(tmp_path / "r" / "metrics.jsonl"))[-1]["event"] == "done"


# --------------------------------------------------------------------------- setup form


@run_async
async def test_setup_bad_input_shows_inline_errors(in_assets):
    app = MlxtoyApp(model="tiny.gguf", data="data.jsonl", runs_dir="runs")
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: "data" not in app.screen.errors, 30, "the data preview")
        assert app.screen.errors == {}

        await set_field(pilot, app, "model", "missing.gguf")
        assert "no such file" in error_text(app, "model")
        await set_field(pilot, app, "model", "data.jsonl")  # exists, but not a GGUF
        assert "not a GGUF" in error_text(app, "model")
        await set_field(pilot, app, "model", "tiny.gguf")
        assert error_text(app, "model") == ""

        await set_field(pilot, app, "data", "nope.jsonl")
        assert "no such file" in error_text(app, "data")
        await set_field(pilot, app, "data", "bad.jsonl")
        await wait_for(pilot, lambda: "invalid JSON" in error_text(app, "data"), 30, "the malformed data error")
        assert "bad.jsonl:2" in error_text(app, "data")  # names file and line

        await set_field(pilot, app, "lora_rank", "0")
        assert "must be > 0" in error_text(app, "lora_rank")
        await set_field(pilot, app, "lr", "abc")
        assert "not a number" in error_text(app, "lr")
        await set_field(pilot, app, "lora_targets", "q,zz")
        assert "unknown LoRA target" in error_text(app, "lora_targets")

        # Start refuses, says why, and the app keeps running on the setup screen
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert app.trainer is None and type(app.screen).__name__ == "SetupScreen" and app.is_running
        form_error = app.screen.query_one("#form-error", Static)
        assert form_error.display and "fix" in str(form_error.render())

        # typing over with good values clears the errors
        await set_field(pilot, app, "data", "data.jsonl")
        await set_field(pilot, app, "lora_rank", "4")
        await set_field(pilot, app, "lr", "1e-3")
        await set_field(pilot, app, "lora_targets", "q,v")
        await wait_for(pilot, lambda: not app.screen.errors, 30, "errors to clear")

        # a folder that already holds a run is refused too
        await set_field(pilot, app, "out", "runs/demo-a")
        assert "already holds a run" in error_text(app, "out")


@run_async
async def test_setup_form_starts_from_trainconfig_defaults(in_assets):
    """What the form shows (read back from its inputs and from the config it would start)
    is TrainConfig's defaults, except the two fields the UI turns on so the dashboard has
    something to show, and beta, which shows what the default objective resolves it to."""
    from mlxtoy.config import TrainConfig
    from tui.setup import FIELDS, UI_OVERRIDES

    assert set(UI_OVERRIDES) == {"sample_every", "taps_every", "beta"}
    assert UI_OVERRIDES["beta"] == TrainConfig().validate().beta  # validation resolves beta
    defaults = TrainConfig()
    app = MlxtoyApp(model="tiny.gguf", data="data.jsonl", runs_dir="runs")
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: "data" not in app.screen.errors, 30, "the data preview")
        cfg = app.screen.collect()
        assert cfg is not None
        for f in FIELDS:
            shown = app.screen.query_one(f"#f-{f.name}", Input).value
            want = UI_OVERRIDES.get(f.name, getattr(defaults, f.name))
            assert parse_value(f.name, shown) == (want, None), (f.name, shown)
            if f.applies("lora", defaults.objective):
                assert cfg[f.name] == want, f.name
        assert cfg["seq_len"] == defaults.seq_len  # the default that once drifted


@run_async
async def test_setup_data_preview(in_assets):
    app = MlxtoyApp(model="tiny.gguf", data="data.jsonl", runs_dir="runs")
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.screen.preview is not None, 30, "the data preview")
        preview = app.screen.preview
        assert preview["count"] == 60 and preview["kind"] == "text"
        assert preview["lengths"]["min"] > 0 and preview["lengths"]["max"] >= preview["lengths"]["min"]
        assert len(preview["examples"]) == 3
        text = str(app.screen.query_one("#data-info", Static).render())
        assert "60 examples" in text and "tokens per example" in text
        # the first record as the trainer renders it (mlxtoy.train.formats; checked against the
        # trainer's batches for every kind in tests/test_record_kinds.py)
        first = json.loads(open("data.jsonl").readline())["text"]
        assert "As trained" in text and first[:40] in text


# A stand-in for the trainer: says which device it was asked for and which it computes on.
REPORT_DEVICE = ("import json, os; from mlxtoy import backend; print(json.dumps({'event': 'log', 'message': "
                 "'device: MLXTOY_DEVICE=%s computes on %s' % (os.environ.get('MLXTOY_DEVICE', 'unset'), "
                 "backend.INFO.device)}), flush=True)")


@run_async
async def test_setup_device_reaches_the_trainer(in_assets):
    """The Setup form's device (issue 35: --device cpu|gpu in the TUI) reaches the trainer's
    process, whose backend computes there; auto leaves the choice to it; gpu is refused where
    this MLX has no GPU."""
    from mlxtoy import backend

    app = MlxtoyApp(model="tiny.gguf", data="data.jsonl", runs_dir="runs",
                    trainer_argv=lambda cfg: [sys.executable, "-c", REPORT_DEVICE])
    async with app.run_test(size=SIZE) as pilot:
        await fill_setup(pilot, app, str(in_assets / "runs-e2e" / "device"))
        device = app.screen.query_one("#f-device", Select)
        assert device.value == "auto" and app.screen.device is None
        if backend.gpu_name() is None:
            device.value = "gpu"
            await pilot.pause()
            assert "no GPU here" in error_text(app, "device") and app.screen.collect() is None
        for choice, env, computes in (("cpu", "cpu", "cpu"), ("auto", "unset", backend.gpu_name() or "cpu")):
            await pilot.press("f1")
            await wait_for(pilot, lambda: type(app.screen).__name__ == "SetupScreen", 10, "the setup")
            app.screen.query_one("#f-device", Select).value = choice
            await pilot.pause()
            assert "device" not in app.screen.errors
            app.screen.query_one("#f-out", Input).value = str(in_assets / "runs-e2e" / f"device-{choice}")
            await pilot.pause()
            await pilot.press("ctrl+s")
            want = f"device: MLXTOY_DEVICE={env} computes on {computes}"
            await wait_for(pilot, lambda: any(l.message == want for l in app.run_state.logs), 60, want)
            await wait_for(pilot, lambda: not app.trainer_alive, 30, "the stand-in to exit")


@run_async
async def test_setup_model_by_hugging_face_id(in_assets, tmp_path, monkeypatch):
    """The model field takes an id; Enter fetches it (here from an offline local HF cache) and
    the status line says where it is; a missing id is an inline error; a parquet file and a
    dataset id pass the data field's check."""
    import huggingface_hub.constants
    import pyarrow as pa
    import pyarrow.parquet as pq

    from helpers_hub import folder_files, hub_repo
    from helpers_train import write_tiny_model_folder

    home = str(tmp_path / "hf")
    snap = hub_repo(home, "acme/tiny", folder_files(write_tiny_model_folder(str(tmp_path / "tiny"))))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", os.path.join(home, "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    pq.write_table(pa.Table.from_pylist([{"text": w} for w in WORDS]), "words.parquet")
    app = MlxtoyApp(model="tiny.gguf", data="data.jsonl", runs_dir="runs")
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: "data" not in app.screen.errors, 30, "the data preview")
        info = app.screen.query_one("#model-info", Static)
        await set_field(pilot, app, "model", "acme/tiny")
        assert error_text(app, "model") == "" and "Hugging Face id" in str(info.render())
        app.screen.query_one("#f-model", Input).focus()
        await pilot.press("enter")
        await wait_for(pilot, lambda: "fetched" in str(info.render()), 30, "the fetched model")
        assert os.path.basename(snap) in str(info.render()).replace("\n", "")
        assert "model" not in app.screen.errors
        await set_field(pilot, app, "model", "acme/nope")
        assert error_text(app, "model") == ""  # id-shaped: only fetching can tell
        await pilot.press("enter")
        await wait_for(pilot, lambda: "HF_HUB_OFFLINE" in error_text(app, "model"), 30, "the fetch error")
        await set_field(pilot, app, "data", "words.parquet")
        await wait_for(pilot, lambda: app.screen.preview is not None and app.screen.preview["count"] == len(WORDS),
                       30, "the parquet preview")
        await set_field(pilot, app, "data", "acme/nope-data")
        await wait_for(pilot, lambda: "acme/nope-data" in error_text(app, "data"), 30, "the dataset id error")


@run_async
async def test_file_picker_sets_the_field(in_assets):
    app = MlxtoyApp(model="tiny.gguf", runs_dir="runs")
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("ctrl+o")
        await pilot.pause(0.3)
        assert type(app.screen).__name__ == "FilePicker"
        await pilot.press("escape")
        await pilot.pause()
        assert type(app.screen).__name__ == "SetupScreen"
        # picking a file dismisses with its path
        await pilot.press("ctrl+o")
        await pilot.pause(0.3)
        app.screen.dismiss(str(in_assets / "data.jsonl"))
        await wait_for(pilot, lambda: app.screen.preview is not None, 30, "the data preview")
        assert app.screen.query_one("#f-data", Input).value == "data.jsonl"


# --------------------------------------------------------------------------- end to end


@run_async
async def test_train_pause_sample_resume_stop(in_assets, capsys):
    """Setup, start, the chart fills, pause, sample, resume, stop: the run is saved on disk.
    Also measures how fast key presses are handled while the trainer runs (subprocess)."""
    out = str(in_assets / "runs-e2e" / "e2e")  # not under runs/: the snapshots list runs/
    app = MlxtoyApp(model="tiny.gguf", data="data.jsonl", runs_dir="runs")
    async with app.run_test(size=SIZE) as pilot:
        await fill_setup(pilot, app, out)
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: type(app.screen).__name__ == "DashboardScreen", 10, "the dashboard")
        state = app.run_state

        n = 8
        await wait_for(pilot, lambda: len(state.steps) >= n, 120, f"{n} training steps")
        chart = app.screen.query_one(LossChart)
        await wait_for(pilot, lambda: len(chart.steps) >= n, 5, "the chart to catch up")
        assert chart.steps[:n] == list(range(1, n + 1))
        assert all(v == v for v in chart.losses)
        await wait_for(pilot, lambda: state.val_steps, 60, "an eval")
        await wait_for(pilot, lambda: app.screen.query_one(TapsHeatmap).state.taps, 60, "taps")

        await pilot.press("p")
        assert state.status == PAUSED
        await wait_for(pilot, lambda: any(l.message.startswith("paused at step") for l in state.logs), 60,
                       "the trainer to pause")
        paused_at = len(state.steps)
        await pilot.pause(1.0)
        assert len(state.steps) == paused_at, "steps arrived while paused"
        # the pause wrote a checkpoint of the paused weights
        await wait_for(pilot, lambda: state.checkpoints and state.checkpoints[-1][0] == state.step, 60,
                       "the checkpoint at the pause")

        # talk to the paused weights: Chat loads that checkpoint in the UI process
        await pilot.press("f3")
        await pilot.pause(0.3)
        chat = app.screen
        assert chat.query_one("#source", Select).value == "@current"
        chat.query_one("#temp", Input).value = "0"
        chat.query_one("#max_tokens", Input).value = "6"
        await pilot.press("ctrl+l")
        await wait_for(pilot, lambda: chat.loaded is not None, 60, "the paused weights to load")
        assert chat.loaded.adapter == state.checkpoints[-1][1]
        chat.query_one("#prompt", Input).value = "the dog"
        chat.query_one("#prompt", Input).focus()
        await pilot.press("enter")
        await wait_for(pilot, lambda: not chat.generating and chat._reply_text, 60, "a reply")
        await pilot.press("f2")
        await pilot.pause(0.2)

        n_ckpt = len(state.checkpoints)
        await pilot.press("g")  # a sample is taken after the next step
        await pilot.press("p")
        assert state.status == RUNNING
        await wait_for(pilot, lambda: state.samples, 120, "the sample")
        assert state.samples[0].text is not None
        await wait_for(pilot, lambda: len(state.steps) > paused_at, 60, "steps after resuming")

        await pilot.press("c")
        await wait_for(pilot, lambda: len(state.checkpoints) > n_ckpt, 60, "the requested checkpoint")

        # latency while training: the trainer subprocess keeps the CPU busy; events stream in
        app.latency = type(app.latency)()  # measure this stretch only
        for _ in range(10):
            await pilot.press("p")
            await pilot.pause(0.1)
            await pilot.press("p")
            await pilot.pause(0.1)
        report = app.latency.report()

        await pilot.press("s")
        await wait_for(pilot, lambda: state.status == DONE and not app.trainer_alive, 120, "the stop")
        assert state.done_reason == "stopped"
        assert app.trainer.returncode == 0

    with capsys.disabled():
        print(f"\nkey-press latency while training (n={report['key']['n']}): median "
              f"{report['key']['median_ms']:.1f} ms, p95 {report['key']['p95_ms']:.1f} ms, max "
              f"{report['key']['max_ms']:.1f} ms; 50 ms timer lag: median {report['lag']['median_ms']:.1f} ms, "
              f"p95 {report['lag']['p95_ms']:.1f} ms, max {report['lag']['max_ms']:.1f} ms; "
              f"load average {os.getloadavg()[0]:.1f}")
    assert report["key"]["median_ms"] < 100, report

    # the run on disk: config, metrics (the same events), a complete checkpoint at the stop
    assert os.path.exists(os.path.join(out, "config.yaml"))
    from mlxtoy.rundir import read_metrics

    events = read_metrics(os.path.join(out, "metrics.jsonl"))
    kinds = {e["event"] for e in events}
    assert {"start", "step", "eval", "taps", "sample", "checkpoint", "done"} <= kinds
    ckpts = [e["path"] for e in events if e["event"] == "checkpoint"]
    last = ckpts[-1]
    assert os.path.exists(os.path.join(last, "state.json"))
    assert os.path.exists(os.path.join(last, "trainable.safetensors"))
    with open(os.path.join(last, "state.json")) as f:
        assert json.load(f)["step"] == events[-1]["step"]


@run_async
async def test_quit_saves_the_run(in_assets):
    out = str(in_assets / "runs-e2e" / "quit")
    app = MlxtoyApp(model="tiny.gguf", data="data.jsonl", runs_dir="runs")
    async with app.run_test(size=SIZE) as pilot:
        await fill_setup(pilot, app, out)
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: len(app.run_state.steps) >= 3, 120, "3 steps")
        await pilot.press("q")
        await wait_for(pilot, lambda: not app.is_running, 120, "the app to quit")
    assert app.trainer.returncode == 0
    from mlxtoy.rundir import read_metrics

    events = read_metrics(os.path.join(out, "metrics.jsonl"))
    assert events[-1]["event"] == "done" and events[-1]["reason"] == "stopped"
    ckpt = [e for e in events if e["event"] == "checkpoint"][-1]
    assert ckpt["step"] == events[-1]["step"] and os.path.isdir(ckpt["path"])


@run_async
async def test_scratch_run_finishes(in_assets):
    """A from-scratch run to the end: the final weights are written and the dashboard says done."""
    out = str(in_assets / "runs-e2e" / "scratch")
    app = MlxtoyApp(model="tiny.gguf", data="data.jsonl", runs_dir="runs")
    async with app.run_test(size=SIZE) as pilot:
        app.screen.query_one("#f-method", Select).value = "scratch"
        await pilot.pause()
        await fill_setup(pilot, app, out, steps=6)
        for name, value in (("d_model", "64"), ("n_layers", "2"), ("n_heads", "2"), ("eval_every", "3")):
            await set_field(pilot, app, name, value)
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: app.run_state.status == DONE and not app.trainer_alive, 120, "the end")
        assert app.run_state.done_reason == "finished" and len(app.run_state.steps) == 6
        assert app.run_state.final_path and os.path.exists(app.run_state.final_path)
        assert app.run_state.method == "scratch" and app.run_state.config["d_model"] == 64


@run_async
async def test_setup_offers_dora_with_the_lora_options(in_assets):
    """The method list is TrainConfig's: dora is there and keeps the LoRA fields."""
    app = MlxtoyApp(model="tiny.gguf", data="data.jsonl", runs_dir="runs")
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: "data" not in app.screen.errors, 30, "the data preview")
        app.screen.query_one("#f-method", Select).value = "dora"
        await pilot.pause()
        assert app.screen.query_one("#row-lora_rank").display
        cfg = app.screen.collect()
        assert cfg is not None and cfg["method"] == "dora" and cfg["lora_rank"] == 8


@run_async
async def test_trainer_error_is_shown(in_assets):
    """An error only the trainer can find (a corrupt GGUF behind a valid magic) fails visibly."""
    app = MlxtoyApp(model="tiny.gguf", data="data.jsonl", runs_dir="runs")
    async with app.run_test(size=SIZE) as pilot:
        await fill_setup(pilot, app, str(in_assets / "runs-e2e" / "fails"))
        await set_field(pilot, app, "model", "corrupt.gguf")
        await wait_for(pilot, lambda: not app.screen.errors, 30, "the form to accept it")
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: app.run_state.status == "failed", 120, "the failure")
        errors = [l.message for l in app.run_state.logs if l.level == "error"]
        assert any("corrupt.gguf" in m for m in errors), errors
        assert any("exited with code 2" in m for m in errors), errors
        assert app.is_running and not app.trainer_alive
        await pilot.press("f1")  # back to Setup: it can start again
        assert type(app.screen).__name__ == "SetupScreen"


@run_async
async def test_chat_streams_from_base_and_run(in_assets):
    app = MlxtoyApp(model="tiny.gguf", runs_dir="runs-e2e")
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f3")
        await pilot.pause(0.3)
        screen = app.screen
        screen.query_one("#source", Select).value = "base:tiny.gguf"
        screen.query_one("#temp", Input).value = "0"
        screen.query_one("#max_tokens", Input).value = "12"
        await pilot.press("ctrl+l")
        await wait_for(pilot, lambda: screen.loaded is not None, 60, "the model to load")
        prompt = screen.query_one("#prompt", Input)
        prompt.focus()
        prompt.value = "the cat"
        await pilot.press("enter")
        await wait_for(pilot, lambda: not screen.generating and screen._reply_text, 60, "a reply")
        assert len(screen._reply_text) > 0
        status = str(screen.query_one("#chat-status", Static).render())
        assert "tokens/s" in status

        # bad sampling values: an inline error, nothing generated
        screen.query_one("#temp", Input).value = "hot"
        await pilot.pause()
        assert "not a number" in str(screen.query_one("#chat-error", Static).render())

        # the e2e run (if it ran first) or none: a run source loads through mlxtoy.load(adapter=)
        runs = [k for k in screen.sources if k.startswith("run:") and "e2e" in k]
        if runs:
            screen.query_one("#source", Select).value = runs[0]
            await pilot.press("ctrl+l")
            await wait_for(pilot, lambda: screen.loaded is not None and screen.loaded.adapter, 60,
                           "the run to load")


@run_async
async def test_chat_offers_the_current_runs_best_checkpoint(in_assets, tmp_path):
    from helpers_train import run_training
    from mlxtoy.config import TrainConfig

    out = tmp_path / "run"
    run_training(TrainConfig(model=str(in_assets / "tiny.gguf"), data=str(in_assets / "datasets"), out=str(out),
                             steps=2, batch_size=2, seq_len=32, eval_every=1, eval_batches=1, save_every=0),
                 handle_sigint=False)
    best = str(out / "best")
    app = MlxtoyApp(model="tiny.gguf", runs_dir="runs")
    async with app.run_test(size=SIZE) as pilot:
        app.run_state.run_dir = str(out)
        await pilot.press("f3")
        await pilot.pause(0.3)
        screen = app.screen
        screen.refresh_sources()
        assert "best (lowest validation loss)" in screen.sources[f"ckpt:{best}"].label
        screen.query_one("#source", Select).value = f"ckpt:{best}"
        await pilot.press("ctrl+l")
        await wait_for(pilot, lambda: screen.loaded is not None, 60, "best/ to load")
        assert screen.loaded.adapter == best
        assert app.generator.model.run_source == best


@run_async
async def test_chat_keeps_a_qlora_runs_base_quantized(in_assets, tmp_path):
    """The chat panel loads a QLoRA run as `mlxtoy generate` does: the base quantized as it
    trained, the adapters unmerged on top (not the dense merged model), and it replies."""
    from helpers_train import run_training
    from mlxtoy.config import TrainConfig
    from mlxtoy.models.lora import LORA_TYPES
    from mlxtoy.models.quant import QUANTIZED_TYPES

    out = str(tmp_path / "qlora")
    run_training(TrainConfig(model=str(in_assets / "tiny.gguf"), data=str(in_assets / "datasets"), out=out,
                             steps=2, batch_size=2, seq_len=32, eval_every=0, save_every=0, qlora="on",
                             lora_targets=["q", "v", "down"]), handle_sigint=False)
    app = MlxtoyApp(model="tiny.gguf", runs_dir="runs")
    async with app.run_test(size=SIZE) as pilot:
        app.run_state.run_dir = out
        await pilot.press("f3")
        await pilot.pause(0.3)
        screen = app.screen
        screen.refresh_sources()
        screen.query_one("#source", Select).value = "@current"
        screen.query_one("#temp", Input).value = "0"
        screen.query_one("#max_tokens", Input).value = "6"
        await pilot.press("ctrl+l")
        await wait_for(pilot, lambda: screen.loaded is not None, 60, "the QLoRA run to load")
        model = app.generator.model
        adapters = [m for _, m in model.named_modules() if isinstance(m, LORA_TYPES)]
        assert len(adapters) == 3 * model.config.n_layers
        assert all(isinstance(m.base, QUANTIZED_TYPES) for m in adapters)
        assert "quantized base" in str(screen.query_one("#chat-status", Static).render())
        prompt = screen.query_one("#prompt", Input)
        prompt.focus()
        prompt.value = "say the"
        await pilot.press("enter")
        await wait_for(pilot, lambda: not screen.generating and screen._reply_text, 60, "a reply")
        assert "tokens/s" in str(screen.query_one("#chat-status", Static).render())


@run_async
async def test_runs_screen_reopens_charts(in_assets):
    app = MlxtoyApp(model="tiny.gguf", runs_dir="runs")
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f4")
        await pilot.pause(0.3)
        table = app.screen.query_one(DataTable)
        names = [table.get_row_at(i)[0] for i in range(table.row_count)]
        assert "demo-a" in names and "demo-b" in names
        table.move_cursor(row=names.index("demo-b"))
        await pilot.pause(0.2)
        chart = app.screen.query_one(LossChart)
        assert len(chart.steps) == 12
        await pilot.press("o")
        await pilot.pause(0.3)
        assert type(app.screen).__name__ == "DashboardScreen"
        assert len(app.screen.query_one(LossChart).steps) == 12


def _write_run(path, events) -> None:
    path.mkdir(parents=True)
    with open(path / "metrics.jsonl", "w") as f:
        for ev in events:
            f.write(json.dumps(ev) + "\n")


@run_async
async def test_runs_screen_shows_a_grpo_runs_reward_as_its_headline(in_assets):
    """A GRPO run's row shows its reward (sampled, and greedy on the validation prompts) and its
    chart plots the reward, as the objective declares in the start event; a run written before
    the declaration (no `shows`) still shows its loss (control)."""
    # a runs folder of its own: the module's shared runs folder is what the Runs snapshot shows
    runs = in_assets / "grpo-runs"
    shutil.copytree(in_assets / "runs" / "demo-a", runs / "demo-a")
    grpo = list(fake_events(steps=20, n_layers=4, run_dir="grpo-runs/grpo-run", objective="grpo"))
    _write_run(runs / "grpo-run", grpo)
    old = [dict(e) for e in grpo]
    del old[0]["shows"]
    _write_run(runs / "grpo-old", old)
    rewards = [e["reward"] for e in grpo if e["event"] == "step"]
    greedy = [e["reward"] for e in grpo if e["event"] == "eval"]
    app = MlxtoyApp(model="tiny.gguf", runs_dir=str(runs))
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f4")
        await pilot.pause(0.3)
        table = app.screen.query_one(DataTable)
        rows = {table.get_row_at(i)[0]: table.get_row_at(i) for i in range(table.row_count)}
        assert rows["grpo-run"][3:5] == [f"reward {rewards[-1]:.3f}", f"val reward {greedy[-1]:.3f}"]
        assert rows["grpo-old"][3] == f"{[e['loss'] for e in grpo if e['event'] == 'step'][-1]:.4f}"
        assert rows["demo-a"][3] == f"{2.2999:.4f}"  # an SFT run: its loss, as before
        table.move_cursor(row=list(rows).index("grpo-run"))
        await pilot.pause(0.3)
        chart = app.screen.query_one(LossChart)
        assert chart.losses == rewards and chart.val_losses == greedy
        assert str(chart.border_title).startswith("reward")


def test_snapshot_dashboard_grpo(in_assets, snap_compare):
    """A GRPO run's Train screen: its reward is the headline of the stats (then the held-out
    greedy reward), the rewards chart beside the loss, the sampled completions."""
    assert snap_compare(_app(data=None), terminal_size=SIZE, run_before=_dashboard("dark", "grpo"))


@run_async
async def test_theme_toggle(in_assets):
    app = MlxtoyApp(model="tiny.gguf", runs_dir="runs")
    async with app.run_test(size=(80, 24)) as pilot:
        assert app.theme == "textual-dark"
        await pilot.press("ctrl+t")
        assert app.theme == "textual-light"
        await pilot.press("ctrl+t")
        assert app.theme == "textual-dark"


# --------------------------------------------------------------------------- snapshots


def _fake_state(steps: int = 40, n_layers: int = 30, done: bool = False, objective: str = "sft") -> RunState:
    state = RunState.from_events(list(fake_events(steps=steps, n_layers=n_layers, done=done,
                                                  run_dir="runs/demo", objective=objective)))
    if not done:
        state.status = RUNNING
    return state


def _app(theme: str = "textual-dark", data: str | None = "data.jsonl") -> MlxtoyApp:
    return MlxtoyApp(model="tiny.gguf", data=data, runs_dir="runs", theme=theme)


async def _steady(pilot) -> None:
    """No blinking cursors: a snapshot must not depend on when in the blink it is taken."""
    for inp in pilot.app.screen.query(Input):
        inp.cursor_blink = False
    await pilot.pause(0.1)


async def _settle_setup(pilot) -> None:
    app = pilot.app
    app.screen.query_one("#f-out", Input).value = "runs/new-run"
    await wait_for(pilot, lambda: "data" not in app.screen.errors, 30, "the data preview")
    app.screen.query_one("#f-steps", Input).focus()
    await pilot.pause(0.2)
    await _steady(pilot)


def test_snapshot_setup(in_assets, snap_compare):
    assert snap_compare(_app(), terminal_size=SIZE, run_before=_settle_setup)


def test_snapshot_setup_errors(in_assets, snap_compare):
    async def run_before(pilot):
        await _settle_setup(pilot)
        s = pilot.app.screen
        s.query_one("#f-data", Input).value = "bad.jsonl"
        s.query_one("#f-lora_rank", Input).value = "0"
        s.query_one("#f-lr", Input).value = "abc"
        await wait_for(pilot, lambda: "invalid JSON" in error_text(pilot.app, "data"), 30, "the data error")
        await pilot.press("ctrl+s")
        await pilot.pause(0.2)
        await _steady(pilot)

    assert snap_compare(_app(), terminal_size=SIZE, run_before=run_before)


def test_snapshot_file_picker(in_assets, snap_compare):
    async def run_before(pilot):
        await _settle_setup(pilot)
        pilot.app.screen.query_one("#f-data", Input).value = "datasets/train.jsonl"
        await wait_for(pilot, lambda: "data" not in pilot.app.screen.errors, 30, "the data preview")
        await pilot.press("ctrl+o")
        await pilot.pause(0.5)
        await _steady(pilot)

    assert snap_compare(_app(), terminal_size=SIZE, run_before=run_before)


def _dashboard(theme: str, objective: str = "sft"):
    async def run_before(pilot):
        pilot.app.run_state = _fake_state(objective=objective)
        await pilot.press("f2")
        await pilot.pause(0.6)
        await _steady(pilot)

    return run_before


@run_async
async def test_log_lines_do_not_wrap(in_assets):
    """A log line longer than the log is one line that scrolls sideways: a path in it stays
    whole (to copy, to grep), never broken across two lines."""
    from textual.widgets import RichLog

    app = _app(data=None)
    async with app.run_test(size=SIZE) as pilot:
        state = _fake_state()
        path = "/tmp/" + "/".join(["a-rather-long-folder-name"] * 6) + "/checkpoints/step_16"
        state.log(f"step 16: checkpoint {path}")
        app.run_state = state
        await pilot.press("f2")
        await wait_for(pilot, lambda: app.screen.query_one("#log", RichLog).lines, 10, "the log")
        await pilot.pause(0.3)
        log = app.screen.query_one("#log", RichLog)
        texts = [strip.text for strip in log.lines]
        assert sum(path in t for t in texts) == 1, texts  # the whole path on one line
        assert len(texts) == len(state.logs)  # one rendered line per log line
        assert log.virtual_size.width > log.scrollable_content_region.width  # it scrolls sideways


def test_snapshot_dashboard(in_assets, snap_compare):
    assert snap_compare(_app(data=None), terminal_size=SIZE, run_before=_dashboard("dark"))


def test_snapshot_dashboard_80x24_light(in_assets, snap_compare):
    assert snap_compare(_app("textual-light", data=None), terminal_size=(80, 24), run_before=_dashboard("light"))


def test_snapshot_dashboard_preference(in_assets, snap_compare):
    """A DPO run: reward margin and pair accuracy beside the loss, margin and acc in the stats."""
    assert snap_compare(_app(data=None), terminal_size=SIZE, run_before=_dashboard("dark", "dpo"))


def test_snapshot_chat(in_assets, snap_compare):
    async def run_before(pilot):
        pilot.app.run_state = _fake_state(done=True)
        await pilot.press("f3")
        await pilot.pause(0.3)
        s = pilot.app.screen
        from textual.containers import VerticalScroll

        transcript = s.query_one("#transcript", VerticalScroll)
        await transcript.mount(Static("[b]you[/b] What is the capital of France?", classes="msg user"))
        s._reply = Static("", classes="msg model")
        await transcript.mount(s._reply)
        s._append("The capital of France is Paris.")
        s.query_one("#chat-status", Static).update("[dim]prompt: 9 tokens | generation: 8 tokens (stop)[/dim]")
        await pilot.pause(0.3)
        await _steady(pilot)

    assert snap_compare(_app(data=None), terminal_size=SIZE, run_before=run_before)


def test_snapshot_runs(in_assets, snap_compare):
    async def run_before(pilot):
        await pilot.press("f4")
        await pilot.pause(0.5)
        await _steady(pilot)

    assert snap_compare(_app(data=None), terminal_size=SIZE, run_before=run_before)


@run_async
async def test_grpo_run_shows_rewards_and_samples(in_assets):
    """A GRPO run started from the Setup screen (objective grpo, a reward, the group size):
    the dashboard's reward chart and samples panel (completions with their rewards) fill in."""
    from tui.widgets import LossChart

    rng = random.Random(1)
    with open(in_assets / "qa.jsonl", "w") as f:
        for _ in range(20):
            a = rng.randrange(10, 99)
            f.write(json.dumps({"prompt": f"{a}+1=", "answer": str(a + 1)}) + "\n")
    out = str(in_assets / "runs-e2e" / "grpo")
    app = MlxtoyApp(model="tiny.gguf", data="qa.jsonl", runs_dir="runs")
    async with app.run_test(size=SIZE) as pilot:
        app.screen.query_one("#f-objective", Select).value = "grpo"
        await pilot.pause()
        assert app.screen.query_one("#row-reward").display and app.screen.query_one("#f-beta", Input).value == "0"
        await wait_for(pilot, lambda: "data" not in app.screen.errors, 30, "the data preview")
        for name, value in (("out", out), ("steps", "4"), ("batch_size", "2"), ("seq_len", "64"), ("lr", "0.001"),
                            ("group_size", "3"), ("max_completion_tokens", "5"), ("eval_every", "2"),
                            ("eval_batches", "1"), ("save_every", "0"), ("sample_every", "0"), ("taps_every", "0")):
            await set_field(pilot, app, name, value)
        assert app.screen.errors == {}, app.screen.errors
        await pilot.press("ctrl+s")  # no reward yet: Start says so, nothing starts
        await pilot.pause(0.2)
        assert "needs --reward" in str(app.screen.query_one("#form-error").render()) and not app.trainer_alive
        await set_field(pilot, app, "reward", "contains,length:3")
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: app.run_state.status == DONE and not app.trainer_alive, 180, "the end")
        state = app.run_state
        rewards, held_out = state.headline_series
        assert state.done_reason == "finished" and state.metrics[0][0].key == "reward" and len(rewards.values) == 4
        assert held_out.steps == [0, 2, 4] and state.config["objective"] == "grpo"
        assert any("reward" in s.text and "length_3" in s.text for s in state.samples)
        await pilot.press("f2")
        await pilot.pause(1.2)
        chart = app.screen.query_one(LossChart)
        assert chart.label == "reward" and len(chart.steps) == 4
        samples = "\n".join(str(line.text) for line in app.screen.query_one("#samples").lines)
        assert "contains" in samples and "length_3" in samples
