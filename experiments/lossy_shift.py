"""How far a lossy acceptance rule moves the output away from the target's distribution, measured.

  python -m experiments.lossy_shift --drafters=medusa=stdlib-target-medusa --tree=medusa63

Two measurements, each beside the exact speculative sampler (and plain sampling) as the noise floor:
  1. Next-token distributions. For a few contexts c, the exact distribution of the SECOND generated token,
     p2(x) = sum_t1 p(t1 | c) p(x | c, t1), is computed by enumerating t1 over the target's top tokens (covering
     all but --tail_mass of p(t1 | c)); then --samples requests per context are decoded (2 new tokens) with each
     rule, and the total variation and KL(p2 || empirical, add-half smoothed) of the second token are printed.
     (The first token comes from the prefill and is exact under every rule; the second is the first one a
     draft can supply.)
  2. A sequence-level quantity: the mean per-token negative log-likelihood, under the target, of --max_new_tokens
     continuations decoded by each rule from HumanEval prompts (several samples each), with its standard error,
     and tau. The exact rules estimate the target's entropy rate; a rule that over-accepts likely drafts shows a
     lower NLL (less diverse text). No peer reports this.
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import dataclasses

from absl import app, flags
import jax
import numpy as np

import specjax
from specjax import SpecConfig
from specjax.drafters import registry
from specjax.sampling import probabilities
from experiments.harness import tree_fields
from experiments.prompts import load_prompt_set
from experiments.tables import write_table

FLAGS = flags.FLAGS
flags.DEFINE_string("target", "stdlib-target", "target model")
flags.DEFINE_string("method", "medusa", "speculative method whose acceptance rules are compared")
flags.DEFINE_list("drafters", ["medusa=stdlib-target-medusa"], "method=artifact pairs")
flags.DEFINE_string("tree", "acc16", "'acc<N>' (Medusa: N nodes from measured accuracies), 'medusa63', 'chain<k>' "
                    "or '' (num_speculative_tokens=--k)")
flags.DEFINE_integer("k", 4, "chain length when --tree is chain")
flags.DEFINE_float("temperature", 1.0, "sampling temperature (typical acceptance only matters above 0)")
flags.DEFINE_float("posterior_threshold", 0.09, "typical acceptance epsilon")
flags.DEFINE_float("posterior_alpha", 0.3, "typical acceptance delta")
flags.DEFINE_integer("num_contexts", 4, "contexts for the next-token measurement")
flags.DEFINE_integer("samples", 20000, "requests per context for the next-token measurement")
flags.DEFINE_float("tail_mass", 1e-4, "p(t1 | c) mass left out of the enumeration")
flags.DEFINE_integer("num_prompts", 8, "HumanEval prompts for the sequence-level measurement")
flags.DEFINE_integer("repeats", 4, "samples per prompt for the sequence-level measurement")
flags.DEFINE_integer("max_new_tokens", 96, "continuation length for the sequence-level measurement")
flags.DEFINE_integer("batch", 2000, "requests per generate() call")
flags.DEFINE_string("out", "runs/lossy_shift/lossy_shift", "path stem of the two tables: <out>_next_token and "
                    "<out>_sequence (.csv, .json)")


def configs() -> dict[str, SpecConfig]:
    artifact = dict(e.split("=", 1) for e in FLAGS.drafters).get(FLAGS.method)
    if FLAGS.tree.startswith("acc"):           # the tree the heads' measured accuracies favour (Medusa)
        shape = tree_fields("acc", int(FLAGS.tree[3:]), artifact)
    elif FLAGS.tree == "medusa63":
        shape = tree_fields("medusa63", 0)
    else:                                      # a chain: chain<k>, or '' for --k
        shape = tree_fields("", int(FLAGS.tree[5:]) if FLAGS.tree.startswith("chain") else FLAGS.k)
    common = dict(temperature=FLAGS.temperature, stop_at_eos=False)
    return {"plain": SpecConfig(**common),
            "exact": SpecConfig(method=FLAGS.method, **shape, **common),
            "typical_lossy": SpecConfig(method=FLAGS.method, **shape, **common, acceptance_method="typical_lossy",
                                        posterior_threshold=FLAGS.posterior_threshold,
                                        posterior_alpha=FLAGS.posterior_alpha)}


def second_token_distribution(target, context: list[int], sp) -> tuple[np.ndarray, float]:
    """Exact p2 [V] by enumeration over the first token's likely values -> (p2, mass left out)."""
    p1 = np.asarray(probabilities(target.logits([context])[:, -1], sp))[0]
    order = np.argsort(-p1)
    keep = order[:int(np.searchsorted(np.cumsum(p1[order]), 1 - FLAGS.tail_mass)) + 1]
    p2 = np.zeros_like(p1, dtype=np.float64)
    for start in range(0, len(keep), 256):
        t1 = keep[start:start + 256]
        seqs = np.array([context + [int(t)] for t in t1], np.int32)
        p = np.asarray(probabilities(target.logits(seqs)[:, -1], sp), np.float64)
        p2 += (p1[t1, None] * p).sum(0)
    left = 1.0 - p1[keep].sum()
    return p2 / p2.sum(), float(left)


def decode_many(target, prompt, config, drafter, n: int, seed: int) -> tuple[np.ndarray, dict]:
    toks, acc, passes, gen = [], 0, 0, 0
    for start in range(0, n, FLAGS.batch):
        m = min(FLAGS.batch, n - start)
        r = specjax.generate(target, [prompt] * m, config, drafter=drafter, seed=seed,
                             request_ids=list(range(start, start + m)))
        toks.append(np.asarray(r.tokens))
        acc += r.stats["accepted"]
        passes += r.stats["target_passes"]
        gen += r.stats["generated_tokens"]
    return np.concatenate(toks), {"tau": (gen - n) / max(passes, 1)}


def tv_kl(p: np.ndarray, counts: np.ndarray) -> tuple[float, float]:
    q = counts / counts.sum()
    q_smooth = (counts + 0.5) / (counts.sum() + 0.5 * len(counts))
    tv = 0.5 * np.abs(p - q).sum()
    kl = float(np.sum(np.where(p > 0, p * (np.log(np.maximum(p, 1e-300)) - np.log(q_smooth)), 0.0)))
    return float(tv), kl


def sequence_nll(target, prompt_ids: list[int], outputs: list[list[int]]) -> np.ndarray:
    """Per-token NLL of each output continuation under the target (the sampling transform's temperature is not
    applied: this is the model's own likelihood)."""
    seqs = np.array([prompt_ids + o for o in outputs], np.int32)
    logp = jax.nn.log_softmax(target.logits(seqs), -1)
    P = len(prompt_ids)
    tgt = seqs[:, P:]
    lp = np.take_along_axis(np.asarray(logp[:, P - 1:-1]), tgt[..., None], -1)[..., 0]
    return -lp.mean(1)


def main(argv):
    del argv
    target = specjax.load_model(FLAGS.target)
    artifacts = dict(e.split("=", 1) for e in FLAGS.drafters)
    spec = registry.get(FLAGS.method)
    drafter = spec.load(target, artifacts[FLAGS.method]) if FLAGS.method in artifacts and spec.load else None
    cfgs = configs()
    sp = cfgs["exact"].sampling
    settings = {k: FLAGS[k].value for k in ("target", "method", "drafters", "tree", "temperature",
                                            "posterior_threshold", "posterior_alpha", "samples", "num_contexts",
                                            "num_prompts", "repeats", "max_new_tokens")}
    next_token, sequence = [], []
    prompts = load_prompt_set("humaneval", max(FLAGS.num_contexts, FLAGS.num_prompts), target.tokenizer)
    print(f"1. second generated token: TV / KL(p2 || empirical) over {FLAGS.samples} samples per context")
    for c in range(FLAGS.num_contexts):
        ctx = target.tokenize(prompts[c])
        p2, left = second_token_distribution(target, ctx, sp)
        rows = []
        for name, cfg in cfgs.items():
            toks, st = decode_many(target, ctx, dataclasses.replace(cfg, max_new_tokens=2),
                                   drafter if cfg.method != "none" else None, FLAGS.samples, seed=100 + c)
            tv, kl = tv_kl(p2, np.bincount(toks[:, 1], minlength=len(p2)).astype(np.float64))
            rows.append({"context": c, "rule": name, "tv": tv, "kl": kl, "tail_mass_left_out": left})
        next_token += rows
        print(f"  context {c}: " + "  ".join(f"{r['rule']}: TV {r['tv']:.4f} KL {r['kl']:.4f}" for r in rows)
              + f"  (enumeration left out {left:.1e} of p(t1))", flush=True)
    print(f"\n2. per-token NLL under the target of {FLAGS.max_new_tokens}-token continuations "
          f"({FLAGS.num_prompts} HumanEval prompts x {FLAGS.repeats} samples)")
    for name, cfg in cfgs.items():
        cfg = dataclasses.replace(cfg, max_new_tokens=FLAGS.max_new_tokens)
        nll, taus = [], []
        for i in range(FLAGS.num_prompts):
            ids = target.tokenize(prompts[i])
            r = specjax.generate(target, [ids] * FLAGS.repeats, cfg, drafter=drafter if cfg.method != "none" else None, seed=7,
                                 request_ids=list(range(i * FLAGS.repeats, (i + 1) * FLAGS.repeats)))
            nll.extend(sequence_nll(target, ids, r.tokens).tolist())
            taus.append(r.stats["tau"])
        nll = np.array(nll)
        s = {"rule": name, "nll_mean": float(nll.mean()), "nll_sem": float(nll.std(ddof=1) / np.sqrt(len(nll))),
             "tau": float(np.mean(taus))}
        sequence.append(s)
        print(f"  {name:>14}: NLL {s['nll_mean']:.4f} +- {s['nll_sem']:.4f} nats/token, tau {s['tau']:.2f}")
    write_table(next_token, FLAGS.out + "_next_token", meta=settings)
    write_table(sequence, FLAGS.out + "_sequence", meta=settings)


if __name__ == "__main__":
    app.run(main)
