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
#
#   BUDGET=400 bash pallas_kernels/bench/accelerator_session.sh kernels forward_random forward e2e
#   SMOKE=1 bash pallas_kernels/bench/accelerator_session.sh kernels forward_random forward e2e   # tiny, on a CPU
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
PROMPTS=${PROMPTS:-.dev/prompts}
mkdir -p "$WORK"
export PYTHONUNBUFFERED=1 JAX_DEFAULT_MATMUL_PRECISION=highest XLA_PYTHON_CLIENT_PREALLOCATE=false
if [ "$SMOKE" = 1 ]; then export JAX_PLATFORMS=cpu; else export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}; fi
GGUF=${GGUF:-smollm2-135m}
BUDGET=${BUDGET:-86400}
START=$(date +%s)

stage() {                     # stage NAME SECONDS COMMAND...: its output in $OUT/r/NAME.txt, the tail printed
    local name=$1 limit=$2 left
    shift 2
    mkdir -p "$WORK"
    left=$((BUDGET - ($(date +%s) - START) - 15))
    if [ "$left" -lt 20 ]; then echo "== $name: skipped (${left}s left)"; return; fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name: start $(date +%T), limit ${limit}s"
    timeout -k 5 "$limit" "$@" > "$WORK/$name.txt" 2>&1
    echo "== $name: exit $? at $(date +%T)"
    tail -n "${TAIL:-25}" "$WORK/$name.txt"
    tar -czf "$OUT/$PART.tgz" -C "$WORK" .
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
    # EAGLE-3 is the trained drafter taken along: the best of the shipped ones on held-out ShareGPT on a CPU (a
    # call carries 64 MiB: the GGUF in two parts, EAGLE-3's 20 MB beside one of them, no room for DFlash's 27 MB).
    # On an H200 one experiments.speedup group took over 100 s (compiling the 30-layer loops and the cost
    # programs of the prediction, not decoding: plain decoding ran at ~600 tok/s), hence the limits.
    local common=(--target="$GGUF" --num_prompts=3 --max_new_tokens=96 --rounds=2)
    local eagle3="drafter=smollm2-135m-eagle3:stop_at_eos=true" sharegpt="$PROMPTS/sharegpt.json"
    if [ "$SMOKE" = 1 ]; then
        stage e2e_chain 900 python -m experiments.speedup --target="$GGUF" --num_prompts=1 --max_new_tokens=8 \
            --runs="$sharegpt:ngram:4:stop_at_eos=true,$sharegpt:eagle3:3:$eagle3:implementation=pallas" \
            --out="$WORK/e2e_chain"
        return
    fi
    # Batch 1, XLA attention: the demo's rows (EAGLE-3 and prompt lookup on ShareGPT; lookup and suffix grounded).
    stage e2e_chain 240 python -m experiments.speedup "${common[@]}" \
        --runs="$sharegpt:eagle3:3:$eagle3,$sharegpt:ngram:4:stop_at_eos=true" --out="$WORK/e2e_chain"
    # The Pallas verify kernel in the loop (plain decoding and EAGLE-3 both on it), then batch 8.
    stage e2e_pallas 180 python -m experiments.speedup "${common[@]}" \
        --runs="$sharegpt:eagle3:3:$eagle3:implementation=pallas" --out="$WORK/e2e_pallas"
    stage e2e_batch8 200 python -m experiments.speedup --target="$GGUF" --num_prompts=8 --max_new_tokens=64 \
        --rounds=2 --batch_sizes=8 --runs="$sharegpt:eagle3:3:drafter=smollm2-135m-eagle3,$sharegpt:ngram:4" \
        --out="$WORK/e2e_batch8"
    stage e2e_grounded 200 python -m experiments.speedup "${common[@]}" \
        --runs="$PROMPTS/grounded.json:ngram:4:stop_at_eos=true,$PROMPTS/grounded.json:suffix:8:stop_at_eos=true" \
        --out="$WORK/e2e_grounded"
}

for PART in "$@"; do
    case $PART in
        kernels|tiles|forward_random|forward|e2e) "$PART" ;;
        *) echo "unknown part $PART (kernels | tiles | forward_random | forward | e2e)"; exit 2 ;;
    esac
done
