#!/usr/bin/env bash
# The test command from the README: sets itself up, then runs the whole suite
# (tiny-model tests and the real-model SmolLM2 tests), then the core of it (`-m core`: parity,
# gradients, adapters, preference losses, resume, greedy decoding, exports) a second time with
# MLXTOY_KERNELS=0: the MLX-only path, which Metal and CUDA run; on an AVX-512 CPU, the kernels'
# tests a third time in their AVX2 forms (MLXTOY_KERNEL_AVX512=0), as an AVX2-only CPU runs them.
# Extra arguments go to every run. Each run spreads its test files over up to 4 pytest-xdist
# workers, one a core: a test spends much of its time on one thread (starting processes, Python,
# compiling), which left the second of 2 cores half idle in a run of one process.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
WORKERS=$(nproc 2>/dev/null || echo 1)
[ "$WORKERS" -gt 4 ] && WORKERS=4
PARALLEL=(-n "$WORKERS" --dist loadfile)
run_pytest() {
  # pytest exits 5 when nothing was collected (e.g. a -k filter that matches nothing)
  local rc=0
  "$@" || rc=$?
  if [ "$rc" -eq 5 ]; then echo "no tests collected"; rc=0; fi
  return "$rc"
}
rc=0
run_pytest .venv/bin/python -m pytest -q -rs "${PARALLEL[@]}" --durations=15 "$@" || rc=$?
echo "== the core again on the MLX-only path (MLXTOY_KERNELS=0)"
run_pytest env MLXTOY_KERNELS=0 .venv/bin/python -m pytest -q -rs "${PARALLEL[@]}" -m core --durations=10 "$@" || rc=$?
if .venv/bin/python -c "import mlxtoy, mlxtoy_kernels as K; raise SystemExit(K.forms() != 'avx512')" 2>/dev/null; then
  echo "== the kernels' tests again in the forms an AVX2-only CPU takes (MLXTOY_KERNEL_AVX512=0)"
  run_pytest env MLXTOY_KERNEL_AVX512=0 .venv/bin/python -m pytest -q -rs "${PARALLEL[@]}" --durations=5 tests/test_kernels.py \
    tests/test_decode_block.py tests/test_qlora_decode.py tests/test_gemm.py tests/test_engine.py "$@" || rc=$?
fi
exit "$rc"
