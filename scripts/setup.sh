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
