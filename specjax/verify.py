"""Acceptance rules. Every function works on a batch; rows accept different numbers of tokens (ragged) while
shapes stay fixed.

Chains (Leviathan et al. 2023, Chen et al. 2023): with draft tokens d_1..d_k drawn from q_1..q_k and the target's
distributions p_1..p_{k+1} (p_i conditions on d_<i), accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); at
the first rejection sample from norm(max(0, p_i - q_i)); if all k are accepted sample the bonus token from p_{k+1}.
The output is distributed exactly as the target's. A deterministic drafter (prompt lookup, predictions) has a
one-hot q, which makes the rule: accept with probability p(d), else sample from p with d removed.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def leading_true(accept: jax.Array) -> jax.Array:
    """[B, k] bool -> [B] int32: length of the all-True prefix of each row."""
    return jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def chain_greedy(draft_tokens: jax.Array, target_logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """draft_tokens [B, k], target_logits [B, k+1, V] -> (num_accepted [B], next_token [B])."""
    target_tokens = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)           # [B, k+1]
    n = leading_true(draft_tokens == target_tokens[:, :-1])
    next_token = jnp.take_along_axis(target_tokens, n[:, None], axis=1)[:, 0]
    return n, next_token


def residual_distribution(p: jax.Array, q: jax.Array) -> jax.Array:
    """norm(max(0, p - q)) over the last axis; falls back to p where p == q (rejection then has probability 0)."""
    r = jnp.maximum(p - q, 0.0)
    total = jnp.sum(r, axis=-1, keepdims=True)
    return jnp.where(total > 0, r / jnp.where(total > 0, total, 1.0), p)


def chain_sampled(keys: jax.Array, draft_tokens: jax.Array, draft_probs: jax.Array | None,
                  target_probs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """keys [B] (one PRNG key per row), draft_tokens [B, k], draft_probs [B, k, V] or None (one-hot drafts),
    target_probs [B, k+1, V] -> (num_accepted [B], next_token [B])."""
    B, k = draft_tokens.shape
    V = target_probs.shape[-1]
    if draft_probs is None:
        draft_probs = jax.nn.one_hot(draft_tokens, V, dtype=target_probs.dtype)
    p_d = jnp.take_along_axis(target_probs[:, :k], draft_tokens[..., None], axis=-1)[..., 0]   # [B, k]
    q_d = jnp.take_along_axis(draft_probs, draft_tokens[..., None], axis=-1)[..., 0]           # [B, k]

    def row(key, p_d, q_d, p, q):
        k_accept, k_next = jax.random.split(key)
        u = jax.random.uniform(k_accept, (k,))
        n = leading_true(u * q_d < p_d)                  # u < p/q without dividing; p == 0 never accepts
        q_n = jnp.where(n < k, q[jnp.minimum(n, k - 1)], 0.0)
        dist = residual_distribution(p[n], q_n)          # n == k: q_n = 0, so this is p_{k+1} (the bonus)
        return n, jax.random.categorical(k_next, jnp.log(dist)).astype(jnp.int32)

    return jax.vmap(row)(keys, p_d, q_d, target_probs, draft_probs)
