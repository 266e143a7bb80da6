"""Throughput of plain vs speculative decoding as the batch grows, measured side by side, with the prediction from
costs measured at that batch size.

  python -m experiments.batch_scaling --batch_sizes=1,8,32,64 \
      --runs=humaneval:draft_model:4,humaneval:ngram:4 --max_new_tokens=128

Takes experiment.speedup's flags (--runs entries prompt_set:method:k[:tree][:key=value], --drafters,
--max_new_tokens, --temperature, ...). For each batch size B the first B prompts of the set are decoded as ONE
batch by plain decoding and by each run, timed in alternation (--rounds rounds, the fastest of each), EOS
ignored so every row generates max_new_tokens. Columns: tokens/s of plain and speculative decoding, their ratio,
alpha, tau (the rows' mean), batch tau (tokens per loop iteration: the batch steps together, so an iteration
lasts until its slowest row is done), and the predicted ratio from costs measured at batch B and the run's buffer
(experiments.costs: the prefill as generate() runs it, one target forward over 1 and over k + 1 positions, one
proposal) and the run's loop iterations: for the whole call (prefills included, as timed) and for the loop alone
(batch tau / (c_step + verify_cost)). A gap between measured and predicted is the loop's overhead at that batch
size. Speculation loses throughput once the verify
pass stops being memory-bound (the EAGLE-3 paper's batch table shows it on GPUs); on this CPU that comes early.

Beside them: the roofline prediction (specjax.analysis.batch_roofline with this machine's measured matmul peak and
read bandwidth, the run's alpha and draft cost), and the dynamic policy (--draft_len_schedule, e.g. 8:k =
speculate with the run's k up to batch 8 and decode plainly beyond; --acceptance_rate_threshold: switch off
when the batch's drafts stop being accepted), timed in the same alternating rounds when it runs a program of
its own; where it resolves to the fixed-k program or to plain decoding itself, its cell is that program's time
(and plain decoding is timed a second time, to show how far two samples of one program disagree here). The table is printed again
in the EAGLE-3 paper's batch-table layout, written as CSV/JSON and plotted (--table_out).
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import time

import numpy as np
from absl import app, flags

import specjax
from specjax import analysis
from specjax.drafters.registry import BuildRequest, build as build_drafter
from specjax.drafters import registry
from experiments import costs, speedup
from experiments.prompts import load_prompt_set
from experiments.tables import pyplot, save_figure, write_table

FLAGS = flags.FLAGS
flags.DEFINE_list("batch_sizes", ["1", "8", "32", "64"], "batch sizes")
flags.DEFINE_integer("rounds", 3, "alternating timing rounds per batch size (the fastest of each is kept)")
flags.DEFINE_string("table_out", "runs/batch_scaling", "path stem of the table (.csv, .json) and its plot (.png)")
flags.DEFINE_list("draft_len_schedule", ["8:k"], "the dynamic policy's SpecConfig.draft_len_schedule, as "
                  "max_batch:k entries (k = 'k': the run's own k); an entry method@max_batch:k applies to that "
                  "method only, and a method with entries of its own ignores the unprefixed ones; empty: no "
                  "policy rows")
flags.DEFINE_float("acceptance_rate_threshold", None, "the dynamic policy's acceptance-rate switch (None: off)")
flags.DEFINE_integer("acceptance_rate_window_size", 16, "speculative steps the acceptance rate is taken over")


def timed_generate(target, ids: list[list[int]], config, drafter) -> tuple[float, dict, list]:
    # Padded to the longest prompt: the smallest buffer, which every row's attention reads whole (generate()'s
    # bucket would add up to a quarter). One compile per batch size either way.
    t0 = time.perf_counter()
    res = specjax.generate(target, ids, config, drafter=drafter, pad_to=max(map(len, ids)))
    return time.perf_counter() - t0, res.stats, res.tokens


def policy_fields(method: str, k: int) -> dict:
    """The dynamic policy's SpecConfig fields for a run of `method` drafting k tokens, from the flags ({} = no
    policy)."""
    fields = {}
    own = [e.split("@", 1)[1] for e in FLAGS.draft_len_schedule if e.startswith(method + "@")]
    entries = own or [e for e in FLAGS.draft_len_schedule if "@" not in e]
    try:
        schedule = {int(b): (k if v == "k" else int(v)) for b, v in (e.split(":") for e in entries)}
    except ValueError:
        raise app.UsageError(f"--draft_len_schedule {FLAGS.draft_len_schedule}: entries are max_batch:k or "
                             f"method@max_batch:k (k an int or 'k')") from None
    if schedule:
        fields["draft_len_schedule"] = schedule
    if FLAGS.acceptance_rate_threshold is not None:
        fields.update(acceptance_rate_threshold=FLAGS.acceptance_rate_threshold,
                      acceptance_rate_window_size=FLAGS.acceptance_rate_window_size)
    return fields


def main(argv):
    del argv
    batch_sizes = [int(b) for b in FLAGS.batch_sizes]
    target = specjax.load_model(FLAGS.target)
    runs = [speedup.parse_run(entry) for entry in FLAGS.runs]
    peak_flops, bandwidth = costs.machine_roofline()
    print(f"this machine: {peak_flops / 1e9:.0f} GFLOP/s (float32 matmul), {bandwidth / 1e9:.1f} GB/s (array read)")
    records = []
    for B in batch_sizes:
        for run in runs:
            pset, method, k, tree = run["pset"], run["method"], run["k"], run["tree"]
            prompts = load_prompt_set(pset, B, target.tokenizer)
            if len(prompts) < B:
                raise ValueError(f"prompt set {pset!r} has {len(prompts)} prompts, fewer than batch size {B}")
            ids = [target.tokenize(p) if isinstance(p, str) else list(p) for p in prompts]     # tokenized once
            sampling = {f: v for f, v in run["overrides"].items() if f in ("temperature", "top_k", "top_p")}
            plain_config = speedup.spec_config("none", None, **sampling)
            _, plain_stats, plain_out = timed_generate(target, ids, plain_config, None)    # compile
            drafter = speedup.drafter_argument(target, method, plain_out, run["drafter"])
            artifact = run["drafter"] or dict(e.split("=", 1) for e in FLAGS.drafters).get(method)
            config = speedup.spec_config(method, k, tree, artifact, **run["overrides"])
            k = config.k
            _, stats, spec_out = timed_generate(target, ids, config, drafter)               # compile
            fields = policy_fields(method, k)
            policy = fields and speedup.spec_config(method, k, tree, artifact, **run["overrides"], **fields)
            # The policy at batch B is often one of the two programs timed already (the schedule's k is the run's:
            # the same config; k = 0: plain decoding itself); then its cell is that program's time, not a second
            # sample of it. Only a policy that runs another program (another k, an acceptance switch) is timed.
            resolved = policy.for_batch(B) if policy else None
            same_as = ("plain" if resolved == plain_config else "fixed" if resolved == config else None) \
                if policy else None
            timed_policy = bool(policy) and same_as is None
            if timed_policy:
                _, policy_stats, policy_out = timed_generate(target, ids, policy, drafter)  # compile
            plain_s = spec_s = policy_s = noise_s = float("inf")
            for _ in range(FLAGS.rounds):
                plain_s = min(plain_s, timed_generate(target, ids, plain_config, None)[0])
                spec_s = min(spec_s, timed_generate(target, ids, config, drafter)[0])
                if timed_policy:
                    policy_s = min(policy_s, timed_generate(target, ids, policy, drafter)[0])
                elif same_as == "plain":     # plain again: how far two samples of one program disagree here
                    noise_s = min(noise_s, timed_generate(target, ids, plain_config, None)[0])
            if same_as is not None:
                policy_s = plain_s if same_as == "plain" else spec_s
                policy_stats, policy_out = (plain_stats, plain_out) if same_as == "plain" else (stats, spec_out)
            # Costs at this batch size, at a typical context: mean prompt length + half the generation.
            context = int(np.mean([len(r) for r in ids])) + FLAGS.max_new_tokens // 2
            buf = stats["buffer_len"]
            t1 = costs.forward_seconds(target, context, 1, batch=B, cache_size=buf)
            tv = costs.forward_seconds(target, context, k + 1, batch=B, cache_size=buf)
            d_obj, d_params = build_drafter(BuildRequest(config, target, drafter, ids, max(buf, context + 2 * k + 8)))
            if registry.get(method).per_request_params:
                tp = float("nan")              # predictions per request: proposing is a table lookup
            else:
                tp = costs.propose_seconds(d_obj, d_params, target, context, config.sampling, batch=B,
                                           cache_size=buf)
            draft_cost = 0.0 if np.isnan(tp) else tp / t1
            # The batch steps together: a loop iteration ends when its slowest row does, so the loop's tokens per
            # iteration (batch tau) is below the rows' mean tau once rows accept at different rates.
            steps = FLAGS.max_new_tokens - 1
            iterations = stats["accept_trace"].shape[1]
            batch_tau = steps / iterations
            steady = analysis.speedup_from_tau(batch_tau, draft_cost, tv / t1)
            # The whole call, as timed: both pay the target's prefill (in length groups, as generate() runs it),
            # speculation also its drafter's; then N - 1 plain steps, or the run's loop iterations of draft + verify.
            longest = max(len(r) for r in ids)
            t_pre = costs.prefill_seconds(target, ids, buf, pad_to=longest)
            t_dpre = costs.init_seconds(d_obj, d_params, target, longest, config.sampling, batch=B, cache_size=buf,
                                        reps=3, inner=2)
            predicted = (t_pre + steps * t1) / (t_pre + t_dpre + iterations * (draft_cost * t1 + tv))
            n = B * FLAGS.max_new_tokens
            greedy = plain_config.sampling.greedy
            exact = ("yes" if spec_out == plain_out and (not policy or policy_out == plain_out) else "no") \
                if greedy else "n/a"
            # The roofline of this machine (measured peak and bandwidth) at this batch, for the measured alpha
            # and draft cost: what the hardware allows, beside what the measured costs predict.
            roofline = float(analysis.batch_roofline(
                [B], **costs.roofline_inputs(target, context), peak_flops=peak_flops, bandwidth=bandwidth,
                alpha=stats["alpha"], k=k, c=draft_cost)[0]) if not config.is_tree else float("nan")
            rec = dict(batch=B, prompts=pset, method=run["label"] or method + (f"/{tree}" if tree else ""), k=k,
                       plain_tokens_per_s=n / plain_s, tokens_per_s=n / spec_s, speedup=plain_s / spec_s,
                       predicted=predicted, predicted_steady=steady, prefill_share=t_pre / (t_pre + steps * t1),
                       alpha=stats["alpha"], tau=stats["tau"], batch_tau=batch_tau,
                       c_step=draft_cost, verify_cost=tv / t1, forward_ms=t1 * 1e3, buffer=buf, exact=exact,
                       roofline=roofline)
            if policy:
                rec.update(policy_k=policy_stats["num_speculative_tokens"], policy_speedup=plain_s / policy_s,
                           policy_tokens_per_s=n / policy_s,
                           # k = 0: every pass is a plain step; else those after the acceptance switch
                           policy_plain_share=1.0 if policy_stats["num_speculative_tokens"] == 0 else
                           policy_stats["plain_passes"] / max(policy_stats["target_passes"], 1),
                           policy_program=same_as or "own", plain_repeat=plain_s / noise_s if noise_s < float("inf")
                           else float("nan"))
            records.append(rec)
            print(f"batch {B:>3} {rec['method']:>14} k={k}: plain {rec['plain_tokens_per_s']:7.0f} tok/s, spec "
                  f"{rec['tokens_per_s']:7.0f} ({rec['speedup']:.2f}x, predicted {predicted:.2f}x, loop alone "
                  f"{steady:.2f}x; prefill {rec['prefill_share']:.0%} of plain), "
                  f"alpha {rec['alpha']:.3f} tau {rec['tau']:.2f} (batch {batch_tau:.2f}) c_step {draft_cost:.2f} "
                  f"verify {tv / t1:.2f}, roofline {roofline:.2f}x"
                  + (f"; policy (k={rec['policy_k']}, {rec['policy_program']}) {rec['policy_speedup']:.2f}x"
                     if policy else "")
                  + (f"; plain timed again: {rec['plain_repeat']:.2f}x" if same_as == "plain" else ""), flush=True)

    print(f"\n{FLAGS.target}, float32, CPU, {FLAGS.max_new_tokens} new tokens per row, EOS ignored; one generate() "
          f"call per batch; fastest of {FLAGS.rounds} alternating rounds")
    print(f"| batch | method | k | plain tok/s | spec tok/s | speedup | predicted | loop alone | roofline | "
          f"prefill share | alpha | tau | batch tau | c_step | verify cost | policy k | policy | exact |")
    print("| " + " | ".join(["---"] * 18) + " |")
    for r in records:
        pol = (f"{r['policy_k']} | {r['policy_speedup']:.2f}x" if "policy_k" in r else "- | -")
        print(f"| {r['batch']} | {r['method']} | {r['k']} | {r['plain_tokens_per_s']:.0f} | {r['tokens_per_s']:.0f} "
              f"| {r['speedup']:.2f}x | {r['predicted']:.2f}x | {r['predicted_steady']:.2f}x | "
              f"{r['roofline']:.2f}x | {r['prefill_share']:.0%} | {r['alpha']:.3f} | {r['tau']:.2f} | "
              f"{r['batch_tau']:.2f} | "
              f"{r['c_step']:.2f} | {r['verify_cost']:.2f} | {pol} | {r['exact']} |")
    print_batch_table(records, batch_sizes)
    write_table(records, FLAGS.table_out, meta={"batch_sizes": batch_sizes, "runs": FLAGS.runs, "target": FLAGS.target,
                                          "max_new_tokens": FLAGS.max_new_tokens, "rounds": FLAGS.rounds,
                                          "draft_len_schedule": FLAGS.draft_len_schedule,
                                          "acceptance_rate_threshold": FLAGS.acceptance_rate_threshold,
                                          "acceptance_rate_window_size": FLAGS.acceptance_rate_window_size,
                                          "peak_flops": peak_flops, "bandwidth": bandwidth})
    plot(records, batch_sizes)


def print_batch_table(records: list[dict], batch_sizes: list[int]) -> None:
    """The EAGLE-3 paper's batch table shape: one row per method (fixed k, then the policy), throughput relative
    to plain decoding at each batch size."""
    print("\nthroughput relative to plain decoding (EAGLE-3 Table 5 layout)")
    print("| method | " + " | ".join(f"bs{b}" for b in batch_sizes) + " |")
    print("| --- | " + " | ".join("---" for _ in batch_sizes) + " |")
    for method in dict.fromkeys(r["method"] for r in records):
        rows = {r["batch"]: r for r in records if r["method"] == method}
        for label, key in ((f"{method} k={next(iter(rows.values()))['k']}", "speedup"),
                           ("  + roofline", "roofline"), (f"{method} policy", "policy_speedup"),
                           ("  plain timed again", "plain_repeat")):
            if any(key in r and not np.isnan(r[key]) for r in rows.values()):
                print(f"| {label} | " + " | ".join(f"{rows[b][key]:.2f}" if b in rows and not np.isnan(rows[b].get(key, np.nan)) else "-"
                                                  for b in batch_sizes) + " |")


def plot(records: list[dict], batch_sizes: list[int]) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for method in dict.fromkeys(r["method"] for r in records):
        rows = sorted((r for r in records if r["method"] == method), key=lambda r: r["batch"])
        bs = [r["batch"] for r in rows]
        line, = ax.plot(bs, [r["speedup"] for r in rows], "o-", label=f"{method} k={rows[0]['k']}")
        ax.plot(bs, [r["predicted"] for r in rows], ":", color=line.get_color(), label=f"{method} predicted")
        if "policy_speedup" in rows[0]:
            ax.plot(bs, [r["policy_speedup"] for r in rows], "s--", color=line.get_color(), label=f"{method} policy")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(batch_sizes, [str(b) for b in batch_sizes])
    ax.set_xlabel("batch size")
    ax.set_ylabel("throughput vs plain decoding")
    ax.legend(fontsize=7)
    save_figure(fig, FLAGS.table_out)


if __name__ == "__main__":
    app.run(main)
