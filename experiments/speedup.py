"""The main experiment: speculative vs plain decoding on the same target, measured in one run, beside the analytic
prediction from the measured alpha, draft cost c and verify-cost ratio.

  python -m experiments.speedup                                   # shipped models, HumanEval + stdlib prompts
  python -m experiments.speedup --runs=humaneval:draft_model:4,stdlib:ngram:8 --num_prompts=8
  PYTHONPATH=tests python -m experiments.speedup --drafter_modules=_repeat_last_drafter --runs=humaneval:repeat_last:2

Each run is prompt_set:method:k[:tree][:key=value ...], where tree is `dyn<D>x<K>` (an EAGLE-2-style dynamic tree
of depth D, top-K children, k drafted nodes, pruned by cumulative draft log-probability), `static` (a fixed tree
of k choices: two branches per node, rank-0-first), `medusa63` (Medusa's 63-node tree; k = 63) or `acc` (Medusa:
the k-node tree that the heads' measured per-rank accuracies favour, from the artifact's MANIFEST). Tree and chain
at the same k draft and verify the same number of tokens per step. Optional key=value fields: `target=` (a
shipped name or directory: this row and its plain baseline run on that target), `drafter=` (the artifact, instead
of --drafters), `label=` (the row's name), any SpecConfig field (e.g. acceptance_method=typical_lossy), and any
drafter option of the method (e.g. `humaneval:lookahead:16:window_size=4:ngram_size=3:guess_set_size=4`). For
suffix decoding `drafter=` names its global cache (`humaneval2x:suffix:8:drafter=rep`: a fresh one per name).
Prompts are decoded one at a time (batch 1), as in the papers' tables.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import app, flags
import jax
import numpy as np

import specjax
from specjax import SpecConfig, analysis
from specjax.drafters import registry
from experiments import harness
from experiments.harness import tree_fields
from experiments.prompts import load_prompt_set

FLAGS = flags.FLAGS
flags.DEFINE_string("target", "stdlib-target", "target model: shipped name or HF directory")
flags.DEFINE_list("drafters", ["draft_model=stdlib-draft"],
                  "method=artifact pairs: what each method drafts from (a directory or a shipped name)")
flags.DEFINE_list("runs", ["humaneval:draft_model:4", "humaneval:draft_model:4:dyn4x2", "humaneval:ngram:4",
                           "stdlib:draft_model:4", "stdlib:ngram:4"], "prompt_set:method:k[:tree] entries")
flags.DEFINE_integer("num_prompts", 6, "prompts per prompt set")
flags.DEFINE_integer("max_new_tokens", 96, "tokens generated per prompt")
flags.DEFINE_float("temperature", 0.0, "0 = greedy (exactness column compares tokens with plain decoding)")
flags.DEFINE_integer("top_k", 0, "top-k (0 = off)")
flags.DEFINE_float("top_p", 1.0, "top-p (1 = off)")
flags.DEFINE_integer("prompt_lookup_min", 1, "ngram: shortest n-gram tried")
flags.DEFINE_integer("prompt_lookup_max", 4, "ngram: longest n-gram tried")
flags.DEFINE_integer("seed", 0, "sampling seed")
flags.DEFINE_string("out", "runs/speedup.json", "where the rows are written as JSON ('' = nowhere)")
flags.DEFINE_integer("repeats", 1, "timed passes over the prompt set (times are averaged over them)")
flags.DEFINE_list("drafter_modules", [], "importable modules that register extra drafters (specjax.drafters."
                  "registry.register), imported before the runs; e.g. _repeat_last_drafter with PYTHONPATH=tests")


def spec_config(method: str, k: int | None, tree: str = "", artifact: str | None = None, **overrides) -> SpecConfig:
    """The run's SpecConfig: the flags' sampling settings, then the run's own fields (e.g. temperature=1)."""
    fields = dict(max_new_tokens=FLAGS.max_new_tokens, temperature=FLAGS.temperature, top_k=FLAGS.top_k,
                  top_p=FLAGS.top_p, stop_at_eos=False)
    if "prompt_lookup_min" in registry.get(method).reads:
        fields.update(prompt_lookup_min=FLAGS.prompt_lookup_min, prompt_lookup_max=FLAGS.prompt_lookup_max)
    if method != "none":
        fields.update(tree_fields(tree, k, artifact))
    fields.update(overrides)
    return SpecConfig(method=method, **fields)


def parse_run(entry: str) -> dict:
    """prompt_set:method:k[:tree][:key=value ...] -> its parts (see the module docstring)."""
    parts = entry.split(":")
    if len(parts) < 3:
        raise ValueError(f"run {entry!r}: expected prompt_set:method:k[:tree][:key=value ...]")
    tree = parts[3] if len(parts) > 3 and "=" not in parts[3] else ""
    extra = dict(p.split("=", 1) for p in parts[3 + bool(tree):] if p)
    run = {"pset": parts[0], "method": parts[1], "k": int(parts[2]), "tree": tree,
           "target": extra.pop("target", FLAGS.target), "drafter": extra.pop("drafter", None),
           "label": extra.pop("label", None)}
    fields = {f.name: f.type for f in dataclasses.fields(SpecConfig)}
    options = registry.get(run["method"]).options
    overrides, drafter_options = {}, {}
    for key, value in extra.items():
        if key not in fields and key not in options:
            raise ValueError(f"run {entry!r}: unknown field {key!r} (neither a SpecConfig field nor an option of "
                             f"method={run['method']!r}: {sorted(options) or 'none'})")
        if value.lower() in ("true", "false"):
            value = value.lower() == "true"
        for cast in (int, float):
            if isinstance(value, bool):
                break
            try:
                value = cast(value)
                break
            except ValueError:
                pass
        (overrides if key in fields else drafter_options)[key] = value
    if drafter_options:
        overrides["drafter_options"] = drafter_options
    run["overrides"] = overrides
    return run


def run_prompts(target, prompts, runs: list) -> list[tuple[list, dict]]:
    """Decode prompts one by one with each (config, drafter) in `runs`, timed interleaved (--repeats passes, one
    compile call per run first): experiments.harness.run_prompts at batch 1. -> [(outputs, totals)] per run."""
    return harness.run_prompts(target, prompts, runs, repeats=FLAGS.repeats, seed=FLAGS.seed)


_loaded: dict = {}


def drafter_argument(target, method: str, plain_outputs: list, artifact: str | None = None):
    """What `method` drafts from in this experiment: its artifact (the run's drafter=, else --drafters; loaded
    once and reused), the plain outputs as predictions for methods that take one prediction per request, else
    None."""
    spec = registry.get(method)
    artifact = artifact or dict(entry.split("=", 1) for entry in FLAGS.drafters).get(method)
    if artifact:
        key = (target.name, method, artifact)
        if key not in _loaded:
            _loaded[key] = spec.load(target, artifact) if spec.load else artifact
        return _loaded[key]
    if spec.per_request_params:
        return plain_outputs
    return None


def main(argv):
    del argv
    for module in FLAGS.drafter_modules:
        importlib.import_module(module)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; temperature {FLAGS.temperature} unless a run "
          f"sets its own")
    rows, baselines, prompt_sets, targets, records = [], {}, {}, {}, []
    for entry in FLAGS.runs:
        run = parse_run(entry)
        pset, method, k, tree = run["pset"], run["method"], run["k"], run["tree"]
        if run["target"] not in targets:
            targets[run["target"]] = specjax.load_model(run["target"])
            t = targets[run["target"]]
            print(f"target {t.name}: {t.config.num_params() / 1e6:.1f}M params")
        target = targets[run["target"]]
        # Sampling settings are per run (a run may set temperature=...); its plain baseline uses the same ones.
        sampling = {f: v for f, v in run["overrides"].items() if f in ("temperature", "top_k", "top_p")}
        plain_config = spec_config("none", None, **sampling)
        temperature = plain_config.temperature
        if (pset, run["target"]) not in prompt_sets:
            prompt_sets[(pset, run["target"])] = load_prompt_set(pset, FLAGS.num_prompts, target.tokenizer)
        prompts = prompt_sets[(pset, run["target"])]
        key = (pset, run["target"], plain_config.sampling)
        if key not in baselines:
            baselines[key] = run_prompts(target, prompts, [(plain_config, None)])[0]
            tps = baselines[key][1]["tokens_per_s"]
            print(f"plain decoding of {target.name} on {pset} at temperature {temperature}: {tps:.1f} tok/s, "
                  f"{tps * target.config.num_params() * 4 / 1e9:.2f} GB/s of float32 weight reads")
        drafter_arg = drafter_argument(target, method, baselines[key][0], run["drafter"])
        artifact = run["drafter"] or dict(e.split("=", 1) for e in FLAGS.drafters).get(method)
        config = spec_config(method, k, tree, artifact, **run["overrides"])
        k = config.k
        base_outs = baselines[key][0]
        # Plain decoding is timed again, interleaved with this run, for the speedup of this row.
        (_, base), (outs, st) = run_prompts(target, prompts, [(plain_config, None), (config, drafter_arg)])

        # Draft, verify and decode costs measured as the loop pays them, and the prediction from them.
        pred = harness.predict(target, config, drafter_arg, prompts, st, base, FLAGS.max_new_tokens, bool(tree))
        c, verify_cost, alpha_fit, predicted, steady = (pred[f] for f in ("c", "verify_cost", "alpha_fit",
                                                                          "predicted", "steady"))
        plain_ms, step_ms = pred["plain_ms_per_step"], pred["spec_ms_per_step"]
        tp, tv, t1 = pred["propose_ms"] / 1e3, pred["verify_ms"] / 1e3, pred["decode_ms"] / 1e3
        measured = st["tokens_per_s"] / base["tokens_per_s"]
        # Sampled output matches the plain run only in distribution (tested by the conformance suite), not per token.
        exact = ("yes" if outs == base_outs else "no") if temperature == 0 else "n/a"
        shown = {**run["overrides"], **dict(run["overrides"].get("drafter_options") or {})}
        shown.pop("drafter_options", None)
        name = run["label"] or method + (f"/{tree}" if tree else "") + "".join(f"/{v}" for v in shown.values())
        per_pos = ",".join(f"{a:.2f}" for a in st["accept_per_position"][:8])
        records.append(dict(prompts=pset, method=name, target=target.name, temperature=temperature, k=k,
                            alpha=st["alpha"],
                            alpha_fit=alpha_fit, tau=st["tau"], accept_per_position=st["accept_per_position"],
                            tokens_per_s=st["tokens_per_s"], plain_tokens_per_s=base["tokens_per_s"],
                            speedup=measured, steady=steady, predicted=predicted, c=c, verify_cost=verify_cost,
                            exact=exact, drafter=artifact, accept_hist=np.asarray(st["accept_hist"]).tolist(),
                            target_passes=st["target_passes"], propose_ms=tp * 1e3, verify_ms=tv * 1e3,
                            decode_ms=t1 * 1e3, plain_ms_per_step=plain_ms, spec_ms_per_step=step_ms))
        print(f"[{len(records)}/{len(FLAGS.runs)}] {pset} T={temperature:g} {name}: tau {st['tau']:.2f}, per-position acceptance "
              f"{per_pos}, speedup {measured:.2f}x (predicted {predicted:.2f}x)", flush=True)
        if FLAGS.out:                       # after every row, so a crash later loses nothing measured
            os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
            with open(FLAGS.out, "w") as f:
                json.dump({"flags": {k: FLAGS[k].value for k in ("runs", "num_prompts", "max_new_tokens",
                                                                "temperature", "repeats", "drafters", "seed")},
                           "rows": records}, f, indent=1)
        rows.append((pset, temperature, name, k, st["alpha"], alpha_fit, st["tau"],
                     st["tokens_per_s"], base["tokens_per_s"], measured, steady, predicted, c, verify_cost,
                     exact, plain_ms, t1 * 1e3, step_ms, (tp + tv) * 1e3))

    print("\nalpha = accepted/drafted; alpha_fit = i.i.d. acceptance that explains tau; c = draft cost per token "
          "/ target decode step; vcost = (k+1)-position verify / 1-position decode; predicted = "
          "(1-a^(k+1))/((1-a)(k c + vcost)) with a = alpha_fit")
    hdr = (f"{'prompts':>9} {'T':>3} {'method':>28} {'k':>2} {'alpha':>6} {'a_fit':>6} {'tau':>5} {'tok/s':>7} "
           f"{'plain':>7} {'speedup':>8} {'steady':>7} {'predicted':>9} {'gap':>6} {'c':>6} {'vcost':>6} "
           f"{'exact':>5} {'plain ms/step':>13} {'(model)':>7} {'spec ms/step':>12} {'(model)':>7}")
    print(hdr)
    for r in rows:
        pset, temp, method, k, alpha, afit, tau, tps, base_tps, meas, steady, pred, c, vc, exact, pms, t1ms, sms, pm = r
        print(f"{pset:>9} {temp:3g} {method:>28} {k:>2} {alpha:6.3f} {afit:6.3f} {tau:5.2f} {tps:7.1f} {base_tps:7.1f} "
              f"{meas:7.2f}x {steady:6.2f}x {pred:8.2f}x {steady / pred - 1:+6.1%} {c:6.3f} {vc:6.2f} "
              f"{exact:>5} {pms:13.2f} {t1ms:7.2f} {sms:12.2f} {pm:7.2f}")
    print("speedup: end to end (tokens/s, prefill included); steady: the decode loop alone (measured prefill time "
          "subtracted), which is what the formula predicts; gap = steady / predicted - 1. ms/step: measured time "
          "per target pass in the loop; (model): what the prediction assumes (one target forward for plain, "
          "propose + verify for speculative); their difference is the engine's per-step overhead.")
    if FLAGS.out and records:
        plot(records, os.path.splitext(FLAGS.out)[0])


def plot(records: list[dict], stem: str) -> None:
    """Two figures beside the JSON: per-position acceptance of every chain row, and speedup vs k for every
    (prompts, method, T) measured at two or more k, with the analytic curve through the group's measured costs
    (alpha_fit, c and the verify-cost ratio per k, interpolated between the measured k)."""
    from experiments.tables import pyplot, save_figure
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in records:
        if r["accept_per_position"] and not np.isnan(r["alpha_fit"]):
            pos = np.arange(1, len(r["accept_per_position"]) + 1)
            ax.plot(pos, r["accept_per_position"], "o-", ms=3, label=f"{r['prompts']} T={r['temperature']:g} "
                    f"{r['method']} k={r['k']}")
    ax.set_xlabel("draft position")
    ax.set_ylabel("P(accepted)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=6)
    save_figure(fig, stem + "_acceptance")

    groups: dict = {}
    for r in records:
        if not np.isnan(r["alpha_fit"]):
            groups.setdefault((r["prompts"], r["method"].split("/")[0], r["temperature"]), []).append(r)
    groups = {key: sorted(rows, key=lambda r: r["k"]) for key, rows in groups.items() if len({r["k"] for r in rows}) > 1}
    if not groups:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for (pset, method, temperature), rows in groups.items():
        ks = [r["k"] for r in rows]
        line, = ax.plot(ks, [r["speedup"] for r in rows], "o", label=f"{pset} T={temperature:g} {method} measured")
        alpha = float(np.mean([r["alpha_fit"] for r in rows]))
        grid = np.arange(1, max(ks) + 1)
        c = np.interp(grid, ks, [r["c"] for r in rows])
        verify = {r["k"] + 1: r["verify_cost"] for r in rows}
        ax.plot(grid, [analysis.walltime_speedup(alpha, int(k), float(ck), verify) for k, ck in zip(grid, c)], "--",
                color=line.get_color(), label=f"analytic (alpha {alpha:.2f})")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("k (drafts per step)")
    ax.set_ylabel("speedup vs plain decoding")
    ax.legend(fontsize=6)
    save_figure(fig, stem + "_speedup_vs_k")


if __name__ == "__main__":
    app.run(main)
