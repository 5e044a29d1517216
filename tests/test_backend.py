"""The BLAS mlxtoy.cpublas puts under MLX on Linux CPU: which library each choice loads (read back
from the process's own memory map), that MLX's GEMMs and the kernels' block attention on it
agree with numpy float64 and mx.fast (numpy keeps its own OpenBLAS, libscipy_openblas64_), and that PyPI's prefixed OpenBLAS gets its thread count
back after the block attention sets it to one. Each BLAS in a fresh interpreter, since the choice
is made once, before mlx.core is imported. And glibc's malloc as mlxtoy.backend sets it: freed
memory kept for the next step in a thread too."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import mlxtoy  # noqa: F401  (fast BLAS before mlx.core)
from mlxtoy import cpublas

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = r"""
import ctypes, json, sys
import numpy as np
import mlxtoy
import mlx.core as mx
from mlxtoy import backend
from mlxtoy.models import attention, fastmath

r = np.random.default_rng(3)
a, b = r.standard_normal((200, 300)), r.standard_normal((300, 150))
gemm_err = float(np.abs(np.array(mx.array(a, mx.float32) @ mx.array(b, mx.float32), np.float64) - a @ b).max())

q = mx.array(r.standard_normal((2, 6, 90, 16)), mx.float32)
k, v = (mx.array(r.standard_normal((2, 2, 90, 16)), mx.float32) for _ in range(2))
g = mx.array(r.standard_normal((2, 6, 90, 16)), mx.float32)
forwarder = getattr(ctypes.CDLL(None), "mlxtoy_blas_threads", None)
before = forwarder() if forwarder else None
loss = lambda q, k, v: (attention.attention(q, k, v, 0.25, "causal") * g).sum()
ref = lambda q, k, v: (mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal") * g).sum()
ours, theirs = mx.grad(loss, argnums=(0, 1, 2))(q, k, v), mx.grad(ref, argnums=(0, 1, 2))(q, k, v)
attention_err = max(float(mx.abs(x - y).max()) for x, y in zip(ours, theirs))
maps = open("/proc/self/maps").read()
print(json.dumps({"blas": backend.INFO.blas, "path": backend.INFO.blas_path, "core": backend.INFO.blas_core,
                  "mapped": [name for name in ("libscipy_openblas.so", "libmkl_rt", "libmkl_intel_thread", "libmkl_gnu_thread",
                                               "libmlxtoy_blas") if name in maps],
                  "gemm_err": gemm_err, "attention_err": attention_err, "block_attention": attention.block_attention_on(),
                  "threads_before": before, "threads_after": forwarder() if forwarder else None}))
"""


def probe(blas: str, **env: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=os.environ | {"MLXTOY_BLAS": blas} | env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.kernels  # the block attention is theirs
@pytest.mark.parametrize("blas", ["openblas", "mkl"])
def test_each_blas_is_the_one_mapped_and_computes_mlx_gemms_and_block_attention(blas):
    got = probe(blas)
    assert got["blas"] == blas
    if blas == "openblas":  # PyPI's, behind the forwarder that gives MLX its CBLAS names
        assert "libscipy_openblas" in got["path"] and got["core"]
        assert {"libscipy_openblas.so", "libmlxtoy_blas"} <= set(got["mapped"]) and "libmkl_rt" not in got["mapped"]
        # the block attention set OpenBLAS to one thread for its GEMMs and gave the count back
        assert got["threads_before"] == got["threads_after"] == int(os.environ.get("OPENBLAS_NUM_THREADS", len(os.sched_getaffinity(0))))
    else:  # MKL on its Intel OpenMP layer, the runtime the kernels' loops share
        assert got["mapped"] == ["libmkl_rt", "libmkl_intel_thread"]
    assert got["block_attention"]
    assert got["gemm_err"] < 1e-3  # float32 sums of 300 products against float64
    assert got["attention_err"] < 1e-4


MKL_LAYER = r"""
import ctypes, glob, os, sys
lib = os.path.join(sys.prefix, "lib")
mkl = ctypes.CDLL(glob.glob(os.path.join(lib, "libmkl_rt.so*"))[0], mode=ctypes.RTLD_GLOBAL)
a = (ctypes.c_float * 4)(1, 2, 3, 4); c = (ctypes.c_float * 4)()
mkl.cblas_sgemm(101, 111, 111, 2, 2, 2, ctypes.c_float(1), a, 2, a, 2, ctypes.c_float(0), c, 2)
print([name for name in ("libmkl_intel_thread", "libmkl_gnu_thread") if name in open("/proc/self/maps").read()], list(c))
"""


def test_mkl_runs_its_intel_openmp_layer_whatever_the_environment_asks():
    """mlxtoy sets MKL's threading layer itself (libmkl_rt took its GNU layer on an Intel host);
    the control: MKL loaded by hand with MKL_THREADING_LAYER=GNU maps its GNU layer, so the
    map check sees the difference."""
    got = probe("mkl", MKL_THREADING_LAYER="GNU")
    assert got["blas"] == "mkl" and "libmkl_gnu_thread" not in got["mapped"]
    assert "libmkl_intel_thread" in got["mapped"] and got["gemm_err"] < 1e-3
    control = subprocess.run([sys.executable, "-c", MKL_LAYER], env=os.environ | {"MKL_THREADING_LAYER": "GNU"},
                             capture_output=True, text=True, timeout=60, check=True).stdout
    assert control.strip() == "['libmkl_gnu_thread'] [7.0, 10.0, 15.0, 22.0]"


def test_blas_threads_follow_the_cores_this_process_may_use():
    """Under taskset (or a container's cpuset) the BLAS gets as many threads as allowed cores,
    not the machine's count; the control is the same process on every allowed core."""
    code = "import os, mlxtoy; print(os.environ['MKL_NUM_THREADS'], os.environ['OPENBLAS_NUM_THREADS'])"
    env = {k: v for k, v in os.environ.items() if k not in ("MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    allowed = sorted(os.sched_getaffinity(0))
    one = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True,
                         preexec_fn=lambda: os.sched_setaffinity(0, {allowed[0]})).stdout.split()
    every = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60,
                           check=True).stdout.split()
    assert one == ["1", "1"] and every == [str(len(allowed))] * 2


def test_reference_blas_when_none_is_asked_for():
    """Positive control for the map check above: MLXTOY_BLAS=none loads neither library, and MLX's
    own (reference) BLAS computes the same GEMM."""
    got = probe("none")
    assert got["blas"] is None and got["mapped"] == []
    assert got["gemm_err"] < 1e-3


def test_unmeasured_openblas_first_on_amd_and_mkl_first_on_intel(monkeypatch, tmp_path):
    monkeypatch.setenv("MLXTOY_CACHE", str(tmp_path))  # nothing measured here
    monkeypatch.delenv("MLXTOY_BLAS", raising=False)
    names = {}
    for vendor, flags in [("AuthenticAMD", {"avx2", "avx512f"}), ("AuthenticAMD", {"avx2"}),
                          ("GenuineIntel", {"avx512f"}), ("GenuineIntel", {"avx2"})]:
        names[vendor, "avx512f" in flags] = [name for name, _ in cpublas.blas_candidates(vendor, flags)]
    assert names["AuthenticAMD", True][0] == names["AuthenticAMD", False][0] == "openblas+prefix"
    assert names["GenuineIntel", True][0] == names["GenuineIntel", False][0] == "mkl"
    assert set(names["GenuineIntel", True]) >= {"mkl", "openblas+prefix"}  # CI installs both


THREAD_FAULTS = r"""
import ctypes, resource, sys, threading
import mlxtoy  # noqa: F401  (its malloc settings)
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE: a fault a 4 KiB page, whatever the machine's huge pages
if sys.argv[1] == "glibc-pad":
    libc.mallopt(-2, 128 * 1024)  # M_TOP_PAD back to glibc's default
faults = []

def work():
    size = 40 << 20  # two of them do not fit one of a thread arena's heaps (64 MiB)
    held = libc.malloc(size)
    ctypes.memset(held, 1, size)
    for _ in range(4):  # a decoding thread's step: a large array made, filled and freed
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        p = libc.malloc(size)
        ctypes.memset(p, 1, size)
        libc.free(ctypes.c_void_p(p))
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
    libc.free(ctypes.c_void_p(held))

t = threading.Thread(target=work)
t.start()
t.join()
print(max(faults[1:]))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc")
def test_a_thread_reuses_the_memory_it_freed_instead_of_faulting_in_fresh_pages():
    """A server's decoding thread made and freed arrays past its arena's heap every step; glibc
    unmapped that heap on each free (the trim threshold does not bind a thread's arena), and
    the kernel zeroed 40 MB of fresh pages again. Counted by the kernel's own fault counter;
    the positive control puts glibc's top pad back and sees the faults return."""
    def faults(mode: str) -> int:
        env = {k: v for k, v in os.environ.items() if k != "MLXTOY_MALLOC"}
        proc = subprocess.run([sys.executable, "-c", THREAD_FAULTS, mode], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=120, check=False)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return int(proc.stdout.split()[-1])

    pages = (40 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert faults("glibc-pad") > pages // 2  # each round faults the array's pages in again
    assert faults("mlxtoy") < pages // 20
