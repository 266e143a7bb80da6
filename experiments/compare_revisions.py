"""Did a change alter the decode loop? Compare the compiled programs and their speed at two revisions, in one run.

  python -m experiments.compare_revisions --base=HEAD~1                # the working tree vs a commit
  python -m experiments.compare_revisions --base=main --methods=none,draft_model --rounds=6

For each revision a worker process (that revision's code, in a temporary git worktree; the working tree as it
is) compiles generate()'s loop for each method on the shipped models and reports the optimized HLO (instruction
count, a hash with source metadata stripped, XLA's flop and byte estimates). Then the workers are timed in
alternation, round by round, so drift in the machine's speed hits both alike; tokens/s per method is the median
over rounds.
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import hashlib
import json
import re
import subprocess
import sys

from absl import app, flags

from experiments.revisions import REPO, revision_checkout

FLAGS = flags.FLAGS
flags.DEFINE_string("base", "HEAD", "git revision to compare the working tree against")
flags.DEFINE_list("methods", ["none", "draft_model", "ngram"], "methods to compile and time (k = 4)")
flags.DEFINE_integer("rounds", 5, "alternating timing rounds")
flags.DEFINE_integer("max_new_tokens", 128, "tokens per prompt")
flags.DEFINE_integer("batch", 1, "prompts per generate() call")


WORKER = r'''
import hashlib, json, re, sys, time
import jax, numpy as np
import specjax
from specjax import SpecConfig
from specjax.drafters.registry import BuildRequest, build as build_drafter
from specjax.decode import decode_loop
methods, max_new, batch = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3])
target = specjax.load_model("stdlib-target")
draft = specjax.load_model("stdlib-draft")
prompts = ["def fibonacci(n):\n    ", "import os\n\ndef walk(path):\n", "class Stack:\n    def push(self, x):"]
prompts = (prompts * batch)[:batch]
def config(m):
    if m == "none":
        return SpecConfig(max_new_tokens=max_new, stop_at_eos=False)
    return SpecConfig(method=m, num_speculative_tokens=4, max_new_tokens=max_new, stop_at_eos=False)
arg = {"draft_model": draft}
report = {}
for m in methods:
    cfg = config(m)
    ids = [target.tokenize(p) for p in prompts]
    P, buf = 64, 64 + max_new + 4 + 1 + 63 & ~63
    arr = np.zeros((batch, P), np.int32)
    for i, r in enumerate(ids):
        arr[i, :len(r)] = r
    d, dp = build_drafter(BuildRequest(cfg, target, arg.get(m), ids, buf))
    keys = jax.random.split(jax.random.PRNGKey(0), batch)
    lowered = decode.lower(target.params, dp, arr, np.array([len(r) for r in ids], np.int32), keys,
                           np.int32(-1), cfg=target.config, drafter=d, spec=cfg, buffer_len=buf)
    text = lowered.compile().as_text()
    stripped = re.sub(r", metadata=\{[^}]*\}", "", text)
    ops = sum(1 for line in stripped.splitlines() if " = " in line and not line.lstrip().startswith("//"))
    cost = lowered.compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    report[m] = {"hlo_instructions": ops, "hlo_sha256": hashlib.sha256(stripped.encode()).hexdigest()[:16],
                 "flops": float(cost.get("flops", -1)), "bytes_accessed": float(cost.get("bytes accessed", -1))}
    specjax.generate(target, prompts, cfg, drafter=arg.get(m), pad_to=P)       # compile
print("READY " + json.dumps(report), flush=True)
for line in sys.stdin:
    out = {}
    for m in methods:
        r = specjax.generate(target, prompts, config(m), drafter=arg.get(m), pad_to=64)
        out[m] = r.stats["generated_tokens"] / r.stats["wall_s"]
    print("TIMES " + json.dumps(out), flush=True)
'''


def start(code_dir: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=code_dir, JAX_PLATFORMS="cpu")
    return subprocess.Popen([sys.executable, "-c", WORKER, ",".join(FLAGS.methods), str(FLAGS.max_new_tokens),
                             str(FLAGS.batch)], cwd=code_dir, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def read(proc: subprocess.Popen, tag: str) -> dict:
    for line in proc.stdout:
        if line.startswith(tag + " "):
            return json.loads(line[len(tag) + 1:])
    raise RuntimeError(f"worker exited (code {proc.wait()}) before printing {tag}")


def main(argv):
    del argv
    with revision_checkout(FLAGS.base) as base_dir:
        sides = {"base": start(base_dir), "new": start(REPO)}
        hlo = {name: read(p, "READY") for name, p in sides.items()}
        times = {name: {m: [] for m in FLAGS.methods} for name in sides}
        for r in range(FLAGS.rounds):
            for name, p in sides.items():
                p.stdin.write("run\n")
                p.stdin.flush()
                for m, v in read(p, "TIMES").items():
                    times[name][m].append(v)
            print(f"round {r + 1}/{FLAGS.rounds} done", flush=True)
        for p in sides.values():
            p.stdin.close()
            p.wait()
    median = lambda xs: sorted(xs)[len(xs) // 2]
    print(f"\nbase = {FLAGS.base}, new = working tree; batch {FLAGS.batch}, {FLAGS.max_new_tokens} new tokens, "
          f"k = 4, median of {FLAGS.rounds} alternating rounds")
    print(f"{'method':>12} {'side':>5} {'HLO instr':>9} {'HLO sha256 (no metadata)':>24} {'GFLOP':>8} "
          f"{'MB accessed':>11} {'tok/s':>8} {'new/base':>8}")
    for m in FLAGS.methods:
        for name in ("base", "new"):
            h = hlo[name][m]
            tps = median(times[name][m])
            ratio = tps / median(times["base"][m])
            print(f"{m:>12} {name:>5} {h['hlo_instructions']:>9} {h['hlo_sha256']:>24} {h['flops'] / 1e9:8.3f} "
                  f"{h['bytes_accessed'] / 1e6:11.1f} {tps:8.1f} {ratio:7.3f}x")


if __name__ == "__main__":
    app.run(main)
