#!/usr/bin/env bash
# Create ./.venv (once) and install mlxtoy into it. `scripts/setup.sh test` adds the test
# references (llama-cpp-python compiles llama.cpp: ~10 minutes the first time on 2 cores;
# pip caches the built wheel, so later runs are fast).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
if [ "${1:-}" = "test" ]; then
  # torch==2.13.0 is pinned on purpose: it is a CPU wheel (a test reference only).
  .venv/bin/python -m pip install -q -e ".[test]"
else
  .venv/bin/python -m pip install -q -e .
fi
# mlxtoy's CPU kernels (kernels/: C++ MLX primitives, ~15 s to build), built against the MLX
# just installed. Without them mlxtoy runs its pure-MLX paths; the tests need them.
.venv/bin/python -m pip install -q "nanobind>=3.0.1,<4" "cmake>=3.25" "setuptools>=77"  # the build needs (no isolation)
if ! .venv/bin/python -m pip install -q --no-build-isolation ./kernels; then
  [ "${1:-}" = "test" ] && exit 1
  echo "note: kernels/ did not build (a C++20 compiler is needed); mlxtoy runs without them" >&2
fi
