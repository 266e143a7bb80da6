"""How far a lossy weight format moves a target away from its float32 self, measured on real prompts.

  python -m experiments.weight_format_shift --target=smollm2-135m --weight_format=gguf_int8
  python -m experiments.weight_format_shift --weight_format=gguf --prompt_sets=sharegpt     # the exact one: no shift

Per prompt set: the float32 model's greedy continuation of each prompt (--max_new_tokens, EOS ignored); then, over
prompt + that continuation, both models' next-token distributions at the continuation's positions (one forward
each): how often their argmax agrees, KL(p_float32 || p_format) (mean, and the 99th percentile over positions),
and the continuation's mean negative log-likelihood under each (a format that hurts the model raises its own);
and the format's own greedy continuation: how many rows equal float32's token for token, and where the others
first differ. With --spec_method, the format's greedy continuation decoded speculatively too, against its own plain
one: equal on every format where the CPU kernels fix the forward's order (a verify pass computes each row as a
one-position step does); this counts the rows where it is not.
"""
from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import app, flags
import jax.numpy as jnp
import numpy as np

import specjax
from experiments.engines import first_difference
from experiments.prompts import load_prompt_set
from experiments.tables import text_table, write_table
from specjax.inputs import encode_all

FLAGS = flags.FLAGS


def log_probs(model: specjax.Model, ids: list[int]) -> np.ndarray:
    """float64 [len(ids), V]: log p(next | prefix) at every position (one forward, no cache)."""
    logits = np.asarray(model.logits(jnp.asarray([ids], jnp.int32))[0], np.float64)
    return logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)


def compare(reference: specjax.Model, other: specjax.Model, prompts: list, max_new_tokens: int,
            spec_method: str = "") -> dict:
    """One prompt set's row (the module docstring); spec_method "method:k" or ""."""
    config = specjax.SpecConfig(max_new_tokens=max_new_tokens, stop_at_eos=False)
    ids = encode_all(reference, prompts, "prompts")
    ref_out = specjax.generate(reference, ids, config).tokens
    other_out = specjax.generate(other, ids, config).tokens
    spec = {}
    if spec_method:
        method, k = spec_method.split(":")
        spec_out = specjax.generate(other, ids, dataclasses.replace(config, method=method,
                                                                     num_speculative_tokens=int(k))).tokens
        spec_firsts = [first_difference(a, b) for a, b in zip(other_out, spec_out)]
        spec = dict(spec_method=spec_method, spec_identical_rows=spec_firsts.count(None),
                    spec_first_difference_mean=mean_or_none([f for f in spec_firsts if f is not None]))
    agree, kl, nll_ref, nll_other, firsts = [], [], [], [], []
    for prompt, cont, mine in zip(ids, ref_out, other_out):
        seq = prompt + cont
        at = np.arange(len(prompt) - 1, len(seq) - 1)            # positions predicting the continuation
        p, q = log_probs(reference, seq)[at], log_probs(other, seq)[at]
        agree.append(p.argmax(-1) == q.argmax(-1))
        kl.append(np.sum(np.exp(p) * (p - q), axis=-1))
        nll_ref.append(-p[np.arange(len(cont)), cont])
        nll_other.append(-q[np.arange(len(cont)), cont])
        firsts.append(first_difference(cont, mine))
    kl = np.concatenate(kl)
    differing = [f for f in firsts if f is not None]
    return dict(prompts=len(ids), positions=int(kl.size), top1_agreement=float(np.mean(np.concatenate(agree))),
                kl_mean=float(kl.mean()), kl_p99=float(np.quantile(kl, 0.99)),
                nll_float32=float(np.mean(np.concatenate(nll_ref))),
                nll_format=float(np.mean(np.concatenate(nll_other))),
                identical_rows=len(ids) - len(differing), first_difference_mean=mean_or_none(differing), **spec)


def mean_or_none(values: list) -> float | None:
    return float(np.mean(values)) if values else None


def main(_):
    reference = specjax.load_model(FLAGS.target)
    other = specjax.load_model(FLAGS.target, weight_format=FLAGS.weight_format)
    rows = []
    for pset in FLAGS.prompt_sets:
        rows.append(dict(target=FLAGS.target, weight_format=FLAGS.weight_format, prompt_set=pset,
                         max_new_tokens=FLAGS.max_new_tokens,
                         **compare(reference, other, load_prompt_set(pset, FLAGS.num_prompts, reference.tokenizer),
                                   FLAGS.max_new_tokens, FLAGS.spec_method)))
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in rows[-1].items()), flush=True)
    show = lambda v: f"{v:.4g}" if isinstance(v, float) else v
    print(text_table(list(rows[0]), [[show(v) for v in r.values()] for r in rows]))
    write_table(rows, FLAGS.out)


def define_flags() -> None:
    """Defined only when run as a program, so that tests can import this module beside other entry points."""
    flags.DEFINE_string("target", "smollm2-135m", "a GGUF target (load_model(weight_format=) must take it)")
    flags.DEFINE_string("weight_format", "gguf_int8", "the format compared with float32 (load_model's weight_format)")
    flags.DEFINE_list("prompt_sets", ["sharegpt", "humaneval_chat", "grounded"], "prompt sets (experiments.prompts)")
    flags.DEFINE_integer("num_prompts", 16, "prompts per set")
    flags.DEFINE_integer("max_new_tokens", 128, "continuation length")
    flags.DEFINE_string("spec_method", "ngram:4", "method:k decoded speculatively on the format beside its plain "
                        "decoding ('' to skip)")
    flags.DEFINE_string("out", "runs/weight_format_shift/shift", "path stem of the table (.csv, .json)")


if __name__ == "__main__":
    define_flags()
    app.run(main)
