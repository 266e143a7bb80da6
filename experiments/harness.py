"""The flag-free parts of measuring speculative against plain decoding, shared by experiments/speedup.py (many
runs, batch 1) and experiments/reproduce.py (one paper row, any batch): tree settings from a short name, the
interleaved timing of plain and speculative decoding over a prompt set, and the analytic prediction from measured
costs (experiments/costs.py). No absl flags here: every setting is an argument, so any experiment can import it.
"""
from __future__ import annotations

import numpy as np

import specjax
from specjax import analysis, metrics
from specjax.drafters.registry import BuildRequest, build as build_drafter
from specjax.drafters import registry
from experiments import costs


def tree_fields(tree: str, k: int, artifact: str | None = None) -> dict:
    """`dyn<D>x<K>` -> dynamic tree; `static` -> a fixed k-node tree (two branches at every depth near the root);
    `medusa63` -> Medusa's 63-node tree; `acc` -> the k-node tree a Medusa artifact's measured accuracies favour;
    '' -> a chain of k."""
    if not tree:
        return dict(num_speculative_tokens=k)
    if tree.startswith("dyn"):
        depth, topk = map(int, tree[3:].split("x"))
        return dict(num_steps=depth, topk=topk, num_draft_tokens=k + 1)
    if tree.startswith("acc"):             # Medusa: the tree its heads' measured accuracies favour, of k nodes
        from specjax.drafters.medusa import accuracy_tree
        return dict(tree_choices=accuracy_tree(artifact, k))
    if tree == "medusa63":
        from specjax.trees import MEDUSA_63
        return dict(tree_choices=MEDUSA_63)
    if tree == "static":
        from specjax.trees import normalize_choices
        choices, frontier = [], [()]
        while len(choices) < k:                     # breadth-first, two children per node, rank 0 first
            nxt = []
            for node in frontier:
                for r in (0, 1):
                    if len(choices) < k:
                        choices.append(node + (r,))
                        nxt.append(node + (r,))
            frontier = nxt
        return dict(tree_choices=tuple(normalize_choices(choices)))
    raise ValueError(f"unknown tree {tree!r}: use dyn<D>x<K>, static, medusa63 or acc")


def prompt_ids(target, prompt) -> list[int]:
    return target.tokenize(prompt) if isinstance(prompt, str) else list(prompt)


def run_prompts(target, prompts, runs: list, repeats: int = 1, seed: int = 0,
                batch_size: int = 1) -> list[tuple[list, dict]]:
    """Decode prompts batch_size at a time with each (config, drafter) in `runs`, timed INTERLEAVED (batch i with
    every run, then batch i+1, ...; `repeats` passes), so drift in the machine's speed hits every run alike. All
    prompts are padded to one shape, so one untimed call per run and batch shape compiles its program first.
    A drafter given as a list holds one entry per prompt (predictions). -> [(outputs, totals)] per run."""
    pad_to = max(len(prompt_ids(target, p)) for p in prompts)
    batches = [list(range(i, min(i + batch_size, len(prompts)))) for i in range(0, len(prompts), batch_size)]
    pick = lambda d, idx: d[idx[0]:idx[-1] + 1] if isinstance(d, list) else d    # predictions: one per prompt
    # The compile call decodes a 1-token prompt: a drafter that learns from earlier outputs (suffix decoding's
    # global cache) must not see the set's own answers before the timed pass.
    first = prompt_ids(target, prompts[0])[:1]
    for size in sorted({len(b) for b in batches}, reverse=True):     # a short last batch is its own program
        for config, drafter in runs:
            specjax.generate(target, [first] * size, config, drafter=pick(drafter, list(range(size))),
                             pad_to=pad_to)
    results = [([], {"generated_tokens": 0, "wall_s": 0.0, "accepted": 0, "drafted": 0, "target_passes": 0,
                     "first_tokens": 0, "buffer_len": 0, "loop_steps": 0, "calls": 0}) for _ in runs]
    for rep in range(repeats):
        for idx in batches:
            batch = [prompts[i] for i in idx]
            for (config, drafter), (outs, totals) in zip(runs, results):
                r = specjax.generate(target, batch, config, drafter=pick(drafter, idx), seed=seed,
                                     request_ids=idx, pad_to=pad_to)
                totals["wall_s"] += r.stats["wall_s"] / repeats
                if rep == 0:
                    outs.extend(r.tokens)
                    for key in ("generated_tokens", "accepted", "drafted", "target_passes"):
                        totals[key] += r.stats[key]
                    totals["accept_hist"] = totals.get("accept_hist", 0) + np.asarray(r.stats["accept_hist"])
                    totals["first_tokens"] += len(idx)
                    totals["buffer_len"] = r.stats["buffer_len"]
                    totals["calls"] += 1
                    # Passes of the batched loop (it runs until its slowest row is done); one row: its own passes.
                    trace = r.stats.get("accept_trace")
                    totals["loop_steps"] += (r.stats["target_passes"] if len(idx) == 1 or trace is None
                                             else int(np.shape(trace)[1]))
    for _, totals in results:
        totals.update(metrics.rates(*(totals[key] for key in ("generated_tokens", "first_tokens", "target_passes",
                                                               "accepted", "drafted", "accept_hist", "wall_s"))))
    return results


def predict(target, config, drafter_arg, prompts, spec: dict, base: dict, max_new_tokens: int, is_tree: bool,
            batch: int = 1) -> dict:
    """The analytic speedup beside the measured one: the target's decode step t1, its (k+1)-position verify tv
    and the drafter's proposal tp measured the way the loop pays them (batch rows, the run's buffer length, at a
    typical context: mean prompt length + half the generation), then Leviathan's formula with the i.i.d.
    acceptance that explains tau (chains) or tau over the measured cost of a step (trees). spec / base: the
    totals run_prompts returned for the speculative and the plain run; drafter_arg: what the run drafted from.
    -> c, verify_cost, alpha_fit, predicted, steady (the measured decode loop without prefills, which is what
    the formula models), per-step times in ms."""
    k, sp = config.k, config.sampling
    # Costs at a typical context: mean prompt length + half the generation.
    lens = [len(prompt_ids(target, p)) for p in prompts]
    context = int(np.mean(lens)) + max_new_tokens // 2
    buf = spec["buffer_len"]
    t1 = costs.forward_seconds(target, context, 1, reps=50, batch=batch, cache_size=buf)
    tv = costs.forward_seconds(target, context, k + 1, reps=50, batch=batch, cache_size=buf)
    ids = [prompt_ids(target, p) for p in prompts[:batch]]
    per_request = registry.get(config.method).per_request_params
    d_obj, d_params = build_drafter(BuildRequest(config, target, drafter_arg[:batch] if per_request else drafter_arg,
                                   ids, max(buf, context + 2 * k + 8)))
    tp = costs.propose_seconds(d_obj, d_params, target, context, sp, reps=50, batch=batch, cache_size=buf)
    # Prefill (prompt padded to the set's longest, as in run_prompts), and the drafter's own (its init).
    t_pre = costs.forward_seconds(target, 0, max(lens), reps=10, batch=batch, cache_size=buf)
    t_dpre = costs.init_seconds(d_obj, d_params, target, max(lens), sp, reps=10, batch=batch, cache_size=buf)
    c, verify_cost = tp / (k * t1), tv / t1
    # Chains: the i.i.d. acceptance that explains tau, through Leviathan's formula. Trees have no alpha; their
    # prediction is tau over the measured cost of a step (draft + verify), in units of a decode step.
    alpha_fit = analysis.alpha_from_tau(min(spec["tau"], k + 1 - 1e-9), k) if not is_tree else float("nan")
    predicted = analysis.walltime_speedup(alpha_fit, k, c, verify_cost) if not is_tree else \
        analysis.speedup_from_tau(spec["tau"], k * c, verify_cost)
    # Steady state: the decode loop without the prefills, which is what the formula models.
    # Per pass of the loop: with one row that is a row's pass, and tokens per pass is tau; a batched loop runs
    # until its slowest row is done, so its tokens per pass are counted over the loop's passes.
    n = base.get("calls") or len(prompts)
    steps = lambda t: t.get("loop_steps") or t["target_passes"]
    per_step = lambda t: (t["generated_tokens"] - t["first_tokens"]) / max(steps(t), 1) if batch > 1 else t["tau"]
    plain_ms = 1e3 * (base["wall_s"] - n * t_pre) / steps(base)
    step_ms = 1e3 * (spec["wall_s"] - n * (t_pre + t_dpre)) / steps(spec)
    steady = (plain_ms / per_step(base)) / (step_ms / per_step(spec))
    return dict(c=c, verify_cost=verify_cost, alpha_fit=alpha_fit, predicted=predicted, steady=steady,
                plain_ms_per_step=plain_ms, spec_ms_per_step=step_ms, propose_ms=tp * 1e3, verify_ms=tv * 1e3,
                decode_ms=t1 * 1e3)
