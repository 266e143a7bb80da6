"""Throughput of plain vs speculative decoding as the batch grows, measured side by side, with the prediction from
costs measured at that batch size.

  python -m experiments.batch_scaling --batch_sizes=1,8,32,64 \
      --runs=humaneval:draft_model:4,humaneval:ngram:4 --max_new_tokens=128

Takes experiment.speedup's flags (--runs entries prompt_set:method:k[:tree][:key=value], --drafters,
--max_new_tokens, --temperature, ...). For each batch size B the first B prompts of the set are decoded as ONE
batch by plain decoding and by each run, timed in alternation (--rounds rounds, the fastest of each), EOS
ignored so every row generates max_new_tokens. Columns: tokens/s of plain and speculative decoding, their ratio,
alpha, tau, and the predicted ratio from costs measured at batch B and the run's buffer (experiments.costs: the
prefills, one target forward over 1 and over k + 1 positions, one proposal): for the whole call (prefills
included, as timed) and for the loop alone (tau / (c_step + verify_cost)). A gap between measured and predicted is
the loop's overhead at that batch size. Speculation loses throughput once the verify
pass stops being memory-bound (the EAGLE-3 paper's batch table shows it on GPUs); on this CPU that comes early.
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json
import time

import numpy as np
from absl import app, flags

import specjax
from specjax import analysis
from specjax.api import make_drafter
from specjax.drafters import registry
from experiments import costs, speedup
from experiments.prompts import load_prompt_set

FLAGS = flags.FLAGS
flags.DEFINE_list("batch_sizes", ["1", "8", "32", "64"], "batch sizes")
flags.DEFINE_integer("rounds", 3, "alternating timing rounds per batch size (the fastest of each is kept)")
flags.DEFINE_string("table_out", "runs/batch_scaling.json", "where the table is written as JSON")


def timed_generate(target, ids: list[list[int]], config, drafter) -> tuple[float, dict, list]:
    # Padded to the longest prompt, not generate()'s power-of-two bucket: at batch 64 the bucket would make every
    # row's attention read a 60% longer buffer. One compile per batch size either way.
    t0 = time.perf_counter()
    res = specjax.generate(target, ids, config, drafter=drafter, pad_to=max(map(len, ids)))
    return time.perf_counter() - t0, res.stats, res.tokens


def main(argv):
    del argv
    batch_sizes = [int(b) for b in FLAGS.batch_sizes]
    target = specjax.load_model(FLAGS.target)
    runs = [speedup.parse_run(entry) for entry in FLAGS.runs]
    records = []
    for B in batch_sizes:
        for run in runs:
            pset, method, k, tree = run["pset"], run["method"], run["k"], run["tree"]
            prompts = load_prompt_set(pset, B, target.tokenizer)
            if len(prompts) < B:
                raise ValueError(f"prompt set {pset!r} has {len(prompts)} prompts, fewer than batch size {B}")
            ids = [target.encode(p) if isinstance(p, str) else list(p) for p in prompts]     # tokenized once
            sampling = {f: v for f, v in run["overrides"].items() if f in ("temperature", "top_k", "top_p")}
            plain_config = speedup.spec_config("none", None, **sampling)
            _, _, plain_out = timed_generate(target, ids, plain_config, None)              # compile
            drafter = speedup.drafter_argument(target, method, plain_out, run["drafter"])
            artifact = run["drafter"] or dict(e.split("=", 1) for e in FLAGS.drafters).get(method)
            config = speedup.spec_config(method, k, tree, artifact, **run["overrides"])
            k = config.k
            _, stats, spec_out = timed_generate(target, ids, config, drafter)               # compile
            plain_s = spec_s = float("inf")
            for _ in range(FLAGS.rounds):
                plain_s = min(plain_s, timed_generate(target, ids, plain_config, None)[0])
                spec_s = min(spec_s, timed_generate(target, ids, config, drafter)[0])
            # Costs at this batch size, at a typical context: mean prompt length + half the generation.
            context = int(np.mean([len(r) for r in ids])) + FLAGS.max_new_tokens // 2
            buf = stats["buffer_len"]
            t1 = costs.forward_seconds(target, context, 1, batch=B, cache_size=buf)
            tv = costs.forward_seconds(target, context, k + 1, batch=B, cache_size=buf)
            d_obj, d_params = make_drafter(target, config, drafter, ids, max(buf, context + 2 * k + 8))
            if registry.get(method).per_request_params:
                tp = float("nan")              # predictions per request: proposing is a table lookup
            else:
                tp = costs.propose_seconds(d_obj, d_params, target, context, config.sampling, batch=B,
                                           cache_size=buf)
            draft_cost = 0.0 if np.isnan(tp) else tp / t1
            steady = analysis.speedup_from_tau(stats["tau"], draft_cost, tv / t1)
            # The whole call, as timed: both pay the target's prefill (padded to the longest prompt), speculation
            # also its drafter's; then N - 1 tokens at 1 per plain step or tau per draft + verify step.
            longest = max(len(r) for r in ids)
            t_pre = costs.forward_seconds(target, 0, longest, batch=B, cache_size=buf, reps=3, inner=2)
            t_dpre = costs.init_seconds(d_obj, d_params, target, longest, config.sampling, batch=B, cache_size=buf,
                                        reps=3, inner=2)
            steps = FLAGS.max_new_tokens - 1
            predicted = (t_pre + steps * t1) / (t_pre + t_dpre + steps / stats["tau"] * (draft_cost * t1 + tv))
            n = B * FLAGS.max_new_tokens
            exact = ("yes" if spec_out == plain_out else "no") if plain_config.sampling.greedy else "n/a"
            rec = dict(batch=B, prompts=pset, method=run["label"] or method + (f"/{tree}" if tree else ""), k=k,
                       plain_tokens_per_s=n / plain_s, tokens_per_s=n / spec_s, speedup=plain_s / spec_s,
                       predicted=predicted, predicted_steady=steady, prefill_share=t_pre / (t_pre + steps * t1),
                       alpha=stats["alpha"], tau=stats["tau"],
                       c_step=draft_cost, verify_cost=tv / t1, forward_ms=t1 * 1e3, buffer=buf, exact=exact)
            records.append(rec)
            print(f"batch {B:>3} {rec['method']:>14} k={k}: plain {rec['plain_tokens_per_s']:7.0f} tok/s, spec "
                  f"{rec['tokens_per_s']:7.0f} ({rec['speedup']:.2f}x, predicted {predicted:.2f}x, loop alone "
                  f"{steady:.2f}x; prefill {rec['prefill_share']:.0%} of plain), "
                  f"alpha {rec['alpha']:.3f} tau {rec['tau']:.2f} c_step {draft_cost:.2f} "
                  f"verify {tv / t1:.2f}", flush=True)

    print(f"\n{FLAGS.target}, float32, CPU, {FLAGS.max_new_tokens} new tokens per row, EOS ignored; one generate() "
          f"call per batch; fastest of {FLAGS.rounds} alternating rounds")
    print(f"| batch | method | k | plain tok/s | spec tok/s | speedup | predicted | loop alone | prefill share | "
          f"alpha | tau | c_step | verify cost | exact |")
    print("| " + " | ".join(["---"] * 14) + " |")
    for r in records:
        print(f"| {r['batch']} | {r['method']} | {r['k']} | {r['plain_tokens_per_s']:.0f} | {r['tokens_per_s']:.0f} "
              f"| {r['speedup']:.2f}x | {r['predicted']:.2f}x | {r['predicted_steady']:.2f}x | "
              f"{r['prefill_share']:.0%} | {r['alpha']:.3f} | {r['tau']:.2f} | {r['c_step']:.2f} | "
              f"{r['verify_cost']:.2f} | {r['exact']} |")
    if FLAGS.table_out:
        os.makedirs(os.path.dirname(FLAGS.table_out) or ".", exist_ok=True)
        with open(FLAGS.table_out, "w") as f:
            json.dump({"flags": {"batch_sizes": batch_sizes, "runs": FLAGS.runs, "target": FLAGS.target,
                                 "max_new_tokens": FLAGS.max_new_tokens, "rounds": FLAGS.rounds},
                       "rows": records}, f, indent=1)
        print(f"wrote {FLAGS.table_out}")


if __name__ == "__main__":
    app.run(main)
