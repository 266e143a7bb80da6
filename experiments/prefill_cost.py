"""What the prefill costs a batch, before and after the prefill in length groups and the finer prompt bucket, timed
side by side in one run.

  python -m experiments.prefill_cost --batch_sizes=1,8,32,64 --rounds=4

Plain greedy decoding of the first B HumanEval prompts as one batch (EOS ignored, --max_new_tokens each) with
three settings of generate(), each prepared once (specjax.api.prepare) and its run timed in alternation
(experiments.costs.fastest_alternating: the fastest of --rounds rounds each):
- before: the previous defaults: every prompt padded to the power-of-two bucket of the longest, one prefill, a
  buffer rounded up to 64 slots (SpecConfig.max_cache_len sets it). Its prefill attends over its own width as all
  three do now, not over the whole buffer as it did, so this understates the change;
- one group: prefill_groups=1: the new bucket (a quarter octave) and buffer, still one prefill;
- grouped: the default: rows taken in prompt-length order and cut into at most 4 groups (plan_prefill), each
  prefilled at its own width.
Each setting is also timed with max_new_tokens=1 at the same buffer: that call is the prefill and one token; the
rest of the whole call, over the remaining max_new_tokens - 1 steps, is the loop step. Every setting's tokens must
equal the others'.
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import app, flags

import specjax
from specjax import SpecConfig, api
from specjax.planning import round_up
from experiments import costs
from experiments.prompts import humaneval_prompts
from experiments.tables import text_table, write_table

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "stdlib-target", "target (shipped name or HF directory)")
flags.DEFINE_list("batch_sizes", ["1", "8", "32", "64"], "batch sizes")
flags.DEFINE_integer("max_new_tokens", 128, "tokens per prompt")
flags.DEFINE_integer("rounds", 4, "alternating timing rounds (the fastest of each setting is kept)")
flags.DEFINE_string("table_out", "runs/prefill_cost/prefill_cost", "path stem of the table (.csv, .json)")


def settings(ids: list[list[int]], max_new: int) -> dict:
    """name -> (prepare() keyword arguments, config fields), the three settings of the module docstring."""
    longest = max(map(len, ids))
    pow2 = max(16, 1 << (longest - 1).bit_length())
    before = dict(max_cache_len=round_up(pow2 + max_new + 1, 64))
    return {"before": (dict(pad_to=pow2, prefill_groups=1), before),
            "one group": (dict(prefill_groups=1), {}),
            "grouped": ({}, {})}


def main(argv):
    del argv
    target = specjax.load_model(FLAGS.model)
    rows = []
    for B in map(int, FLAGS.batch_sizes):
        ids = [target.tokenize(t) for t in humaneval_prompts(B)]
        prepared = {}
        for name, (kwargs, fields) in settings(ids, FLAGS.max_new_tokens).items():
            whole = api.prepare(target, ids, SpecConfig(max_new_tokens=FLAGS.max_new_tokens, stop_at_eos=False,
                                                        **fields), **kwargs)
            # max_new_tokens = 1 at the same buffer as the whole call: the prefill's cost at the same shapes
            prefill = api.prepare(target, ids, SpecConfig(max_new_tokens=1, stop_at_eos=False,
                                                          max_cache_len=whole.buffer_len), **kwargs)
            prepared[name, FLAGS.max_new_tokens], prepared[name, 1] = whole, prefill
        best, results = costs.fastest_alternating({key: (lambda p=p: api.run(p)) for key, p in prepared.items()},
                                                  FLAGS.rounds)
        outputs = {name: results[name, FLAGS.max_new_tokens].tokens for name in settings(ids, FLAGS.max_new_tokens)}
        exact = all(out == outputs["before"] for out in outputs.values())
        lengths = [len(r) for r in ids]
        for name in settings(ids, FLAGS.max_new_tokens):
            groups = prepared[name, FLAGS.max_new_tokens].prefill_groups
            whole, prefill = best[name, FLAGS.max_new_tokens], best[name, 1]
            rows.append({"batch": B, "setting": name, "buffer": prepared[name, FLAGS.max_new_tokens].buffer_len,
                         "groups": " ".join(f"{r}x{w}" for r, w in groups),
                         "padded_prompt_tokens": sum(r * w for r, w in groups), "prompt_tokens": sum(lengths),
                         "prefill_ms": 1e3 * prefill, "call_ms": 1e3 * whole,
                         "step_ms": 1e3 * (whole - prefill) / max(FLAGS.max_new_tokens - 1, 1),
                         "prefill_share": prefill / whole, "tok_s": B * FLAGS.max_new_tokens / whole,
                         "exact": exact})
        print(f"batch {B} done", flush=True)
    header = ["batch", "setting", "buffer", "groups", "padded / real prompt tokens", "prefill ms", "step ms",
              "call ms", "prefill share", "tok/s", "exact"]
    print(text_table(header, [[r["batch"], r["setting"], r["buffer"], r["groups"],
                               f"{r['padded_prompt_tokens']} / {r['prompt_tokens']}", f"{r['prefill_ms']:.1f}",
                               f"{r['step_ms']:.2f}", f"{r['call_ms']:.0f}", f"{r['prefill_share']:.0%}",
                               f"{r['tok_s']:.0f}",
                               "yes" if r["exact"] else "NO"] for r in rows]))
    write_table(rows, FLAGS.table_out, {"model": FLAGS.model, "max_new_tokens": FLAGS.max_new_tokens,
                                        "rounds": FLAGS.rounds, "prompts": "HumanEval, the first B"})


if __name__ == "__main__":
    app.run(main)
