#!/usr/bin/env bash
# The README's main job: set up .venv, then fine-tune the built-in SmolLM2-135M-Instruct with
# LoRA on the bundled demo task (ISO dates -> "14 July 2021") and print held-out accuracy and
# sample answers before and after. A few minutes on a 2-core CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
out="runs/quickstart-$(date +%Y%m%d-%H%M%S)"
.venv/bin/mlxtoy train --config assets/demo/lora.yaml --out "$out" --eval-accuracy "$@"
echo
echo "run saved in $out; try:"
echo "  .venv/bin/mlxtoy generate --adapter $out --chat --prompt 'Write the date 1999-03-02 as day, month name and year.'"
echo "  .venv/bin/mlxtoy export $out --out demo.gguf --dtype f16"
