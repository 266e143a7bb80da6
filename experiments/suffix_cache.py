"""Suffix decoding's acceptance as its global cache fills: the same HumanEval prompts answered --passes times, one
at a time, with one fresh cache; prints tau per request (the curve) and per pass, and checks every output is plain
greedy output.

  python -m experiments.suffix_cache --num_prompts=8 --passes=2 --k=8
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import app, flags
import numpy as np

import specjax
from specjax import SpecConfig
from specjax.drafters.suffix import SuffixCache
from experiments.prompts import load_prompt_set
from experiments.tables import write_table

FLAGS = flags.FLAGS
flags.DEFINE_string("target", "stdlib-target", "target model: shipped name or HF directory")
flags.DEFINE_string("prompts", "humaneval", "prompt set")
flags.DEFINE_integer("num_prompts", 8, "distinct prompts")
flags.DEFINE_integer("passes", 2, "times the prompt set is answered")
flags.DEFINE_integer("k", 8, "num_speculative_tokens (tree nodes per step)")
flags.DEFINE_integer("max_new_tokens", 96, "tokens generated per prompt")
flags.DEFINE_string("out", "runs/suffix_cache/suffix_cache", "path stem of the curve's table (.csv, .json; '' = "
                    "nowhere)")


def main(argv):
    del argv
    target = specjax.load_model(FLAGS.target)
    prompts = load_prompt_set(FLAGS.prompts, FLAGS.num_prompts, target.tokenizer)
    pad_to = max(len(target.tokenize(p)) if isinstance(p, str) else len(p) for p in prompts)
    plain_cfg = SpecConfig(max_new_tokens=FLAGS.max_new_tokens, stop_at_eos=False)
    plain = [specjax.generate(target, [p], plain_cfg, pad_to=pad_to).tokens[0] for p in prompts]
    config = SpecConfig(method="suffix", num_speculative_tokens=FLAGS.k, max_new_tokens=FLAGS.max_new_tokens,
                        stop_at_eos=False)
    specjax.generate(target, [prompts[0]], config, drafter=SuffixCache(), pad_to=pad_to)     # compile, untimed
    cache = SuffixCache(name="experiment")
    curve = []
    for rnd in range(FLAGS.passes):
        for i, p in enumerate(prompts):
            r = specjax.generate(target, [p], config, drafter=cache, pad_to=pad_to)
            curve.append(dict(pass_=rnd + 1, prompt=i, tau=r.stats["tau"], alpha=r.stats["alpha"],
                              exact=r.tokens[0] == plain[i], cached_requests=len(cache),
                              cached_tokens=cache.num_tokens, wall_s=r.stats["wall_s"]))
            c = curve[-1]
            print(f"pass {rnd + 1} prompt {i}: tau {c['tau']:.2f} alpha {c['alpha']:.3f} exact {c['exact']} "
                  f"(cache after: {c['cached_requests']} requests, {c['cached_tokens']} tokens)", flush=True)
    for rnd in range(FLAGS.passes):
        taus = [c["tau"] for c in curve if c["pass_"] == rnd + 1]
        print(f"pass {rnd + 1}: mean tau {np.mean(taus):.2f} over {len(taus)} prompts")
    print(f"all outputs equal plain greedy: {all(c['exact'] for c in curve)}")
    if FLAGS.out:
        write_table(curve, FLAGS.out, meta={"target": target.name, "prompts": FLAGS.prompts, "k": FLAGS.k,
                                            "max_new_tokens": FLAGS.max_new_tokens, "passes": FLAGS.passes})


if __name__ == "__main__":
    app.run(main)
