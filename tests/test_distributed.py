"""Data-parallel training (mlxtoy.train.distributed): 2 ranks on loopback with mlx.launch's ring
backend against one process with the same global batch; resume; a killed or hung rank."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import mlxtoy  # noqa: F401  (fast BLAS before mlx.core)
import mlx.core as mx
from helpers_train import REPO, qa_rows, run_cli, write_jsonl, write_tiny_model_folder
from mlxtoy.rundir import read_metrics
from mlxtoy.loading import load_run_model
from mlxtoy.train.checkpoint import load_checkpoint

LAUNCH = os.path.join(os.path.dirname(sys.executable), "mlx.launch")

# Ranks > 0 must write nothing: this sitecustomize logs every file write / folder change they
# make from Python (rank 0 and single processes are untouched).
AUDIT = r'''
import os, sys
if (os.environ.get("MLX_RANK", "0") != "0" or os.environ.get("AUDIT_ALL_RANKS")) and os.environ.get("AUDIT_LOG"):
    _fd = os.open(os.environ["AUDIT_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    _root = os.environ["AUDIT_ROOT"]
    def _hook(ev, args):
        if ev == "open" and isinstance(args[0], str) and (args[2] or 0) & (os.O_WRONLY | os.O_RDWR):
            path = args[0]
        elif ev == "open" and isinstance(args[0], str) and args[1] and any(c in args[1] for c in "wax+"):
            path = args[0]
        elif ev in ("os.mkdir", "os.rename", "os.remove", "os.rmdir", "shutil.rmtree"):
            path = str(args[0])
        else:
            return
        if os.path.abspath(path).startswith(_root):
            os.write(_fd, f"{ev} {path}\n".encode())
    sys.addaudithook(_hook)
'''


def free_port_pair() -> int:
    """A base port p with p and p+1 free (the ring listens on one port per rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p > 65000:
            continue
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", p))
                b.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no free port pair")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    model = write_tiny_model_folder(str(root / "model"))
    data = root / "data"
    write_jsonl(str(data / "train.jsonl"), qa_rows(120, seed=1))
    write_jsonl(str(data / "valid.jsonl"), qa_rows(16, seed=2))
    site = root / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(AUDIT)
    return {"root": root, "model": model, "data": str(data), "site": str(site)}


def common(work, method: str, **kw) -> list[str]:
    opts = {"model": work["model"], "data": work["data"], "method": method, "steps": 6,
            "batch-size": 4, "seq-len": 64, "eval-every": 3, "eval-batches": 3, "save-every": 3,
            "lora-targets": "q,v", "lr": 5e-3, "seed": 0}
    if method == "full":
        opts["lr"] = 1e-3
    opts.update(kw)
    return [a for k, v in opts.items() for a in (f"--{k}", str(v))]


def launch(work, args: list[str], n: int = 2, timeout: float = 120, audit: str | None = None,
           wait: bool = True, env_extra: dict | None = None):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([work["site"], os.environ.get("PYTHONPATH", "")]))
    if audit:
        env.update(AUDIT_LOG=audit, AUDIT_ROOT=str(work["root"]))
    env.update(env_extra or {})
    cmd = [LAUNCH, "--backend", "ring", "-n", str(n), "--starting-port", str(free_port_pair()),
           "--python", sys.executable, "--", "-m", "mlxtoy", "train", *args]
    if not wait:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def curve(run, kind="step", key="loss") -> list[float]:
    return [e[key] for e in read_metrics(os.path.join(run, "metrics.jsonl")) if e["event"] == kind]


def final_weights(run) -> dict[str, mx.array]:
    for name in ("adapters.safetensors", "model.safetensors"):
        if os.path.exists(os.path.join(run, name)):
            return mx.load(os.path.join(run, name))
    raise AssertionError(f"no result in {run}")


# Two ranks sum a step's gradient as two halves of the batch, added by the all-reduce: exactly the
# sums of one process that accumulates two micro-batches (--batch-size 2 --grad-accum 2), so those
# runs agree to the bit. One process with the whole batch (--batch-size 4) sums each weight
# gradient over 4 rows in one GEMM, in an order that depends on the BLAS: its float32 rounding
# differs (4.5e-7 on MKL on Zen 3, 1.3e-5 on MKL on a Cascade Lake), and AdamW carries a rounding
# difference in a gradient near zero into an update of up to lr (5e-3 here) an element. So against
# that run the tolerance is rounding's, stated: 1e-4, far below what a wrong reduction gives (a
# gradient summed twice or a shard left out moves the loss curve by ~1e-2 at step 2).
SAME_SUMS = 0.0
OTHER_SUMMATION_ORDER = 1e-4


def assert_same_run(a, b, atol: float = OTHER_SUMMATION_ORDER, evals: bool = True) -> None:
    """The step losses and the final weights agree within atol, and with `evals` the eval losses
    (runs whose eval batches are the same rows)."""
    np.testing.assert_allclose(curve(a), curve(b), atol=atol, rtol=0)
    if evals:
        np.testing.assert_allclose(curve(a, "eval", "val_loss"), curve(b, "eval", "val_loss"), atol=atol, rtol=0)
    wa, wb = final_weights(a), final_weights(b)
    assert sorted(wa) == sorted(wb)
    for k in wa:
        np.testing.assert_allclose(np.array(wa[k]), np.array(wb[k]), atol=atol, rtol=0, err_msg=k)


@pytest.fixture(scope="module")
def single(work):
    """One process, global batch 4: the reference runs, as one batch of 4 and as two accumulated
    micro-batches of 2 (the sums two ranks make)."""
    out = {}
    for method in ("lora", "full"):
        for name, extra in (("single", {}), ("accum", {"batch-size": 2, "grad-accum": 2})):
            run = str(work["root"] / f"{name}-{method}")
            r = run_cli("train", *common(work, method, **extra), "--out", run)
            assert r.returncode == 0, r.stderr
            out[method if name == "single" else f"{method}-accum"] = run
    return out


@pytest.mark.parametrize("method", ["lora", "full"])
def test_two_ranks_equal_one_process(work, single, method, tmp_path):
    run = str(work["root"] / f"two-{method}")
    audit = str(tmp_path / "audit.log")
    r = launch(work, [*common(work, method), "--out", run], audit=audit)
    assert r.returncode == 0 and '"world_size": 2' in r.stdout, r.stdout + r.stderr
    assert r.stdout.count('"reason": "finished"') == 1  # only rank 0 reports
    assert_same_run(run, single[f"{method}-accum"], SAME_SUMS, evals=False)  # (its eval batches hold 2 rows)
    assert_same_run(run, single[method], OTHER_SUMMATION_ORDER)
    # rank 0 wrote everything exactly once; rank 1 wrote nothing
    steps = [e["step"] for e in read_metrics(os.path.join(run, "metrics.jsonl")) if e["event"] == "step"]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == ["step_3", "step_6"]
    assert not os.path.exists(audit) or open(audit).read() == "", open(audit).read()
    assert "world_size: 2" in open(os.path.join(run, "config.yaml")).read()


def test_the_tolerance_tells_a_run_on_other_rows_apart(work, single, tmp_path):
    """Positive control for OTHER_SUMMATION_ORDER: a process that trains on half of each batch
    (what a reduction that dropped a rank's shard would train on) falls far outside it."""
    run = str(tmp_path / "half")
    r = run_cli("train", *common(work, "lora", **{"batch-size": 2}), "--out", run)
    assert r.returncode == 0, r.stderr
    with pytest.raises(AssertionError):
        assert_same_run(run, single["lora"], 100 * OTHER_SUMMATION_ORDER)


def test_two_ranks_write_taps_events_and_the_accuracy_report(work, tmp_path):
    """The job is the same under mlx.launch: --taps-every and --eval-accuracy are honoured
    (rank 0 writes them, rank 1 writes nothing)."""
    data = tmp_path / "data"
    write_jsonl(str(data / "train.jsonl"), qa_rows(120, seed=1))
    write_jsonl(str(data / "valid.jsonl"), qa_rows(16, seed=2))
    write_jsonl(str(data / "test.jsonl"), qa_rows(6, seed=3))
    run = str(tmp_path / "run")
    audit = str(tmp_path / "audit.log")
    opts = common(work, "lora", data=str(data), steps=2, **{"eval-every": 0, "save-every": 0})
    r = launch(work, [*opts, "--out", run, "--taps-every", "1", "--eval-accuracy"], audit=audit)
    assert r.returncode == 0, r.stdout + r.stderr
    taps = [e for e in read_metrics(os.path.join(run, "metrics.jsonl")) if e["event"] == "taps"]
    assert [e["step"] for e in taps] == [1, 2] and taps[0]["stats"]
    with open(os.path.join(run, "accuracy.json")) as f:
        report = json.load(f)
    assert report["before"]["total"] == 6 and report["after"]["total"] == 6
    assert r.stdout.count("before: held-out accuracy") == 1  # rank 0 reports, once
    assert r.stdout.count("after: held-out accuracy") == 1
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["world_size"] == 2 and summary["accuracy_after"] == report["after"]["accuracy"]
    assert not os.path.exists(audit) or open(audit).read() == "", open(audit).read()


def test_the_write_audit_sees_writes(work, tmp_path):
    """Positive control for the "rank 1 wrote nothing" audits: with the audit on every rank,
    rank 0's writes of the same job are logged."""
    run = str(work["root"] / "audited")
    audit = str(tmp_path / "audit.log")
    opts = common(work, "lora", steps=1, **{"eval-every": 0, "save-every": 0})
    r = launch(work, [*opts, "--out", run], audit=audit, env_extra={"AUDIT_ALL_RANKS": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    logged = open(audit).read()
    assert "metrics.jsonl" in logged and "config.yaml" in logged, logged


def test_resume_with_two_ranks_or_one_equals_uninterrupted(work, single):
    part = str(work["root"] / "part")
    r = launch(work, [*common(work, "lora", **{"save-every": 0}), "--out", part, "--stop-at", "3"])
    assert r.returncode == 0 and '"reason": "stopped"' in r.stdout, r.stdout + r.stderr
    assert os.listdir(os.path.join(part, "checkpoints")) == ["step_3"]
    r = launch(work, ["--resume", part])
    assert r.returncode == 0 and '"step": 6' in r.stdout, r.stdout + r.stderr
    assert_same_run(part, single["lora-accum"], SAME_SUMS, evals=False)
    assert_same_run(part, single["lora"], OTHER_SUMMATION_ORDER)
    # the data position and RNG are global: one process can continue a 2-rank run
    part1 = str(work["root"] / "part1")
    r = launch(work, [*common(work, "lora", **{"save-every": 0}), "--out", part1, "--stop-at", "3"])
    assert r.returncode == 0, r.stderr
    r = run_cli("train", "--resume", part1)
    assert r.returncode == 0, r.stderr
    assert_same_run(part1, single["lora"], OTHER_SUMMATION_ORDER)  # steps 4-6 summed as one batch


def test_batch_not_divisible_is_refused(work, tmp_path):
    r = launch(work, [*common(work, "lora", **{"batch-size": 3}), "--out", str(tmp_path / "x")])
    assert "not divisible by the 2 ranks" in r.stderr
    assert not (tmp_path / "x").exists()


def _rank_pid(root_pid: int, rank: int) -> int | None:
    """The process with MLX_RANK=rank below root_pid."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    todo = [root_pid]
    while todo:
        pid = todo.pop()
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            if f"MLX_RANK={rank}".encode() in env and b"python" in open(f"/proc/{pid}/cmdline", "rb").read():
                return pid
        except OSError:
            pass
        todo += children.get(pid, [])
    return None


def _wait_for_checkpoint(run: str, name: str, proc, deadline: float) -> None:
    ck = os.path.join(run, "checkpoints", name)
    while not os.path.exists(os.path.join(ck, "state.json")):
        if time.time() > deadline or proc.poll() is not None:
            out, err = proc.communicate(timeout=10) if proc.poll() is not None else ("", "")
            pytest.fail(f"no {name} checkpoint: {out}{err}")
        time.sleep(0.05)


def test_killed_rank_stops_the_job_and_the_checkpoint_loads(work):
    run = str(work["root"] / "killed")
    proc = launch(work, [*common(work, "lora", steps=2000, **{"save-every": 2, "eval-every": 0}),
                         "--out", run], wait=False)
    try:
        _wait_for_checkpoint(run, "step_2", proc, time.time() + 60)
        pid = _rank_pid(proc.pid, 1)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        t0 = time.time()
        out, err = proc.communicate(timeout=30)  # bounded: no hang
        assert time.time() - t0 < 30
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "rank 1" in err.lower() and ("lost contact" in err or "killed" in err or "exited" in err), err
    assert '"reason": "finished"' not in out
    state, trainable, opt = load_checkpoint(sorted(
        (os.path.join(run, "checkpoints", n) for n in os.listdir(os.path.join(run, "checkpoints"))),
        key=lambda p: int(p.rsplit("_", 1)[1]))[-1])
    assert state.step >= 2 and trainable and opt
    load_run_model(run)


def test_hung_rank_trips_the_watchdog(work):
    """A rank that stops responding (sockets open, no error) ends the job after --dist-timeout.

    The ranks are started the way mlx.launch starts them (MLX_RANK, MLX_HOSTFILE), so the test
    can freeze one with SIGSTOP and still reap it (mlx.launch would wait on a stopped child)."""
    run = str(work["root"] / "hung")
    port = free_port_pair()
    hostfile = work["root"] / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    args = [sys.executable, "-m", "mlxtoy", "train",
            *common(work, "lora", steps=2000, **{"save-every": 2, "eval-every": 0}),
            "--out", run, "--dist-timeout", "4"]
    procs = [subprocess.Popen(args, cwd=REPO, env=dict(os.environ, MLX_RANK=str(r), MLX_HOSTFILE=str(hostfile)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    try:
        _wait_for_checkpoint(run, "step_2", procs[0], time.time() + 60)
        procs[1].send_signal(signal.SIGSTOP)
        t0 = time.time()
        out, err = procs[0].communicate(timeout=30)
        waited = time.time() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    assert procs[0].returncode == 1, err
    assert "waited more than 4s" in err and "Last checkpoint:" in err, err
    assert waited < 20
    state, trainable, _ = load_checkpoint(os.path.join(run, "checkpoints", "step_2"))
    assert state.step == 2 and trainable
    load_run_model(run)


# ------------------------------------------------------------------ statistics across ranks


class _Rank:
    """One rank of a two-rank group, in process: its all-reduce adds what the other rank sent
    (recorded when that one reduced first), as mx.distributed.all_sum would."""

    def __init__(self, rank: int, peer: "_Rank | None" = None):
        self.rank, self.size, self.peer = rank, 2, peer
        self.sent: list[mx.array] = []
        self.allreduce_seconds: list[float] = []

    def all_sum(self, arrays, what):
        self.sent = arrays
        return [a + b for a, b in zip(arrays, self.peer.sent)] if self.peer else arrays


class _Control:
    def local_flags(self):
        return mx.zeros((3,), mx.float32)

    def agree(self, flags):
        self.flags = flags


def test_grpo_min_max_statistics_reduce_by_min_and_max_across_ranks():
    """GRPO's clip_ratio/low_min and high_max are the least and the largest rank's values (TRL's
    nanmin / nanmax over processes), not their sum; every other statistic is summed (shares of
    the one-process mean). Control: without the objective's extremes, the two are summed."""
    from mlxtoy.train.distributed import GradientAllReduce
    from mlxtoy.train.grpo import STATS
    from mlxtoy.train.objectives import GRPO

    values = [np.arange(1, len(STATS) + 1, dtype=np.float32) / 10, np.arange(len(STATS), 0, -1, dtype=np.float32) / 10]
    grads = {"w": mx.ones((2,))}

    def reduce(extremes):
        other = _Rank(1)
        GradientAllReduce(other, _Control()).reduce(mx.array(values[1]), grads, extremes)
        out, g = GradientAllReduce(_Rank(0, other), _Control()).reduce(mx.array(values[0]), grads, extremes)
        assert np.allclose(np.array(g["w"]), 2.0)
        return dict(zip(STATS, np.array(out).tolist()))

    got = reduce(GRPO.extremes)
    low, high = STATS.index("clip_ratio/low_min"), STATS.index("clip_ratio/high_max")
    assert got["clip_ratio/low_min"] == pytest.approx(min(values[0][low], values[1][low]))
    assert got["clip_ratio/high_max"] == pytest.approx(max(values[0][high], values[1][high]))
    for i, key in enumerate(STATS):
        if key not in ("clip_ratio/low_min", "clip_ratio/high_max"):
            assert got[key] == pytest.approx(values[0][i] + values[1][i]), key
    summed = reduce({})  # control: the check sees a sum
    assert summed["clip_ratio/low_min"] == pytest.approx(values[0][low] + values[1][low])
