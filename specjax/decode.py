"""generate(): prefill, then ONE lax.while_loop over (propose -> verify -> accept -> commit).

Plain decoding is this loop with the null drafter (k = 0): baseline and speculative runs share every line except
the drafter, which keeps their comparison fair. The whole generation is a single compiled XLA program.

With an acceptance policy (SpecConfig.acceptance_rate_threshold) the batch switches to plain one-token steps for
good once its acceptance over the last acceptance_rate_window_size speculative steps falls below the threshold
(TensorRT-LLM's rule): the loop then exits into a second loop over the same body with the plain step.

Invariant at the top of each iteration, per row: `tokens[:length]` are committed; the target cache holds the
first length - 1 of them; the last committed token is fed to the target together with the k drafts (a tree:
as node 0 of its T = k + 1 nodes, whose accepted root-to-node path is then compacted into contiguous KV slots).
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
from specjax.sampling import probabilities, sample
from specjax.verify import (chain_greedy, chain_sampled, chain_typical_lossy, tree_greedy, tree_sampled,
                            tree_typical_lossy)


class DecodeStats(NamedTuple):
    steps: jax.Array            # [B] target passes after prefill (verify passes and plain steps)
    drafted: jax.Array          # [B] draft tokens proposed
    accepted: jax.Array         # [B] draft tokens accepted
    accept_hist: jax.Array      # [B, k+1] how often 0..k drafts were accepted in a speculative step
    plain_steps: jax.Array      # [B] steps taken with speculation switched off by the acceptance policy
    accept_trace: jax.Array     # [B, max_new_tokens] drafts accepted at loop step t; -1: inactive or plain step


class PolicyState(NamedTuple):
    """The acceptance policy's running window, over the whole batch (one verify shape serves every row)."""
    speculating: jax.Array      # [] bool; False for good once the window's acceptance fell below the threshold
    accepted: jax.Array         # [W] draft tokens accepted by active rows in each of the last W speculative steps
    drafted: jax.Array          # [W] draft tokens proposed to active rows in those steps
    filled: jax.Array           # [] int32 speculative steps taken (the window is full from W on)


class LoopState(NamedTuple):
    tokens: jax.Array           # [B, L]
    length: jax.Array           # [B]
    num_new: jax.Array          # [B]
    done: jax.Array             # [B] bool
    cache: KVCache | GroupedKVCache   # grouped: a ragged batch's prefill groups (prefill_forward)
    draft_state: Any
    step: jax.Array             # [] int32
    stats: DecodeStats
    policy: PolicyState | None  # None: no acceptance policy (one loop, no switch)


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def buffer_length(prompt_width: int, max_new_tokens: int, num_speculative_tokens: int) -> int:
    """The token/KV buffer generate() allocates for prompts padded to prompt_width: every new token plus the k + 1
    slots of a verify pass, rounded up to 16."""
    return round_up(prompt_width + max_new_tokens + num_speculative_tokens + 1, 16)


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
        return jnp.argmax(logits, -1).astype(jnp.int32)
    return jax.vmap(sample)(keys, probabilities(logits, spec.sampling))


def _verify_tree(target_params: dict, cfg: ModelConfig, spec: SpecConfig, draft: Draft, cache: KVCache | GroupedKVCache,
                 key: jax.Array, layers: tuple) -> tuple[jax.Array, jax.Array, ForwardOut, Verified]:
    """One target forward over the T tree nodes (root = last committed token), accept a root-to-node path, and
    compact its KV entries (slots lengths + node index) to contiguous slots from lengths.

    Returns (new [B, D+1]: the path's drafted tokens then the next token, n [B] accepted drafts, the target
    output gathered along the path, so drafters see it in sequence order like a chain, with the compacted cache,
    and the whole verify pass).
    """
    tree, sp = draft.tree, spec.sampling
    out = forward(target_params, cfg, tree.tokens, cache, depths=tree.depths, mask=tree.mask,
                  hidden_layers=layers, implementation=spec.implementation)
    verified = Verified(tree.tokens, tree.parents, out)
    if sp.greedy:
        path, n, nxt = tree_greedy(tree.tokens, tree.parents, out.logits, tree.max_depth)
    elif spec.acceptance_method == "typical_lossy":
        path, n, nxt = tree_typical_lossy(key, tree.tokens, tree.parents, probabilities(out.logits, sp),
                                          spec.posterior_threshold, spec.posterior_alpha, tree.max_depth)
    else:
        path, n, nxt = tree_sampled(key, tree.tokens, tree.parents, draft.probs, probabilities(out.logits, sp),
                                    tree.max_depth)
    idx = jnp.maximum(path, 0)                                                      # [B, D+1], -1 pads -> root
    drafted = jnp.take_along_axis(tree.tokens, idx, axis=1)[:, 1:]                  # [B, D] path minus the root
    new = _accepted_then_next(drafted, n, nxt)                                      # [B, D+1]
    along = lambda x: jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)
    out = ForwardOut(along(out.logits), along(out.hidden), tuple(map(along, out.layer_hidden)),
                     out.cache.compact(cache.lengths[:, None] + idx, cache.lengths))
    return new, n, out, verified


def target_exposure(drafter: Drafter, target_params: dict, vocab_size: int | None = None) -> tuple[tuple[int, ...], dict]:
    """What a drafter declared it reads of the target: (layer indices requested from every target forward,
    {name: target weight}). A drafter that declares nothing gets ((), {}): the forward computes nothing extra.
    vocab_size: the logical vocabulary; the embedding / LM head a mesh padded are handed over cut back to it."""
    layers = tuple(getattr(drafter, "target_layers", ()))
    return layers, {name: target_weight(target_params, name, vocab_size)
                    for name in getattr(drafter, "target_weights", ())}


# What a group's own cache costs the decode loop per step (gathers and an attention call of its own in every
# layer), counted as the (row, slot) pairs an attention pass over one buffer reads in the same time on a CPU. A
# heuristic: a ragged batch whose groups spare fewer pairs than this per extra group keeps one buffer.
GROUP_CACHE_COST_SLOTS = 320


def group_cache_sizes(groups: tuple[tuple[int, int], ...], buffer_len: int, max_new_tokens: int,
                      num_speculative_tokens: int) -> tuple[int, ...] | None:
    """The slots of each prefill group's own cache in the decode loop (the buffer_length of its width, at most
    buffer_len), or None when one buffer of buffer_len slots serves the batch: a single group, or groups that
    together spare fewer (row, slot) pairs than GROUP_CACHE_COST_SLOTS per extra group."""
    sizes = tuple(min(buffer_len, buffer_length(width, max_new_tokens, num_speculative_tokens)) for _, width in groups)
    spared = sum(rows * (buffer_len - size) for (rows, _), size in zip(groups, sizes))
    return sizes if len(groups) > 1 and spared >= GROUP_CACHE_COST_SLOTS * (len(groups) - 1) else None


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
    B, P = prompts.shape
    k = drafter.k
    sp = spec.sampling
    max_new = spec.max_new_tokens
    step_keys = lambda step: jax.vmap(lambda key: jax.random.fold_in(key, step))(request_keys)

    layers, exposed = target_exposure(drafter, target_params, cfg.vocab_size)
    groups = prefill_groups or ((B, P),)
    prefill = prefill_forward(target_params, cfg, prompts, prompt_lengths, groups, buffer_len, layers,
                              spec.implementation, prefill_order, cache_sizes)
    last_logits = prefill.logits[:, 0]                                                  # [B, V]
    first = _target_token(last_logits, step_keys(0), spec)                             # [B]
    tokens = jnp.zeros((B, buffer_len), jnp.int32).at[:, :P].set(prompts)
    tokens = _write_rows(tokens, first[:, None], prompt_lengths)
    length = prompt_lengths + 1
    ctx = Context(tokens, length, prompt_lengths, exposed)
    draft_state = drafter.init(draft_params, ctx, prefill, sp)
    zeros = jnp.zeros((B,), jnp.int32)
    window = spec.acceptance_rate_window_size
    policy = None if spec.acceptance_rate_threshold is None else PolicyState(
        jnp.bool_(True), jnp.zeros((window,), jnp.int32), jnp.zeros((window,), jnp.int32), jnp.int32(0))
    state = LoopState(tokens, length, jnp.ones((B,), jnp.int32), (first == eos_id) | (max_new <= 1),
                      prefill.cache.replace(lengths=prompt_lengths), draft_state, jnp.int32(0),
                      DecodeStats(zeros, zeros, zeros, jnp.zeros((B, k + 1), jnp.int32), zeros,
                                  jnp.full((B, max_new), -1, jnp.int32)), policy)

    def cond(s: LoopState):
        return jnp.any(~s.done) & (s.step < max_new)

    def commit_tokens(s: LoopState, new: jax.Array, n: jax.Array):
        """new [B, W] (n [B] accepted drafts, then the target's token) -> (tokens, length, num_new, done, count):
        each active row commits up to its first EOS and at most its remaining budget."""
        pos = jnp.arange(new.shape[1])[None, :]
        count = n + 1
        is_eos = (new == eos_id) & (pos < count[:, None])
        hit_eos = jnp.any(is_eos, axis=1)
        count = jnp.where(hit_eos, jnp.argmax(is_eos, axis=1) + 1, count)
        count = jnp.minimum(count, max_new - s.num_new)
        active = ~s.done
        count = jnp.where(active, count, 0)
        num_new = s.num_new + count
        done = s.done | (active & hit_eos) | (num_new >= max_new)
        return _write_rows(s.tokens, new, s.length), s.length + count, num_new, done, count

    def speculative_step(s: LoopState, keys: jax.Array):
        ctx = Context(s.tokens, s.length, prompt_lengths, exposed)
        draft, draft_state = drafter.propose(draft_params, s.draft_state, ctx, keys[:, 0], sp)
        if draft.tree is None:                                                          # chain
            verify_in = jnp.concatenate([last_tokens(ctx, 1), draft.tokens], axis=1)   # [B, k+1]
            out = forward(target_params, cfg, verify_in, s.cache, hidden_layers=layers,
                          implementation=spec.implementation)
            verified = Verified(verify_in, None, out)
            if sp.greedy:
                n, nxt = chain_greedy(draft.tokens, out.logits)
            elif spec.acceptance_method == "typical_lossy":
                n, nxt = chain_typical_lossy(keys[:, 1], draft.tokens, probabilities(out.logits, sp),
                                             spec.posterior_threshold, spec.posterior_alpha)
            else:
                n, nxt = chain_sampled(keys[:, 1], draft.tokens, draft.probs, probabilities(out.logits, sp))
            new = _accepted_then_next(draft.tokens, n, nxt)                             # [B, k+1]
        else:                                                                           # tree of k + 1 nodes
            new, n, out, verified = _verify_tree(target_params, cfg, spec, draft, s.cache, keys[:, 1], layers)
        tokens, length, num_new, done, count = commit_tokens(s, new, n)
        ctx = Context(tokens, length, prompt_lengths, exposed)
        draft_state = drafter.commit(draft_params, draft_state, ctx, n, out, verified)
        return tokens, length, num_new, done, out.cache.replace(lengths=s.cache.lengths + count), draft_state, n

    def plain_step(s: LoopState, keys: jax.Array):
        """One target position per row; the drafter is not run again (speculation stays off), so its state is
        left as it was."""
        ctx = Context(s.tokens, s.length, prompt_lengths, exposed)
        out = forward(target_params, cfg, last_tokens(ctx, 1), s.cache, implementation=spec.implementation)
        nxt = _target_token(out.logits[:, 0], keys[:, 1], spec)                          # [B]
        n = jnp.zeros((B,), jnp.int32)
        tokens, length, num_new, done, count = commit_tokens(s, nxt[:, None], n)
        return tokens, length, num_new, done, out.cache.replace(lengths=s.cache.lengths + count), s.draft_state, n

    def update_policy(p: PolicyState, active: jax.Array, n: jax.Array) -> PolicyState:
        slot = p.filled % window
        accepted = p.accepted.at[slot].set(jnp.sum(jnp.where(active, n, 0)))
        drafted = p.drafted.at[slot].set(k * jnp.sum(active.astype(jnp.int32)))
        filled = p.filled + 1
        # accepted / drafted < threshold without dividing (a window of finished rows drafts nothing)
        low = (filled >= window) & (jnp.sum(accepted) < spec.acceptance_rate_threshold * jnp.sum(drafted))
        return PolicyState(~low, accepted, drafted, filled)

    def loop_step(speculative: bool):
        step = speculative_step if speculative else plain_step

        def body(s: LoopState):
            keys = jax.vmap(lambda key: jax.random.split(key))(step_keys(s.step + 1))  # [B, 2] keys
            tokens, length, num_new, done, cache, draft_state, n = step(s, keys)
            active = ~s.done
            a = active.astype(jnp.int32)
            st = s.stats
            if speculative:
                stats = DecodeStats(st.steps + a, st.drafted + a * k, st.accepted + a * n,
                                    st.accept_hist + a[:, None] * jax.nn.one_hot(n, k + 1, dtype=jnp.int32),
                                    st.plain_steps, st.accept_trace.at[:, s.step].set(jnp.where(active, n, -1)))
                policy = None if s.policy is None else update_policy(s.policy, active, n)
            else:
                stats, policy = st._replace(steps=st.steps + a, plain_steps=st.plain_steps + a), s.policy
            return LoopState(tokens, length, num_new, done, cache, draft_state, s.step + 1, stats, policy)
        return body

    if policy is None:
        final = lax.while_loop(cond, loop_step(True), state)
    else:
        # Two loops in sequence rather than a lax.cond per step: a cond's branches are separate computations
        # whose carried KV cache XLA copies in and out, which cost a plain step up to a third at batch 32.
        speculated = lax.while_loop(lambda s: cond(s) & s.policy.speculating, loop_step(True), state)
        final = lax.while_loop(cond, loop_step(False), speculated)
    return final.tokens, final.num_new, final.stats
