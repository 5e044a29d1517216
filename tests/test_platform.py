"""The path a Mac runs, seen from the outside: every MLXTOY_* switch in one table (checked against
the source that reads them), a kernels build for another MLX refused at import with one warning,
`mlxtoy doctor`, and `--device` on every command."""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from importlib.util import find_spec
from pathlib import Path

import mlx.core as mx
import pytest

from helpers_train import REPO, run_cli
from mlxtoy import backend, settings
from mlxtoy.cli import COMMANDS, build_parser

PYTHON_READ = re.compile(r"(?:environ(?:\.get)?\(?\[?|getenv\()\s*[\"'](MLXTOY_[A-Z0-9_]+)")
CPP_READ = re.compile(r"getenv\(\"(MLXTOY_[A-Z0-9_]+)\"\)")


def source_files(*folders: str, suffixes: tuple[str, ...]) -> list[Path]:
    return [p for folder in folders for p in sorted(Path(REPO, folder).rglob("*")) if p.suffix in suffixes]


# ----------------------------------------------------------------------------- switches


def test_python_reads_switches_only_through_settings():
    reads = {(p.name, name) for p in source_files("mlxtoy", "tui", suffixes=(".py",))
             for name in PYTHON_READ.findall(p.read_text()) if p.name != "settings.py"}
    assert reads == set()
    # positive control: the pattern finds the reads in the table's own module
    assert PYTHON_READ.findall('os.environ.get("MLXTOY_X", "")') == ["MLXTOY_X"]


def test_the_table_lists_exactly_the_switches_the_code_reads():
    table = {s.name: s for s in settings.SWITCHES}
    cpp = {name for p in source_files("kernels/src", suffixes=(".h", ".cpp")) for name in CPP_READ.findall(p.read_text())}
    assert "MLXTOY_KERNEL_THREADS" in cpp  # positive control: pool.h's reads are found
    assert cpp == {name for name, s in table.items() if s.read_by == "C++"}
    files = source_files("mlxtoy", "tui", suffixes=(".py",))
    python = "\n".join(p.read_text() for p in files if p.name != "settings.py")
    own = "\n".join(p.read_text() for p in files if p.name == "settings.py")  # its helpers (cache_dir)
    for s in settings.SWITCHES:
        if s.read_by == "Python":  # each is read somewhere, as settings.<ITS NAME> (or in settings.py's own helpers)
            short = s.name.removeprefix("MLXTOY_")
            assert f"settings.{short}." in python or f"{short}.value()" in own, s.name
    assert len(table) == len(settings.SWITCHES)
    assert all(s.audience in (settings.USER, settings.DEBUG) and s.help for s in settings.SWITCHES)


def test_markdown_table_has_a_row_per_switch():
    lines = settings.markdown_table().splitlines()
    assert lines[0].startswith("| switch |") and len(lines) == 2 + len(settings.SWITCHES)
    for s, line in zip(settings.SWITCHES, lines[2:]):
        assert line.startswith(f"| `{s.name}` | {s.audience}") and line.count("|") == 5


def test_switch_values_are_typed(monkeypatch, capsys):
    for raw, want in [("0", False), ("off", False), ("1", True), ("TRUE", True), ("", True)]:
        monkeypatch.setenv("MLXTOY_KERNELS", raw)
        assert settings.KERNELS.value() is want
    monkeypatch.setenv("MLXTOY_KERNELS", "maybe")
    assert settings.KERNELS.value() is True and "MLXTOY_KERNELS='maybe'" in capsys.readouterr().err
    monkeypatch.setenv("MLXTOY_MEMORY_GB", "1.5")
    assert settings.MEMORY_GB.value() == 1.5
    monkeypatch.setenv("MLXTOY_MEMORY_GB", "lots")  # refused once, by check_all (the CLI's first act)
    assert settings.MEMORY_GB.value() is None
    with pytest.raises(settings.UserError, match="MLXTOY_MEMORY_GB='lots'"):
        settings.check_all()
    monkeypatch.setenv("MLXTOY_DEVICE", "GPU")
    assert settings.DEVICE.value() == "gpu"


# ----------------------------------------------------------------------------- the kernels' stamp

# imports mlxtoy as a user would, then computes through the model's maths; prints what ran
STAMP_PROBE = r"""
import json, sys
import numpy as np
import mlxtoy
import mlx.core as mx
from mlxtoy import backend
from mlxtoy.io import gguf_file
from mlxtoy.models import fastmath
x, w = mx.random.normal((3, 64), key=mx.random.key(0)), mx.random.normal((64,), key=mx.random.key(1))
got = fastmath.rms_norm(x, w, 1e-5)
want = mx.fast.rms_norm(x, w, 1e-5)
print(json.dumps({"kernels": fastmath.kernels_on(), "dequantize_kernels": gguf_file.mlxtoy_kernels is not None,
                  "status": fastmath.kernels_status(), "from": getattr(backend.cpu_kernels()[0], "__file__", None),
                  "extension_loaded": "mlxtoy_kernels._ext" in sys.modules,
                  "err": float(mx.abs(got - want).max())}))
"""


@pytest.fixture
def kernels_copy(tmp_path):
    """The installed kernels, copied to a folder that a subprocess puts first on its path, so a
    test can rewrite their stamp without touching the installed ones."""
    spec = find_spec("mlxtoy_kernels")
    assert spec is not None, "the tests need the kernels installed (scripts/setup.sh test)"
    folder = tmp_path / "site"
    shutil.copytree(Path(spec.origin).parent, folder / "mlxtoy_kernels",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return folder


def probe_with(site: Path) -> tuple[dict, list[str]]:
    env = os.environ | {"PYTHONPATH": str(site)}
    env.pop("MLXTOY_KERNELS", None)
    r = subprocess.run([sys.executable, "-c", STAMP_PROBE], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr.strip().splitlines()


def test_a_build_stamped_for_another_mlx_is_refused_with_one_warning(kernels_copy):
    stamp = kernels_copy / "mlxtoy_kernels" / backend.KERNELS_STAMP
    # positive control: the copy, stamped with this MLX, is taken
    stamp.write_text(mx.__version__ + "\n")
    got, err = probe_with(kernels_copy)
    assert got["kernels"] and got["dequantize_kernels"] and got["from"].startswith(str(kernels_copy))
    assert not [line for line in err if line.startswith("warning")], err
    # stamped for another MLX: the MLX-only path, the same numbers, one warning naming the fix
    stamp.write_text("0.1.0\n")
    got, err = probe_with(kernels_copy)
    assert not got["kernels"] and not got["dequantize_kernels"] and not got["extension_loaded"]
    assert got["err"] < 1e-5
    assert got["status"].startswith("off (built for MLX 0.1.0")
    warnings = [line for line in err if "warning" in line]
    assert len(warnings) == 1 and len(err) == 1, err
    assert "MLX 0.1.0" in warnings[0] and f"MLX {mx.__version__}" in warnings[0]
    assert backend.KERNELS_FIX in warnings[0]
    # a build from before the stamp: refused the same way
    stamp.unlink()
    got, err = probe_with(kernels_copy)
    assert not got["kernels"] and len(err) == 1 and "no stamp" in err[0]


# ----------------------------------------------------------------------------- doctor


def doctor(*args: str, env: dict | None = None) -> dict[str, str]:
    r = run_cli("doctor", *args, env=env)
    assert r.returncode == 0, r.stderr
    if "--json" in args:
        return json.loads(r.stdout)
    lines = r.stdout.strip().splitlines()
    assert all(": " in line for line in lines), lines
    return dict(line.split(": ", 1) for line in lines)


def test_doctor_reports_versions_device_and_kernels():
    text = doctor()
    assert text == doctor("--json")  # the same facts either way
    assert text["mlx"] == metadata.version("mlx")
    assert text["mlxtoy"] == metadata.version("mlxtoy")
    assert text["python"].startswith(platform.python_version())
    assert text["platform"].split()[0] == platform.system()
    assert text["device"] == backend.INFO.device
    assert text["compute dtype"] == ("float32" if backend.INFO.device == "cpu" else "bfloat16")
    assert text["metal"] == ("available" if mx.metal.is_available() else "not available")
    if backend.cpu_kernels()[0] is not None and backend.INFO.device == "cpu":  # CI on x86-64 Linux
        assert text["kernels"] == "on" and text["kernels built for"] == f"MLX {mx.__version__}"
    else:
        assert re.fullmatch(r"off \(.+\)", text["kernels"])


def test_doctor_with_the_kernels_switched_off():
    text = doctor(env={"MLXTOY_KERNELS": "0"})
    assert text["kernels"] == "off (MLXTOY_KERNELS=0)"
    assert "kernels built for" not in text


# ----------------------------------------------------------------------------- --device


@pytest.mark.parametrize("module", COMMANDS, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_every_command_takes_device(module, capsys):
    name = module.__name__.rsplit(".", 1)[-1]
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([name, "--help"])
    assert e.value.code == 0
    assert "--device {cpu,gpu}" in capsys.readouterr().out


def test_device_cpu_and_a_gpu_where_there_is_none():
    assert doctor("--device", "cpu")["device"] == "cpu"
    assert doctor("--device", "cpu")["compute dtype"] == "float32"
    r = run_cli("doctor", "--device", "gpu")
    if backend.gpu_name() is None:
        assert r.returncode == 2 and r.stdout == ""
        assert r.stderr.splitlines() == [r.stderr.strip()] and r.stderr.startswith("error: --device gpu: no GPU")
    else:  # Metal or CUDA: the GPU, in bfloat16
        assert r.returncode == 0 and f"device: {backend.gpu_name()}" in r.stdout
    bad = run_cli("doctor", "--device", "tpu")
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and len(bad.stderr.splitlines()) == 1


# ----------------------------------------------------------------------------- the install


def test_an_install_that_cannot_build_the_kernels_installs_without_them(tmp_path):
    """setup.py with no working C++ compiler: the wheel still builds, holds mlxtoy and no kernels
    (no extension, no stamp), so mlxtoy runs its MLX-only path. (That the install builds them
    where a compiler exists is what scripts/setup.sh and the doctor test above check.)"""
    source = tmp_path / "src"
    source.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(Path(REPO, name), source / name)
    for folder in ("mlxtoy", "tui", "kernels"):
        shutil.copytree(Path(REPO, folder), source / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so", "build", "*.egg-info", "mlx_version.txt"))
    env = os.environ | {"CXX": str(tmp_path / "no-such-c++")}
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-build-isolation", "--no-deps",
                        "--no-index", "-w", str(tmp_path / "wheels"), str(source)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "mlxtoy: the CPU kernels did not build" in r.stdout + r.stderr  # it tried, and said why
    (wheel,) = (tmp_path / "wheels").glob("mlxtoy-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "mlxtoy/backend.py" in names and "mlxtoy/commands/doctor.py" in names
    assert not [n for n in names if n.startswith("mlxtoy_kernels/") and not n.endswith("__init__.py")], names


def test_device_reaches_the_processes_a_command_starts(monkeypatch):
    """`mlxtoy tui --device cpu` trains in a child process: the choice goes with it (MLXTOY_DEVICE)."""
    monkeypatch.delenv("MLXTOY_DEVICE", raising=False)  # and restored afterwards
    before = backend.INFO.device
    try:
        backend.use_device("cpu")
        assert os.environ["MLXTOY_DEVICE"] == "cpu"
        child = subprocess.run([sys.executable, "-c", "import mlxtoy; print(mlxtoy.backend.INFO.device)"],
                               cwd=REPO, capture_output=True, text=True, timeout=60)
        assert child.stdout.strip() == "cpu", child.stderr
    finally:
        backend.use_device("cpu" if before == "cpu" else "gpu")


def test_mlx_without_a_backend_is_named_at_import(tmp_path):
    """MLX installed with no backend wheel (Linux: `mlx` alone, no mlx-cpu / mlx-cuda) fails at
    `import mlxtoy` with the extras that fix it; any other import error is left as it is."""
    for message, expected in (("libmlx.so: cannot open shared object file", "pip install -e '.[cpu]'"),
                              ("no module named numpy", "no module named numpy")):
        fake = tmp_path / message.split(":")[0].replace(" ", "_") / "mlx"
        fake.mkdir(parents=True)
        (fake / "__init__.py").write_text("")
        (fake / "core.py").write_text(f"raise ImportError({message!r})\n")
        env = dict(os.environ, PYTHONPATH=f"{fake.parent}{os.pathsep}{REPO}")
        p = subprocess.run([sys.executable, "-c", "import mlxtoy"], capture_output=True, text=True, env=env)
        assert p.returncode != 0
        assert p.stderr.strip().splitlines()[-1].startswith("ImportError: ")
        assert expected in p.stderr.strip().splitlines()[-1], p.stderr[-500:]
