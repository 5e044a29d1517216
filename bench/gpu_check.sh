#!/usr/bin/env bash
# The checks of MLX's CUDA backend, the GPU path Metal shares, on a lent NVIDIA machine: no network
# there, Python 3.12 with torch, transformers and peft, but no MLX. What it needs travels from here
# in .gpu/ (git-ignored: each run names its parts in `carry`), which `kit` builds: MLX's CUDA wheels
# (the CUDA one is over what one transfer may carry, so it goes in two halves, one per phase, and
# phase 1 leaves its half on the machine), the small wheels mlxtoy and mlx-lm need there, and
# SmolLM2's tokenizer (the SmolLM2 wheel is too large to carry: the models are random, of
# SmolLM2-135M's, Llama-3.2-1B's and Llama-3.1-8B's shapes, written there); and llama-cpp-python,
# the GGUF reference of the core tests, built here (it compiles llama.cpp) and slimmed to ~5 MB.
#
#   bash bench/gpu_check.sh kit   # here, once
#   bash bench/gpu_check.sh 1     # there: the models, torch + peft's rows          (carry .gpu/wheels .gpu/tok .gpu/mlxcuda.00)
#   bash bench/gpu_check.sh 2     # there, next: MLX, doctor, a user's first run, mlxtoy against mlx-lm:
#                                 # LoRA, QLoRA, decoding (carry .gpu/mlxcuda.01 .gpu/llama); with
#                                 # BUDGET=seconds it goes on to 3 with the time left
#   BUDGET=300 bash bench/gpu_check.sh 3   # there, after 2: the 8B QLoRA (MLX's quantized matmul, then
#                                 # MLXTOY_GPU_SLAB_ROWS), then the core tests on the GPU, llama-cpp-python
#                                 # with them, in the time left (carry .gpu/llama when 3 runs alone)
#
# Results: each step's tail in the output, every log in $OUT/logs-N.tgz (the logs stay in $WORK, so
# phase 2 shows phase 1's torch rows). A dry run of the scripts on this machine's CPU, no installs:
#   PY=.venv/bin/python WORK=/tmp/gpu-dry MID=135m BIG=135m STEPS=3 bash bench/gpu_check.sh 1 (then 2)
set -uo pipefail
cd "$(dirname "$0")/.."
KIT=.gpu
WORK=${WORK:-/tmp/mlxtoy-gpu}
OUT=${OUT:-$WORK/out}
LOGS=$WORK/logs
PY=${PY:-python3}
MID=${MID:-1b}  # the sizes (bench/bench_scale.py's SIZES)
BIG=${BIG:-8b}
MLX_VERSION=0.32.4
LLAMA_VERSION=0.3.36  # pyproject.toml's test extra
STEPS=${STEPS:-8}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$WORK" "$OUT" "$LOGS"
trap 'tar czf "$OUT/logs-${1:-x}.tgz" -C "$LOGS" . 2>/dev/null' EXIT
step() { echo "== $*"; }
run() {  # run LOG SECONDS CMD...: its output to $LOGS/LOG.log, the tail here
  local log=$1 secs=$2; shift 2
  local t0=$SECONDS
  timeout "$secs" "$@" >"$LOGS/$log.log" 2>&1
  local rc=$?
  echo "-- $log: exit $rc, $((SECONDS - t0)) s"
  tail -n "${TAIL:-14}" "$LOGS/$log.log"
}

case "${1:-}" in
kit)
  rm -rf "$KIT" && mkdir -p "$KIT/wheels" "$KIT/tok"
  get() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d "$1" "${@:2}"; }
  get "$KIT/wheels" "mlx==$MLX_VERSION" gguf textual textual-plotext "plotext<6" mdit-py-plugins platformdirs \
    linkify-it-py uc-micro-py "mlx-lm==0.32.2" diskcache
  # llama-cpp-python: scripts/setup.sh test's build in pip's cache, else built now for any x86-64 with
  # AVX2 (GGML_NATIVE off). A cached build is native to this CPU: the one carried so far (Zen 3) held
  # no AMD-only instructions (SSE4a, XOP, FMA4, TBM; objdump), so it runs on an Intel host too
  llama=$(ls -t ~/.cache/pip/wheels/*/*/*/*/llama_cpp_python-$LLAMA_VERSION-py3-none-*.whl 2>/dev/null | head -1)
  if [ -z "$llama" ]; then
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" .venv/bin/python -m pip wheel -q \
      --no-deps -w "$WORK/llama" "llama-cpp-python==$LLAMA_VERSION" || exit 3
    llama=$(ls "$WORK"/llama/llama_cpp_python-$LLAMA_VERSION-*.whl)
  fi
  mkdir -p "$KIT/llama"
  # the wheel holds each library 6 times (lib/ and llama_cpp/lib/, 3 names each: 24 MB); kept: the
  # package, and in llama_cpp/lib the names ctypes loads (libllama.so, libmtmd.so) and the sonames
  # the libraries ask for (*.so.0); RECORD keeps the lines of what is kept
  python3 - "$llama" "$KIT/llama/$(basename "$llama")" <<'PY'
import re, sys, zipfile
src, dst = sys.argv[1:]
def keep(name):
    if name.startswith(("lib/", "include/", "bin/")):
        return False
    return not name.startswith("llama_cpp/lib/") or re.fullmatch(r"llama_cpp/lib/(lib(llama|mtmd)\.so|.*\.so\.0)", name)
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
    for item in zin.infolist():
        if not keep(item.filename):
            continue
        data = zin.read(item)
        if item.filename.endswith(".dist-info/RECORD"):
            lines = data.decode().splitlines(keepends=True)
            data = "".join(l for l in lines if keep(l.split(",")[0])).encode()
        zout.writestr(item, data)
PY
  get "$WORK/cuda" "mlx-cuda-13==$MLX_VERSION"
  split -b 46m -d "$WORK"/cuda/mlx_cuda_13-*.whl "$KIT/mlxcuda."
  .venv/bin/python bench/bench_scale.py --save-tokenizer "$KIT/tok"
  du -sh "$KIT"/*
  ;;
1)
  step "machine"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  cp "$KIT/mlxcuda.00" "$WORK/"
  [ "$PY" = python3 ] && python3 -m pip install -q --no-index --no-deps --no-compile "$KIT"/wheels/*.whl
  step "models"
  for size in 135m $MID; do run "hf-$size" 300 $PY bench/bench_scale.py --work "$WORK" --tokenizer "$KIT/tok" --write-hf $size; done
  run "gguf-$BIG" 300 $PY bench/bench_scale.py --work "$WORK" --tokenizer "$KIT/tok" --write-gguf "$BIG"
  step "torch + peft, LoRA r8 q,v, bfloat16, batch 4 x 256"
  for size in 135m $MID; do
    TAIL=3 run "torch-$size" 200 $PY bench/bench_train.py --work "$WORK" --model "$WORK/random-$size-hf" --tools torch \
      --methods lora --dtype bfloat16 --rounds 1 --steps "$STEPS"
  done
  ls -la "$WORK"
  ;;
2)
  step "MLX $MLX_VERSION with its CUDA backend"
  if [ "$PY" = python3 ]; then
    [ -f "$WORK/mlxcuda.00" ] || { echo "phase 1's half of the CUDA wheel is gone (a fresh machine): run 1 again"; exit 3; }
    cat "$WORK/mlxcuda.00" "$KIT/mlxcuda.01" >"$WORK/mlx_cuda_13-$MLX_VERSION-py3-none-manylinux_2_35_x86_64.whl"
    python3 -m pip install -q --no-index --no-deps --no-compile "$KIT"/wheels/mlx-*.whl \
      "$WORK/mlx_cuda_13-$MLX_VERSION-py3-none-manylinux_2_35_x86_64.whl" || exit 3
  fi
  $PY -c "import mlx.core as mx; print(mx.__version__, mx.default_device(), mx.cuda.is_available())"
  TAIL=30 run doctor 60 $PY -m mlxtoy doctor
  step "a user's first run: train (LoRA, bfloat16 on the GPU), then generate with the adapter"
  data=$WORK/data
  TAIL=4 run first-train 200 $PY -m mlxtoy train --model "$WORK/random-135m-hf" --data "$data" --out "$WORK/run-135m" \
    --steps 12 --batch-size 4 --seq-len 256 --eval-every 6 --save-every 0
  TAIL=4 run first-generate 100 $PY -m mlxtoy generate --model "$WORK/random-135m-hf" --adapter "$WORK/run-135m" \
    --prompt "Once upon a time" --max-tokens 24
  step "mlxtoy against mlx-lm (and torch + peft from phase 1), LoRA r8 q,v, bfloat16, batch 4 x 256"
  TAIL=2 run convert 200 $PY -m mlx_lm convert --hf-path "$WORK/random-$MID-hf" --mlx-path "$WORK/random-$MID-mlx4" -q
  for model in random-135m-hf random-$MID-hf random-$MID-mlx4; do
    tools=mlxtoy,mlx-lm
    [ "$model" = "random-$MID-mlx4" ] && tools=mlxtoy,mlxtoy-slabs,mlx-lm  # QLoRA: MLXTOY_GPU_SLAB_ROWS too
    TAIL=5 run "train-$model" 300 $PY bench/bench_train.py --work "$WORK" --model "$WORK/$model" --tools $tools \
      --methods lora --dtype bfloat16 --rounds 1 --steps "$STEPS" --baseline mlx-lm
  done
  step "decoding: the 1B's mlx-lm 4-bit folder (mlxtoy, mlx-lm), the 8B Q4_0 GGUF (mlxtoy)"
  TAIL=3 run decode-1b 200 $PY bench/bench_decode_scale.py --models "$WORK/random-$MID-mlx4" --engines mlxtoy,mlx-lm --rounds 1 \
    --prompt-tokens 128 --decode-tokens 64
  TAIL=3 run decode-8b 200 $PY bench/bench_decode_scale.py --models "$WORK/random-$BIG-q4_0.gguf" --engines mlxtoy \
    --rounds 1 --prompt-tokens 128 --decode-tokens 64
  step "torch + peft (phase 1)"
  tail -qn 1 "$LOGS"/torch-*.log
  [ -n "${BUDGET:-}" ] || exit 0
  ;&
3)
  step "8B QLoRA from the Q4_0 GGUF, batch 1 x 256, --grad-checkpoint"
  TAIL=3 run qlora-8b 300 $PY bench/bench_scale.py --work "$WORK" --tokenizer "$KIT/tok" --size "$BIG" --modes qlora \
    --batch 1 --seq 256 --grad-checkpoint --steps 4
  TAIL=1 run qlora-8b-slabs 300 env MLXTOY_GPU_SLAB_ROWS=256 $PY bench/bench_scale.py --work "$WORK" --tokenizer "$KIT/tok" \
    --size "$BIG" --modes qlora --batch 1 --seq 256 --grad-checkpoint --steps 4
  # the rest of the call's BUDGET seconds, else TEST_SECS
  secs=${TEST_SECS:-$((${BUDGET:-300} - SECONDS - 15))}
  [ "$secs" -ge 30 ] || { echo "== no time left for the core tests (${secs} s)"; exit 0; }
  step "the core tests on the GPU, ${secs} s at most (MLX-only path, float32 without TF32: the CPU's tolerances)"
  # llama-cpp-python from the kit (the GGUF tests' reference, on the host's CPU); without it
  # test_dora / test_export (which import it) are left out and -k drops the tests that call it.
  # `real` needs the SmolLM2 wheel; a test's first run compiles MLX's CUDA kernels (NVRTC), which
  # can take minutes: pytest-timeout (there, not here) fails that test and goes on, so the
  # summary is printed
  if [ "$PY" = python3 ] && ls "$KIT"/llama/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile "$KIT"/llama/*.whl "$KIT"/wheels/diskcache-*.whl
  fi
  skip=(--ignore tests/test_dora.py --ignore tests/test_export.py -k "not llama_cpp and not tensor_types")
  if $PY -c "import llama_cpp" 2>/dev/null; then
    skip=()
    echo "llama-cpp-python $($PY -c 'import llama_cpp; print(llama_cpp.__version__)'): its tests run too"
  fi
  TIMEOUT=$($PY -c "import pytest_timeout" 2>/dev/null && echo "--timeout ${TEST_TIMEOUT:-60}")
  TAIL=12 run core-tests "$secs" env MLXTOY_KERNELS=0 MLXTOY_DEVICE=gpu MLXTOY_DTYPE=float32 MLX_ENABLE_TF32=0 \
    $PY -m pytest -v -m "core and not real" "${skip[@]}" -p no:cacheprovider --continue-on-collection-errors \
    $TIMEOUT --tb=short -rfE --durations=5
  grep -E "(FAILED|ERROR)( |$)" "$LOGS/core-tests.log" | grep "::" | head -40
  grep -cE " PASSED" "$LOGS/core-tests.log"
  ;;
*)
  echo "usage: bash bench/gpu_check.sh kit|1|2|3" >&2
  exit 2
  ;;
esac
