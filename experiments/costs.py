"""The experiments' one timer (fastest_seconds; fastest_alternating for candidates timed side by side) and the
measured costs that the analytic speedup model needs: target forward over T positions at a given context, and
one drafter proposal.

Each cost is measured the way the decode loop pays it: `inner` calls chained inside ONE jitted lax.fori_loop
(each call's input depends on the loop counter, so nothing is hoisted), timed after compilation, the fastest of `reps`
divided by `inner`. Timing single jitted calls instead adds ~0.1-0.2 ms of Python dispatch and host sync per call,
which on a ~1 ms CPU step inflates the verify-cost ratio and c.
"""
from __future__ import annotations

import collections
import functools
import glob
import re
import shutil
import tempfile
import time
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from specjax import api, settings
from specjax.cache import KVCache
from specjax.config import SpecConfig
from specjax.decode import PROGRAM_PARTS, shares_target_cache, target_exposure
from specjax.drafters.base import Context, Verified
from specjax.models.llama import forward
from specjax.models.model import weight_arrays


MIN_REPS = 3          # timed calls a time budget never cuts below


def _seconds(call: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    result = call()
    return time.perf_counter() - t0, result


def fastest_seconds(fn: Callable, reps: int, fresh_input: Callable[[], Any] | None = None,
                    budget_s: float | None = None) -> float:
    """fn() timed `reps` times after a first call. fresh_input: made before each call, off the clock, and passed
    to fn (an input fn donates: each call needs its own). budget_s: stop early once the timed calls took this
    long (at least MIN_REPS of them): the same bound on the noise for a 10-ms and a 1-s call."""
    call = fn if fresh_input is None else lambda: fn(fresh_input())
    call()
    times = []
    for _ in range(reps):
        args = () if fresh_input is None else (fresh_input(),)
        times.append(_seconds(lambda: fn(*args))[0])
        if budget_s is not None and len(times) >= MIN_REPS and sum(times) > budget_s:
            break
    # The fastest run: on a shared machine the slower ones measure the neighbours, not the code.
    return float(np.min(times))


def fastest_alternating(calls: Mapping[str, Callable[..., Any]], rounds: int, warmup: bool = True,
                        fresh_inputs: Mapping[str, Callable[[], Any]] | None = None,
                        budget_s: float | None = None) -> tuple[dict[str, float], dict[str, Any]]:
    """Candidates timed side by side: `rounds` rounds that call each one once in turn, the fastest time of each
    kept, so drift in a shared machine's speed hits every candidate alike (one after the other, a slow spell
    would be charged to whichever ran in it). warmup: each called once, untimed, first (it compiles); a caller
    that compiles otherwise passes False (a drafter that learns from its outputs must not see them before the
    timed call). fresh_inputs: {name: make its input}, made before each call off the clock and passed to it (an
    input the call donates). budget_s: stop after a round once some candidate's timed calls took this long (at
    least MIN_REPS rounds). -> (fastest seconds by name, each name's first result)."""
    def timed(name):
        if fresh_inputs is None:
            return _seconds(calls[name])
        arg = fresh_inputs[name]()
        return _seconds(lambda: calls[name](arg))

    results = {name: timed(name)[1] for name in calls} if warmup else {}
    best = {name: float("inf") for name in calls}
    spent = {name: 0.0 for name in calls}
    for done in range(1, rounds + 1):
        for name in calls:
            seconds, result = timed(name)
            best[name] = min(best[name], seconds)
            spent[name] += seconds
            results.setdefault(name, result)
        if budget_s is not None and done >= MIN_REPS and max(spent.values()) > budget_s:
            break
    return best, results


def _per_call_seconds(one_call, args, inner: int, reps: int, budget_s: float | None = None) -> float:
    """one_call(i, *args) -> a float32 scalar that depends on the work."""
    looped = jax.jit(lambda *a: lax.fori_loop(0, inner, lambda i, acc: acc + one_call(i, *a), jnp.float32(0)))
    return fastest_seconds(lambda: looped(*args).block_until_ready(), reps, budget_s=budget_s) / inner


@functools.partial(jax.jit, static_argnames=("cfg", "T", "inner", "implementation", "switches"),
                   donate_argnums=1)
def _chained_forwards(params, cache, *, cfg, T: int, inner: int, implementation: str, switches: tuple):
    """`inner` cached target forwards over T new positions, chained in one compiled loop (module-level, so every
    cost measurement of one shape shares one compiled program). switches: the backend choices in force when a
    forward is traced (specjax.settings.backends()), a static argument so that another choice compiles its own
    program."""
    del switches
    batch = cache.lengths.shape[0]

    def step(i, carry):
        acc, c = carry
        toks = (jnp.arange(T, dtype=jnp.int32)[None, :] + i) % cfg.vocab_size
        out = forward(params, cfg, jnp.broadcast_to(toks, (batch, T)), c, implementation=implementation)
        return acc + out.logits[0, -1, 0], out.cache.replace(lengths=cache.lengths)
    return lax.fori_loop(0, inner, step, (jnp.float32(0), cache))


def looped_forward(model, context: int, T: int, batch: int = 1, cache_size: int | None = None, inner: int = 16,
                   implementation: str = "xla"):
    """(fn, params, cache): fn(params, cache) runs `inner` cached target forwards over T new positions after
    `context` tokens of history, chained in one compiled loop; it donates the cache (pass a fresh copy each call).
    The cache holds the weights' dtype, as the decode loop's does; implementation: the attention path."""
    cfg = model.config
    size = max(context + T + 1, cache_size or 0)
    cache = KVCache.init(cfg.num_layers, batch, size, cfg.num_kv_heads, cfg.head_dim,
                         model.params["embed"].dtype).replace(lengths=jnp.full((batch,), context, jnp.int32))
    # The cache is carried, as in the decode loop, so its writes update it in place; a loop-invariant cache would
    # be copied whole by every write and the copy counted as forward time. It is donated as the loop's state is:
    # otherwise every call copies it into the loop's carry first (returned, so that the carry can live in it).
    switches = settings.backends()
    fn = functools.partial(_chained_forwards, cfg=cfg, T=T, inner=inner, implementation=implementation,
                           switches=switches)
    return fn, model.params, cache


def _copied(tree):
    """A fresh copy of a pytree of arrays, made before a timed call that donates it (off the clock)."""
    return jax.block_until_ready(jax.tree.map(jnp.copy, tree))


def forward_seconds(model, context: int, T: int, reps: int = 10, batch: int = 1,
                    cache_size: int | None = None, inner: int = 16, budget_s: float | None = None,
                    implementation: str = "xla") -> float:
    """One cached target forward over T new positions after `context` tokens of history. The XLA attention reads
    the whole buffer, so pass the decode loop's buffer length as cache_size to measure what the loop pays."""
    return forward_seconds_alternating(model, context, (T,), reps, batch, cache_size, inner, budget_s,
                                       implementation)[T]


def forward_seconds_alternating(model, context: int, positions: tuple[int, ...], reps: int = 10, batch: int = 1,
                                cache_size: int | None = None, inner: int = 16, budget_s: float | None = None,
                                implementation: str = "xla") -> dict[int, float]:
    """forward_seconds for several T, timed side by side: each rep calls every T's compiled loop once in turn,
    so a slow spell of a shared machine hits T = 1 and T = k + 1 alike instead of inflating whichever ran in it
    (the verify-cost ratio is their quotient). budget_s: per T, as forward_seconds'. -> {T: seconds}."""
    looped = {T: looped_forward(model, context, T, batch, cache_size, inner, implementation) for T in positions}
    calls = {T: functools.partial(lambda fn, params, cache: jax.block_until_ready(fn(params, cache)), fn, params)
             for T, (fn, params, _) in looped.items()}
    fresh = {T: functools.partial(_copied, cache) for T, (_, _, cache) in looped.items()}
    seconds, _ = fastest_alternating(calls, reps, fresh_inputs=fresh, budget_s=budget_s)
    return {T: s / inner for T, s in seconds.items()}


class _DrafterSetup(NamedTuple):
    tokens: jax.Array          # [B, buffer_len] random tokens; the first `context` are the committed sequence
    prompt_lengths: jax.Array  # [B]
    exposed: dict              # the target weights the drafter declared
    layers: tuple              # the target layers it reads
    prefill: Any               # the target's forward over the prompt (ForwardOut)
    state: Any                 # the drafter's state after its init on that prompt


def _random_prefill(drafter, model, prompt_len: int, buffer_len: int, batch: int):
    """Random tokens [B, buffer_len] and the target's prefill over the first prompt_len of them, with the layers
    and weights the drafter declares -> (tokens, layers, exposed, prefill)."""
    cfg = model.config
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, cfg.vocab_size, (batch, buffer_len)), jnp.int32)
    layers, exposed = target_exposure(drafter, model.params)
    cache = KVCache.init(cfg.num_layers, batch, buffer_len, cfg.num_kv_heads, cfg.head_dim)
    return tokens, layers, exposed, forward(model.params, cfg, tokens[:, :prompt_len], cache, hidden_layers=layers)


def drafter_setup(drafter, draft_params, model, context: int, sp, batch: int,
                  cache_size: int | None) -> _DrafterSetup:
    """A random prompt of context // 2 tokens, the target's prefill over it (with the layers and weights the
    drafter declares) and the drafter's own init(): the state a step's proposal and commit are measured on."""
    prompt_len = context // 2
    tokens, layers, exposed, prefill = _random_prefill(
        drafter, model, prompt_len, max(context + 2 * drafter.k + 8, cache_size or 0), batch)
    prompt_lengths = jnp.full((batch,), prompt_len, jnp.int32)
    state = drafter.init(draft_params, Context(tokens, prompt_lengths + 1, prompt_lengths, exposed), prefill, sp)
    return _DrafterSetup(tokens, prompt_lengths, exposed, layers, prefill, state)


def _verify_pass(model, su: _DrafterSetup, context: int, k: int):
    """A verify pass on the setup's prefill: the last committed token (at context - 1) and the k random tokens
    after it -> (verify_in [B, k + 1], the target's ForwardOut with the layers the drafter reads)."""
    verify_in = su.tokens[:, context - 1:context + k]                                    # [B, k + 1]
    lengths = jnp.full((su.tokens.shape[0],), context - 1, jnp.int32)
    return verify_in, forward(model.params, model.config, verify_in, su.prefill.cache.replace(lengths=lengths),
                              hidden_layers=su.layers)


def _scalar_of(tree) -> jax.Array:
    """A float32 scalar that depends on every leaf of `tree` (its last element each), so the work that made the
    tree stays in a timing loop."""
    return sum((x.ravel()[-1].astype(jnp.float32) for x in jax.tree_util.tree_leaves(tree)), jnp.float32(0))


def _depends_on(i, state):
    """The state plus i * 1e-30 (below float32 resolution of O(1) values): head drafters (Medusa, EAGLE) read only
    their state, so without it XLA would hoist the whole call out of the timing loop."""
    return jax.tree_util.tree_map(
        lambda x: x + (i * 1e-30).astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, state)


def propose_seconds(drafter, draft_params, model, context: int, sp, reps: int = 10, batch: int = 1,
                    cache_size: int | None = None, inner: int = 16, budget_s: float | None = None,
                    setup: _DrafterSetup | None = None) -> float:
    """One drafter.propose call (all k draft tokens, or the whole tree) on a context of `context` committed
    tokens. The drafter's state comes from its own init() on a random prompt (with the target's prefill output
    and the target weights it declares), so any registered drafter is measured the way the loop runs it.
    Build the drafter for a buffer of at least context + 2k + 8 slots (cache_size if given)."""
    cfg = model.config
    su = setup or drafter_setup(drafter, draft_params, model, context, sp, batch, cache_size)
    lengths = jnp.full((batch,), context, jnp.int32)
    keys = jax.random.split(jax.random.PRNGKey(0), batch)
    # A drafter that drafts over the target's cache gets the prefill's (as the loop hands it the loop's cache).
    target_cache = su.prefill.cache.replace(lengths=lengths - 1) if shares_target_cache(drafter) else None

    def one(i, params, state, tokens, exposed, target_cache):
        ctx = Context(tokens.at[:, context - 1].set(i % cfg.vocab_size), lengths, su.prompt_lengths, exposed,
                      target_cache)
        return drafter.propose(params, _depends_on(i, state), ctx, keys, sp)[0].tokens[0, -1].astype(jnp.float32)

    return _per_call_seconds(one, (draft_params, su.state, su.tokens, su.exposed, target_cache), inner, reps,
                             budget_s)


def _proposal_context(drafter, su: _DrafterSetup, context: int) -> Context:
    """The Context a step's proposal reads after `context` committed tokens (with the target's cache for a drafter
    that drafts over it)."""
    lengths = jnp.full((su.tokens.shape[0],), context, jnp.int32)
    ctx = Context(su.tokens, lengths, su.prompt_lengths, su.exposed)
    if shares_target_cache(drafter):
        ctx = ctx._replace(target_cache=su.prefill.cache.replace(lengths=lengths - 1))
    return ctx


def _proposed_tree(drafter, draft_params, context: int, sp, su: _DrafterSetup):
    """The token tree of one proposal after `context` committed tokens (None: the drafter proposes a chain)."""
    keys = jax.random.split(jax.random.PRNGKey(0), su.tokens.shape[0])
    ctx = _proposal_context(drafter, su, context)
    return jax.jit(lambda params, state: drafter.propose(params, state, ctx, keys, sp)[0].tree)(draft_params,
                                                                                                su.state)


def _tree_depth(tree) -> int:
    """A token tree's depth: the loop gathers the verify output along the accepted root path, max_depth + 1
    positions, before the commit."""
    return tree.max_depth if tree.max_depth is not None else tree.tokens.shape[1] - 1


def _depth(tree, k: int) -> int:
    """The drafts a step's commit takes at most: a chain's k (tree None), a tree's depth."""
    return k if tree is None else _tree_depth(tree)


def committed_depth(drafter, draft_params, context: int, sp, su: _DrafterSetup) -> int:
    """The drafts a step's commit takes at most after `context` committed tokens: a chain's k, a token tree's
    depth."""
    return _depth(_proposed_tree(drafter, draft_params, context, sp, su), drafter.k)


def along_deepest_path(tree, out):
    """The target's output over the tree gathered along a root path as deep as the tree (node d: the first node at
    depth d), as the loop gathers it along the accepted path: [B, depth + 1] positions."""
    depth = _tree_depth(tree)
    path = jnp.argmax(tree.depths[:, None, :] == jnp.arange(depth + 1)[None, :, None], axis=2)    # [B, depth + 1]
    along = lambda x: jnp.take_along_axis(x, path.reshape(path.shape + (1,) * (x.ndim - 2)), axis=1)
    return out._replace(logits=along(out.logits), hidden=along(out.hidden),
                        layer_hidden=tuple(map(along, out.layer_hidden)))


def _commit_inputs(drafter, draft_params, model, context: int, sp, su: _DrafterSetup):
    """What a step's widest commit reads, computed once: (depth, the verify output along the path [B, depth + 1],
    the whole pass as Verified). A chain: k random drafts after the last committed token, all accepted. A tree: a
    proposal's tree, the target's pass over it and its deepest root path."""
    tree = _proposed_tree(drafter, draft_params, context, sp, su)
    depth = _depth(tree, drafter.k)
    if tree is None:
        verify_in, out = _verify_pass(model, su, context, depth)
        return depth, out, Verified(verify_in, None, out)
    lengths = jnp.full((su.tokens.shape[0],), context - 1, jnp.int32)
    full = forward(model.params, model.config, tree.tokens, su.prefill.cache.replace(lengths=lengths),
                   depths=tree.depths, mask=tree.mask, hidden_layers=su.layers)
    return depth, along_deepest_path(tree, full), Verified(tree.tokens, tree.parents, full)


def commit_seconds(drafter, draft_params, model, context: int, sp, reps: int = 10, batch: int = 1,
                   cache_size: int | None = None, inner: int = 16, budget_s: float | None = None,
                   setup: _DrafterSetup | None = None) -> float:
    """One drafter.commit call after a verify pass that accepted every draft it could (the widest commit: a
    drafter that feeds the accepted positions' target features through its own layers, as EAGLE does, feeds all
    of them): a chain's k + 1 positions, a token tree's deepest root path (committed_depth + 1 positions, the
    verify output gathered along it as the loop gathers the accepted path), on a context of `context` committed
    tokens. The target's verify forward is not included (forward_seconds measures it). Build the drafter for a
    buffer of at least context + 2k + 8 slots."""
    cfg = model.config
    su = setup or drafter_setup(drafter, draft_params, model, context, sp, batch, cache_size)
    depth, out, verified = _commit_inputs(drafter, draft_params, model, context, sp, su)
    lengths = jnp.full((batch,), context + depth + 1, jnp.int32)
    num_accepted = jnp.full((batch,), depth, jnp.int32)

    def one(i, params, state, tokens, exposed, out):
        ctx = Context(tokens.at[:, context + depth].set(i % cfg.vocab_size), lengths, su.prompt_lengths, exposed)
        whole = verified if verified.parents is not None else verified._replace(out=out)      # a chain: the same
        return _scalar_of(drafter.commit(params, _depends_on(i, state), ctx, num_accepted, out, whole))

    return _per_call_seconds(one, (draft_params, su.state, su.tokens, su.exposed, out), inner, reps, budget_s)


def drafter_step_seconds(drafter, draft_params, model, context: int, sp, batch: int = 1,
                         cache_size: int | None = None, setup: _DrafterSetup | None = None,
                         **timing) -> tuple[float, float]:
    """(propose, commit) seconds: the drafter's work in one speculative step beside the target's verify (a draft
    model catches up inside propose; EAGLE feeds the verified positions' features through its layer in commit),
    both on one prompt, prefill and drafter state (setup: drafter_setup's, shared with other measurements).
    timing: reps, inner, budget_s."""
    su = setup or drafter_setup(drafter, draft_params, model, context, sp, batch, cache_size)
    kw = dict(batch=batch, cache_size=cache_size, setup=su, **timing)
    return (propose_seconds(drafter, draft_params, model, context, sp, **kw),
            commit_seconds(drafter, draft_params, model, context, sp, **kw))


class InTurn(NamedTuple):
    """step_in_turn_seconds' three programs, timed side by side (seconds per step, free of per-call costs)."""
    in_turn: float      # proposal, verify, commit in turn
    drafter: float      # the drafter's part alone (proposal and commit, on one fixed verify output)
    verify: float       # the target's verify forward alone
    beside: dict        # {name: (seconds per call, first result)} of the `beside` calls, in the same rounds
    per_call: float = 0.0   # seconds a call of the in-turn program costs beside its steps (its call of no steps)


def step_in_turn_seconds(drafter, draft_params, model, context: int, sp, reps: int = 10, batch: int = 1,
                         cache_size: int | None = None, inner: int = 16, budget_s: float | None = None,
                         implementation: str = "xla", setup: _DrafterSetup | None = None,
                         beside: Mapping[str, Callable[[], Any]] | None = None) -> InTurn:
    """One speculative step's model work, run in turn as the decode loop runs it: the drafter's proposal, the
    target's verify forward over it (a chain's k + 1 positions, a tree's nodes), then the drafter's commit after
    every draft it could was accepted (a chain's k; a tree's deepest path, the verify output gathered along a root
    path of that depth, as the loop gathers the accepted one); `inner` steps chained in one compiled loop, each
    proposal reading what the last verify gave. Timed side by side with the drafter's part alone and the verify
    alone (the same loops less the other model). Each program's step is its call of `inner` steps less its call
    of none (the dispatch and the carry's handover, which a decode loop's step does not pay either: engine
    overheads compare it with the loop's call less its one-token call), over `inner`. Left out is the loop's own
    work (acceptance, a tree's path gathers and KV compaction, committing tokens, statistics), so the loop's step
    over `in_turn` is the engine's overhead, and `in_turn` over drafter + verify is what taking turns costs: where
    the weights fit in the caches (the toy), each model evicts the other's. beside: other calls timed in the same
    rounds (e.g. the decode loop itself, whose step is then compared with `in_turn` measured in the same spells of
    a shared machine). Build the drafter for a buffer of at least context + 2k + 8 slots."""
    if inner < 1:
        raise ValueError(f"step_in_turn_seconds: inner={inner}, the steps chained per call, must be at least 1")
    cfg, k = model.config, drafter.k
    su = setup or drafter_setup(drafter, draft_params, model, context, sp, batch, cache_size)
    lengths = jnp.full((batch,), context, jnp.int32)
    keys = jax.random.split(jax.random.PRNGKey(0), batch)
    shares = shares_target_cache(drafter)
    depth, path_out, whole = _commit_inputs(drafter, draft_params, model, context, sp, su)   # the drafter alone
    commit_lengths, all_accepted = lengths + depth + 1, jnp.full((batch,), depth, jnp.int32)  # commits after these
    fixed_in, _ = _verify_pass(model, su, context, k)               # the verify alone feeds a chain of k + 1

    def step(i, carry, with_drafter, with_verify, weights):
        target_params, draft_params, exposed = weights
        last, state, cache = carry
        tokens = su.tokens.at[:, context - 1].set((i + last) % cfg.vocab_size)
        ctx = Context(tokens, lengths, su.prompt_lengths, exposed)
        tree = None
        if with_drafter:
            if shares:   # drafts over the target's cache past the committed entries, as the loop hands it over
                draft, state, drafted = drafter.propose(draft_params, state, ctx._replace(target_cache=cache), keys,
                                                        sp)
                cache = drafted.replace(lengths=cache.lengths)
            else:
                draft, state = drafter.propose(draft_params, state, ctx, keys, sp)
            tree = draft.tree
            verify_in = tree.tokens if tree is not None else \
                jnp.concatenate([tokens[:, context - 1:context], draft.tokens], axis=1)        # [B, k + 1]
        else:
            verify_in = jnp.concatenate([tokens[:, context - 1:context], fixed_in[:, 1:]], axis=1)
        if with_verify:
            out = forward(target_params, cfg, verify_in, cache, hidden_layers=su.layers, implementation=implementation,
                          **({} if tree is None else dict(depths=tree.depths, mask=tree.mask)))
            cache = out.cache.replace(lengths=cache.lengths)
            last = (out.logits[0, -1, 0] > 0).astype(jnp.int32)    # the next step reads this verify
            seen = Verified(verify_in, None if tree is None else tree.parents, out)
            if tree is not None:
                out = along_deepest_path(tree, out)
        else:            # the drafts feed the next step (or XLA drops an unread proposal), the commit reads the
            last = verify_in[0, -1] % 2      # fixed output made to depend on the step (or XLA hoists it)
            out = path_out._replace(**_depends_on(i, dict(
                logits=path_out.logits, hidden=path_out.hidden, layer_hidden=path_out.layer_hidden)))
            seen = whole if whole.parents is not None else whole._replace(out=out)
        if with_drafter:
            state = drafter.commit(draft_params, state, ctx._replace(length=commit_lengths), all_accepted, out, seen)
            if not with_verify:
                last = last + _scalar_of(state).astype(jnp.int32) % 2
        return last, state, cache

    def program(**parts):
        # state and cache carried and donated, as the loop's are: their writes then update them in place. The
        # weights are arguments, as the loop's are: closed over, they would be compiled into the program as
        # constants, other buffers than the loop reads (and a large program to compile)
        looped = jax.jit(lambda weights, carry, steps: lax.fori_loop(
            0, steps, functools.partial(step, weights=weights, **parts), carry), donate_argnums=1)
        weights = (model.params, draft_params, su.exposed)
        return {steps: (lambda carry, steps=jnp.int32(steps): jax.block_until_ready(looped(weights, carry, steps)))
                for steps in (inner, 0)}             # one compiled program: the step count is an argument

    start = (jnp.int32(0), su.state, su.prefill.cache.replace(lengths=lengths - 1))
    fresh = functools.partial(_copied, start)
    programs = dict(in_turn=program(with_drafter=True, with_verify=True),
                    drafter=program(with_drafter=True, with_verify=False),
                    verify=program(with_drafter=False, with_verify=True))
    calls = {(name, steps): call for name, by_steps in programs.items() for steps, call in by_steps.items()}
    fresh_inputs = {name: fresh for name in calls}
    for name, call in (beside or {}).items():
        calls[f"beside:{name}"], fresh_inputs[f"beside:{name}"] = (lambda _, call=call: call()), (lambda: None)
    seconds, results = fastest_alternating(calls, reps, fresh_inputs=fresh_inputs, budget_s=budget_s)
    return InTurn(*((seconds[name, inner] - seconds[name, 0]) / inner for name in programs),
                  {name: (seconds[f"beside:{name}"], results[f"beside:{name}"]) for name in beside or {}},
                  seconds["in_turn", 0])


def init_seconds(drafter, draft_params, model, prompt_len: int, sp, reps: int = 10, batch: int = 1,
                 cache_size: int | None = None, inner: int = 4, budget_s: float | None = None) -> float:
    """One drafter.init call after a prompt of prompt_len tokens (e.g. a draft model's own prefill; ~0 for
    drafters with no state). The target's prefill is not included: forward_seconds measures it."""
    cfg = model.config
    tokens, _, exposed, prefill = _random_prefill(
        drafter, model, prompt_len, max(prompt_len + 2 * drafter.k + 8, cache_size or 0), batch)
    lengths = jnp.full((batch,), prompt_len, jnp.int32)

    def one(i, params, tokens, prefill, exposed):
        # positions 0 and 1 both vary: a drafter that reads tokens from 1 on (EAGLE) must not be hoisted either
        ctx = Context(tokens.at[:, :2].set(i % cfg.vocab_size), lengths + 1, lengths, exposed)
        return _scalar_of(drafter.init(params, ctx, prefill, sp))

    return _per_call_seconds(one, (draft_params, tokens, prefill, exposed), inner, reps, budget_s)


def prefill_seconds(model, ids: list[list[int]], buffer_len: int, reps: int = 5, **prepare_kw) -> float:
    """The target's prefill of these prompts as generate() runs it (rows cut into length groups, each prefilled at
    its own width) at buffer_len cache slots, with a run's fixed host costs: the fastest of `reps` runs of one
    prepared plain greedy call producing one token (specjax.api.run, as the experiments time a call). A single
    forward over every prompt padded to the longest overstates the grouped prefill of a ragged batch.
    prepare_kw: prepare()'s (pad_to, prefill_groups)."""
    config = SpecConfig(max_new_tokens=1, stop_at_eos=False, max_cache_len=buffer_len)
    prepared = api.prepare(model, ids, config, **prepare_kw)
    return fastest_seconds(lambda: api.run(prepared), reps)


def machine_roofline(reps: int = 5) -> tuple[float, float]:
    """(peak FLOP/s, memory bandwidth in bytes/s) of the default device as XLA reaches them in float32: a
    1024-cubed matmul, and a sum over a 256 MB array (read once). What the roofline in specjax.analysis needs to
    predict this machine rather than a datasheet's."""
    n = 1024
    a = jnp.ones((n, n), jnp.float32)
    matmul = jax.jit(lambda a: a @ a)
    flops = 2 * n ** 3 / fastest_seconds(lambda: matmul(a).block_until_ready(), reps)
    big = jnp.ones((64 << 20,), jnp.float32)
    total = jax.jit(jnp.sum)
    bandwidth = big.nbytes / fastest_seconds(lambda: total(big).block_until_ready(), reps)
    return flops, bandwidth


def roofline_inputs(model, context: int) -> dict:
    """The model-side arguments of specjax.analysis.roofline_step_time / batch_roofline for `model` at
    `context` tokens: weight bytes, KV bytes per cached token, FLOPs per new token (matmuls + attention)."""
    cfg = model.config
    arrays = weight_arrays(model.params)
    params = sum(x.size for x in arrays)
    itemsize = arrays[0].dtype.itemsize
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context
    return dict(param_bytes=params * itemsize, kv_bytes_per_token=kv_per_token, context_len=context,
                flops_per_token=2 * params + attention)


def _kind(hlo_name: str) -> str:
    """An HLO instruction's (or its thunk's) name less its number: `ynn_fusion.12` -> `ynn_fusion`."""
    return re.sub(r"[.\d]+$", "", hlo_name)


def hlo_signatures(hlo_text: str) -> dict[str, str]:
    """{HLO instruction name: its signature} from a compiled program's text (jit(...).lower(...).compile()
    .as_text()): a custom call's target, a fusion's kind (its name less the number: `ynn_fusion`, a dot handed to
    YNNPACK) or another instruction's opcode, then its result shape (a tuple's first element), e.g.
    `specjax_small_m_matmul f32[40,256]`, `select_add_fusion s32[8,5,4096]` or `conditional (s32[1], ...)`:
    one key for every instance of one kernel at one shape, and the same key in two programs (thunk_profile's
    `names`)."""
    signatures = {}
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%([\w.-]+) = (.*)", line)
        if not m:
            continue
        name, rest = m.groups()
        if rest.startswith("("):                    # a tuple: up to its closing parenthesis
            depth, end = 0, 0
            for end, ch in enumerate(rest):
                depth += {"(": 1, ")": -1}.get(ch, 0)
                if depth == 0:
                    break
            first = re.search(r"[a-z]+\d*\[[\d,]*\]", rest[:end])
            shape, rest = f"({first.group(0) if first else ''}, ...)", rest[end + 1:]
        else:
            shape, _, rest = rest.partition(" ")
            shape = re.sub(r"\{[^}]*\}$", "", shape)              # the layout
        opcode = re.match(r"\s*([\w-]+)\(", rest)
        if opcode:
            target = re.search(r'custom_call_target="([\w.-]+)"', rest)
            kind = _kind(name) if opcode.group(1) == "fusion" else opcode.group(1)
            signatures[name] = f"{target.group(1) if target else kind} {shape}"
    return signatures


LOOP_CONTROL = "loop"


def hlo_parts(hlo_text: str) -> dict[str, str]:
    """{HLO instruction name: the decode program's part it belongs to} from a compiled program's text: the first of
    specjax.decode.PROGRAM_PARTS among the named scopes of its op_name (prefill, propose, target_forward, ...). One
    with none (XLA drops the op_name of what its passes create, e.g. the first stages of a long reduction) takes
    the part that every user of its result has, else the part of the instruction calling its computation (a
    drafter's own inner loop is the proposal's), else LOOP_CONTROL (the loop's conditions, keys and carry copies,
    and the little outside the loop that is neither the prefill nor the drafter's init)."""
    parts = set(PROGRAM_PARTS)
    own, computation_of, caller_of, users = {}, {}, {}, collections.defaultdict(set)
    computation = None
    for line in hlo_text.splitlines():
        head = re.match(r"^(?:ENTRY )?%([\w.-]+) .*\{$", line)
        if head:
            computation = head.group(1)
            continue
        m = re.match(r"\s*(?:ROOT )?%([\w.-]+) = (.*)", line)
        if not m or computation is None:
            continue
        name, rest = m.groups()
        op = re.search(r'op_name="([^"]*)"', rest)
        found = [seg for seg in (op.group(1).split("/") if op else ()) if seg in parts]
        own[name], computation_of[name] = (found[0] if found else None), computation
        branches = re.search(r"branch_computations=\{([^}]*)\}", rest)
        callees = re.findall(r"(?:body|condition|calls|to_apply)=%([\w.-]+)", rest)
        callees += re.findall(r"%([\w.-]+)", branches.group(1)) if branches else []
        for callee in callees:
            caller_of[callee] = name
        for operand in set(re.findall(r"%([\w.-]+)", rest)) - set(callees):
            users[operand].add(name)
    changed = True
    while changed:                     # through chains of unnamed instructions, users first
        changed = False
        for name, part in own.items():
            if part is None and users[name]:
                theirs = {own.get(user) for user in users[name]}
                if len(theirs) == 1 and None not in theirs:
                    own[name], changed = theirs.pop(), True
    resolved = {}

    def part_of(name: str, depth: int = 0) -> str:
        if name not in resolved:
            part, computation = own[name], computation_of[name]
            if part is None and computation in caller_of and depth < 64:
                part = part_of(caller_of[computation], depth + 1)
            resolved[name] = part or LOOP_CONTROL
        return resolved[name]
    return {name: part_of(name) for name in own}


def thunk_profile(call: Callable[[], Any], calls: int = 1,
                  names: Mapping[str, str] | None = None) -> dict[str, tuple[float, float]]:
    """call() `calls` times under jax.profiler (warm it up first: compilation is not what this is for) ->
    {XLA operation kind: (thread ms, executions)} summed over the calls, every executed thunk on every XLA host
    thread, by its HLO name without the numeric suffix (`ynn_fusion`: a matmul handed to YNNPACK, `copy`,
    `ffi_call`: a custom call such as the small-M matmul kernel, `cond`: a conditional with its branch). names:
    {HLO instruction name: the key its time is summed under instead} (hlo_signatures' of the program called). A
    kind that runs on two threads at once counts twice: this is CPU time, not wall time."""
    where = tempfile.mkdtemp(prefix="thunk_profile_")
    try:
        with jax.profiler.trace(where):
            for _ in range(calls):
                jax.block_until_ready(call())
        data = jax.profiler.ProfileData.from_file(glob.glob(f"{where}/**/*.xplane.pb", recursive=True)[0])
        ns, count = collections.Counter(), collections.Counter()
        for plane in data.planes:
            for line in plane.lines:
                if "Eigen" not in line.name and "PjRt" not in line.name:      # XLA's host threads only
                    continue
                for ev in line.events:
                    # containers (the executor, the loop) and waits: their time is their contents'
                    if ev.name.startswith(("ThunkExecutor", "end: ", "SlinkyThreadPool", "while",
                                           "ThreadpoolListener")):
                        continue
                    kind = (names or {}).get(ev.name) or _kind(ev.name)
                    ns[kind] += ev.duration_ns
                    count[kind] += 1
    finally:
        shutil.rmtree(where, ignore_errors=True)
    return {kind: (ns[kind] / 1e6, float(count[kind])) for kind in ns}
