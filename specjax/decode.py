"""generate()'s compiled program: prefill, then ONE lax.while_loop over (propose -> verify -> accept -> commit).
The proposal for a step is made at the end of the step before (after its commit; after prefill for the first), so
it is in the loop state when the step starts and the step's width can be chosen from it.

Plain decoding is this loop with the null drafter (k = 0): baseline and speculative runs share every line except
the drafter, which keeps their comparison fair. The whole generation is a single compiled XLA program.

With an acceptance policy (SpecConfig.acceptance_rate_threshold) the batch switches to plain one-token steps for
good once its acceptance over the last acceptance_rate_window_size speculative steps falls below the threshold
(TensorRT-LLM's rule): the loop then exits into a second loop over the same state with the plain step.
A drafter that reports how much it proposed (Draft.num_drafted: prompt lookup, suffix decoding, predicted
outputs; any chain drafter under SpecConfig.draft_confidence_threshold) gets a one-position step whenever no row
of the batch proposed anything, rather than a verify pass over k + 1 positions of filler; the proposal is made
once per step either way.

Invariant at the top of each iteration, per row: `tokens[:length]` are committed; the target cache holds the
first length - 1 of them; the last committed token is fed to the target together with the k drafts (a tree:
as node 0 of its T = k + 1 nodes, whose accepted root-to-node path is then compacted into contiguous KV slots).

In the code: `decode_loop` builds the LoopInputs (what no step changes) and the first LoopState (prefill and
the first token), then loops `speculative_step` (and `plain_step` when nothing was drafted or after a policy
switch), each a function LoopState -> LoopState. A step's parts (proposal, target forward, acceptance, commits,
statistics) run under named scopes (STEP_PARTS), so a profile of the compiled loop can sum its time by part.
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from specjax.cache import GroupedKVCache, KVCache
from specjax.config import SpecConfig
from specjax.drafters.base import Context, Draft, Drafter, Verified, last_tokens, target_weight
from specjax.models.config import ModelConfig
from specjax.models.llama import ForwardOut, forward, kv_heads
from specjax.sampling import greedy_token, probabilities, sample
from specjax.trees import first_nodes
from specjax.verify import accept


class DecodeStats(NamedTuple):
    steps: jax.Array            # [B] target passes after prefill (verify passes and one-position steps)
    drafted: jax.Array          # [B] draft tokens verified (k, or the row's own verify width, in each step it proposed)
    accepted: jax.Array         # [B] draft tokens accepted
    accept_hist: jax.Array      # [B, k+1] how often 0..k drafts were accepted in a speculative step
    plain_steps: jax.Array      # [B] one-position steps: the row proposed nothing (Draft.num_drafted), or the
                                # acceptance policy switched speculation off
    accept_trace: jax.Array     # [B, max_new_tokens] drafts accepted at loop step t; -1: inactive or one position
    verify_hist: jax.Array      # [B, k+1] active steps by the drafts the target pass verified (0: one position)


class PolicyState(NamedTuple):
    """The acceptance policy's running window, over the whole batch (one verify shape serves every row)."""
    speculating: jax.Array      # [] bool; False for good once the window's acceptance fell below the threshold
    accepted: jax.Array         # [W] draft tokens accepted by active rows in each of the last W speculative steps
    drafted: jax.Array          # [W] draft tokens proposed to active rows in those steps
    filled: jax.Array           # [] int32 speculative steps taken (the window is full from W on)


class LoopState(NamedTuple):
    """The while_loop's carry: what a step reads and returns."""
    tokens: jax.Array           # [B, L] prompt + committed tokens; entries at or past `length` are stale
    length: jax.Array           # [B] committed tokens, prompt included
    num_new: jax.Array          # [B] tokens generated so far (at most max_new_tokens)
    done: jax.Array             # [B] bool: the row hit EOS or its budget and commits nothing more
    cache: KVCache | GroupedKVCache   # the target's; grouped: a ragged batch's prefill groups (prefill_forward)
    draft_state: Any            # the drafter's own carry (init -> propose -> commit), as `pending`'s propose left it
    pending: Draft | None       # the drafter's proposal for the coming step (made when the last step committed)
    step: jax.Array             # [] int32 loop steps taken
    stats: DecodeStats
    policy: PolicyState | None  # None: no acceptance policy (one loop, no switch)


class LoopInputs(NamedTuple):
    """What every step reads and none changes: the call's arrays and its static settings. Built while tracing
    decode_loop and closed over by the steps; never itself a jit argument."""
    target_params: dict
    draft_params: Any
    prompt_lengths: jax.Array   # [B]
    request_keys: jax.Array     # [B, 2] one PRNG key per request
    eos_id: jax.Array           # [] int32; -1: none
    target_layers: tuple[int, ...]    # the drafter's declared target layers (requested from every forward)
    target_weights: dict        # {name: array}: the drafter's declared target weights
    cfg: ModelConfig
    drafter: Drafter
    spec: SpecConfig


# The parts of a loop step, as named scopes of the compiled program (an operation's op_name holds its part's
# name): a profile of the loop sums its operations' time by part (experiments.harness.loop_profile's
# by="part"); what falls in none of them is the loop's own control (its conditions, keys, the carry's copies).
# accepted_path: a tree's accepted root-to-node path gathered from the verify output and its KV compacted.
# Before the loop, the prefill and the drafter's init have scopes of their own.
PROPOSE, TARGET_FORWARD, ACCEPT, ACCEPTED_PATH, COMMIT_TOKENS, DRAFTER_COMMIT, STATS = (
    "propose", "target_forward", "accept", "accepted_path", "commit_tokens", "drafter_commit", "stats")
STEP_PARTS = (PROPOSE, TARGET_FORWARD, ACCEPT, ACCEPTED_PATH, COMMIT_TOKENS, DRAFTER_COMMIT, STATS)
PREFILL, DRAFTER_INIT = "prefill", "drafter_init"
PROGRAM_PARTS = (PREFILL, DRAFTER_INIT) + STEP_PARTS


def target_exposure(drafter: Drafter, target_params: dict,
                    vocab_size: int | None = None) -> tuple[tuple[int, ...], dict]:
    """What a drafter declared it reads of the target: (layer indices requested from every target forward,
    {name: target weight}). A drafter that declares nothing gets ((), {}): the forward computes nothing extra.
    vocab_size: the logical vocabulary; the embedding / LM head a mesh padded are handed over cut back to it."""
    return tuple(drafter.target_layers), {name: target_weight(target_params, name, vocab_size)
                                          for name in drafter.target_weights}


def shares_target_cache(drafter: Drafter) -> bool:
    """Whether the drafter's propose reads and writes the target's cache (specjax.drafters.base)."""
    return bool(getattr(drafter, "shares_target_cache", False))


def prefill_forward(params: dict, cfg: ModelConfig, prompts: jax.Array, prompt_lengths: jax.Array,
                    groups: tuple[tuple[int, int], ...], buffer_len: int, hidden_layers: tuple[int, ...] = (),
                    implementation: str = "xla", order: jax.Array | None = None,
                    cache_sizes: tuple[int, ...] | None = None) -> ForwardOut:
    """The target's forward over right-padded prompts [B, P], one forward per group of rows -> ForwardOut: logits
    [B, 1, V] at each row's last prompt token, hidden states [B, P, ...] (zero past its group's width), the cache
    (lengths not set). Rows keep their order in every output.

    groups ((num_rows, width), ...) cut the rows taken in `order` [B] (default: as given) into consecutive runs,
    every prompt of a run at most `width` tokens. Rows sorted by length and grouped by width skip most of the
    padding, which on a ragged batch (prompts of very different lengths padded to the longest) is several times
    the real work. Each group also attends over a cache of its own width.
    cache_sizes: None: every group is written into one cache of buffer_len slots. Else the slots of each group's
    own cache for the decode loop (group_cache_sizes), a GroupedKVCache: no row's attention then passes over the
    slots only a longer prompt needs."""
    B, P = prompts.shape
    if sum(rows for rows, _ in groups) != B or any(not 0 < width <= P for _, width in groups):
        raise ValueError(f"prefill groups {groups} do not cover a batch of {B} prompts of width {P}")
    if cache_sizes is not None and (len(cache_sizes) != len(groups) or any(
            not width <= size <= buffer_len for (_, width), size in zip(groups, cache_sizes))):
        raise ValueError(f"cache sizes {cache_sizes} do not fit prefill groups {groups} in a buffer of {buffer_len}")
    Hkv, dtype = kv_heads(params, cfg), params["embed"].dtype
    new_cache = lambda rows, size: KVCache.init(cfg.num_layers, rows, size, Hkv, cfg.head_dim, dtype)
    cache = None if cache_sizes else new_cache(B, buffer_len)
    if order is None:
        order = jnp.arange(B)
    outs, parts, start = [], [], 0
    for g, (rows, width) in enumerate(groups):
        at = order[start:start + rows] if len(groups) > 1 or cache_sizes else slice(None)     # [rows] batch rows
        out = forward(params, cfg, prompts[at, :width], new_cache(rows, width), hidden_layers=hidden_layers,
                      implementation=implementation, logits_at=prompt_lengths[at] - 1)
        if cache_sizes:
            parts.append(new_cache(rows, cache_sizes[g]).place(slice(None), out.cache))
        else:
            cache = cache.place(at, out.cache)
        outs.append((at, out))
        start += rows
    if cache_sizes:
        cache = GroupedKVCache.of(parts, [at for at, _ in outs], jnp.zeros((B,), jnp.int32))
    if len(groups) == 1:
        return outs[0][1]._replace(cache=cache)

    def gather(get, width=None):            # every group's [rows, w, ...] output into [B, width or w, ...]
        first = get(outs[0][1])
        full = jnp.zeros((B, width or first.shape[1]) + first.shape[2:], first.dtype)
        for at, out in outs:
            full = full.at[at, :get(out).shape[1]].set(get(out))
        return full
    return ForwardOut(gather(lambda o: o.logits), gather(lambda o: o.hidden, P),
                      tuple(gather(lambda o, i=i: o.layer_hidden[i], P) for i in range(len(hidden_layers))), cache)


# ---------------------------------------------------------------------------------------------------------------
# The loop's pieces. Each reads the LoopInputs `run` and the current LoopState `s`.
# ---------------------------------------------------------------------------------------------------------------

def _write_rows(buf: jax.Array, new: jax.Array, starts: jax.Array) -> jax.Array:
    """buf [B, L], new [B, n] written at starts[b]."""
    return jax.vmap(lambda b, x, s: lax.dynamic_update_slice(b, x, (s,)))(buf, new, starts)


def _accepted_then_next(drafted: jax.Array, n: jax.Array, nxt: jax.Array) -> jax.Array:
    """drafted [B, D] (a chain, or the accepted tree path), n [B] accepted, nxt [B] -> [B, D+1]: the n accepted
    drafts, then the target's token; what follows is never committed."""
    pos = jnp.arange(drafted.shape[1] + 1)[None, :]
    return jnp.where(pos < n[:, None], jnp.pad(drafted, ((0, 0), (0, 1))), nxt[:, None])


def _target_token(logits: jax.Array, keys: jax.Array, spec: SpecConfig) -> jax.Array:
    """logits [B, V] -> the target's own next token [B]: its argmax, or a sample from the sampling transform."""
    if spec.sampling.greedy:
        return greedy_token(logits)
    return jax.vmap(sample)(keys, probabilities(logits, spec.sampling))


def _step_keys(run: LoopInputs, step: jax.Array | int) -> jax.Array:
    """[B] keys: each request's own key folded with the step (0: the first token, t: loop step t)."""
    return jax.vmap(lambda key: jax.random.fold_in(key, step))(run.request_keys)


def _context(run: LoopInputs, s: LoopState) -> Context:
    return Context(s.tokens, s.length, run.prompt_lengths, run.target_weights,
                   draft_confidence_threshold=run.spec.draft_confidence_threshold)


def _running(run: LoopInputs, s: LoopState) -> jax.Array:
    return jnp.any(~s.done) & (s.step < run.spec.max_new_tokens)


def _commit_tokens(run: LoopInputs, s: LoopState, new: jax.Array, n: jax.Array) -> tuple[LoopState, jax.Array]:
    """new [B, W] (n [B] accepted drafts, then the target's token) -> (s with tokens, length, num_new and done
    updated, count [B] tokens committed): each active row commits up to its first EOS and at most its remaining
    budget."""
    max_new = run.spec.max_new_tokens
    pos = jnp.arange(new.shape[1])[None, :]
    count = n + 1
    is_eos = (new == run.eos_id) & (pos < count[:, None])
    hit_eos = jnp.any(is_eos, axis=1)
    count = jnp.where(hit_eos, jnp.argmax(is_eos, axis=1) + 1, count)
    count = jnp.minimum(count, max_new - s.num_new)
    active = ~s.done
    count = jnp.where(active, count, 0)
    num_new = s.num_new + count
    done = s.done | (active & hit_eos) | (num_new >= max_new)
    return s._replace(tokens=_write_rows(s.tokens, new, s.length), length=s.length + count, num_new=num_new,
                      done=done), count


class Verification(NamedTuple):
    new: jax.Array              # [B, D+1] the accepted drafts, then the target's next token (the rest: never read)
    num_accepted: jax.Array     # [B]
    out: ForwardOut             # the target's output in sequence order (a tree: gathered along the accepted
                                # path, its cache compacted), as drafters see it
    verified: Verified          # the whole verify pass


def _verify(run: LoopInputs, ctx: Context, draft: Draft, cache: KVCache | GroupedKVCache,
            keys: jax.Array, limit: jax.Array | None = None) -> Verification:
    """One target forward over the last committed token and the draft, then the acceptance rule (keys [B]; limit
    [B]: the drafts each row offers, verify.accept's).
    A chain feeds [B, k+1] tokens; a tree its T nodes (root = the last committed token), and the KV entries of
    the accepted root-to-node path (slots lengths + node index) are compacted to contiguous slots from lengths."""
    spec = run.spec
    if draft.tree is None:
        verify_in = jnp.concatenate([last_tokens(ctx, 1), draft.tokens], axis=1)       # [B, k+1]
        with jax.named_scope(TARGET_FORWARD):
            out = forward(run.target_params, run.cfg, verify_in, cache, hidden_layers=run.target_layers,
                          implementation=spec.implementation)
        verified = Verified(verify_in, None, out)
        with jax.named_scope(ACCEPT):
            acc = accept(spec, keys, draft.tokens, draft.probs, out.logits, limit=limit)
            return Verification(_accepted_then_next(draft.tokens, acc.num_accepted, acc.next_token),
                                acc.num_accepted, out, verified)
    tree = draft.tree
    with jax.named_scope(TARGET_FORWARD):
        out = forward(run.target_params, run.cfg, tree.tokens, cache, depths=tree.depths, mask=tree.mask,
                      hidden_layers=run.target_layers, implementation=spec.implementation)
    verified = Verified(tree.tokens, tree.parents, out)
    with jax.named_scope(ACCEPT):
        acc = accept(spec, keys, draft.tokens, draft.probs, out.logits, tree, limit)
    with jax.named_scope(ACCEPTED_PATH):
        idx = jnp.maximum(acc.path, 0)                                              # [B, D+1], -1 pads -> root
        drafted = jnp.take_along_axis(tree.tokens, idx, axis=1)[:, 1:]              # [B, D] path minus the root
        new = _accepted_then_next(drafted, acc.num_accepted, acc.next_token)        # [B, D+1]
        along = lambda x: jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)
        out = ForwardOut(along(out.logits), along(out.hidden), tuple(map(along, out.layer_hidden)),
                         out.cache.compact(cache.lengths[:, None] + idx, cache.lengths))
    return Verification(new, acc.num_accepted, out, verified)


def _update_policy(run: LoopInputs, p: PolicyState, drafting: jax.Array, n: jax.Array,
                   offered: jax.Array) -> PolicyState:
    """The window after one speculative step: drafting [B] the active rows that proposed, n [B] drafts each
    accepted, offered [B] drafts each row's verification offered."""
    window = run.spec.acceptance_rate_window_size
    slot = p.filled % window
    accepted = p.accepted.at[slot].set(jnp.sum(jnp.where(drafting, n, 0)))
    drafted = p.drafted.at[slot].set(jnp.sum(jnp.where(drafting, offered, 0)))
    filled = p.filled + 1
    # accepted / drafted < threshold without dividing (a window of finished rows drafts nothing)
    low = (filled >= window) & (jnp.sum(accepted) < run.spec.acceptance_rate_threshold * jnp.sum(drafted))
    return PolicyState(~low, accepted, drafted, filled)


def _step_key_pairs(run: LoopInputs, s: LoopState) -> jax.Array:
    """[B, 2] keys of the coming step: [:, 0] proposes, [:, 1] accepts (or samples the target's token)."""
    return jax.vmap(lambda key: jax.random.split(key))(_step_keys(run, s.step + 1))


def _propose_ahead(run: LoopInputs, s: LoopState) -> LoopState:
    """s with the drafter's proposal for the coming step in `pending` (and its draft state; a drafter sharing the
    target cache drafts over it past the committed entries, which the verify pass then overwrites)."""
    with jax.named_scope(PROPOSE):
        ctx, key = _context(run, s), _step_key_pairs(run, s)[:, 0]
        if shares_target_cache(run.drafter):
            draft, draft_state, cache = run.drafter.propose(run.draft_params, s.draft_state,
                                                            ctx._replace(target_cache=s.cache), key, run.spec.sampling)
            s = s._replace(cache=cache.replace(lengths=s.cache.lengths))
        else:
            draft, draft_state = run.drafter.propose(run.draft_params, s.draft_state, ctx, key, run.spec.sampling)
        return s._replace(pending=_gate_by_confidence(run, draft), draft_state=draft_state)


def _gate_by_confidence(run: LoopInputs, draft: Draft) -> Draft:
    """The draft as the loop carries it: with SpecConfig.draft_confidence_threshold, num_drafted cut to the
    leading drafts whose running product of confidences stays at or above it; the confidences themselves are
    dropped (never carried, so a drafter's computing them is compiled out when nothing reads them). What changes a
    step is only whether a row proposes anything, which reads the first position's top probability: a function
    of the committed context, not of a sampled draft, so the verification that follows stays exact."""
    threshold = run.spec.draft_confidence_threshold
    if threshold is None:
        return draft._replace(confidence=None)
    if draft.confidence is None:
        raise ValueError(f"draft_confidence_threshold: method={run.spec.method!r} does not report the confidence of "
                         "its drafts (Draft.confidence), so it cannot be gated by it")
    confident = jnp.sum(jnp.cumprod(draft.confidence, axis=1) >= threshold, axis=1).astype(jnp.int32)   # [B]
    num_drafted = confident if draft.num_drafted is None else jnp.minimum(draft.num_drafted, confident)
    return draft._replace(num_drafted=num_drafted, confidence=None)


def verify_widths(spec: SpecConfig, k: int) -> tuple[int, ...]:
    """The drafts a loop pass may verify, ascending: 0 (a one-position step), SpecConfig.verify_widths (sorted,
    each below k: the config sees to it) and k."""
    return (0,) + (spec.verify_widths or ()) + (k,)


def _width_index(num_drafted: jax.Array, widths: tuple[int, ...]) -> jax.Array:
    """num_drafted [...] -> [...] int32: the index into widths of the fewest drafts that hold that many."""
    return jnp.sum(jnp.asarray(widths[:-1]) < num_drafted[..., None], axis=-1).astype(jnp.int32)


def _width_needed(s: LoopState, widths: tuple[int, ...]) -> jax.Array:
    """[] int32: the index into widths of the pass that holds every active row's proposal (Draft.num_drafted)."""
    return _width_index(jnp.max(jnp.where(s.done, 0, s.pending.num_drafted)), widths)


def first_drafts(draft: Draft, width: int) -> Draft:
    """The draft cut to its first `width` drafts, what a narrower pass verifies (a tree: its root and first width
    nodes, a tree again since a parent precedes its children); num_drafted is kept. A drafter's proposals come
    first (Draft.num_drafted), so the cut drops filler only."""
    k = draft.tokens.shape[1]
    if width == k:
        return draft
    if draft.tree is None:
        probs = None if draft.probs is None else draft.probs[:, :width]
        return draft._replace(tokens=draft.tokens[:, :width], probs=probs)
    if draft.probs is not None:
        # Sampled siblings are verified in the order they were drawn, which a node order need not follow.
        raise ValueError("verify_widths: a sampled token tree (Draft.probs) cannot be verified in part")
    return draft._replace(tokens=draft.tokens[:, :width], tree=first_nodes(draft.tree, width + 1))


def speculative_step(run: LoopInputs, s: LoopState, width: int | None = None) -> LoopState:
    """verify the pending proposal (its first `width` drafts; None: all k) -> accept -> commit, for every row (a
    finished row commits nothing), then propose for the next step."""
    k = run.drafter.k
    width = k if width is None else width
    keys = _step_key_pairs(run, s)
    ctx = _context(run, s)
    draft = first_drafts(s.pending, width)
    offered, limit = jnp.full(s.length.shape, width, jnp.int32), None                 # [B] drafts verified
    widths = verify_widths(run.spec, k)
    if draft.num_drafted is not None and len(widths) > 2:
        # Each row is verified at its own width, the fewest that holds its proposal (the pass may be wider for
        # a batch mate): so a request's output does not depend on its batch mates, sampled or greedy.
        own_width = jnp.asarray(widths, jnp.int32)[_width_index(draft.num_drafted, widths)]      # [B]
        offered = limit = jnp.minimum(own_width, width)
    v = _verify(run, ctx, draft, s.cache, keys[:, 1], limit)
    n, new = v.num_accepted, v.new                                                    # [B], [B, D+1]
    active = ~s.done
    drafting = active                                                                 # [B] rows that proposed
    if draft.num_drafted is not None:
        # A row that proposed nothing gets what a one-position step gives it (its filler is no draft): the
        # target's token from the first position, with the same key. So its output does not depend on whether
        # a batch mate's proposal made this step wider.
        with jax.named_scope(ACCEPT):
            proposed = draft.num_drafted > 0
            n = jnp.where(proposed, n, 0)
            own = _target_token(v.verified.out.logits[:, 0], keys[:, 1], run.spec)   # [B]
            new = new.at[:, 0].set(jnp.where(proposed, new[:, 0], own))
        drafting = active & proposed
    with jax.named_scope(COMMIT_TOKENS):
        committed, count = _commit_tokens(run, s, new, n)
    with jax.named_scope(DRAFTER_COMMIT):
        draft_state = run.drafter.commit(run.draft_params, s.draft_state, _context(run, committed), n, v.out,
                                         v.verified)
    cache = v.out.cache.replace(lengths=s.cache.lengths + count)
    with jax.named_scope(STATS):
        stats, policy = _step_stats(run, s, width, active, drafting, offered, n)
    return _propose_ahead(run, committed._replace(cache=cache, draft_state=draft_state, step=s.step + 1,
                                                  stats=stats, policy=policy))


def _step_stats(run: LoopInputs, s: LoopState, width: int, active: jax.Array, drafting: jax.Array,
                offered: jax.Array, n: jax.Array) -> tuple[DecodeStats, PolicyState | None]:
    """The statistics and the acceptance policy's window after one speculative step of `width` drafts."""
    k = run.drafter.k
    a, d = active.astype(jnp.int32), drafting.astype(jnp.int32)
    st = s.stats
    stats = DecodeStats(st.steps + a, st.drafted + d * offered, st.accepted + d * n,
                        st.accept_hist + d[:, None] * jax.nn.one_hot(n, k + 1, dtype=jnp.int32),
                        st.plain_steps + a - d, st.accept_trace.at[:, s.step].set(jnp.where(drafting, n, -1)),
                        st.verify_hist.at[:, width].add(a))
    policy = None if s.policy is None else _update_policy(run, s.policy, drafting, n, offered)
    return stats, policy


def plain_step(run: LoopInputs, s: LoopState, commit_drafter: bool = False) -> LoopState:
    """One target position per row: after the policy switched speculation off (the drafter is not run again, so
    its state is left as it was), or when no row proposed anything (commit_drafter: the drafter's commit sees the
    one committed token, as Draft.num_drafted's contract says, and it proposes for the next step)."""
    keys = _step_key_pairs(run, s)                                                    # [:, 1] samples
    ctx = _context(run, s)
    tokens = last_tokens(ctx, 1)                                                      # [B, 1]
    with jax.named_scope(TARGET_FORWARD):
        out = forward(run.target_params, run.cfg, tokens, s.cache, hidden_layers=run.target_layers if commit_drafter
                      else (), implementation=run.spec.implementation)
    with jax.named_scope(ACCEPT):
        nxt = _target_token(out.logits[:, 0], keys[:, 1], run.spec)                  # [B]
    n = jnp.zeros(nxt.shape, jnp.int32)                                               # no drafts accepted
    with jax.named_scope(COMMIT_TOKENS):
        committed, count = _commit_tokens(run, s, nxt[:, None], n)
    draft_state = s.draft_state
    if commit_drafter:
        with jax.named_scope(DRAFTER_COMMIT):
            draft_state = run.drafter.commit(run.draft_params, draft_state, _context(run, committed), n, out,
                                             Verified(tokens, None, out))
    cache = out.cache.replace(lengths=s.cache.lengths + count)
    with jax.named_scope(STATS):
        a = (~s.done).astype(jnp.int32)
        stats = s.stats._replace(steps=s.stats.steps + a, plain_steps=s.stats.plain_steps + a,
                                 verify_hist=s.stats.verify_hist.at[:, 0].add(a))
    s = committed._replace(cache=cache, draft_state=draft_state, step=s.step + 1, stats=stats)
    return _propose_ahead(run, s) if commit_drafter else s


def _speculation_loop(run: LoopInputs, state: LoopState, speculating) -> LoopState:
    """Speculative steps while running and speculating(s) ([] bool). A drafter that says how much it drafted
    (Draft.num_drafted) gets the step's width chosen per step: the fewest of verify_widths' draft counts that hold
    every active row's proposal, a one-position step when no active row proposed anything. Nested while loops
    (one per width) rather than a lax.switch per step: the carried KV cache stays in place (decode_loop says
    why)."""
    keep_going = lambda s: _running(run, s) & speculating(s)
    k = run.drafter.k
    if state.pending.num_drafted is None:
        if run.spec.verify_widths:
            raise ValueError(f"verify_widths: method={run.spec.method!r} does not say how much it drafted "
                             "(Draft.num_drafted), so every step verifies all k drafts; it applies to prompt lookup, "
                             "suffix decoding, predicted outputs and chains under draft_confidence_threshold")
        return lax.while_loop(keep_going, functools.partial(speculative_step, run), state)
    widths = verify_widths(run.spec, k)
    steps = [functools.partial(plain_step, run, commit_drafter=True)] + [
        functools.partial(speculative_step, run, width=w) for w in widths[1:]]

    def each_width(s):   # each inner loop runs until the width changes, so every pass advances
        for i, step in enumerate(steps):
            s = lax.while_loop(lambda s, i=i: keep_going(s) & (_width_needed(s, widths) == i), step, s)
        return s
    return lax.while_loop(keep_going, each_width, state)


def _initial_state(run: LoopInputs, prompts: jax.Array, buffer_len: int, groups: tuple[tuple[int, int], ...],
                   order: jax.Array | None, cache_sizes: tuple[int, ...] | None) -> LoopState:
    """Prefill (prefill_forward), the first token from its logits, the drafter's init and first proposal, empty
    stats."""
    B, P = prompts.shape
    k, spec = run.drafter.k, run.spec
    max_new = spec.max_new_tokens
    with jax.named_scope(PREFILL):
        prefill = prefill_forward(run.target_params, run.cfg, prompts, run.prompt_lengths, groups, buffer_len,
                                  run.target_layers, spec.implementation, order, cache_sizes)
        first = _target_token(prefill.logits[:, 0], _step_keys(run, 0), spec)          # [B]
    tokens = jnp.zeros((B, buffer_len), jnp.int32).at[:, :P].set(prompts)             # [B, L]
    tokens = _write_rows(tokens, first[:, None], run.prompt_lengths)
    length = run.prompt_lengths + 1
    ctx = Context(tokens, length, run.prompt_lengths, run.target_weights)
    with jax.named_scope(DRAFTER_INIT):
        draft_state = run.drafter.init(run.draft_params, ctx, prefill, spec.sampling)
    zeros = jnp.zeros((B,), jnp.int32)
    window = spec.acceptance_rate_window_size
    policy = None if spec.acceptance_rate_threshold is None else PolicyState(
        jnp.bool_(True), jnp.zeros((window,), jnp.int32), jnp.zeros((window,), jnp.int32), jnp.int32(0))
    state = LoopState(tokens, length, jnp.ones((B,), jnp.int32), (first == run.eos_id) | (max_new <= 1),
                      prefill.cache.replace(lengths=run.prompt_lengths), draft_state, None, jnp.int32(0),
                      DecodeStats(zeros, zeros, zeros, jnp.zeros((B, k + 1), jnp.int32), zeros,
                                  jnp.full((B, max_new), -1, jnp.int32), jnp.zeros((B, k + 1), jnp.int32)), policy)
    return _propose_ahead(run, state)


@functools.partial(jax.jit, static_argnames=("cfg", "drafter", "spec", "buffer_len", "prefill_groups", "cache_sizes"))
def decode_loop(target_params: dict, draft_params: Any, prompts: jax.Array, prompt_lengths: jax.Array,
                request_keys: jax.Array, eos_id: jax.Array, *, cfg: ModelConfig, drafter: Drafter, spec: SpecConfig,
                buffer_len: int, prefill_groups: tuple[tuple[int, int], ...] | None = None,
                prefill_order: jax.Array | None = None,
                cache_sizes: tuple[int, ...] | None = None) -> tuple[jax.Array, jax.Array, DecodeStats]:
    """prompts [B, P] right-padded int32, prompt_lengths [B], request_keys [B, 2] (one per request), eos_id []
    (-1 = none). Returns (tokens [B, buffer_len], num_new [B], stats); row b's output is
    tokens[b, prompt_lengths[b] : prompt_lengths[b] + num_new[b]]. prefill_groups (static) and prefill_order [B]:
    as prefill_forward's groups and order (None: one prefill of every row at width P). cache_sizes (static): as
    prefill_forward's (group_cache_sizes picks them; None: one cache of buffer_len slots)."""
    layers, exposed = target_exposure(drafter, target_params, cfg.vocab_size)
    run = LoopInputs(target_params, draft_params, prompt_lengths, request_keys, eos_id, layers, exposed, cfg,
                     drafter, spec)
    state = _initial_state(run, prompts, buffer_len, prefill_groups or (prompts.shape,), prefill_order, cache_sizes)
    if state.policy is None:
        final = _speculation_loop(run, state, lambda s: jnp.bool_(True))
    else:
        # Two loops in sequence rather than a lax.cond per step: a cond's branches are separate computations
        # whose carried KV cache XLA copies in and out, which cost a plain step up to a third at batch 32.
        speculated = _speculation_loop(run, state, lambda s: s.policy.speculating)
        final = lax.while_loop(functools.partial(_running, run), functools.partial(plain_step, run), speculated)
    return final.tokens, final.num_new, final.stats
