"""Per-position acceptance of trained chain drafters in the decode loop, beside what their training eval predicts
for the same rows, and the loop's walk replayed over the eval's drafts.

  python -m experiments.acceptance_replay --runs=eagle3:smollm2-135m-eagle3,dflash:smollm2-135m-dflash
  python -m experiments.acceptance_replay --runs=draft_model:runs/smollm2-135m-draft     # train.draft --init_layers

For every run, prompt set and temperature: the speculative decode loop answers each prompt (to the end of its turn
or --max_new_tokens) and its per-step acceptance trace gives P(draft i accepted) and the conditional acceptance
P(draft i | draft i - 1 accepted). The drafter's training eval (its loss module's teacher-forced agreements:
train.losses.eagle.eagle_agreements, train.losses.dflash.dflash_agreements, and for a draft model reading the
target's embedding, a TargetEmbeddingDraft artifact, train.losses.draft_model.draft_agreements) then scores the same
rows at every committed length:
- over all lengths, what the training eval reports (top-1 agreement per draft position, chains, conditionals);
- along the loop's walk (the committed lengths its steps started from): at T = 0 on the greedy rows the eval's
  chain at each such length must accept exactly what the loop accepted there; every step where the two differ is a
  train/serve mismatch, counted (the loop's output is checked against plain greedy decoding first);
- at T = 1, the eval's prediction is the product of the per-draft acceptance probabilities 1 - TV(p, q) along each
  chain (over all lengths and along the walk), beside the loop's measured rates;
- the real-feature counterfactual along the walk (T = 0): where the loop's draft 1 was accepted, how often draft 2
  (drafted from the drafter's own output) agrees, against how often a fresh draft 1 from the next length (drafted
  from the target's real features there) would: the gap a perfect feedback would close. Only for a drafter that
  reads the target's features: a draft model (TOKEN_DRAFTERS) reads the committed tokens alone, so once draft 1 is
  accepted its draft 2 IS the next length's draft 1 (no gap by construction); its rows report draft 2 given draft 1
  and leave the counterfactual out (None).
The spread across prompts (tokens per target pass per prompt: 10th, 50th, 90th percentile) goes with each row.
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import specjax
from specjax import SpecConfig
from specjax.planning import prompt_bucket, round_up
from experiments.harness import prompt_ids
from experiments.prompts import OPEN_CHAT_SETS, load_prompt_set
from experiments.tables import text_table, write_table
from train.data import LabeledRows

FLAGS = flags.FLAGS

METHODS = ("eagle", "eagle3", "dflash", "draft_model")     # the families training_eval scores (their training evals)
TOKEN_DRAFTERS = ("draft_model",)     # families whose drafts read the committed tokens only, no target features


def define_flags() -> None:
    """The entry point's flags (defined only when run as a program, so tests import this module beside others)."""
    flags.DEFINE_string("target", "smollm2-135m", "target: shipped name or model directory")
    flags.DEFINE_list("runs", ["eagle3:smollm2-135m-eagle3", "dflash:smollm2-135m-dflash"],
                      "method:drafter pairs (methods: " + ", ".join(METHODS) + "; draft_model: a TargetEmbeddingDraft "
                      "artifact, train.draft --init_layers)")
    flags.DEFINE_list("prompt_sets", list(OPEN_CHAT_SETS), "prompt sets (experiments.prompts)")
    flags.DEFINE_integer("num_prompts", 64, "prompts per set")
    flags.DEFINE_integer("k", 4, "drafts per step (a chain)")
    flags.DEFINE_list("temperatures", ["0", "1"], "sampling temperatures")
    flags.DEFINE_integer("max_new_tokens", 256, "answer tokens at most (each answer stops at its end of turn)")
    flags.DEFINE_integer("batch_size", 8, "requests decoded together")
    flags.DEFINE_integer("seed", 0, "sampling seed")
    flags.DEFINE_string("out", "runs/acceptance_replay/acceptance", "output path stem (.csv/.json)")


WIDTH_BUCKET = 128          # rows are padded to a multiple of this, so the eval compiles once per bucket


def training_eval(method: str, target, drafter_name: str, k: int) -> tuple[Callable, object]:
    """(a function (rows LabeledRows [1, R]) -> train.losses.common.ChainAgreement of k drafts, jitted: the
    trained drafter family's training eval; the drafter's loaded weights)."""
    if method in ("eagle", "eagle3"):
        from specjax.drafters import eagle
        from train.losses.eagle import eagle_agreements
        w = eagle.load(drafter_name, target, method)
        fn = lambda p, tp, rows: eagle_agreements(p, tp, target.config, w.config, rows, 0, k, w.d2t)
    elif method == "dflash":
        from specjax.drafters import dflash
        from train.losses.dflash import dflash_agreements
        w = dflash.load(drafter_name, target)
        fn = lambda p, tp, rows: dflash_agreements(p, tp, target.config, w.config, rows, 0, k, 1, w.d2t)
    elif method == "draft_model":
        from specjax.drafters import draft_model
        from train.losses.draft_model import draft_agreements
        w = draft_model.load(drafter_name, target)        # a TargetEmbeddingDraft: only it has a training eval
        fn = lambda p, tp, rows: draft_agreements(p, tp, w.config, target.config, rows, 0, k, w.d2t)
    else:
        raise ValueError(f"acceptance_replay scores {', '.join(METHODS)} drafters (their training evals); got "
                         f"method {method!r}")
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), w.params)
    jitted = jax.jit(fn)
    return lambda rows: jax.device_get(jitted(params, target.params, jax.tree.map(jnp.asarray, rows))), w


def _rows(prompts: list[list[int]], answers: list[list[int]]) -> list[LabeledRows]:
    out = []
    for p, a in zip(prompts, answers):
        n = len(p) + len(a)
        width = round_up(n + 1, WIDTH_BUCKET)
        tokens = np.zeros((1, width), np.int32)
        tokens[0, :n] = p + list(a)
        out.append(LabeledRows(tokens, np.array([len(p)], np.int32), np.array([n], np.int32)))
    return out


def _positions(hist: np.ndarray) -> tuple[list[float], list[float]]:
    """Counts of steps by drafts accepted [k + 1] -> (P(draft i accepted), P(draft i | draft i - 1 accepted))."""
    total = max(hist.sum(), 1)
    p = [float(hist[i + 1:].sum() / total) for i in range(len(hist) - 1)]
    return p, _conditional(p)


def _conditional(p: list[float]) -> list[float]:
    return [p[0]] + [p[i] / p[i - 1] if p[i - 1] > 0 else float("nan") for i in range(1, len(p))]


def _walk(trace: np.ndarray, prompt_len: int, length: int, k: int):
    """The committed lengths a row's loop steps started from, with the drafts each accepted, for the steps whose k
    drafts all lie inside the row."""
    L = prompt_len + 1                                                   # prefill committed the first token
    for a in trace:
        if a < 0 or L + k > length:
            break
        yield L, int(a)
        L += int(a) + 1


def measure(target, method: str, drafter_name: str, prompts: list, temperature: float, k: int = 4,
            max_new_tokens: int = 256, batch_size: int = 8, seed: int = 0, evaluation: tuple | None = None,
            agreement_fn: Callable | None = None) -> dict:
    """One run on one prompt set at one temperature: the row of the table (see the module docstring).
    evaluation: training_eval's result for this run, made once for all of its rows (default: made here);
    agreement_fn: (rows) -> ChainAgreement in place of the drafter family's training eval (tests plant bugs)."""
    agreements, weights = evaluation or training_eval(method, target, drafter_name, k)
    agreements = agreement_fn or agreements
    ids = [prompt_ids(target, p) for p in prompts]
    common = dict(max_new_tokens=max_new_tokens, temperature=temperature)
    # every batch padded to the set's longest prompt and prefilled in one forward: one compiled program per run
    shape = dict(pad_to=prompt_bucket(max(map(len, ids))), prefill_groups=1)
    spec_tokens, traces, hist = [], [], np.zeros(k + 1)
    plain_tokens = []
    for start in range(0, len(ids), batch_size):
        block = ids[start:start + batch_size]
        req = list(range(start, start + len(block)))
        res = specjax.generate(target, block, SpecConfig(method=method, num_speculative_tokens=k, **common),
                               drafter=weights, seed=seed, request_ids=req, **shape)
        spec_tokens += res.tokens
        traces += list(np.asarray(res.stats["accept_trace"]))
        hist += np.asarray(res.stats["accept_hist"])
        if temperature == 0:
            plain_tokens += specjax.generate(target, block, SpecConfig(**common), **shape).tokens
    exact = None if temperature else sum(a == b for a, b in zip(spec_tokens, plain_tokens))
    loop_p, loop_c = _positions(hist)
    taus = [float(np.mean(np.asarray(t)[np.asarray(t) >= 0] + 1)) if np.any(np.asarray(t) >= 0) else float("nan")
            for t in traces]
    # the training eval over the same rows
    all_agree, all_accept, walk_hist, walk_pred = [], [], np.zeros(k + 1), np.zeros(k)
    mismatches, walk_steps, own, real = 0, 0, [], []
    for row, trace in zip(_rows(ids, spec_tokens), traces):
        ca = agreements(row)
        P, n = int(row.first_label[0]), int(row.label_end[0])
        ok = ca.valid[0].all(0)                                          # [R + 1] lengths with k label drafts
        chain = np.cumprod(ca.agree[0], 0).astype(bool)                  # [k, R + 1]
        all_agree.append(chain[:, ok])
        all_accept.append(np.cumprod(ca.accept[0], 0)[:, ok])
        for L, a in _walk(trace, P, n, k):
            walk_steps += 1
            replay = int(chain[:, L].sum())
            walk_hist[replay] += 1
            walk_pred += np.cumprod(ca.accept[0][:, L])
            mismatches += int(temperature == 0 and replay != a)
            if ca.agree[0][0, L] and L + 1 <= n - 1:
                own.append(bool(ca.agree[0][1, L]))
                real.append(bool(ca.agree[0][0, L + 1]))
    all_agree = np.concatenate(all_agree, 1)
    all_accept = np.concatenate(all_accept, 1)
    eval_p = (all_agree if temperature == 0 else all_accept).mean(1).tolist()
    walk_p = (_positions(walk_hist)[0] if temperature == 0 else (walk_pred / max(walk_steps, 1)).tolist())
    row = dict(method=method, drafter=drafter_name, temperature=temperature, k=k, prompts=len(prompts),
               exact=exact, loop_steps=int(hist.sum()), loop_accept=loop_p, loop_conditional=loop_c,
               tau=float(np.nanmean(taus)), tau_p10=float(np.nanpercentile(taus, 10)),
               tau_p50=float(np.nanpercentile(taus, 50)), tau_p90=float(np.nanpercentile(taus, 90)),
               eval_lengths=int(all_agree.shape[1]), eval_accept=eval_p, eval_conditional=_conditional(eval_p),
               walk_steps=walk_steps, walk_accept=walk_p, walk_conditional=_conditional(walk_p))
    if temperature == 0:
        counterfactual = None if method in TOKEN_DRAFTERS else float(np.mean(real)) if real else float("nan")
        row.update(walk_mismatches=mismatches,
                   walk_draft2_given_draft1=float(np.mean(own)) if own else float("nan"),
                   walk_real_feature_draft1_next=counterfactual)
    return row


def main(argv) -> None:
    del argv
    target = specjax.load_model(FLAGS.target)
    evaluations = {}                                     # each run's training eval, compiled once for every row
    for run in FLAGS.runs:
        method, drafter = run.split(":", 1)
        evaluations[method, drafter] = training_eval(method, target, drafter, FLAGS.k)
    rows = []
    for name in FLAGS.prompt_sets:
        prompts = load_prompt_set(name, FLAGS.num_prompts, target.tokenizer)
        for (method, drafter), evaluation in evaluations.items():
            for temp in (float(t) for t in FLAGS.temperatures):
                r = dict(prompt_set=name, **measure(target, method, drafter, prompts, temp, FLAGS.k,
                                                    FLAGS.max_new_tokens, FLAGS.batch_size, FLAGS.seed,
                                                    evaluation))
                rows.append(r)
                fmt = lambda xs: " ".join(f"{x:.3f}" for x in xs)
                print(f"{name} {method} T={temp:g}: tau {r['tau']:.3f} (p10 {r['tau_p10']:.2f}, p90 "
                      f"{r['tau_p90']:.2f}); loop P(draft i) {fmt(r['loop_accept'])}, conditional "
                      f"{fmt(r['loop_conditional'])}; eval over all lengths {fmt(r['eval_accept'])} (conditional "
                      f"{fmt(r['eval_conditional'])}); eval along the loop's walk {fmt(r['walk_accept'])}"
                      + (f"; mismatches {r['walk_mismatches']} of {r['walk_steps']} steps; exact "
                         f"{r['exact']}/{r['prompts']}; given draft 1: draft 2 {r['walk_draft2_given_draft1']:.3f}, "
                         + (f"real-feature draft 1 at the next length {r['walk_real_feature_draft1_next']:.3f}"
                            if r["walk_real_feature_draft1_next"] is not None else
                            "no real-feature counterfactual (reads tokens only: draft 2 is the next length's draft 1)")
                         if temp == 0 else ""), flush=True)
    header = ("set", "run", "T", "tau (p10-p90)", "loop P(i)", "loop cond", "eval all", "eval cond", "walk")
    fmt = lambda xs: " ".join(f"{x:.2f}" for x in xs)
    print(text_table(header, [(r["prompt_set"], f"{r['method']}:{r['drafter']}", r["temperature"],
                               f"{r['tau']:.2f} ({r['tau_p10']:.2f}-{r['tau_p90']:.2f})", fmt(r["loop_accept"]),
                               fmt(r["loop_conditional"]), fmt(r["eval_accept"]), fmt(r["eval_conditional"]),
                               fmt(r["walk_accept"])) for r in rows]))
    write_table(rows, FLAGS.out, dict(target=FLAGS.target, k=FLAGS.k, max_new_tokens=FLAGS.max_new_tokens))


if __name__ == "__main__":
    define_flags()
    app.run(main)
