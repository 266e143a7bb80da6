"""The flag-free parts of measuring speculative against plain decoding, shared by experiments/speedup.py (many
runs at batch 1, or --batch_sizes sweeps) and experiments/reproduce.py (one paper row, any batch): tree settings
from a short name, the timing of plain and speculative decoding side by side over a prompt set or one batch, and
the analytic prediction from measured costs (experiments/costs.py). Every call is prepared once
(specjax.api.prepare) and its run timed (specjax.api.run) with experiments.costs' timer. No absl flags here: every
setting is an argument, so any experiment can import it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

import specjax
from specjax import analysis, api, decode, metrics
from specjax.config import SpecConfig
from specjax.drafters import registry
from specjax.drafters.medusa import accuracy_tree
from specjax.inputs import encode_all
from specjax.trees import MEDUSA_63, normalize_choices
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
        return dict(tree_choices=accuracy_tree(artifact, k))
    if tree == "medusa63":
        return dict(tree_choices=MEDUSA_63)
    if tree == "static":
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
    """A prompt (text, token ids or a chat) as generate() tokenizes it."""
    return encode_all(target, [prompt], "prompt")[0]


def run_prompts(target, prompts, runs: list, rounds: int = 1, seed: int = 0,
                batch_size: int = 1) -> list[tuple[list, dict]]:
    """Decode prompts batch_size at a time with each (config, drafter) in `runs`, timed side by side: each batch
    prepared once per run, then its runs timed in `rounds` alternating rounds (costs.fastest_alternating, the
    fastest kept; a call's time is its run(), not its preparation), so drift in the machine's speed hits every run
    alike. All prompts are padded to one shape, so one untimed call per run and batch shape compiles its program
    first. A drafter given as a list holds one entry per prompt (predictions). -> [(outputs, totals)] per run."""
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
                     "plain_passes": 0, "first_tokens": 0, "buffer_len": 0, "loop_steps": 0, "calls": 0})
               for _ in runs]
    for idx in batches:
        batch = [prompts[i] for i in idx]
        prepared = [api.prepare(target, batch, config, drafter=pick(drafter, idx), seed=seed, request_ids=idx,
                                pad_to=pad_to) for config, drafter in runs]
        seconds, first_runs = costs.fastest_alternating(
            {j: (lambda p=p: api.run(p)) for j, p in enumerate(prepared)}, rounds, warmup=False)
        for j, (outs, totals) in enumerate(results):
            r = first_runs[j]
            totals["wall_s"] += seconds[j]
            outs.extend(r.tokens)
            for key in ("generated_tokens", "accepted", "drafted", "target_passes", "plain_passes"):
                totals[key] += r.stats[key]
            for key in ("accept_hist", "verify_hist"):
                totals[key] = totals.get(key, 0) + np.asarray(r.stats[key])
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


def loop_profile(target, ids: list[list[int]], config: SpecConfig, drafter: Any = None, calls: int = 2,
                 top: int = 8, by: str = "kind") -> dict:
    """Where one decode call's loop iterations go: ids decoded as one batch by `config`, `calls` calls after a
    warm-up under jax.profiler (costs.thunk_profile), less the same calls generating one token (the prefill and
    the drafter's init, no loop iteration) -> {"iterations": loop iterations per call, "thread_ms": CPU ms per
    iteration, "copy_thread_ms": the `copy` kinds' part of it, "ops": the `top` kinds by time, {kind: {"thread_ms",
    "per_iteration"}} per iteration}. by: "kind" (the operation's HLO name less its number), "signature" (its
    kernel or opcode and result shape: costs.hlo_signatures of the compiled loop) or "part" (the step's part it
    belongs to: costs.hlo_parts; the parts' times add up to the iteration's)."""
    groupings = {"kind": None, "signature": costs.hlo_signatures, "part": costs.hlo_parts}
    if by not in groupings:
        raise ValueError(f"loop_profile by={by!r}: one of {sorted(groupings)}")

    def profile(cfg):
        prepared = api.prepare(target, ids, cfg, drafter=drafter, pad_to=max(map(len, ids)))
        result = api.run(prepared)
        names = groupings[by](api.compiled_text(prepared)) if groupings[by] else None
        return result, costs.thunk_profile(lambda: api.run(prepared), calls, names)
    result, kinds = profile(config)
    _, before_loop = profile(dataclasses.replace(config, max_new_tokens=1))
    trace = result.stats.get("accept_trace")
    iterations = result.stats["target_passes"] if len(ids) == 1 or trace is None else int(np.shape(trace)[1])
    n = calls * iterations
    before_the_loop = (decode.PREFILL, decode.DRAFTER_INIT) if by == "part" else ()   # whole in the one-token call
    per_iteration = {kind: ((ms - before_loop.get(kind, (0.0, 0.0))[0]) / n,
                            (c - before_loop.get(kind, (0.0, 0.0))[1]) / n) for kind, (ms, c) in kinds.items()
                     if kind not in before_the_loop}
    ranked = sorted(per_iteration.items(), key=lambda kv: -kv[1][0])
    return dict(iterations=iterations, thread_ms=sum(ms for ms, _ in per_iteration.values()),
                copy_thread_ms=sum(ms for kind, (ms, _) in per_iteration.items() if kind.startswith("copy")),
                ops={kind: {"thread_ms": round(ms, 4), "per_iteration": round(c, 1)} for kind, (ms, c) in ranked[:top]})


def profile_line(profile: dict) -> str:
    """loop_profile's result in one line."""
    return (f"{profile['thread_ms']:.2f} thread ms per iteration (copies {profile['copy_thread_ms']:.3f}): "
            + "; ".join(f"{k} {v['thread_ms']:.3f} x{v['per_iteration']:.0f}" for k, v in profile["ops"].items()))


def measured_context(target, prompts: Sequence, max_new_tokens: int, prepared: api.Prepared) -> int:
    """The context the costs are measured at: a typical one (mean prompt length + half the generation), kept
    inside the run's buffer with the costs' own margin of 2k + 8 slots."""
    typical = int(np.mean([len(prompt_ids(target, p)) for p in prompts])) + max_new_tokens // 2
    return max(1, min(typical, prepared.buffer_len - 2 * prepared.config.k - 8))


# engine_overhead's rounds, not cut by a time budget: the loop's step is a difference of two whole calls (the
# loop's and its one-token call's) over a few dozen iterations, so a call's spread moves it by several points.
ENGINE_ROUNDS = 6
COST_BUDGET_S = 2.0       # seconds of timed calls per measured cost (experiments.costs.fastest_seconds' budget_s)


def predict(target, config, drafter_arg, prompts, spec: dict, base: dict, max_new_tokens: int, is_tree: bool,
            batch: int = 1, cost_memo: dict | None = None, engine_overhead: bool = False,
            engine_rounds: int = ENGINE_ROUNDS, engine_repeats: int = 1) -> dict:
    """The analytic speedup beside the measured one: the target's decode step t1, its (k+1)-position verify tv
    and the drafter's proposal tp measured the way the loop pays them (batch rows, the drafter and buffer that
    prepare() gives the run's first batch, at a typical context: measured_context), then Leviathan's formula with
    the i.i.d. acceptance that explains tau (chains) or tau over the measured cost of a step (trees). spec / base:
    the totals run_prompts returned for the speculative and the plain run; drafter_arg: what the run drafted from.
    -> c, verify_cost (with SpecConfig.verify_widths: the mean over the run's verify passes, each at its width,
    and verify_cost_full at k + 1), alpha_fit, predicted, steady (the measured decode loop without prefills, which
    is what the formula models), one_position_share (steps that verified one position: nothing drafted), per-step
    times in ms (model_ms_per_step: what the prediction assumes a step costs). engine_overhead: also the step's
    drafter and target work run in turn (costs.step_in_turn_seconds) with the row's decode loop on its first
    prompt (or batch) timed in the same rounds (loop_calls), which on a shared machine is what tells the engine's
    overhead from a change of the machine's speed between the run and the cost measurements -> engine_fields
    (the loop is not timed again for a drafter that learns across calls), in engine_rounds alternating rounds,
    engine_repeats times (repeated_engine_fields).
    cost_memo: the target's forward costs already measured by this caller (one dict per experiment, whose targets
    outlive it), so rows that share a target, batch, buffer and context measure them once."""
    k, sp = config.k, config.sampling
    lens = [len(prompt_ids(target, p)) for p in prompts]
    per_request = registry.get(config.method).per_request_params
    prepared = api.prepare(target, prompts[:batch], config, drafter_arg[:batch] if per_request else drafter_arg,
                           pad_to=max(lens))                               # as run_prompts prepares a batch
    context, buf = measured_context(target, prompts, max_new_tokens, prepared), prepared.buffer_len
    # Each cost: the fastest of up to 50 (prefills: 10) timed calls within COST_BUDGET_S, so a real target's
    # 30-ms step is measured in seconds, as the toy's 0.5-ms one is.
    timing = dict(batch=batch, cache_size=buf, budget_s=COST_BUDGET_S)
    target_timing = dict(timing, implementation=config.implementation)     # the attention path the loop runs
    memo = {} if cost_memo is None else cost_memo

    def forward_seconds(context: int, T: int, **kw) -> float:
        key = (id(target), context, T, tuple(sorted({**target_timing, **kw}.items())))
        if key not in memo:
            memo[key] = costs.forward_seconds(target, context, T, **target_timing, **kw)
        return memo[key]
    # The decode step and the verify timed side by side (their quotient is the verify cost); with
    # SpecConfig.verify_widths, every width the run's passes took (spec["verify_hist"]: passes by drafts verified).
    hist = np.asarray(spec["verify_hist"], dtype=float)
    positions = (1, k + 1) + tuple(w + 1 for w in np.flatnonzero(hist[1:k]) + 1)
    pair_key = (id(target), context, positions, tuple(sorted(target_timing.items())))
    if pair_key not in memo:
        memo[pair_key] = costs.forward_seconds_alternating(target, context, positions, reps=50, **target_timing)
    t1, tv_full = memo[pair_key][1], memo[pair_key][k + 1]
    tv = tv_full                 # the verify passes' mean cost, each at the width it took
    if hist[1:].sum() > 0:
        tv = sum(n * memo[pair_key][w + 1] for w, n in enumerate(hist) if w and n) / hist[1:].sum()
    # The drafter's work per step: its proposal and its commit after the verify.
    setup = costs.drafter_setup(prepared.drafter, prepared.draft_params, target, context, sp, batch, buf)
    t_propose, t_commit = costs.drafter_step_seconds(prepared.drafter, prepared.draft_params, target, context, sp,
                                                     reps=50, setup=setup, **timing)
    tp = t_propose + t_commit
    # engine_overhead: the same work run in turn, as the loop runs it (beside the drafter's part and the verify
    # alone, and the loop itself on the first prompt, at that loop's own context)
    engine = {}
    if engine_overhead:
        beside = loop_calls(target, prepared)
        turn_context = measured_context(target, prompts[:batch], max_new_tokens, prepared) if beside else context
        steps = in_turn_steps(loop_iterations(beside["loop"]().stats)[0] if beside else 0)   # counted once
        engine = repeated_engine_fields(lambda: costs.step_in_turn_seconds(
            prepared.drafter, prepared.draft_params, target, turn_context, sp, reps=engine_rounds, beside=beside,
            **dict(target_timing, budget_s=None), setup=setup if turn_context == context else None, inner=steps),
            t1, tv_full, engine_repeats)
    # Prefill (prompt padded to the set's longest, as in run_prompts) timed as a run pays it, a one-token call (a
    # forward over the prompt chained in a loop of its own overstates it, and the steady step of a row with few
    # passes is the most sensitive to that), and the drafter's own (its init).
    pre_key = (id(target), "prefill", batch, buf, max(lens))
    if pre_key not in memo:
        memo[pre_key] = costs.prefill_seconds(target, [prompt_ids(target, p) for p in prompts[:batch]], buf,
                                              pad_to=max(lens))
    t_pre = memo[pre_key]
    t_dpre = costs.init_seconds(prepared.drafter, prepared.draft_params, target, max(lens), sp, reps=10, **timing)
    c, verify_cost = tp / (k * t1), tv / t1
    # tau over the measured cost of a step in decode steps (Leviathan's formula for a chain whose acceptance is
    # i.i.d.): the drafter's proposal, then a (k+1)-position verify, or one position where nothing was drafted
    # (Draft.num_drafted). Chains: alpha_fit, the i.i.d. acceptance that explains tau of the verify steps (a
    # one-position step commits one token). Trees have no alpha.
    share = hist[0] / max(hist.sum(), 1)
    tau_verified = (spec["tau"] - share) / (1 - share) if share < 1 else 1.0
    alpha_fit = analysis.alpha_from_tau(min(max(tau_verified, 1.0), k + 1 - 1e-9), k) if not is_tree else float("nan")
    predicted = analysis.speedup_from_tau(spec["tau"], k * c, verify_cost, share)
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
                plain_ms_per_step=plain_ms, spec_ms_per_step=step_ms, propose_ms=t_propose * 1e3,
                commit_ms=t_commit * 1e3, verify_ms=tv * 1e3,
                decode_ms=t1 * 1e3, one_position_share=share,
                model_ms_per_step=(tp + share * t1 + (1 - share) * tv) * 1e3,
                **({} if tv == tv_full else dict(verify_cost_full=tv_full / t1)),
                **engine)


def loop_calls(target, prepared: api.Prepared) -> dict | None:
    """The decode call of `prepared` and the same call generating one token (its prefill, the drafter's init and
    first proposal: no loop iteration, the same buffer), for costs.step_in_turn_seconds' `beside`: their
    difference is the loop's iterations, timed in the same rounds as the step in turn (engine_fields). None for a
    drafter that learns from each call's outputs (suffix decoding's global cache): its repeated calls of one
    prompt draft differently, so its loop cannot be timed again beside its costs."""
    if registry.get(prepared.config.method).finish is not None:
        return None
    one = dataclasses.replace(prepared.config, max_new_tokens=1, max_cache_len=prepared.buffer_len)
    first_token = api.prepare(target, prepared.request.prompts, one,
                              drafter=prepared.request.drafter, pad_to=prepared.prompts.shape[1])
    return {"loop": lambda: api.run(prepared), "prefill": lambda: api.run(first_token)}


def in_turn_steps(iterations: int, least: int = 16) -> int:
    """The steps of costs.step_in_turn_seconds' chained loop beside loop_calls' calls: as many as the decode loop's
    `iterations` (at least `least`), so that the calls timed side by side last about as long. A shared machine's
    slow spells then fall into each alike: a call several times longer than the others is likelier to hold one in
    every round, which biases its fastest time upward and the overhead with it."""
    return max(least, iterations)


def loop_iterations(stats: dict) -> tuple[int, int]:
    """A call's loop iterations and those in which no row verified drafts (nothing drafted: Draft.num_drafted),
    which took one position, from its stats' accept_trace [B, iterations] (-1: none verified)."""
    trace = np.asarray(stats["accept_trace"])
    return trace.shape[1], int(np.sum(np.all(trace < 0, axis=0)))


def engine_fields(turn: costs.InTurn, t1: float, tv: float) -> dict:
    """A step_in_turn_seconds measurement as a row's fields: in_turn_ms (the step in turn), taking_turns (it over
    the drafter's part and the verify apart) and, with loop_calls beside it, the engine's own per-step overhead:
    the loop's step (the call less its one-token call, over the loop's iterations) over the in-turn step (its
    chain's call less the same program's call of no steps, over the chain's steps: per-call costs left out on both
    sides) with the call's share of one-position steps (their verify one position wide, at the measured t1 / tv),
    - 1."""
    fields = dict(in_turn_ms=turn.in_turn * 1e3, taking_turns=turn.in_turn / (turn.drafter + turn.verify))
    if "loop" not in turn.beside:
        return fields
    loop_s, result = turn.beside["loop"]
    iterations, one_position = loop_iterations(result.stats)
    loop_ms = 1e3 * (loop_s - turn.beside["prefill"][0]) / max(iterations, 1)
    turn_ms = 1e3 * (turn.in_turn - one_position / max(iterations, 1) * turn.verify * (1 - t1 / tv))
    return dict(fields, loop_ms_per_step=loop_ms, engine_overhead=loop_ms / turn_ms - 1)


def repeated_engine_fields(measure: Callable[[], costs.InTurn], t1: float, tv: float, repeats: int = 1) -> dict:
    """engine_fields of `repeats` measurements (measure(): one step_in_turn_seconds call, its own alternating
    rounds): the fields of the one whose overhead is the median (the lower of two middles), with several also
    engine_overhead_min and engine_overhead_max. A shared machine's state can move a whole measurement: one alone
    has put a row ten points away from its repeats. A measurement without the loop beside it (a drafter that
    learns across calls) is taken once."""
    measured = []
    for _ in range(max(1, repeats)):
        measured.append(engine_fields(measure(), t1, tv))
        if "engine_overhead" not in measured[-1]:
            return measured[-1]
    measured.sort(key=lambda fields: fields["engine_overhead"])
    median = measured[(len(measured) - 1) // 2]
    if len(measured) == 1:
        return median
    return dict(median, engine_overhead_min=measured[0]["engine_overhead"],
                engine_overhead_max=measured[-1]["engine_overhead"])


def policy_fields(schedule: Sequence[str], method: str, k: int, acceptance_rate_threshold: float | None = None,
                  acceptance_rate_window_size: int = 16) -> dict:
    """The dynamic policy's SpecConfig fields for a run of `method` drafting k tokens ({} = no policy). schedule:
    max_batch:k entries (k = 'k': the run's own k); an entry method@max_batch:k applies to that method only, and a
    method with entries of its own ignores the unprefixed ones. acceptance_rate_threshold: the acceptance switch
    (None: off), over acceptance_rate_window_size speculative steps."""
    fields: dict[str, Any] = {}
    own = [e.split("@", 1)[1] for e in schedule if e.startswith(method + "@")]
    entries = own or [e for e in schedule if "@" not in e]
    try:
        steps = {int(b): (k if v == "k" else int(v)) for b, v in (e.split(":") for e in entries)}
    except ValueError:
        raise ValueError(f"draft_len_schedule {list(schedule)}: entries are max_batch:k or method@max_batch:k "
                         f"(k an int or 'k')") from None
    if steps:
        fields["draft_len_schedule"] = steps
    if acceptance_rate_threshold is not None:
        fields.update(acceptance_rate_threshold=acceptance_rate_threshold,
                      acceptance_rate_window_size=acceptance_rate_window_size)
    return fields


def measure_batch(target, ids: list[list[int]], plain_config: SpecConfig, config: SpecConfig, drafter: Any,
                  policy: SpecConfig | None, rounds: int, roofline_machine: tuple[float, float],
                  engine_overhead: bool = False, engine_rounds: int = ENGINE_ROUNDS, engine_repeats: int = 1) -> dict:
    """One batch (every row of ids decoded in one call) by plain decoding, by `config` and by the dynamic policy,
    timed side by side (rounds alternating rounds, the fastest of each), beside the prediction from costs measured
    at this batch size and the run's buffer (the prefill as generate() runs it, one target forward over 1 and over
    k + 1 positions, one proposal) and the run's loop iterations, and the roofline (specjax.analysis.batch_roofline
    with roofline_machine = (peak FLOP/s, bandwidth) of costs.machine_roofline, the run's alpha and draft cost).
    The policy is often one of the two programs timed already (its schedule's k is the run's: the same config;
    k = 0: plain decoding itself); then its cell is that program's time, and a policy that resolves to plain
    decoding times plain decoding a second time, to show how far two samples of one program disagree here.
    engine_overhead: the run's loop is also timed side by side with its step's drafter and target work run in
    turn (costs.step_in_turn_seconds; as predict's), in engine_rounds rounds. -> the row (without the batch's name
    fields)."""
    B, N = len(ids), config.max_new_tokens
    pad_to = max(map(len, ids))   # the smallest buffer, which every row's attention reads whole (one compile per B)
    prepare = lambda cfg, d: api.prepare(target, ids, cfg, drafter=d, pad_to=pad_to)
    plain, spec = prepare(plain_config, None), prepare(config, drafter)
    calls = {"plain": lambda: api.run(plain), "spec": lambda: api.run(spec)}
    same_as = None
    if policy is not None:
        pol = prepare(policy, drafter)
        same_as = "plain" if pol.config == plain.config else "fixed" if pol.config == spec.config else None
        if same_as is None:
            calls["policy"] = lambda: api.run(pol)
        elif same_as == "plain":
            calls["plain again"] = lambda: api.run(plain)
    seconds, results = costs.fastest_alternating(calls, rounds)
    if same_as is not None:
        seconds["policy"], results["policy"] = (seconds["plain"], results["plain"]) if same_as == "plain" else \
            (seconds["spec"], results["spec"])
    stats, k = results["spec"].stats, spec.config.k
    context, buf = measured_context(target, ids, N, spec), spec.buffer_len
    pair = costs.forward_seconds_alternating(target, context, (1, k + 1), batch=B, cache_size=buf)
    t1, tv = pair[1], pair[k + 1]
    if registry.get(config.method).per_request_params:
        draft_cost = 0.0                 # predictions per request: proposing is a table lookup
    else:
        draft_cost = sum(costs.drafter_step_seconds(spec.drafter, spec.draft_params, target, context,
                                                    config.sampling, batch=B, cache_size=buf)) / t1
    # The batch steps together: a loop iteration ends when its slowest row does, so the loop's tokens per
    # iteration (batch tau) is below the rows' mean tau once rows accept at different rates.
    steps = N - 1
    iterations, one_position = loop_iterations(stats)
    batch_tau = steps / iterations
    steady = analysis.speedup_from_tau(batch_tau, draft_cost, tv / t1, one_position / iterations)
    # The whole call, as timed: both pay the target's prefill (in length groups, as generate() runs it),
    # speculation also its drafter's; then N - 1 plain steps, or the run's loop iterations of draft + verify.
    t_pre = costs.prefill_seconds(target, ids, buf, pad_to=pad_to)
    t_dpre = costs.init_seconds(spec.drafter, spec.draft_params, target, pad_to, config.sampling, batch=B,
                                cache_size=buf, reps=3, inner=2)
    predicted = (t_pre + steps * t1) / (t_pre + t_dpre + iterations * draft_cost * t1
                                        + (iterations - one_position) * tv + one_position * t1)
    engine = {}
    if engine_overhead and not registry.get(config.method).per_request_params:
        beside = loop_calls(target, spec)
        engine = repeated_engine_fields(lambda: costs.step_in_turn_seconds(
            spec.drafter, spec.draft_params, target, context, config.sampling, reps=engine_rounds, batch=B,
            cache_size=buf, implementation=config.implementation, beside=beside, inner=in_turn_steps(iterations)),
            t1, tv, engine_repeats)
    plain_out = results["plain"].tokens
    exact = ("yes" if results["spec"].tokens == plain_out and (policy is None or results["policy"].tokens
                                                                == plain_out) else "no") \
        if plain_config.sampling.greedy else "n/a"
    peak_flops, bandwidth = roofline_machine
    roofline = float(analysis.batch_roofline(
        [B], **costs.roofline_inputs(target, context), peak_flops=peak_flops, bandwidth=bandwidth,
        alpha=stats["alpha"], k=k, c=draft_cost)[0]) if not config.is_tree else float("nan")
    n = B * N
    plain_s, spec_s = seconds["plain"], seconds["spec"]
    row = dict(batch=B, k=k, plain_tokens_per_s=n / plain_s, tokens_per_s=n / spec_s, speedup=plain_s / spec_s,
               predicted=predicted, predicted_steady=steady, prefill_share=t_pre / (t_pre + steps * t1),
               alpha=stats["alpha"], tau=stats["tau"], batch_tau=batch_tau, c_step=draft_cost,
               one_position_share=one_position / iterations,
               verify_cost=tv / t1, forward_ms=t1 * 1e3, buffer=buf, exact=exact, roofline=roofline, **engine)
    if policy is not None:
        policy_k = pol.config.k
        policy_stats = results["policy"].stats
        row.update(policy_k=policy_k, policy_speedup=plain_s / seconds["policy"],
                   policy_tokens_per_s=n / seconds["policy"],
                   # k = 0: every pass is a plain step; else those after the acceptance switch
                   policy_plain_share=1.0 if policy_k == 0 else
                   policy_stats["plain_passes"] / max(policy_stats["target_passes"], 1),
                   policy_program=same_as or "own",
                   plain_repeat=plain_s / seconds["plain again"] if "plain again" in seconds else float("nan"))
    return row
