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
# The host's CPU, another x86 kind (issue 43: routes measured on the user's machine): MLX's CPU wheel,
# MKL and OpenBLAS, the kernels built here for Python 3.12; 135M LoRA against torch + peft and mlx-lm
# on every core and on two, 1B LoRA, each BLAS, full fine-tuning, the step's parts on every core and
# on two (bench/profile_step.py: which do not scale), decoding against llama.cpp, and the
# kernels' tests there (AVX-512 forms this 2-core AVX2 box cannot run):
#   PY312=python3.12 bash bench/gpu_check.sh cpukit   # here, once: .gpu/mkl (~50 MB), .gpu/cpu and the common parts
#   bash bench/gpu_check.sh cpu1   # there (carry .gpu/mkl): the CPU; MKL into ~/.local/lib, one SGEMM to check it loads
#   DEADLINE=540 bash bench/gpu_check.sh cpu2   # there, at once, while warm (carry .gpu/wheels .gpu/tok .gpu/llama
#                                  # .gpu/cpu); DEADLINE: the seconds the call may take (each step ends in time)
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
MKL_VERSION=2026.2.0
STEPS=${STEPS:-8}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$WORK" "$OUT" "$LOGS"
trap 'tar czf "$OUT/logs-${1:-x}.tgz" -C "$LOGS" . 2>/dev/null' EXIT
step() { echo "== $*"; }
run() {  # run LOG SECONDS CMD...: its output to $LOGS/LOG.log, the tail here
  local log=$1 secs=$2; shift 2
  local t0=$SECONDS
  if [ -n "${DEADLINE:-}" ]; then  # the call's seconds: end each step in time for the logs to come back
    [ $((DEADLINE - SECONDS - 10)) -lt "$secs" ] && secs=$((DEADLINE - SECONDS - 10))
    [ "$secs" -ge 5 ] || { echo "-- $log: skipped, no time left"; return; }
  fi
  timeout "$secs" "$@" >"$LOGS/$log.log" 2>&1
  local rc=$?
  echo "-- $log: exit $rc, $((SECONDS - t0)) s"
  tail -n "${TAIL:-14}" "$LOGS/$log.log"
}

get() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d "$1" "${@:2}"; }
# the parts both checks carry: the wheels mlxtoy and mlx-lm need there, llama-cpp-python, the tokenizer
kit_common() {
  rm -rf "$KIT/wheels" "$KIT/tok" "$KIT/llama" && mkdir -p "$KIT/wheels" "$KIT/tok"
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
  .venv/bin/python bench/bench_scale.py --save-tokenizer "$KIT/tok"
}

case "${1:-}" in
kit)
  kit_common
  rm -f "$KIT"/mlxcuda.*
  get "$WORK/cuda" "mlx-cuda-13==$MLX_VERSION"
  split -b 46m -d "$WORK"/cuda/mlx_cuda_13-*.whl "$KIT/mlxcuda."
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
cpukit)
  kit_common
  rm -rf "$KIT/cpu" "$KIT/mkl" && mkdir -p "$KIT/cpu" "$KIT/mkl"
  get "$KIT/cpu" "mlx-cpu==$MLX_VERSION" scipy-openblas32
  # the kernels, built here for the Python there (3.12), from this checkout's sources
  "${PY312:-python3.12}" -m venv "$WORK/v312" && "$WORK/v312/bin/python" -m pip install -q "$KIT"/wheels/mlx-*.whl \
    "$KIT"/cpu/mlx_cpu-*.whl "nanobind>=3.0.1,<4" cmake setuptools || exit 3
  rm -rf "$WORK/src" && mkdir -p "$WORK/src" && cp -r setup.py pyproject.toml kernels "$WORK/src/"
  rm -f "$WORK"/src/kernels/mlxtoy_kernels/*.so
  (cd "$WORK/src" && "$WORK/v312/bin/python" setup.py -q build_ext --inplace) >"$WORK/kernels312.log" 2>&1 \
    || { tail "$WORK/kernels312.log"; exit 3; }
  cp "$WORK"/src/kernels/mlxtoy_kernels/{_ext.*.so,libmlxtoy_blas.so,mlx_version.txt} "$KIT/cpu/"
  # MKL, what pyproject installs on x86 Linux (a 220 MB wheel), as much of it as one call carries:
  # the dispatcher, its core and LP64 interface, its OpenMP threading and runtime (intel-openmp's
  # libiomp5), and the kernels it loads on an AMD CPU (libmkl_def, seen on a Zen 3) and on an Intel
  # AVX-512 one; xz-compressed (~50 MB: phase cpu1 carries them alone, Python's lzma unpacks them)
  get "$WORK/mkl" "mkl==$MKL_VERSION" "intel-openmp==$MKL_VERSION"
  for lib in rt core intel_lp64 intel_thread def avx512; do
    unzip -p "$WORK"/mkl/mkl-*.whl "*/lib/libmkl_$lib.so.3" | xz -9 -T0 >"$KIT/mkl/libmkl_$lib.so.3.xz" || exit 3
  done
  unzip -p "$WORK"/mkl/intel_openmp-*.whl "*/lib/libiomp5.so" | xz -9 -T0 >"$KIT/mkl/libiomp5.so.xz" || exit 3
  du -sh "$KIT"/*
  ;;
cpu1)
  step "machine"
  lscpu | grep -E "^(Model name|Vendor ID|CPU family|Model|Thread|Core|Socket|CPU\(s\)|L2|L3)"
  echo "flags: $(grep -m1 -o -w -E 'avx2|fma|avx512f|avx512_vnni|avx512_bf16|avx_vnni|amx_tile|amx_bf16|avx10[_0-9a-z]*' /proc/cpuinfo | sort -u | tr '\n' ' ')"
  step "MKL into ~/.local/lib, where mlxtoy's backend looks"
  mkdir -p ~/.local/lib
  python3 -c "import lzma, pathlib, sys
for f in sys.argv[1:]:
    p = pathlib.Path(f); (pathlib.Path.home() / '.local/lib' / p.stem).write_bytes(lzma.decompress(p.read_bytes()))" "$KIT"/mkl/*.xz
  # a small SGEMM: MKL loads its kernel library for this CPU now, and exits if it was not carried
  python3 -c "import ctypes, os, numpy as np
lib = os.path.expanduser('~/.local/lib/')
ctypes.CDLL(lib + 'libiomp5.so', mode=ctypes.RTLD_GLOBAL); mkl = ctypes.CDLL(lib + 'libmkl_rt.so.3', mode=ctypes.RTLD_GLOBAL)
a, b = np.random.rand(64, 64).astype(np.float32), np.random.rand(64, 64).astype(np.float32); c = np.zeros((64, 64), np.float32)
p = lambda x: x.ctypes.data_as(ctypes.c_void_p); f = ctypes.c_float
mkl.cblas_sgemm(101, 111, 111, 64, 64, 64, f(1), p(a), 64, p(b), 64, f(0), p(c), 64)
print('MKL sgemm: max error', float(abs(c - a @ b).max()))" \
    || { echo "MKL does not run here: removed (mlxtoy takes OpenBLAS)"; rm -f ~/.local/lib/libmkl_* ~/.local/lib/libiomp5*; }
  ls ~/.local/lib
  ;;
cpu2)
  step "mlxtoy on the host's CPU: MLX $MLX_VERSION (CPU), the kernels built for Python 3.12 (phase cpukit)"
  if [ "$PY" = python3 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile "$KIT"/wheels/*.whl "$KIT"/cpu/*.whl "$KIT"/llama/*.whl || exit 3
    cp "$KIT"/cpu/{_ext.*.so,libmlxtoy_blas.so,mlx_version.txt} kernels/mlxtoy_kernels/
    export PYTHONPATH=$PWD/kernels:$PYTHONPATH
  fi
  export MLXTOY_CACHE=$WORK/cache CUDA_VISIBLE_DEVICES=  # torch + peft on the CPU too
  TAIL=0 run doctor 120 $PY -m mlxtoy doctor --calibrate
  grep -vE "^(routes:|  )" "$LOGS/doctor.log"  # the facts; every route's rates are in the logs
  step "the core tests with the kernels (the x86 path): distributed, kernels, routes first"
  TIMEOUT=$($PY -c "import pytest_timeout" 2>/dev/null && echo "--timeout 90")
  TAIL=12 run core-tests 150 $PY -m pytest -q -m "core and not real" -p no:cacheprovider $TIMEOUT \
    tests/test_distributed.py tests/test_kernels.py tests/test_routes.py tests/test_decode_block.py -rfE
  step "models: random weights of SmolLM2-135M's and Llama-3.2-1B's shapes"
  for size in 135m 1b; do run "hf-$size" 120 $PY bench/bench_scale.py --work "$WORK" --tokenizer "$KIT/tok" --write-hf $size; done
  lora="--methods lora --rounds 1 --work $WORK"
  step "135M LoRA r8 q,v, float32, 4 x 256, every core: each route, torch + peft, mlx-lm"
  TAIL=9 run lora-135m 200 $PY bench/bench_train.py $lora --steps 6 --model "$WORK/random-135m-hf" \
    --tools mlxtoy,mlxtoy-blas,torch,mlxtoy-mlx,mlx-lm
  step "the same on 2 cores (taskset: two physical cores), as the README's rows"
  two=$(lscpu -p=CPU,CORE | grep -v "^#" | sort -t, -k2,2 -n -u | head -2 | cut -d, -f1 | paste -sd,)
  TAIL=6 run lora-135m-2cores 150 taskset -c "$two" $PY bench/bench_train.py $lora --steps 6 --model "$WORK/random-135m-hf" \
    --tools mlxtoy,torch
  step "1B LoRA, 2 x 256, every core"
  TAIL=5 run lora-1b 150 $PY bench/bench_train.py $lora --model "$WORK/random-1b-hf" --batch 2 --steps 4 --tools mlxtoy,torch
  step "135M LoRA, every core, with each BLAS (doctor --calibrate picked one by a single product)"
  for blas in mkl openblas; do
    TAIL=1 run "lora-135m-$blas" 60 env MLXTOY_BLAS=$blas $PY bench/bench_train.py $lora --steps 6 --model "$WORK/random-135m-hf" \
      --tools mlxtoy
  done
  step "135M full fine-tuning, every core"
  TAIL=5 run full-135m 100 $PY bench/bench_train.py --methods full --rounds 1 --steps 6 --work "$WORK" \
    --model "$WORK/random-135m-hf" --tools mlxtoy,torch
  step "where a 135M LoRA step's time goes, every core and 2 cores: the parts that do not scale"
  TAIL=9 run profile-all 90 $PY bench/profile_step.py --model "$WORK/random-135m-hf"
  TAIL=9 run profile-2cores 120 taskset -c "$two" $PY bench/profile_step.py --model "$WORK/random-135m-hf"
  step "decoding the 1B's Q4_0 GGUF: mlxtoy, llama.cpp on every core"
  run gguf-1b 100 $PY bench/bench_scale.py --work "$WORK" --tokenizer "$KIT/tok" --write-gguf 1b
  TAIL=4 run decode-1b 100 $PY bench/bench_decode_scale.py --models "$WORK/random-1b-q4_0.gguf" --engines mlxtoy,llama.cpp \
    --threads "$(nproc)" --rounds 1 --prompt-tokens 32 --decode-tokens 32
  ;;
*)
  echo "usage: bash bench/gpu_check.sh kit|1|2|3|cpukit|cpu1|cpu2" >&2
  exit 2
  ;;
esac
