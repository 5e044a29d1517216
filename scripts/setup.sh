#!/usr/bin/env bash
# Create ./.venv (once) and install mlxtoy into it, editable. `scripts/setup.sh test` adds the test
# references (llama-cpp-python compiles llama.cpp: ~10 minutes the first time on 2 cores;
# pip caches the built wheel, so later runs are fast).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
# mlxtoy's install builds its CPU kernels (kernels/: C++ MLX primitives, ~15 s; setup.py) on
# Linux x86-64. Without build isolation they compile against the MLX installed here, so MLX and
# the build's tools come first. Without a compiler mlxtoy installs without them (its MLX-only path).
MLX="mlx>=0.29"
[ "$(uname -s)" = Linux ] && MLX="mlx[cpu]>=0.29"
.venv/bin/python -m pip install -q "$MLX" "nanobind>=3.0.1,<4" "cmake>=3.25" "setuptools>=77"
# kernels installed as their own package before they were built with mlxtoy
.venv/bin/python -m pip uninstall -q -y mlxtoy-kernels 2>/dev/null || true
if [ "${1:-}" = "test" ]; then
  # llama-cpp-python comes as source: without build isolation its build backend must be here
  # (a fresh machine has no cached wheel of it)
  .venv/bin/python -m pip install -q "scikit-build-core[pyproject]>=0.9.2"
  # torch==2.13.0 is pinned on purpose: it is a CPU wheel (a test reference only).
  .venv/bin/python -m pip install -q --no-build-isolation -e ".[test]"
  if [ "$(uname -s)-$(uname -m)" = Linux-x86_64 ]; then  # the tests need the kernels there
    MLXTOY_KERNELS=1 .venv/bin/python -c "import sys; from mlxtoy import backend; k, why = backend.cpu_kernels(); \
sys.exit(0 if k else f'error: the CPU kernels are off ({why})')"
  fi
else
  .venv/bin/python -m pip install -q --no-build-isolation -e .
fi
