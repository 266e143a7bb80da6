"""Measured costs that the analytic speedup model needs: target forward over T positions at a given context, and
one drafter proposal.

Each cost is measured the way the decode loop pays it: `inner` calls chained inside ONE jitted lax.fori_loop
(each call's input depends on the loop counter, so nothing is hoisted), timed after compilation, the fastest of `reps`
divided by `inner`. Timing single jitted calls instead adds ~0.1-0.2 ms of Python dispatch and host sync per call,
which on a ~1 ms CPU step inflates the verify-cost ratio and c.
"""
from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from specjax.cache import KVCache
from specjax.drafters.base import Context
from specjax.models.llama import forward


def fastest_seconds(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    # The fastest run: on a shared machine the slower ones measure the neighbours, not the code.
    return float(np.min(times))


def _per_call_seconds(one_call, args, inner: int, reps: int) -> float:
    """one_call(i, *args) -> a float32 scalar that depends on the work."""
    looped = jax.jit(lambda *a: lax.fori_loop(0, inner, lambda i, acc: acc + one_call(i, *a), jnp.float32(0)))
    return fastest_seconds(lambda: looped(*args).block_until_ready(), reps) / inner


def forward_seconds(model, context: int, T: int, reps: int = 10, batch: int = 1,
                    cache_size: int | None = None, inner: int = 16) -> float:
    """One cached target forward over T new positions after `context` tokens of history. The XLA attention reads
    the whole buffer, so pass the decode loop's buffer length as cache_size to measure what the loop pays."""
    cfg = model.config
    size = max(context + T + 1, cache_size or 0)
    cache = KVCache.init(cfg.num_layers, batch, size, cfg.num_kv_heads, cfg.head_dim).replace(
        lengths=jnp.full((batch,), context, jnp.int32))

    def one(i, params, cache):
        toks = (jnp.arange(T, dtype=jnp.int32)[None, :] + i) % cfg.vocab_size
        return forward(params, cfg, jnp.broadcast_to(toks, (batch, T)), cache).logits[0, -1, 0]

    return _per_call_seconds(one, (model.params, cache), inner, reps)


def propose_seconds(drafter, draft_params, model, context: int, sp, reps: int = 10, batch: int = 1,
                    cache_size: int | None = None, inner: int = 16) -> float:
    """One drafter.propose call (all k draft tokens) on a context of `context` committed tokens."""
    from specjax.drafters.draft_model import DraftModelDrafter
    from specjax.drafters.predicted import PredictedDrafter
    buffer_len = max(context + 2 * drafter.num_tokens + 8, cache_size or 0)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(1, model.config.vocab_size, (batch, buffer_len)), jnp.int32)
    if isinstance(drafter, DraftModelDrafter):
        dc = drafter.config
        drafter = dataclasses.replace(drafter, cache_size=buffer_len + drafter.extra_cache_slots(
            drafter.num_tokens, drafter.num_steps, drafter.topk))
        state = KVCache.init(dc.num_layers, batch, drafter.cache_size, dc.num_kv_heads, dc.head_dim)
    elif isinstance(drafter, PredictedDrafter):
        state = jnp.zeros((batch,), jnp.int32)
    else:
        state = ()
    keys = jax.random.split(jax.random.PRNGKey(0), batch)

    def one(i, params, state, tokens):
        ctx = Context(tokens.at[:, context - 1].set(i % model.config.vocab_size),
                      jnp.full((batch,), context, jnp.int32), jnp.full((batch,), context // 2, jnp.int32))
        return drafter.propose(params, state, ctx, keys, sp)[0].tokens[0, -1].astype(jnp.float32)

    return _per_call_seconds(one, (draft_params, state, tokens), inner, reps)
