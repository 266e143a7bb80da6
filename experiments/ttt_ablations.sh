#!/bin/bash
# EAGLE-3's training-time test on the toy target, one change per row: teacher forcing only, 4 and 7 unrolled steps,
# equal step weights, and the post-norm output fed back (EAGLE-3.1's norm_output). Same self-distilled rows, seed,
# steps and held-out rows for all; each row's MANIFEST (runs/ttt_ablations/<row>/MANIFEST.md) holds its held-out
# chain. About 5-10 minutes a row on 2 CPU cores; a finished row is skipped, an interrupted one resumes.
#   bash experiments/ttt_ablations.sh
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/ttt_ablations}
mkdir -p "$OUT"
common="--kind=eagle3 --num_train=6144 --steps=200 --eval_every=100 --eval_steps=4 --save_every=50 --log_every=20"
row() {
  name=$1; shift
  [ -f "$OUT/$name/MANIFEST.md" ] && return
  $PY -m train.eagle $common "$@" --ckpt_dir="$OUT/ckpt_$name" --out="$OUT/$name" > "$OUT/$name.log" 2>&1 \
    || { echo "$name failed: see $OUT/$name.log"; exit 1; }
}
row ttt1 --ttt_steps=1
row ttt4 --ttt_steps=4
row ttt7 --ttt_steps=7
row ttt4_flat --ttt_steps=4 --step_decay=1.0
row ttt4_normout --ttt_steps=4 --norm_output
echo "rows in $OUT/*/MANIFEST.md"
