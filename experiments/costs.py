"""Measured costs that the analytic speedup model needs: target forward over T positions at a given context, and
one drafter proposal. Each is one jitted call timed after compilation (median of `reps`)."""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax.cache import KVCache
from specjax.drafters.base import Context
from specjax.models.llama import forward


def median_seconds(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def forward_seconds(model, context: int, T: int, reps: int = 20, batch: int = 1,
                    cache_size: int | None = None) -> float:
    """One cached target forward over T new positions after `context` tokens of history. The XLA attention reads
    the whole buffer, so pass the decode loop's buffer length as cache_size to measure what the loop pays."""
    cfg = model.config
    size = max(context + T + 1, cache_size or 0)
    cache = KVCache.init(cfg.num_layers, batch, size, cfg.num_kv_heads, cfg.head_dim).replace(
        lengths=jnp.full((batch,), context, jnp.int32))
    step = jax.jit(lambda p, t, c: forward(p, cfg, t, c).logits)
    toks = jnp.ones((batch, T), jnp.int32)
    return median_seconds(lambda: step(model.params, toks, cache).block_until_ready(), reps)


def propose_seconds(drafter, draft_params, model, context: int, sp, reps: int = 20, batch: int = 1,
                    cache_size: int | None = None) -> float:
    """One drafter.propose call (all k draft tokens) on a context of `context` committed tokens."""
    import dataclasses
    from specjax.drafters.draft_model import DraftModelDrafter
    buffer_len = max(context + 2 * drafter.num_tokens + 8, cache_size or 0)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(1, model.config.vocab_size, (batch, buffer_len)), jnp.int32)
    ctx = Context(tokens, jnp.full((batch,), context, jnp.int32), jnp.full((batch,), context // 2, jnp.int32))
    if isinstance(drafter, DraftModelDrafter):
        dc = drafter.config
        drafter = dataclasses.replace(drafter, cache_size=buffer_len + drafter.extra_cache_slots(
            drafter.num_tokens, drafter.num_steps, drafter.topk))
        state = KVCache.init(dc.num_layers, batch, drafter.cache_size, dc.num_kv_heads, dc.head_dim)
    elif type(drafter).__name__ == "PredictedDrafter":
        state = jnp.zeros((batch,), jnp.int32)
    else:
        state = ()
    keys = jax.random.split(jax.random.PRNGKey(0), batch)
    fn = jax.jit(lambda p, s, c, k: drafter.propose(p, s, c, k, sp)[0].tokens)
    return median_seconds(lambda: fn(draft_params, state, ctx, keys).block_until_ready(), reps)
