"""What the prefill costs a batch, before and after the prefill in length groups and the finer prompt bucket, timed
side by side in one run.

  python -m experiments.prefill_cost --batch_sizes=1,8,32,64 --rounds=4

Plain greedy decoding of the first B HumanEval prompts as one batch (EOS ignored, --max_new_tokens each) with
three settings of generate(), timed in alternation (the fastest of --rounds rounds each):
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

import time

from absl import app, flags

import specjax
from specjax import SpecConfig
from specjax.inputs import plan_prefill, prompt_bucket
from specjax.decode import round_up
from experiments.prompts import humaneval_prompts
from experiments.tables import text_table, write_table

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "stdlib-target", "target (shipped name or HF directory)")
flags.DEFINE_list("batch_sizes", ["1", "8", "32", "64"], "batch sizes")
flags.DEFINE_integer("max_new_tokens", 128, "tokens per prompt")
flags.DEFINE_integer("rounds", 4, "alternating timing rounds (the fastest of each setting is kept)")
flags.DEFINE_string("table_out", "runs/prefill_cost", "path stem of the table (.csv, .json)")


def settings(ids: list[list[int]], max_new: int) -> dict:
    """name -> (generate() keyword arguments, config fields), the three settings of the module docstring."""
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
        calls, outputs, stats = {}, {}, {}
        for name, (kwargs, fields) in settings(ids, FLAGS.max_new_tokens).items():
            for n in (FLAGS.max_new_tokens, 1):
                # n = 1: the same buffer as the whole call, so the prefill's cost at the same shapes
                cfg = SpecConfig(max_new_tokens=n, stop_at_eos=False, **fields) if n > 1 else \
                    SpecConfig(max_new_tokens=1, stop_at_eos=False, max_cache_len=stats[name]["buffer_len"])
                calls[name, n] = lambda cfg=cfg, kwargs=kwargs: specjax.generate(target, ids, cfg, **kwargs)
                res = calls[name, n]()                                  # compile
                if n > 1:
                    outputs[name], stats[name] = res.tokens, res.stats
        exact = all(out == outputs["before"] for out in outputs.values())
        best = {key: float("inf") for key in calls}
        for _ in range(FLAGS.rounds):
            for key, call in calls.items():
                t0 = time.perf_counter()
                call()
                best[key] = min(best[key], time.perf_counter() - t0)
        lengths = [len(r) for r in ids]
        for name, (kwargs, fields) in settings(ids, FLAGS.max_new_tokens).items():
            width = kwargs.get("pad_to") or prompt_bucket(max(lengths))
            _, groups = plan_prefill(lengths, width, kwargs.get("prefill_groups", 4))
            whole, prefill = best[name, FLAGS.max_new_tokens], best[name, 1]
            rows.append({"batch": B, "setting": name, "buffer": stats[name]["buffer_len"],
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
