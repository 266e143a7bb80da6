"""The greedy-token op: the index of a row's largest logit."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.ops import backends

__all__ = ["greedy_token", "greedy_token_reference"]


def greedy_token_reference(logits: jax.Array) -> jax.Array:
    """The definition: logits [..., V] -> int32 [...]: the index of the largest logit, the first on ties (a NaN
    counts as the largest, as in jnp.argmax). Two plain reductions (the max, then the first index holding it) rather
    than argmax's paired value-index reduction, which XLA:CPU runs slower still over a vocabulary. A row with a NaN
    looks for NaNs alone: XLA:CPU's max over a long row may skip a NaN, so the max need not be one."""
    top = jnp.max(logits, axis=-1, keepdims=True)
    index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    nan = jnp.isnan(logits)
    hit = jnp.where(jnp.any(nan, axis=-1, keepdims=True), nan, logits == top)
    return jnp.min(jnp.where(hit, index, logits.shape[-1]), axis=-1)


def greedy_token(logits: jax.Array) -> jax.Array:
    """logits [..., V] -> int32 [...]. An index has no gradient: a differentiated caller's logits reach the
    backend through stop_gradient."""
    return backends.call("greedy_token", greedy_token_reference, jax.lax.stop_gradient(logits))
