"""The main experiment: speculative vs plain decoding on the same target, measured side by side in one run, beside
the analytic prediction from the measured alpha, draft cost c and verify-cost ratio (`make demo` runs it).

  python -m experiments.speedup                  # SmolLM2-135M: ngram and suffix on 3 chat sets, EAGLE-3 and DFlash
  python -m experiments.speedup --target=stdlib-target --drafters=draft_model=stdlib-draft \\
      --runs=humaneval:draft_model:4,stdlib:ngram:8 --num_prompts=8

A run is prompt_set:method:k[:tree][:key=value ...]; --batch_sizes sweeps batches with the dynamic policy,
--engine_overhead splits a step into the models' work and the engine's own, --profile shows where each loop
iteration goes. The manual (runs, columns, modes, output): docs/speedup.md.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import app, flags
import jax
import numpy as np

import specjax
from specjax import SpecConfig, analysis, decode
from specjax.drafters import registry
from experiments import costs, harness
from experiments.harness import tree_fields
from experiments.prompts import load_prompt_set
from experiments.tables import pyplot, save_figure, write_table

FLAGS = flags.FLAGS
flags.DEFINE_string("target", "smollm2-135m", "target model: a shipped or installed name, an HF directory or a "
                    "GGUF file (the toy: stdlib-target)")
flags.DEFINE_enum("weight_format", "auto", ["auto", "float32", "panels", "gguf", "gguf_int8"], "the target's "
                  "weights: auto (panels where the CPU kernel runs, else float32), float32 (row-major), panels (the "
                  "same values in the CPU kernel's panels: the same tokens), gguf (a GGUF target's own Q4_1 / Q8_0 "
                  "blocks read by the CPU kernel: the same values and tokens, a third of the bytes per step) or "
                  "gguf_int8 (those blocks in llama.cpp's arithmetic, 8-bit "
                  "activations: LOSSY, and speculative tokens not promised equal to plain ones); "
                  "load_model(weight_format=)")
flags.DEFINE_list("drafters", [], "method=artifact pairs: what each method drafts from (a directory or a shipped "
                  "name), e.g. draft_model=stdlib-draft on the toy target")
# The default runs: the training-free drafters on the real target's three chat prompt sets (generation stops at
# the end of the assistant's turn), then its two trained drafters on held-out ShareGPT. The toy's table:
# --target=stdlib-target --drafters=draft_model=stdlib-draft
# --runs=humaneval:draft_model:4,humaneval:draft_model:4:dyn4x2,humaneval:ngram:4,stdlib:draft_model:4,stdlib:ngram:4
flags.DEFINE_list("runs", [f"{pset}:{method}:{k}:stop_at_eos=true" for pset in ("sharegpt", "humaneval_chat", "grounded")
                           for method, k in (("ngram", 4), ("suffix", 8))]
                  + [f"sharegpt:{m}:3:drafter=smollm2-135m-{m}:stop_at_eos=true" for m in ("eagle3", "dflash")],
                  "prompt_set:method:k[:tree] entries")
flags.DEFINE_integer("num_prompts", 3, "prompts per prompt set")
flags.DEFINE_integer("max_new_tokens", 96, "tokens generated per prompt")
flags.DEFINE_float("temperature", 0.0, "0 = greedy (exactness column compares tokens with plain decoding)")
flags.DEFINE_integer("top_k", 0, "top-k (0 = off)")
flags.DEFINE_float("top_p", 1.0, "top-p (1 = off)")
flags.DEFINE_integer("prompt_lookup_min", 1, "ngram: shortest n-gram tried")
flags.DEFINE_integer("prompt_lookup_max", 4, "ngram: longest n-gram tried")
flags.DEFINE_integer("seed", 0, "sampling seed")
flags.DEFINE_string("out", None, "path stem of the table (.csv, .json) and its figures (.png); default "
                    "runs/speedup/speedup, or runs/speedup/batch_scaling with --batch_sizes ('' = nowhere)")
flags.DEFINE_integer("rounds", None, "timed rounds, alternating plain decoding and the run (the fastest of each "
                     "kept); default 1 at batch 1 (every prompt is a call of its own), 3 with --batch_sizes")
flags.DEFINE_list("batch_sizes", [], "a batch sweep: for each B, the first B prompts decoded as one batch (empty: "
                  "prompts one at a time)")
flags.DEFINE_list("draft_len_schedule", ["8:k"], "batch sweeps: the dynamic policy's SpecConfig.draft_len_schedule, "
                  "as max_batch:k entries (k = 'k': the run's own k); an entry method@max_batch:k applies to that "
                  "method only, and a method with entries of its own ignores the unprefixed ones; empty: no "
                  "policy rows")
flags.DEFINE_float("acceptance_rate_threshold", None, "batch sweeps: the dynamic policy's acceptance-rate switch "
                   "(None: off)")
flags.DEFINE_integer("acceptance_rate_window_size", 16, "speculative steps the acceptance rate is taken over")
flags.DEFINE_bool("engine_overhead", False, "also each row's step run in turn (the drafter's proposal and commit "
                  "and the target's verify, as the loop runs them; experiments.costs.step_in_turn_seconds) beside "
                  "the two timed apart, and the row's decode loop on its first prompt (or batch) timed in the same "
                  "rounds: the loop's step over the step in turn is the engine's own overhead (stored as "
                  "in_turn_ms, taking_turns, loop_ms_per_step, engine_overhead)")
flags.DEFINE_integer("engine_overhead_rounds", harness.ENGINE_ROUNDS, "--engine_overhead's alternating rounds "
                     "(the fastest of each program kept; no time budget cuts them)", lower_bound=1)
flags.DEFINE_integer("engine_overhead_repeats", 3, "--engine_overhead's measurements per row, each its own rounds: "
                     "the row keeps the median overhead and the range (engine_overhead_min / _max)", lower_bound=1)
flags.DEFINE_enum("profile_by", "kind", ["kind", "signature", "part"], "--profile's grouping: by operation kind, "
                  "by signature (a kernel's or opcode's name and result shape, one key per kernel at one shape), or by "
                  f"the loop step's part ({', '.join(decode.STEP_PARTS)}; '{costs.LOOP_CONTROL}': the loop's own "
                  "control)")
flags.DEFINE_bool("profile", False, "also profile each row's decode loop and its plain baseline by XLA operation "
                  "(experiments.harness.loop_profile: CPU ms per loop iteration by kind, on the row's first prompt or "
                  "its batch), printed and stored in the row as `profile` / `plain_profile`")
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


# SpecConfig fields a run may set that its plain baseline must share: sampling, stopping, lengths, attention.
BASELINE_FIELDS = ("temperature", "top_k", "top_p", "max_new_tokens", "stop_at_eos", "max_cache_len", "implementation")


def baseline_overrides(run: dict) -> dict:
    """The run's overrides of the fields its plain baseline shares (BASELINE_FIELDS)."""
    return {f: v for f, v in run["overrides"].items() if f in BASELINE_FIELDS}


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
        elif "/" in value:                              # a tuple field, e.g. verify_widths=1/2/4
            value = tuple(int(v) for v in value.split("/") if v)
        for cast in (int, float):
            if not isinstance(value, str):
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
    """Decode prompts one by one with each (config, drafter) in `runs`, timed side by side (--rounds alternating
    rounds, one compile call per run first): experiments.harness.run_prompts at batch 1. -> [(outputs, totals)]
    per run."""
    return harness.run_prompts(target, prompts, runs, rounds=FLAGS.rounds or 1, seed=FLAGS.seed)


_loaded: dict = {}


def drafter_argument(target, method: str, plain_outputs: list, artifact: str | None = None):
    """What `method` drafts from in this experiment: its artifact (the run's drafter=, else --drafters; loaded
    once and reused), the plain outputs as predictions for methods that take one prediction per request, else
    None."""
    spec = registry.get(method)
    artifact = artifact or flag_artifact(method)
    if artifact:
        key = (target.name, method, artifact)
        if key not in _loaded:
            _loaded[key] = spec.load(target, artifact) if spec.load else artifact
        return _loaded[key]
    if spec.per_request_params:
        return plain_outputs
    return None


def flag_artifact(method: str) -> str | None:
    """--drafters' artifact for `method` (None: not listed)."""
    return dict(entry.split("=", 1) for entry in FLAGS.drafters).get(method)


def artifact_name(method: str, run: dict) -> str | None:
    """The artifact a run drafts from, as named: the run's drafter=, else --drafters' entry for its method."""
    return run["drafter"] or flag_artifact(method)


def out_stem(default: str) -> str:
    return default if FLAGS.out is None else FLAGS.out


def flag_values(*names: str) -> dict:
    return {name: FLAGS[name].value for name in names}


_STARTED = time.perf_counter()


def _elapsed() -> str:
    """Seconds since the program started, on each progress line: on an accelerator compiling, not decoding, can
    take most of a run's time, and a run cut off by a time limit then shows how far each row got."""
    return f"[{time.perf_counter() - _STARTED:.0f} s]"


def _layout(target) -> str:
    """How the target holds its layer matrices: "panels" (the CPU kernel's PanelMatrix) or "row-major"."""
    return "panels" if "wqkv" in target.params["layers"][0] else "row-major"


def main(argv):
    del argv
    for module in FLAGS.drafter_modules:
        importlib.import_module(module)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; temperature {FLAGS.temperature} unless a run "
          f"sets its own")
    if FLAGS.batch_sizes:
        batch_sweep([int(b) for b in FLAGS.batch_sizes])
    else:
        one_at_a_time()


def one_at_a_time() -> None:
    """Every run's prompts decoded one at a time beside plain decoding; the table and its figures. Runs that share
    a plain baseline (prompt set, target, the baseline's fields) are timed side by side in one alternating pass
    with it: one plain timing per group, not one per row."""
    stem = out_stem("runs/speedup/speedup")
    rows, targets, records, plain_profiles, groups, cost_memo = [], {}, [], {}, {}, {}
    for entry in FLAGS.runs:
        run = parse_run(entry)
        if run["target"] not in targets:
            targets[run["target"]] = specjax.load_model(run["target"], weight_format=FLAGS.weight_format)
            t = targets[run["target"]]
            print(f"target {t.name}: {t.config.num_params() / 1e6:.1f}M params")
        # A run's own settings of what plain decoding reads too (temperature=..., stop_at_eos=...) are its plain
        # baseline's: the exactness column compares like with like.
        plain_config = spec_config("none", None, **baseline_overrides(run))
        groups.setdefault((run["pset"], run["target"], plain_config), []).append(run)
    for key, group in groups.items():
        pset, target_name, plain_config = key
        target = targets[target_name]
        temperature = plain_config.temperature
        prompts = load_prompt_set(pset, FLAGS.num_prompts, target.tokenizer)
        # Plain outputs first only where a method drafts from them (predictions: one per request).
        needs_outputs = any(registry.get(run["method"]).per_request_params and not artifact_name(run["method"], run)
                            for run in group)
        plain_outputs = run_prompts(target, prompts, [(plain_config, None)])[0][0] if needs_outputs else None
        configs, drafter_args = [], []
        for run in group:
            drafter_args.append(drafter_argument(target, run["method"], plain_outputs, run["drafter"]))
            configs.append(spec_config(run["method"], run["k"], run["tree"], artifact_name(run["method"], run),
                                       **run["overrides"]))
        print(f"{_elapsed()} {pset}: plain decoding and {len(group)} run(s), compiled and timed side by side",
              flush=True)
        (base_outs, base), *timed = run_prompts(target, prompts, [(plain_config, None)]
                                                + list(zip(configs, drafter_args)))
        tps = base["tokens_per_s"]
        print(f"{_elapsed()} plain decoding of {target.name} on {pset} at temperature {temperature}: "
              f"{tps:.1f} tok/s, "
              f"{tps * target.config.num_params() * 4 / 1e9:.2f} GB/s of float32 weights"
              + (f" (read as their GGUF blocks, {FLAGS.weight_format})" if FLAGS.weight_format.startswith("gguf")
                 else f" read ({_layout(target)})"))
        for run, config, drafter_arg, (outs, st) in zip(group, configs, drafter_args, timed):
            method, k, tree = run["method"], config.k, run["tree"]
            artifact = artifact_name(method, run)
            # Draft, verify and decode costs measured as the loop pays them, and the prediction from them.
            pred = harness.predict(target, config, drafter_arg, prompts, st, base, FLAGS.max_new_tokens, bool(tree),
                                   cost_memo=cost_memo, engine_overhead=FLAGS.engine_overhead,
                                   engine_rounds=FLAGS.engine_overhead_rounds,
                                   engine_repeats=FLAGS.engine_overhead_repeats)
            c, verify_cost, alpha_fit, predicted, steady = (pred[f] for f in ("c", "verify_cost", "alpha_fit",
                                                                              "predicted", "steady"))
            plain_ms, step_ms = pred["plain_ms_per_step"], pred["spec_ms_per_step"]
            tp, tv, t1 = pred["propose_ms"] / 1e3, pred["verify_ms"] / 1e3, pred["decode_ms"] / 1e3
            share, model_ms = pred["one_position_share"], pred["model_ms_per_step"]
            measured = st["tokens_per_s"] / base["tokens_per_s"]
            # Sampled output matches the plain run only in distribution (the conformance suite tests that), not
            # per token.
            exact = ("yes" if outs == base_outs else "no") if temperature == 0 else "n/a"
            # The row's own settings; those it shares with its baseline (stop_at_eos, ...) are the group's.
            shown = {f: v for f, v in {**run["overrides"], **dict(run["overrides"].get("drafter_options") or {})}
                     .items() if f not in BASELINE_FIELDS + ("drafter_options",)}
            name = run["label"] or method + (f"/{tree}" if tree else "") + "".join(f"/{v}" for v in shown.values())
            per_pos = ",".join(f"{a:.2f}" for a in st["accept_per_position"][:8])
            records.append(dict(prompts=pset, method=name, target=target.name, temperature=temperature, k=k,
                                alpha=st["alpha"],
                                alpha_fit=alpha_fit, tau=st["tau"], accept_per_position=st["accept_per_position"],
                                tokens_per_s=st["tokens_per_s"], plain_tokens_per_s=base["tokens_per_s"],
                                speedup=measured, steady=steady, predicted=predicted, c=c, verify_cost=verify_cost,
                                exact=exact, drafter=artifact, accept_hist=np.asarray(st["accept_hist"]).tolist(),
                                target_passes=st["target_passes"], propose_ms=tp * 1e3,
                                commit_ms=pred["commit_ms"], verify_ms=tv * 1e3,
                                decode_ms=t1 * 1e3, plain_ms_per_step=plain_ms, spec_ms_per_step=step_ms,
                                model_ms_per_step=model_ms, one_position_share=share, plain_passes=st["plain_passes"],
                                verify_hist=np.asarray(st["verify_hist"]).tolist(),
                                verify_cost_full=pred.get("verify_cost_full", verify_cost),
                                **{f: pred[f] for f in ENGINE_FIELDS if f in pred}))
            print(f"{_elapsed()} [{len(records)}/{len(FLAGS.runs)}] {pset} T={temperature:g} {name}: "
                  f"tau {st['tau']:.2f}, "
                  f"per-position acceptance {per_pos}, speedup {measured:.2f}x (predicted {predicted:.2f}x)",
                  flush=True)
            if FLAGS.engine_overhead:
                print_engine_overhead(pred, method)
            if FLAGS.profile:
                first = [harness.prompt_ids(target, prompts[0])]
                one = drafter_arg[:1] if isinstance(drafter_arg, list) else drafter_arg
                if key not in plain_profiles:                   # one per baseline, as the baselines themselves
                    plain_profiles[key] = harness.loop_profile(target, first, plain_config, by=FLAGS.profile_by)
                records[-1].update(plain_profile=plain_profiles[key], profile=harness.loop_profile(
                    target, first, config, one, by=FLAGS.profile_by))
                print(f"    plain: {harness.profile_line(records[-1]['plain_profile'])}\n"
                      f"    {name}: {harness.profile_line(records[-1]['profile'])}", flush=True)
            if stem:                            # after every row, so a crash later loses nothing measured
                write_table(records, stem, meta=flag_values("target", "runs", "num_prompts", "max_new_tokens",
                                                            "temperature", "rounds", "drafters", "seed"))
            rows.append((pset, temperature, name, k, st["alpha"], alpha_fit, st["tau"],
                         st["tokens_per_s"], base["tokens_per_s"], measured, steady, predicted, c, verify_cost,
                         exact, plain_ms, t1 * 1e3, step_ms, model_ms, share))

    print("\nalpha = accepted/drafted; alpha_fit = i.i.d. acceptance that explains tau of the verify steps; c = draft "
          "cost per token / target decode step; vcost = (k+1)-position verify / 1-position decode (verify_widths: the "
          "mean over the verify passes at their widths); 1pos = share of "
          "steps that verified one position (nothing drafted); predicted = tau / (k c + 1pos + (1 - 1pos) vcost), "
          "for a chain (1-a^(k+1))/((1-a)(k c + vcost)) with a = alpha_fit when 1pos = 0")
    hdr = (f"{'prompts':>9} {'T':>3} {'method':>28} {'k':>2} {'alpha':>6} {'a_fit':>6} {'tau':>5} {'tok/s':>7} "
           f"{'plain':>7} {'speedup':>8} {'steady':>7} {'predicted':>9} {'gap':>6} {'c':>6} {'vcost':>6} {'1pos':>5} "
           f"{'exact':>5} {'plain ms/step':>13} {'(model)':>7} {'spec ms/step':>12} {'(model)':>7}")
    print(hdr)
    for r in rows:
        pset, temp, method, k, alpha, afit, tau, tps, base_tps, meas, steady, pred, c, vc, exact, pms, t1ms, sms, pm, \
            share = r
        print(f"{pset:>9} {temp:3g} {method:>28} {k:>2} {alpha:6.3f} {afit:6.3f} {tau:5.2f} {tps:7.1f} {base_tps:7.1f} "
              f"{meas:7.2f}x {steady:6.2f}x {pred:8.2f}x {steady / pred - 1:+6.1%} {c:6.3f} {vc:6.2f} {share:5.2f} "
              f"{exact:>5} {pms:13.2f} {t1ms:7.2f} {sms:12.2f} {pm:7.2f}")
    print("speedup: end to end (tokens/s, prefill included); steady: the decode loop alone (measured prefill time "
          "subtracted), which is what the formula predicts; gap = steady / predicted - 1. ms/step: measured time "
          "per target pass in the loop; (model): what the prediction assumes (one target forward for plain, "
          "propose + verify for speculative, one forward for its one-position steps); their difference also holds "
          "the machine's drift between the run and the cost measurements and the bias of the fastest of --rounds "
          "calls against the fastest of ~50: --engine_overhead measures the engine's own side by side.")
    if stem and records:
        plot(records, stem)
    differ = [f"{r[0]}:{r[2]}:{r[3]}" for r in rows if r[14] == "no"]
    if differ:                  # greedy speculative output must equal plain greedy output: fail loudly, not a cell
        raise SystemExit(f"greedy speculative output differs from plain decoding in runs {differ}")


ENGINE_FIELDS = ("in_turn_ms", "taking_turns", "loop_ms_per_step", "engine_overhead", "engine_overhead_min",
                 "engine_overhead_max")


def print_engine_overhead(measured: dict, method: str) -> None:
    """--engine_overhead's line under a row (harness.engine_fields' fields)."""
    line = (f"    the step's model work in turn: {measured['in_turn_ms']:.3f} ms, x{measured['taking_turns']:.2f} the "
            "drafter's part and the verify timed apart")
    if "engine_overhead" in measured:
        line += (f"; beside it the loop's step {measured['loop_ms_per_step']:.3f} ms: engine overhead "
                 f"{measured['engine_overhead']:+.1%}")
        if "engine_overhead_min" in measured:
            line += (f" (the median of repeats from {measured['engine_overhead_min']:+.1%} to "
                     f"{measured['engine_overhead_max']:+.1%})")
    else:
        line += f"; engine overhead not measured: {method} learns from each call's outputs"
    print(line, flush=True)


def plot(records: list[dict], stem: str) -> None:
    """Two figures beside the JSON: per-position acceptance of every chain row, and speedup vs k for every
    (prompts, method, T) measured at two or more k, with the analytic curve through the group's measured costs
    (alpha_fit, c and the verify-cost ratio per k, interpolated between the measured k)."""
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


def batch_sweep(batch_sizes: list[int]) -> None:
    """For each batch size and run: plain decoding, the run and its dynamic policy on one batch, side by side
    (experiments.harness.measure_batch); the table, the EAGLE-3 batch-table layout and the figure."""
    stem = out_stem("runs/speedup/batch_scaling")
    rounds = FLAGS.rounds or 3
    target = specjax.load_model(FLAGS.target, weight_format=FLAGS.weight_format)
    runs = [parse_run(entry) for entry in FLAGS.runs]
    if any(run["target"] != FLAGS.target for run in runs):
        raise app.UsageError("--batch_sizes sweeps one target (--target): drop target= from the runs")
    peak_flops, bandwidth = costs.machine_roofline()
    print(f"this machine: {peak_flops / 1e9:.0f} GFLOP/s (float32 matmul), {bandwidth / 1e9:.1f} GB/s (array read)")
    records, plain_profiles = [], {}
    for B in batch_sizes:
        for run in runs:
            pset, method, k, tree = run["pset"], run["method"], run["k"], run["tree"]
            prompts = load_prompt_set(pset, B, target.tokenizer)
            if len(prompts) < B:
                raise ValueError(f"prompt set {pset!r} has {len(prompts)} prompts, fewer than batch size {B}")
            ids = [harness.prompt_ids(target, p) for p in prompts]     # tokenized once
            plain_config = spec_config("none", None, **baseline_overrides(run))
            plain_out = (specjax.generate(target, ids, plain_config, pad_to=max(map(len, ids))).tokens
                         if registry.get(method).per_request_params else None)   # predictions: plain's output
            drafter = drafter_argument(target, method, plain_out, run["drafter"])
            artifact = artifact_name(method, run)
            config = spec_config(method, k, tree, artifact, **run["overrides"])
            try:
                fields = harness.policy_fields(FLAGS.draft_len_schedule, method, config.k,
                                               FLAGS.acceptance_rate_threshold, FLAGS.acceptance_rate_window_size)
            except ValueError as e:
                raise app.UsageError(f"--draft_len_schedule: {e}") from None
            policy = spec_config(method, k, tree, artifact, **run["overrides"], **fields) if fields else None
            rec = {"batch": B, "prompts": pset, "method": run["label"] or method + (f"/{tree}" if tree else ""),
                   **harness.measure_batch(target, ids, plain_config, config, drafter, policy, rounds,
                                           (peak_flops, bandwidth), engine_overhead=FLAGS.engine_overhead,
                                           engine_rounds=FLAGS.engine_overhead_rounds,
                                           engine_repeats=FLAGS.engine_overhead_repeats)}
            if FLAGS.profile:
                plain_key = (B, pset, plain_config)
                if plain_key not in plain_profiles:
                    plain_profiles[plain_key] = harness.loop_profile(target, ids, plain_config, by=FLAGS.profile_by)
                rec.update(plain_profile=plain_profiles[plain_key],
                           profile=harness.loop_profile(target, ids, config, drafter, by=FLAGS.profile_by))
            records.append(rec)
            print(f"{_elapsed()} batch {B:>3} {rec['method']:>14} k={rec['k']}: "
                  f"plain {rec['plain_tokens_per_s']:7.0f} tok/s, "
                  f"spec {rec['tokens_per_s']:7.0f} ({rec['speedup']:.2f}x, predicted {rec['predicted']:.2f}x, "
                  f"loop alone {rec['predicted_steady']:.2f}x; prefill {rec['prefill_share']:.0%} of plain), "
                  f"alpha {rec['alpha']:.3f} tau {rec['tau']:.2f} (batch {rec['batch_tau']:.2f}) c_step "
                  f"{rec['c_step']:.2f} verify {rec['verify_cost']:.2f}, roofline {rec['roofline']:.2f}x"
                  + (f"; policy (k={rec['policy_k']}, {rec['policy_program']}) {rec['policy_speedup']:.2f}x"
                     if policy else "")
                  + (f"; plain timed again: {rec['plain_repeat']:.2f}x" if rec.get("policy_program") == "plain"
                     else ""), flush=True)
            if FLAGS.engine_overhead and "in_turn_ms" in rec:
                print_engine_overhead(rec, rec["method"])
            if FLAGS.profile:
                print(f"    plain: {harness.profile_line(rec['plain_profile'])}\n"
                      f"    {rec['method']}: {harness.profile_line(rec['profile'])}", flush=True)

    print(f"\n{FLAGS.target}, {FLAGS.max_new_tokens} new tokens per row, EOS ignored; one call per batch; fastest "
          f"of {rounds} alternating rounds")
    print("| batch | method | k | plain tok/s | spec tok/s | speedup | predicted | loop alone | roofline | "
          "prefill share | alpha | tau | batch tau | c_step | verify cost | policy k | policy | exact |")
    print("| " + " | ".join(["---"] * 18) + " |")
    for r in records:
        pol = (f"{r['policy_k']} | {r['policy_speedup']:.2f}x" if "policy_k" in r else "- | -")
        print(f"| {r['batch']} | {r['method']} | {r['k']} | {r['plain_tokens_per_s']:.0f} | {r['tokens_per_s']:.0f} "
              f"| {r['speedup']:.2f}x | {r['predicted']:.2f}x | {r['predicted_steady']:.2f}x | "
              f"{r['roofline']:.2f}x | {r['prefill_share']:.0%} | {r['alpha']:.3f} | {r['tau']:.2f} | "
              f"{r['batch_tau']:.2f} | {r['c_step']:.2f} | {r['verify_cost']:.2f} | {pol} | {r['exact']} |")
    print_batch_table(records, batch_sizes)
    if stem:
        write_table(records, stem, meta={**flag_values(
            "target", "runs", "batch_sizes", "max_new_tokens", "temperature", "rounds", "drafters", "seed",
            "draft_len_schedule", "acceptance_rate_threshold", "acceptance_rate_window_size"),
            "peak_flops": peak_flops, "bandwidth": bandwidth})
        plot_batches(records, batch_sizes, stem)


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
                print(f"| {label} | " + " | ".join(f"{rows[b][key]:.2f}" if b in rows and not np.isnan(
                    rows[b].get(key, np.nan)) else "-" for b in batch_sizes) + " |")


def plot_batches(records: list[dict], batch_sizes: list[int], stem: str) -> None:
    """Throughput relative to plain decoding against the batch size: measured, predicted and the policy."""
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
    save_figure(fig, stem)


if __name__ == "__main__":
    app.run(main)
