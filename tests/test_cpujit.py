"""MLX's CPU kernel compiles with mlxtoy's precompiled header (`mlxtoy.cpujit`): observed from
g++ itself (a wrapper in PATH adds `-H`, which lists the headers a compile reads, a used
precompiled one marked `!`, an unusable one `x`), with MLX's own build command running in a
process whose temp folder is the test's; the kernel's values against numpy, with the header,
without it and with a broken one (g++ then parses the real header)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from mlxtoy import backend, cpujit

pytestmark = pytest.mark.skipif(cpujit.unavailable() is not None,
                                reason=f"no precompiled header here: {cpujit.unavailable()}")

# a kernel no other test compiles (its constants are part of its name), and its values
PROBE = """
import sys
import mlxtoy
import mlx.core as mx
f = mx.compile(lambda a, b: mx.tanh(a * 1.375 + b) - mx.sin(b) * 0.625 + 0.25)
a = mx.arange(12, dtype=mx.float32) / 7
print(f(a, a[::-1]).tolist())
"""


def probe_values() -> np.ndarray:
    a = np.arange(12, dtype=np.float64) / 7
    return np.tanh(a * 1.375 + a[::-1]) - np.sin(a[::-1]) * 0.625 + 0.25


@pytest.fixture
def temp_folder(tmp_path, monkeypatch):
    """A temp folder of the test's own, for this process (`tempfile`) and the ones it starts."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    os.makedirs(tempfile.tempdir)
    return tempfile.tempdir


def compile_probe(tmp_path, temp: str) -> tuple[np.ndarray, str]:
    """Run PROBE in a new process with TMPDIR=temp and g++ wrapped -> (its values, what g++ -H
    listed for MLX's kernel compile)."""
    wrap = tmp_path / "bin"
    wrap.mkdir(exist_ok=True)
    log = tmp_path / "gxx.log"
    log.unlink(missing_ok=True)
    real = subprocess.run(["sh", "-c", "command -v g++"], capture_output=True, text=True).stdout.strip()
    script = wrap / "g++"
    script.write_text(f'#!/bin/sh\ncase "$*" in *--version*) exec {real} "$@";; esac\nexec {real} -H "$@" 2>>"{log}"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    env = os.environ | {"TMPDIR": temp, "PATH": f"{wrap}{os.pathsep}{os.environ['PATH']}"}
    r = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return np.array(eval(r.stdout.strip().splitlines()[-1])), log.read_text() if log.exists() else ""


def test_mlx_s_kernel_compiles_read_the_precompiled_header(tmp_path, temp_folder):
    """Built into MLX's cache folder, the header is the one g++ reads for MLX's kernel compile
    (`! ...compiled_preamble.h.gch`), and the kernel's values are numpy's. Positive control: in an
    empty temp folder the same compile parses MLX's header itself."""
    assert str(cpujit.cache_dir()).startswith(temp_folder)
    values, listed = compile_probe(tmp_path, temp_folder)
    np.testing.assert_allclose(values, probe_values(), rtol=1e-6, atol=1e-6)
    assert "compiled_preamble.h" in listed and ".gch" not in listed  # control: parsed, no header
    for f in cpujit.cache_dir().glob("*.so"):  # compiled again below
        f.unlink()
    assert cpujit.build_header().startswith("built in")
    assert cpujit.build_header() == "kept"
    values, listed = compile_probe(tmp_path, temp_folder)
    np.testing.assert_allclose(values, probe_values(), rtol=1e-6, atol=1e-6)
    assert f"! {cpujit.header_path()}" in listed


def test_a_broken_header_costs_time_not_values(tmp_path, temp_folder):
    """A header g++ cannot use (truncated: a copy from another g++ would be refused alike) is
    passed over (`x` in g++'s listing) for MLX's real one: the kernel compiles and its values
    are numpy's."""
    cpujit.header_path().parent.mkdir(parents=True)
    cpujit.header_path().write_bytes(b"not a precompiled header")
    values, listed = compile_probe(tmp_path, temp_folder)
    np.testing.assert_allclose(values, probe_values(), rtol=1e-6, atol=1e-6)
    assert f"x {cpujit.header_path()}" in listed and "compiled_preamble.h\n" in listed


def test_one_process_builds_the_header_and_a_killed_builder_s_lock_expires(temp_folder, monkeypatch):
    """A builder's lock keeps a second process from building too; a lock older than
    LOCK_STALE_SECONDS (its builder killed) is taken over, and what it left half-written goes.
    MLXTOY_JIT_HEADER=0 builds nothing."""
    cpujit.header_path().parent.mkdir(parents=True)
    lock = cpujit.header_path().with_name(cpujit.header_path().name + ".lock")
    lock.touch()
    assert cpujit.build_header() == "being built by another process" and not cpujit.header_path().exists()
    old = time.time() - cpujit.LOCK_STALE_SECONDS - 1
    os.utime(lock, (old, old))
    leftover = cpujit.header_path().with_name(cpujit.header_path().name + ".999.part")
    leftover.write_bytes(b"half")
    assert cpujit.build_header().startswith("built in")
    assert cpujit.header_path().exists() and not lock.exists() and not leftover.exists()
    monkeypatch.setenv("MLXTOY_JIT_HEADER", "0")
    cpujit.header_path().unlink()
    assert cpujit.build_header() == "not built: MLXTOY_JIT_HEADER=0" and not cpujit.header_path().exists()
    assert cpujit.start_header() is None


def test_a_temp_folder_the_header_cannot_go_in_is_said_not_raised(tmp_path, monkeypatch):
    """Where MLX's cache folder cannot be made (a file in its place; a read-only temp folder alike,
    which root's tests cannot make), building the header says why and raises nothing."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    (tmp_path / "mlx").write_text("a file where the folder goes")
    said = cpujit.build_header()
    assert said.startswith("not built:") and not cpujit.header_path().exists()
    assert cpujit.start_header() is None  # a job's start: nothing to wait for, nothing raised


def test_a_process_that_exits_while_the_header_builds_still_leaves_it_made(tmp_path):
    """A training job refused in its first seconds exits while its header is being built on a
    thread: the build goes on without it and leaves the header (and no lock) for the next run.
    Positive control: right after the exit the header is not there yet."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    quits = ("import os, mlxtoy\nfrom mlxtoy import cpujit\nassert cpujit.start_header() is not None\n"
             "print(cpujit.header_path(), flush=True)\nos._exit(2)\n")
    r = subprocess.run([sys.executable, "-c", quits], env=os.environ | {"TMPDIR": str(temp)}, capture_output=True,
                       text=True, timeout=120)
    header = Path(r.stdout.strip())
    assert r.returncode == 2 and str(header).startswith(str(temp))
    assert not header.exists()
    deadline = time.time() + 60
    while not header.exists() and time.time() < deadline:
        time.sleep(0.2)
    assert header.exists()
    lock = header.with_name(header.name + ".lock")
    while lock.exists() and time.time() < deadline:
        time.sleep(0.1)
    assert not lock.exists() and not list(header.parent.glob("*.part"))


def test_a_gpu_device_builds_no_header(temp_folder, monkeypatch):
    """On a GPU (Metal, CUDA) MLX compiles no CPU kernels for the model: no header is built, and a
    training job's start has nothing to wait for. Positive control: the CPU device builds it."""
    monkeypatch.setattr(backend.INFO, "device", "cuda")
    assert cpujit.unavailable() == "device cuda: MLX compiles no CPU kernels for it"
    assert cpujit.start_header() is None and cpujit.build_header().startswith("not built: device cuda")
    assert not cpujit.header_path().exists()
    monkeypatch.setattr(backend.INFO, "device", "cpu")
    assert cpujit.build_header().startswith("built in") and cpujit.header_path().exists()
