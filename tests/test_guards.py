"""Nothing a user's reward function, a careless switch or a chat message does can hang a run,
silence it or lose history (issue 46).

- A user's reward is guarded: its prints go to stderr, sys.exit() in it is one error line,
  KeyboardInterrupt in it is an interrupt (exit 130 with a checkpoint), a call that never
  returns is ended by --reward-timeout, and each reward meets one row before the model loads.
- Ctrl-C stops a run at its first press within seconds during sampling, scoring or a step, and
  the run resumes.
- Every MLXTOY_* switch is checked by one rule: a wrong value is refused (exit 2) or warned
  about once; doctor shows the switches that are set.
- Options that cannot combine are refused; a resume that changes a field the run's state
  depends on is refused or warned about by one rule.
- Chat keeps its history when a message is refused, and exits 0.
- The misleading messages: grpo rows without an answer, --adapter naming a file, a K-quant
  export's types and llama.cpp's log, export of a run that does not exist.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from contextlib import redirect_stderr, redirect_stdout

import gguf
import llama_cpp  # noqa: F401  (declared test dependency: the K-quant export needs llama.cpp's quantizer)
import pytest
from helpers_train import REPO, run_cli, write_jsonl, write_tiny_model_folder

from mlxtoy import settings
from mlxtoy.cli import main as cli_main
from mlxtoy.errors import UserError
from mlxtoy.io import registry
from mlxtoy.rundir import read_metrics
from mlxtoy.train import grpo, job, loop
from mlxtoy.train.rewards import RewardTimeout, guarded_call

# ------------------------------------------------------------------ a tiny GRPO task

# batch 2 x group 4: a step scores 8 completions; the check before the model loads is call 1,
# so call 10 is the first completion of step 2
STEP = ["--steps", "3", "--batch-size", "2", "--group-size", "4", "--max-completion-tokens", "6",
        "--eval-every", "0", "--save-every", "0", "--seq-len", "64", "--objective", "grpo"]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("guards")
    model = write_tiny_model_folder(str(root / "model"))
    rows = [{"prompt": f"{a}+1", "answer": str(a + 1)} for a in range(10, 50)]
    data = write_jsonl(str(root / "data.jsonl"), rows)
    return {"root": root, "model": model, "data": data}


def reward_file(tmp_path, body: str, name: str = "rw.py") -> str:
    """A reward `r(completion, answer)` that counts its calls and runs `body` (which may use
    `n`, the call's number) before returning a number."""
    path = tmp_path / name
    path.write_text("import os, sys, time\ncalls = [0]\nprint('NOISE from loading the file')\n"
                    "def r(completion, answer):\n"
                    "    calls[0] += 1\n"
                    "    n = calls[0]\n"
                    + "".join(f"    {line}\n" for line in body.splitlines())
                    + "    return float(completion.strip() == answer)\n")
    return f"{path}:r"


def train_args(work, out, reward: str, *extra: str) -> list[str]:
    return ["train", "--model", work["model"], "--data", work["data"], "--out", str(out), "--reward", reward,
            *STEP, *extra]


def main_in_process(args: list[str]) -> tuple[int, str, list[str]]:
    """cli.main in this process: (exit code, stdout, stderr lines)."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = cli_main(args)
    return code, out.getvalue(), err.getvalue().strip().splitlines()


def steps_done(run) -> list[int]:
    return [e["step"] for e in read_metrics(os.path.join(str(run), "metrics.jsonl")) if e["event"] == "step"]


def resumes_to_the_end(run) -> None:
    code, out, lines = main_in_process(["train", "--resume", str(run), "--steps", "3"])
    assert code == 0 and json.loads(out)["reason"] == "finished", lines
    assert steps_done(run)[-1] == 3


# ------------------------------------------------------------------ the reward guard


def test_a_printing_reward_keeps_stdout_to_the_product(work, tmp_path):
    reward = reward_file(tmp_path, "print('NOISE from the reward', n)\nprint('more', file=sys.stdout)")
    code, out, lines = main_in_process(train_args(work, tmp_path / "run", reward))
    assert code == 0, lines
    assert "NOISE" not in out and json.loads(out)["reason"] == "finished"  # stdout: the summary only
    assert sum("NOISE from the reward" in line for line in lines) >= 1 + 3 * 8  # positive control: it ran
    assert sum("NOISE from loading the file" in line for line in lines) == 1


def test_a_reward_calling_sys_exit_is_one_error_line_and_keeps_the_run(work, tmp_path):
    reward = reward_file(tmp_path, "if n == 10:\n    sys.exit(0)")
    code, out, lines = main_in_process(train_args(work, tmp_path / "run", reward))
    assert code == 2 and out == "", lines
    assert lines[-1].startswith("error: ") and sum(line.startswith("error") for line in lines) == 1
    assert f"{reward}: called sys.exit(0) on {work['data']}:" in lines[-1], lines[-1]
    assert (tmp_path / "run" / "checkpoints" / "step_1").is_dir()  # the step before it is kept


def test_keyboard_interrupt_inside_a_reward_is_an_interrupt_with_a_checkpoint(work, tmp_path):
    reward = reward_file(tmp_path, "if n == 10:\n    raise KeyboardInterrupt")
    run = tmp_path / "run"
    code, out, lines = main_in_process(train_args(work, run, reward))
    assert code == 130 and json.loads(out)["reason"] == "interrupted", lines
    assert any(f"interrupted at step 1; checkpoint {run}/checkpoints/step_1" in line for line in lines), lines
    assert (run / "checkpoints" / "step_1").is_dir()
    resumes_to_the_end(run)  # the module is loaded once a process: call 10 is behind it


def test_a_reward_that_never_returns_is_ended_by_reward_timeout(work, tmp_path):
    reward = reward_file(tmp_path, "while n == 10:\n    pass")
    run = tmp_path / "run"
    t0 = time.perf_counter()
    r = run_cli(*train_args(work, run, reward, "--reward-timeout", "2"), timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert lines[-1].startswith("error: ") and sum(line.startswith("error") for line in lines) == 1, lines
    assert f"{reward}: still running after 2 s (--reward-timeout) on {work['data']}:" in lines[-1]
    assert "Traceback" not in r.stderr and time.perf_counter() - t0 < 100
    assert (run / "checkpoints" / "step_1").is_dir()


def test_a_call_left_running_does_not_hold_up_the_next(capsys):
    release = threading.Event()

    def stuck(completion):
        release.wait(30)
        print("printed after it was left")
        return 0.0

    with pytest.raises(RewardTimeout):
        guarded_call(stuck, {"completion": "x"}, 0.2)
    t0 = time.perf_counter()
    assert guarded_call(lambda completion: len(completion), {"completion": "abc"}, 5) == 3  # a new worker
    assert time.perf_counter() - t0 < 4  # not behind the stuck one (30 s); a busy machine starts a worker slowly
    release.set()
    time.sleep(0.2)
    out = capsys.readouterr()
    assert "printed after it was left" in out.err and "printed after" not in out.out  # still not stdout


@pytest.mark.parametrize("source,why", [
    ("def r(x, completion):\n    return 1.0\n", "needs column 'x'"),  # a column the rows do not have
    ("def r(completion):\n    return 'good'\n", "returned 'good'"),  # not a number
])
def test_a_wrong_reward_is_refused_before_the_model_loads(work, tmp_path, monkeypatch, source, why):
    path = tmp_path / "bad.py"
    path.write_text(source)

    def no_model(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(job, "build_model", no_model)
    out = tmp_path / "run"
    code, _, lines = main_in_process(train_args(work, out, f"{path}:r"))
    assert code == 2 and len(lines) == 1 and why in lines[0] and lines[0].startswith("error: "), lines
    assert not out.exists()
    # positive control: a right reward gets as far as loading the model (an internal error here)
    path.write_text("def r(completion):\n    return 1.0\n")
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))  # a new version of the file
    code, _, lines = main_in_process(train_args(work, out, f"{path}:r"))
    assert code == 1 and any("the model was loaded" in line for line in lines)


# ------------------------------------------------------------------ Ctrl-C at the first press


def test_ctrl_c_while_a_reward_hangs_exits_130_within_seconds_and_resumes(work, tmp_path):
    """A real process and a real SIGINT, sent once while the reward sleeps in step 2's scoring."""
    marker = tmp_path / "scoring"
    reward = reward_file(tmp_path, f"if n == 10 and not os.path.exists({str(marker)!r}):\n"
                                   f"    open({str(marker)!r}, 'w').close()\n    time.sleep(3600)")
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "mlxtoy", *train_args(work, run, reward)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not marker.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert marker.exists(), proc.communicate()
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and time.perf_counter() - t0 < 10, err
    assert json.loads(out)["reason"] == "interrupted" and "Traceback" not in err
    assert f"interrupted at step 1; checkpoint {run}/checkpoints/step_1" in err
    # it hangs once only: the marker is there now
    code, out, lines = main_in_process(["train", "--resume", str(run), "--steps", "2"])
    assert code == 0 and json.loads(out)["reason"] == "finished" and steps_done(run)[-1] == 2, lines


def interrupt(sent: list[float]) -> None:
    """Ctrl-C to this process, as a terminal sends it; when, into `sent`."""
    sent.append(time.perf_counter())
    os.kill(os.getpid(), signal.SIGINT)


def test_ctrl_c_during_sampling_stops_at_once_and_resumes(work, tmp_path, monkeypatch):
    real = grpo.generate_groups
    calls, sent = [], []

    def slow_sampling(*args, **kw):  # step 2's sampling takes 60 s, unless Ctrl-C ends it
        calls.append(1)
        if len(calls) == 2:
            threading.Timer(0.2, interrupt, (sent,)).start()  # from another thread, mid-sampling
            end = time.time() + 60
            while time.time() < end:
                time.sleep(0.01)
        return real(*args, **kw)

    monkeypatch.setattr(grpo, "generate_groups", slow_sampling)
    run = tmp_path / "run"
    code, out, lines = main_in_process(train_args(work, run, "exact"))
    assert code == 130 and time.perf_counter() - sent[0] < 10, lines  # 60 s if the press waited
    assert json.loads(out)["reason"] == "interrupted" and steps_done(run) == [1]  # step 2 never ran
    assert any(f"interrupted at step 1; checkpoint {run}/checkpoints/step_1" in line for line in lines)
    monkeypatch.setattr(grpo, "generate_groups", real)
    resumes_to_the_end(run)


def test_ctrl_c_during_an_update_stops_after_it_and_resumes(work, tmp_path, monkeypatch):
    calls, sent = [], []

    class SlowStepper(loop.Stepper):  # step 2's update takes a second; Ctrl-C arrives during it
        def __call__(self, batches):
            calls.append(1)
            if len(calls) == 2:
                interrupt(sent)
                time.sleep(1.0)
            return super().__call__(batches)

    real = loop.Stepper
    monkeypatch.setattr(loop, "Stepper", SlowStepper)
    run = tmp_path / "run"
    code, out, lines = main_in_process(train_args(work, run, "exact"))
    assert code == 130 and time.perf_counter() - sent[0] < 10, lines
    # the update was not cut in half: step 2 finished and is the checkpoint
    assert json.loads(out)["reason"] == "interrupted" and steps_done(run) == [1, 2]
    assert any(f"interrupted at step 2; checkpoint {run}/checkpoints/step_2" in line for line in lines)
    monkeypatch.setattr(loop, "Stepper", real)
    resumes_to_the_end(run)


def test_ctrl_c_before_any_step_says_nothing_was_saved(work, tmp_path, monkeypatch):
    def interrupted(*args, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(grpo, "generate_groups", interrupted)
    run = tmp_path / "run"
    code, _, lines = main_in_process(train_args(work, run, "exact"))
    assert code == 130, lines
    assert not (run / "checkpoints").exists() or not os.listdir(run / "checkpoints")
    assert any("interrupted at step 0: nothing was saved" in line for line in lines), lines
    assert not any("checkpoint None" in line for line in lines)


# ------------------------------------------------------------------ the switches, one rule

# every switch: a value of the wrong type and one out of range (where it has a range), and
# whether it is refused (exit 2) or warned about (a safe fallback); and a good value
BAD = {
    "MLXTOY_DEVICE": [("tpu", "warned")],
    "MLXTOY_DTYPE": [("int8", "warned")],
    "MLXTOY_BLAS": [("/nonexistent.so", "warned")],
    "MLXTOY_KERNELS": [("perhaps", "warned")],
    "MLXTOY_MALLOC": [("jemalloc", "warned")],
    "MLXTOY_CACHE": [(__file__, "refused")],  # a file where a folder goes
    "MLXTOY_MEMORY_GB": [("abc", "refused"), ("-1", "refused"), ("nan", "refused")],
    "MLXTOY_KERNEL_THREADS": [("abc", "refused"), ("-3", "refused"), ("0", "refused")],
    "MLXTOY_GEMM": [("2", "warned")],
    "MLXTOY_BLOCK_ATTENTION": [("yes please", "warned")],
    "MLXTOY_FUSED_DECODE": [("-1", "warned")],
    "MLXTOY_PACKED_DECODE": [("x", "warned")],
    "MLXTOY_KERNEL_POOL": [("tbb", "warned")],
    "MLXTOY_KERNEL_SPINS": [("1.5", "refused"), ("-1", "refused")],
    "MLXTOY_KERNEL_DONE_SPINS": [("many", "refused"), ("-400", "refused")],
    "MLXTOY_KERNEL_VNNI": [("vnni", "warned")],
    "MLXTOY_JIT_HEADER": [("sometimes", "warned")],
    "MLXTOY_KERNEL_AVX512": [("avx", "warned")],
    "MLXTOY_GPU_SLAB_ROWS": [("1e3", "refused"), ("-8", "refused")],
    "MLXTOY_ROUTES": [(os.path.dirname(__file__), "refused")],  # a folder where a file goes
}
GOOD = {"MLXTOY_DEVICE": "cpu", "MLXTOY_DTYPE": "float32", "MLXTOY_BLAS": "none", "MLXTOY_KERNELS": "1",
        "MLXTOY_MALLOC": "system", "MLXTOY_CACHE": "/tmp/mlxtoy-cache", "MLXTOY_MEMORY_GB": "8",
        "MLXTOY_KERNEL_THREADS": "2", "MLXTOY_GEMM": "0", "MLXTOY_BLOCK_ATTENTION": "on",
        "MLXTOY_FUSED_DECODE": "true", "MLXTOY_PACKED_DECODE": "no", "MLXTOY_KERNEL_POOL": "own",
        "MLXTOY_KERNEL_SPINS": "0", "MLXTOY_KERNEL_DONE_SPINS": "400", "MLXTOY_KERNEL_VNNI": "0",
        "MLXTOY_KERNEL_AVX512": "0", "MLXTOY_JIT_HEADER": "0",
        "MLXTOY_GPU_SLAB_ROWS": "64", "MLXTOY_ROUTES": "/tmp/mlxtoy-routes.json"}


def test_every_switch_is_checked_by_one_rule(monkeypatch, capsys):
    names = {s.name for s in settings.SWITCHES}
    assert set(BAD) == names and set(GOOD) == names  # a new switch needs its cases here
    for s in settings.SWITCHES:
        monkeypatch.delenv(s.name, raising=False)
    capsys.readouterr()
    for name, cases in BAD.items():
        for value, outcome in cases:
            monkeypatch.setenv(name, value)
            if outcome == "refused":
                with pytest.raises(UserError) as e:
                    settings.check_all()
                assert str(e.value).startswith(f"{name}={value!r}") and "\n" not in str(e.value)
                assert capsys.readouterr().err == ""
            else:
                settings.check_all()
                settings.check_all()  # said once, however often it is read
                err = capsys.readouterr().err.splitlines()
                assert len(err) == 1 and err[0].startswith(f"warning: {name}={value!r}"), (name, err)
            switch = next(s for s in settings.SWITCHES if s.name == name)
            assert switch.value() == switch.default  # a wrong value is never used
        # positive control: a good value passes without a word, and is the value
        monkeypatch.setenv(name, GOOD[name])
        settings.check_all()
        assert capsys.readouterr().err == ""
        monkeypatch.delenv(name)


def test_doctor_refuses_a_bad_number_warns_of_a_bad_library_and_shows_what_is_set():
    as_found = json.loads(run_cli("doctor", "--json", timeout=120).stdout)
    r = run_cli("doctor", env={"MLXTOY_KERNEL_THREADS": "-3"}, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == ["error: MLXTOY_KERNEL_THREADS='-3': must be >= 1"]
    r = run_cli("doctor", "--json", env={"MLXTOY_BLAS": "/nonexistent.so", "MLXTOY_KERNEL_THREADS": "1"},
                timeout=120)
    assert r.returncode == 0, r.stderr
    warnings = [line for line in r.stderr.splitlines() if "MLXTOY_BLAS" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: MLXTOY_BLAS='/nonexistent.so'")
    facts = json.loads(r.stdout)
    assert "MLXTOY_BLAS=/nonexistent.so (" in facts["switches"] and "MLXTOY_KERNEL_THREADS=1" in facts["switches"]
    assert facts["blas"] == as_found["blas"] and facts["switches"] != as_found["switches"]  # the fallback


# ------------------------------------------------------------------ options and resume


def test_options_that_cannot_combine_are_refused(work, tmp_path):
    for extra, both in [(["--qlora", "on", "--method", "full"], ("qlora", "full")),
                        (["--lora-rank", "4", "--method", "full"], ("lora_rank", "full")),
                        (["--d-model", "64"], ("d_model", "lora"))]:
        out = tmp_path / "run"
        code, _, lines = main_in_process(["train", "--model", work["model"], "--data", work["data"],
                                          "--out", str(out), "--steps", "1", *extra])
        assert code == 2 and len(lines) == 1 and all(w in lines[0] for w in both), lines
        assert not out.exists()


def test_a_resume_is_refused_or_warned_by_one_rule(work, tmp_path):
    run = tmp_path / "run"
    code, _, lines = main_in_process(train_args(work, run, "exact", "--stop-at", "1"))
    assert code == 0, lines
    for extra, field in [(["--objective", "sft"], "objective"), (["--lora-rank", "4"], "lora_rank"),
                         (["--optimizer", "sgd"], "optimizer")]:
        code, _, lines = main_in_process(["train", "--resume", str(run), *extra])
        assert code == 2 and len(lines) == 1 and f"cannot change {field} when resuming" in lines[0], lines
    code, out, lines = main_in_process(["train", "--resume", str(run), "--group-size", "2", "--steps", "2"])
    assert code == 0 and json.loads(out)["step"] == 2, lines
    warned = [line for line in lines if "resuming with group_size changed (4 -> 2)" in line]
    assert len(warned) == 1 and warned[0].startswith("warning: ")
    # positive control: a resume that changes only what may change says nothing of the kind
    code, out, lines = main_in_process(["train", "--resume", str(run), "--steps", "3", "--lr", "1e-4"])
    assert code == 0 and not any("resuming with" in line for line in lines), lines


# ------------------------------------------------------------------ chat


def reused(stderr: str) -> list[int]:
    return [int(m) for m in re.findall(r"reused (\d+) cached tokens", stderr)]


def test_chat_keeps_its_history_when_a_message_is_refused(work):
    long = "x " * 4000
    r = subprocess.run([sys.executable, "-m", "mlxtoy", "chat", "--model", work["model"], "--max-tokens", "4",
                        "--temp", "0"], input=f"hi there\n{long}\nhello\n", capture_output=True, text=True,
                       cwd=REPO, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    assert sum(line.startswith("error: ") and "does not fit the model's context" in line
               for line in r.stderr.splitlines()) == 1
    kept = reused(r.stderr)
    # positive control: the same turns with the history gone (/reset) reuse only the template's start
    r2 = subprocess.run([sys.executable, "-m", "mlxtoy", "chat", "--model", work["model"], "--max-tokens", "4",
                         "--temp", "0"], input="hi there\n/reset\nhello\n", capture_output=True, text=True,
                        cwd=REPO, timeout=120, check=False)
    assert r2.returncode == 0, r2.stderr
    fresh = reused(r2.stderr)
    assert len(kept) == len(fresh) == 2 and kept[0] == fresh[0] == 0
    assert kept[1] > fresh[1] + len("hi there")  # turn 3 read "hi there" and its reply from the cache


# ------------------------------------------------------------------ the messages that misled


def test_grpo_rows_without_an_answer_say_so(work, tmp_path):
    data = write_jsonl(str(tmp_path / "q.jsonl"), [{"prompt": "1+1"}])
    code, _, lines = main_in_process(["train", "--model", work["model"], "--data", data, "--out",
                                      str(tmp_path / "run"), "--objective", "grpo", "--reward", "exact"])
    assert code == 2 and len(lines) == 1 and "'answer'" in lines[0], lines


def test_adapter_naming_a_file_says_it_is_a_file(work, tmp_path):
    f = tmp_path / "adapters.safetensors"
    f.write_bytes(b"x")
    code, _, lines = main_in_process(["generate", "--model", work["model"], "--adapter", str(f), "--prompt", "a"])
    assert code == 2 and len(lines) == 1 and "is a file; give the run's folder" in lines[0], lines


def test_export_of_a_missing_run_does_not_go_to_the_hub(work, tmp_path, monkeypatch):
    def no_hub(*a, **k):
        raise AssertionError("went to the Hub")

    monkeypatch.setattr(registry, "fetch_model", no_hub)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    (tmp_path / "runs").mkdir()
    monkeypatch.chdir(tmp_path)
    code, out, lines = main_in_process(["export", "runs/nope", "--out", "x.gguf"])
    assert code == 2 and out == "" and len(lines) == 1, lines
    assert lines[0] == "error: runs/nope: no such run, checkpoint or model (runs/ holds none of that name)"
    # positive control: with no such local folder the same shape is a Hugging Face id
    code, _, lines = main_in_process(["export", "acme/nope", "--out", "x.gguf"])
    assert code == 1 and any("went to the Hub" in line for line in lines)


def test_k_quant_export_reports_the_types_it_wrote_and_keeps_llama_cpps_log_behind_verbose(work, tmp_path, capfd):
    out = str(tmp_path / "q.gguf")
    capfd.readouterr()
    assert cli_main(["export", work["model"], "--out", out, "--dtype", "q4_k_m"]) == 0
    quiet = capfd.readouterr()  # file descriptors: llama.cpp's C code writes to fd 2
    assert quiet.out == out + "\n"
    lines = quiet.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"export: wrote {out} (gguf, q4_k_m: tensors "), lines
    # the types named are the file's own, read by gguf-py: 32-wide rows fall back from Q4_K
    types = Counter(t.tensor_type.name for t in gguf.GGUFReader(out).tensors)
    assert "Q4_K" not in types and sum(types.values()) > 3
    for name, n in types.items():
        assert f"{name} {n}" in lines[0]
    # positive control: --verbose shows llama.cpp's log (what the quiet run kept out)
    assert cli_main(["export", work["model"], "--out", out, "--dtype", "q4_k_m", "--verbose"]) == 0
    loud = capfd.readouterr()
    assert len(loud.err.strip().splitlines()) > 10 and loud.out == out + "\n"
