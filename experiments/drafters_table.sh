#!/bin/bash
# The drafter table: every shipped drafter and the training-free ones on the toy target (stdlib-target; SmolLM2's
# drafters are make demo's, python -m experiments.speedup), in ONE run of experiments.speedup (HumanEval + stdlib
# continuations, T=0 and T=1; humaneval2x = each HumanEval prompt answered twice, for suffix decoding). About 7
# minutes on 2 CPU cores, plus 4 the first time (the EAGLE-3 vocabularies' self-distilled counts); EXTRA=",row,..."
# appends rows. The results page's table beside the papers is the quick subset: QUICK=1 TEMPS=0 SETS=humaneval (every
# drafter, T=0, HumanEval).
#   bash experiments/drafters_table.sh [--out=runs/drafters_table]   (writes runs/drafters_table.csv/.json/_*.png)
#
# TARGET=smollm2-135m: the real target's table instead: every method on held-out ShareGPT, HumanEval chat and the
# input-grounded set at T=0 (T=1 on the two open-chat sets: chains and the training-free drafters), batch 1, make
# demo's 3 prompts x 96 tokens per set; then a batch-8 sweep of the chains on ShareGPT. About 21 + 9 minutes.
#   TARGET=smollm2-135m bash experiments/drafters_table.sh   (writes runs/drafters_table_smollm2*.csv/.json/.png)
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
if [ "${TARGET:-stdlib-target}" = smollm2-135m ]; then
  S=stop_at_eos=true
  E3=drafter=smollm2-135m-eagle3; DF=drafter=smollm2-135m-dflash; MD=drafter=smollm2-135m-medusa
  LS=drafter=smollm2-135m-layerskip
  R=""
  for T in 0 1; do
    for P in sharegpt humaneval_chat grounded; do
      [ "$T$P" = 1grounded ] && continue
      R="$R,$P:ngram:4:$S:temperature=$T:label=ngram"
      R="$R,$P:suffix:8:$S:temperature=$T:label=suffix-k8"
      R="$R,$P:eagle3:3:$E3:$S:temperature=$T:label=eagle3-chain"
      R="$R,$P:dflash:3:$DF:$S:temperature=$T:label=dflash-chain"
      R="$R,$P:medusa:3:$MD:$S:temperature=$T:label=medusa1-chain"
      R="$R,$P:layer_skip:1:$LS:$S:temperature=$T:label=layer-skip"
      if [ "$T" = 0 ]; then
        R="$R,$P:eagle3:8:dyn4x2:$E3:$S:label=eagle3-dyn4x2-8"
        R="$R,$P:eagle3:3:drafter=smollm2-135m-eagle31:$S:label=eagle3.1-chain"
        R="$R,$P:dflash:8:dyn4x2:$DF:$S:label=dflash-dyn4x2-8"
        R="$R,$P:medusa:8:acc:$MD:$S:label=medusa1-tree8"
        R="$R,$P:lookahead:8:window_size=2:ngram_size=3:guess_set_size=2:$S:label=lookahead-W2N3G2"
      fi
    done
  done
  $PY -m experiments.speedup --target=smollm2-135m --runs="${R#,}$EXTRA" --out=runs/drafters_table_smollm2 "$@" || exit 1
  B="sharegpt:ngram:4,sharegpt:eagle3:3:$E3,sharegpt:dflash:3:$DF,sharegpt:medusa:3:$MD,sharegpt:layer_skip:1:$LS"
  exec $PY -m experiments.speedup --target=smollm2-135m --batch_sizes=8 --runs="$B" --num_prompts=8 \
    --max_new_tokens=64 --rounds=2 --out=runs/drafters_table_smollm2_batch "$@"
fi
# EAGLE-3 draft vocabularies cut from the shipped drafter (written under runs/, gitignored).
[ -n "$QUICK" ] || [ -d runs/eagle3_vocab/N256 ] || $PY -m experiments.eagle_vocab --sizes=256,512,1024 --num_train=6144
M2=target=stdlib-target-medusa2:drafter=checkpoints/stdlib-target-medusa2/medusa_heads
R=""
for T in ${TEMPS:-0 1}; do
  for P in ${SETS:-humaneval stdlib}; do
    R="$R,$P:draft_model:4:temperature=$T:label=draft_model-chain"
    R="$R,$P:ngram:4:temperature=$T:label=ngram"
    [ "$T$P" != 1stdlib ] && R="$R,$P:medusa:4:temperature=$T:label=medusa1-chain"
    R="$R,$P:medusa:16:acc:temperature=$T:label=medusa1-tree16"
    R="$R,$P:medusa:16:acc:$M2:temperature=$T:label=medusa2-tree16"
    R="$R,$P:eagle:4:temperature=$T:label=eagle1-chain"
    [ "$T$P" != 1stdlib ] && R="$R,$P:eagle:16:static:temperature=$T:label=eagle1-tree16"
    R="$R,$P:eagle:16:dyn4x4:temperature=$T:label=eagle2-dyn4x4-16"
    [ "$T$P" != 1stdlib ] && R="$R,$P:eagle3:4:temperature=$T:label=eagle3-chain"
    R="$R,$P:eagle3:16:dyn4x4:temperature=$T:label=eagle3-dyn4x4-16"
    # Multi-token drafters: MTP modules (D = 2, and k = 4 reusing module 2), the multi-token target's own heads
    # (its own plain baseline), the parallel drafter (one draft forward per step).
    R="$R,$P:mtp:1:temperature=$T:label=mtp-k1"
    R="$R,$P:mtp:2:temperature=$T:label=mtp-D2"
    R="$R,$P:mtp:4:reuse_last_module=true:temperature=$T:label=mtp-D2-reuse-k4"
    R="$R,$P:mtp_heads:3:target=stdlib-target-mtp4:drafter=stdlib-target-mtp4:temperature=$T:label=mtp4-self"
    R="$R,$P:pard:4:temperature=$T:label=pard-k4"
  done
done
if [ -z "$QUICK" ]; then
  R="$R,humaneval:medusa:16:acc:temperature=1:acceptance_method=typical_lossy:label=medusa1-tree16-TYPICAL-LOSSY"
  R="$R,humaneval:medusa:16:acc:$M2:temperature=1:acceptance_method=typical_lossy:label=medusa2-tree16-TYPICAL-LOSSY"
  # Training-free drafters beside ngram.
  R="$R,humaneval2x:ngram:4:label=ngram"
  for P in humaneval stdlib humaneval2x; do
    R="$R,$P:suffix:8:drafter=suffix-$P:label=suffix-k8"
    R="$R,$P:lookahead:16:window_size=4:ngram_size=3:guess_set_size=4:label=lookahead-W4N3G4"
  done
  R="$R,humaneval:lookahead:8:window_size=2:ngram_size=3:guess_set_size=2:label=lookahead-W2N3G2"
  R="$R,humaneval:lookahead:12:window_size=3:ngram_size=4:guess_set_size=1:label=lookahead-W3N4G1"
  for N in 1024 512 256; do R="$R,humaneval:eagle3:4:drafter=runs/eagle3_vocab/N$N:label=eagle3-chain-N$N"; done
else
  R="$R,humaneval:suffix:8:drafter=suffix-humaneval:label=suffix-k8"
  R="$R,humaneval:lookahead:16:window_size=4:ngram_size=3:guess_set_size=4:label=lookahead-W4N3G4"
fi
R="$R$EXTRA"
$PY -m experiments.speedup --target=stdlib-target --num_prompts=8 --max_new_tokens=128 \
  --drafters=draft_model=stdlib-draft,medusa=stdlib-target-medusa,eagle=stdlib-target-eagle,eagle3=stdlib-target-eagle3,mtp=stdlib-target-mtp,pard=stdlib-draft-pard \
  --runs="${R#,}" --out=runs/drafters_table "$@"
