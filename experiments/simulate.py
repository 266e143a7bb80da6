"""Record per-step acceptance traces from a real run and replay them offline to choose k and the dynamic policy,
then check the choice against real runs.

  python -m experiments.simulate --method=draft_model --k_max=8 --ks=1,2,3,4,6,8 --batch_size=8

One greedy run drafting k_max tokens per step records, per row, how many drafts each step accepted
(generate()'s stats["accept_trace"]). For a chain drafter whose proposal at a position depends only on the committed
prefix (a draft model's greedy chain: once its drafts are accepted they ARE the prefix), that trace is a trace of
positions: which committed tokens the drafter agreed with. A step accepting n < k_max drafts tested n + 1
positions (the last one rejected); a step accepting all k_max tested k_max, and the bonus position after them was
never tested (filled with the run's acceptance rate, averaged over --draws Monte Carlo fills). Replaying those
positions with any k <= k_max gives that k's loop iterations (the batch steps together: a loop iteration ends
when its slowest row does), and with the costs measured at this batch size (experiments.costs) its tokens/s:
the propose and verify costs timed alone give the step time's shape in k (a least-squares line through the
timed ks, as single timings scatter on a shared machine), and (--calibrate) the timed plain run, the recorded
k_max run and a run at a middle k (--calibrate_mid_k) map it piecewise-affinely onto the loop's step times (those
three are fits, the other rows the check).
The dynamic policy (draft_len_schedule, acceptance_rate_threshold over a window) is replayed the same way.

The simulation is checked against real runs of every k (--check): predicted vs measured loop iterations and
tokens/s, and the error. Drafters whose chain is not a function of the prefix (prompt lookup continues one match)
are only approximated by the replay; trees are not simulated (a path trace does not say which siblings agreed).
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np
from absl import app, flags

import specjax
from specjax import SpecConfig, api
from specjax.analysis import expected_replay, positions_from_trace
from specjax.drafters import registry
from experiments import costs, harness
from experiments.prompts import load_prompt_set
from experiments.tables import pyplot, read_table, save_figure, write_table

FLAGS = flags.FLAGS
flags.DEFINE_string("target", "stdlib-target", "target: shipped name or HF directory")
flags.DEFINE_string("method", "draft_model", "a chain drafter (specjax.drafters.registry.methods())")
flags.DEFINE_string("drafter", "stdlib-draft", "what the method drafts from (shipped name or directory; '' = none)")
flags.DEFINE_string("prompt_set", "humaneval", "humaneval | stdlib | humaneval2x")
flags.DEFINE_integer("batch_size", 8, "requests decoded together")
flags.DEFINE_integer("max_new_tokens", 128, "tokens per request (EOS ignored)")
flags.DEFINE_integer("k_max", 8, "drafts per step of the recorded run")
flags.DEFINE_list("ks", ["1", "2", "3", "4", "6", "8"], "k values to predict (each <= k_max)")
flags.DEFINE_float("acceptance_rate_threshold", 0.5, "the policy replayed beside the fixed ks (< 0: none)")
flags.DEFINE_integer("acceptance_rate_window_size", 16, "its window")
flags.DEFINE_integer("draws", 20, "Monte Carlo fills of the untested bonus positions")
flags.DEFINE_bool("check", True, "run every k for real and compare")
flags.DEFINE_bool("calibrate", True, "map the isolated step costs onto the loop's, through timed plain, middle-k "
                  "and k_max runs")
flags.DEFINE_integer("calibrate_mid_k", -1, "a third timed run for the calibration, at this k between 0 and k_max "
                     "(-1: k_max // 2; 0: none)")
flags.DEFINE_integer("rounds", 10, "alternating timed rounds of the real runs (one call of each per round, the "
                     "fastest kept)")
flags.DEFINE_string("trace", "", "replay this recorded trace (the <out>_trace table of an earlier run, .json) "
                    "instead of recording one")
flags.DEFINE_string("out", "runs/simulate/simulate", "path stem of the table (.csv/.json/.png); the recorded trace "
                    "is the table <out>_trace (one row per request)")


def record(prepared: api.Prepared, stem: str) -> dict:
    """One run of the prepared k_max call, its per-row acceptance trace written as the table `stem` (one row per
    request: its generated length and the accepted count of each step) -> {trace, alpha, generated}."""
    res = api.run(prepared)
    trace = np.asarray(res.stats["accept_trace"]).tolist()
    write_table([dict(row=i, generated=len(t), trace=steps) for i, (t, steps) in enumerate(zip(res.tokens, trace))],
                stem, meta=dict(alpha=res.stats["alpha"], k_max=prepared.config.k))
    return dict(trace=trace, alpha=res.stats["alpha"], generated=[len(t) for t in res.tokens])


def read_trace(path: str) -> dict:
    """A trace table record() wrote -> {trace, alpha, generated}."""
    table = read_table(path)
    rows = sorted(table["rows"], key=lambda r: r["row"])
    return dict(trace=[r["trace"] for r in rows], alpha=table["meta"]["alpha"],
                generated=[r["generated"] for r in rows])


def main(argv):
    del argv
    ks = [int(k) for k in FLAGS.ks]
    if max(ks) > FLAGS.k_max:
        raise app.UsageError(f"--ks {ks} go past --k_max={FLAGS.k_max}: a trace says nothing beyond its own k")
    target = specjax.load_model(FLAGS.target)
    prompts = load_prompt_set(FLAGS.prompt_set, FLAGS.batch_size, target.tokenizer)[:FLAGS.batch_size]
    ids = [harness.prompt_ids(target, p) for p in prompts]
    B, N = len(ids), FLAGS.max_new_tokens
    longest = max(map(len, ids))                # the real runs pad to the longest: the smallest buffer
    spec = registry.get(FLAGS.method)
    drafter = spec.load(target, FLAGS.drafter) if (FLAGS.drafter and spec.load) else (FLAGS.drafter or None)
    config = lambda k, **policy: SpecConfig(method=FLAGS.method, num_speculative_tokens=k, max_new_tokens=N,
                                            stop_at_eos=False, **policy)
    threshold = FLAGS.acceptance_rate_threshold if FLAGS.acceptance_rate_threshold >= 0 else None
    window = FLAGS.acceptance_rate_window_size

    # Every call prepared once (drafter built, buffer planned, arrays placed), as generate() would; runs timed.
    prepared = {k: api.prepare(target, ids, config(k), drafter=drafter, pad_to=longest)
                for k in sorted(set(ks) | {FLAGS.k_max})}
    plain_config = SpecConfig(max_new_tokens=N, stop_at_eos=False)
    plain = api.prepare(target, ids, plain_config, pad_to=longest)
    if FLAGS.trace:
        recorded = read_trace(FLAGS.trace)
    else:
        recorded = record(prepared[FLAGS.k_max], FLAGS.out + "_trace")
        print(f"recorded a k={FLAGS.k_max} trace of {B} rows (alpha {recorded['alpha']:.3f})", flush=True)
    rows = positions_from_trace(np.asarray(recorded["trace"]), FLAGS.k_max, recorded["generated"])
    tested = np.concatenate([r[r >= 0] for r in rows])
    rate = float(tested.mean())
    print(f"{sum(map(len, rows))} positions, {len(tested)} tested, agreement {rate:.3f}")

    # Costs at this batch size, each at the context and buffer of the run that pays it (its Prepared).
    context = harness.measured_context(target, ids, N, prepared[FLAGS.k_max])
    t1 = costs.forward_seconds(target, context, 1, batch=B, cache_size=plain.buffer_len)
    t_pre = costs.prefill_seconds(target, ids, prepared[FLAGS.k_max].buffer_len, pad_to=longest)  # as runs pay it

    def step_costs(k: int) -> tuple[float, float, float]:
        """(propose, verify, drafter init) seconds at chain length k."""
        if k == 0:
            return 0.0, t1, 0.0
        p = prepared[k]
        tp = sum(costs.drafter_step_seconds(p.drafter, p.draft_params, target, context, p.config.sampling,
                                            batch=B, cache_size=p.buffer_len))
        tv = costs.forward_seconds(target, context, k + 1, batch=B, cache_size=p.buffer_len)
        ti = costs.init_seconds(p.drafter, p.draft_params, target, longest, p.config.sampling, batch=B,
                                cache_size=p.buffer_len, reps=3, inner=2)
        return tp, tv, ti

    choices = [(f"k={k}", k, {}) for k in ks]
    if threshold is not None:
        choices += [(f"k={k} switch<{threshold:g}", k, dict(acceptance_rate_threshold=threshold,
                                                           acceptance_rate_window_size=window)) for k in ks]
    measured_costs = {k: step_costs(k) for k in sorted(set(ks) | {FLAGS.k_max} | {0})}
    print("isolated costs (ms): " + ", ".join(f"k={k}: propose {tp * 1e3:.2f} verify {tv * 1e3:.2f}"
                                               for k, (tp, tv, _) in measured_costs.items()), flush=True)
    # A chain's propose and verify costs grow about linearly in k; one timing per k on this machine scatters by
    # 10-40%, so the shape in k is a least-squares line through all of them.
    drafting = sorted(k for k in measured_costs if k > 0)
    if len(drafting) >= 2:
        lines = [np.polyfit(drafting, [measured_costs[k][i] for k in drafting], 1) for i in (0, 1)]   # propose, verify
        for k in drafting:
            tp, tv = (max(float(np.polyval(line, k)), 0.0) for line in lines)
            measured_costs[k] = (tp, tv, measured_costs[k][2])
    # Real runs, timed in alternation (one call of each per round, the fastest kept) so this machine's drift hits
    # them alike: plain decoding, a middle k and the recorded k_max run for the calibration, every choice for the
    # check.
    real_runs = {"plain": plain}
    mid_k = FLAGS.k_max // 2 if FLAGS.calibrate_mid_k < 0 else FLAGS.calibrate_mid_k
    anchor_ks = sorted({k for k in (mid_k, FLAGS.k_max) if 0 < k <= FLAGS.k_max}) if FLAGS.calibrate else []
    for k in anchor_ks:                             # the same program as the choice k: one sample of it
        real_runs[f"k={k}"] = prepared[k] if k in prepared else api.prepare(target, ids, config(k),
                                                                            drafter=drafter, pad_to=longest)
    if FLAGS.check:
        real_runs.update({label: prepared[k] if not policy else api.prepare(
            target, ids, config(k, **policy), drafter=drafter, pad_to=longest) for label, k, policy in choices})
    real = {}
    if len(real_runs) > 1:
        seconds, results = costs.fastest_alternating({name: (lambda p=p: api.run(p)) for name, p in
                                                      real_runs.items()}, FLAGS.rounds)
        real = {name: [seconds[name], results[name]] for name in real_runs}

    def measured_step(label: str, k: int) -> float:
        """A fixed-k real run's loop step time: its wall time less the prefill and the drafter's init, over its
        loop iterations."""
        wall, res = real[label]
        return (wall - t_pre - measured_costs[k][2]) / res.stats["accept_trace"].shape[1]

    loop_step, plain_step = (lambda isolated: isolated), t1
    if FLAGS.calibrate:
        # Forwards timed alone miss what the loop adds around them and what it saves (the loop can run a plain
        # step faster than the same forward timed alone and a long speculative step slower), and the isolated
        # costs' line in k misses a verify pass that changes formulation with k. Real runs, timed, give the loop's
        # own step times at plain decoding (k = 0), at k_max (the recorded run) and at a middle k; every other
        # choice's step time is the isolated costs mapped piecewise-affinely through those points, so the anchors
        # are fits and the other k are the check.
        plain_wall = real["plain"][0]
        plain_step = (plain_wall - t_pre) / (N - 1)
        points = [("plain", t1, plain_step)]                            # (run, isolated step, loop step seconds)
        for k in anchor_ks:
            isolated = sum(measured_costs[k][:2])                       # propose + verify
            if isolated > points[-1][1]:                                # the map needs increasing isolated costs
                points.append((f"k={k}", isolated, measured_step(f"k={k}", k)))
        if len(points) >= 2:
            xs, ys = (np.asarray(v) for v in list(zip(*points))[1:])

            def loop_step(isolated):         # piecewise-affine through the points, the end segments extended
                i = int(np.clip(np.searchsorted(xs, isolated) - 1, 0, len(xs) - 2))
                return ys[i] + (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i]) * (isolated - xs[i])
        else:                        # no spread between the points to fit a slope through: one factor (k_max's)
            factor = measured_step(f"k={FLAGS.k_max}", FLAGS.k_max) / sum(measured_costs[FLAGS.k_max][:2])
            loop_step = lambda isolated: factor * isolated
        print("calibration (isolated -> loop step, ms): " + ", ".join(
            f"{name} {x * 1e3:.2f} -> {loop_step(x) * 1e3:.2f}" for name, x, _ in points))
    records = []
    for label, k, policy in choices:
        sim = expected_replay(rows, k, rate, FLAGS.draws, threshold=policy.get("acceptance_rate_threshold"),
                              window=window)
        tp, tv, ti = measured_costs[k]
        plain_iters = sim["iterations"] - sim["speculative"]
        step = loop_step(tp + tv)
        seconds = t_pre + ti + sim["speculative"] * step + plain_iters * plain_step
        rec = dict(choice=label, k=k, predicted_iterations=sim["iterations"], predicted_step_ms=step * 1e3,
                   predicted_speculative=sim["speculative"],
                   predicted_alpha=sim["accepted"] / sim["drafted"] if sim["drafted"] else float("nan"),
                   predicted_tokens_per_s=B * N / seconds, propose_ms=tp * 1e3, verify_ms=tv * 1e3)
        records.append(rec)
    plain_seconds = t_pre + (N - 1) * plain_step
    best = max(records, key=lambda r: r["predicted_tokens_per_s"])
    print(f"predicted plain decoding {B * N / plain_seconds:.0f} tok/s; best choice {best['choice']} "
          f"{best['predicted_tokens_per_s']:.0f} tok/s ({best['predicted_tokens_per_s'] * plain_seconds / (B * N):.2f}x)")

    if FLAGS.check:
        plain_s, plain = real["plain"]
        for rec, (label, k, policy) in zip(records, choices):
            seconds, res = real[label]
            iterations = res.stats["accept_trace"].shape[1]              # loop iterations taken
            rec.update(measured_iterations=iterations, measured_alpha=res.stats["alpha"],
                       measured_tokens_per_s=B * N / seconds, measured_speedup=plain_s / seconds,
                       predicted_speedup=rec["predicted_tokens_per_s"] * plain_s / (B * N),
                       exact=res.tokens == plain.tokens)
            # The loop's step time (fixed k only: a policy's run mixes plain and speculative steps).
            rec["measured_step_ms"] = float("nan") if policy else measured_step(label, k) * 1e3
            rec["iterations_error"] = rec["predicted_iterations"] / iterations - 1
            rec["tokens_per_s_error"] = rec["predicted_tokens_per_s"] / rec["measured_tokens_per_s"] - 1
        print(f"measured plain decoding {B * N / plain_s:.0f} tok/s")

    print(f"\n{FLAGS.method} on {FLAGS.target}, {FLAGS.prompt_set}, batch {B}, {N} new tokens; trace at k={FLAGS.k_max}, "
          f"replayed {FLAGS.draws}x")
    head = ["choice", "pred iters", "pred alpha", "pred step ms", "pred tok/s"]
    if FLAGS.check:
        head += ["real iters", "real alpha", "real step ms", "real tok/s", "iters err", "tok/s err", "real speedup",
                 "exact"]
    print("| " + " | ".join(head) + " |\n| " + " | ".join("---" for _ in head) + " |")
    for r in records:
        cells = [r["choice"], f"{r['predicted_iterations']:.1f}", f"{r['predicted_alpha']:.3f}",
                 f"{r['predicted_step_ms']:.2f}", f"{r['predicted_tokens_per_s']:.0f}"]
        if FLAGS.check:
            cells += [str(r["measured_iterations"]), f"{r['measured_alpha']:.3f}", f"{r['measured_step_ms']:.2f}",
                      f"{r['measured_tokens_per_s']:.0f}",
                      f"{r['iterations_error']:+.1%}", f"{r['tokens_per_s_error']:+.1%}",
                      f"{r['measured_speedup']:.2f}x", "yes" if r["exact"] else "no"]
        print("| " + " | ".join(cells) + " |")
    write_table(records, FLAGS.out, meta={k: FLAGS[k].value for k in (
        "target", "method", "drafter", "prompt_set", "batch_size", "max_new_tokens", "k_max", "ks",
        "acceptance_rate_threshold", "acceptance_rate_window_size", "draws")})
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    fixed = [r for r in records if "switch" not in r["choice"]]
    ax.plot([r["k"] for r in fixed], [r["predicted_tokens_per_s"] for r in fixed], "o-", label="replayed trace")
    if FLAGS.check:
        ax.plot([r["k"] for r in fixed], [r["measured_tokens_per_s"] for r in fixed], "s--", label="real runs")
    ax.set_xlabel("k (drafts per step)")
    ax.set_ylabel("tokens/s")
    ax.legend()
    save_figure(fig, FLAGS.out)


if __name__ == "__main__":
    app.run(main)
