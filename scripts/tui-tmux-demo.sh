#!/bin/bash
# Scripted tmux session: mlxtoy tui on SmolLM2 with the demo data, a few LoRA steps.
# Usage: scripts/tui-tmux-demo.sh (after scripts/setup.sh); captures go to $OUT (default /tmp/mlxtoy-tui-tmux).
set -u
S=mlxtoy-tui
OUT=${OUT:-/tmp/mlxtoy-tui-tmux}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p $OUT
rm -rf $OUT/runs $OUT/latency.json $OUT/*.txt
tmux kill-session -t $S 2>/dev/null
tmux new-session -d -s $S -x 100 -y 32 \
  "cd $ROOT && PATH=${MLXTOY_BIN:-$ROOT/.venv/bin}:\$PATH mlxtoy tui ${TUI_ARGS:---data assets/demo} --runs $OUT/runs --latency-log $OUT/latency.json; echo EXIT=\$?; sleep 600"
cap() { tmux capture-pane -p -t $S > $OUT/$1.txt; echo "== $1 =="; }
sleep 8; cap 01-setup
# focus is on "steps": replace values field by field (ctrl+u clears an input, tab moves on)
# Tab selects the next field's text, so typing replaces it. Keys are sent with pauses: Textual
# runs a binding (Tab) only after the key bubbles up, so characters typed right behind it could
# land in the previous field on a busy machine.
keys() { tmux send-keys -t $S -l "$1"; sleep 0.6; tmux send-keys -t $S Tab; sleep 0.6; }
keys 16      # steps
keys 4       # batch size
keys 128     # seq len
keys 2e-4    # lr
keys 8       # lora rank
keys 16      # lora alpha
keys q,v     # lora targets
keys 4       # eval every
keys 2       # eval batches
keys 0       # save every
keys 6       # sample every
keys 2       # taps every
sleep 1; cap 02-setup-filled
if grep -q "✗" $OUT/02-setup-filled.txt; then echo "setup has errors"; cat $OUT/02-setup-filled.txt; tmux kill-session -t $S; exit 1; fi
tmux send-keys -t $S C-s
sleep 5; cap 03-starting
# wait for 4 steps
for i in $(seq 1 120); do
  tmux capture-pane -p -t $S | grep -qE "step ([4-9]|1[0-6])/16" && break; sleep 5
done
cap 04-training
tmux send-keys -t $S p; sleep 1; cap 05-pause-requested
for i in $(seq 1 60); do tmux capture-pane -p -t $S | grep -q "paused at step" && break; sleep 2; done
cap 06-paused
# talk to the paused weights: Chat loads the checkpoint written at the pause
tmux send-keys -t $S F3; sleep 2
tmux send-keys -t $S C-l
for i in $(seq 1 60); do tmux capture-pane -p -t $S | grep -q "✓" && break; sleep 2; done
tmux send-keys -t $S -l "Write the date 2003-04-05 as day, month name and year."; sleep 0.5
tmux send-keys -t $S Enter
for i in $(seq 1 60); do tmux capture-pane -p -t $S | grep -q "tokens/s" && break; sleep 2; done
cap 06b-chat
tmux send-keys -t $S F2; sleep 1
tmux send-keys -t $S g; sleep 0.5
tmux send-keys -t $S p; sleep 1; cap 07-resumed
for i in $(seq 1 120); do
  tmux capture-pane -p -t $S | grep -qE "step (1[0-6])/16" && break; sleep 5
done
cap 08-more-steps
tmux send-keys -t $S q; sleep 2; cap 09-quitting
for i in $(seq 1 120); do tmux capture-pane -p -t $S | grep -q "EXIT=" && break; sleep 2; done
cap 10-exited
tmux kill-session -t $S
