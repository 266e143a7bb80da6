"""The ONE transform from logits to probabilities, shared by the target and every drafter.

Temperature, then top-k, then top-p (Leviathan et al.: any of them is sampling from an adjusted distribution, and
speculative sampling is exact for the adjusted one as long as p and q both go through the same transform).
temperature == 0 means greedy: the distribution is one-hot at the argmax (first index on ties).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0          # 0 = off
    top_p: float = 1.0      # 1.0 = off

    def __post_init__(self):
        validate_sampling(self.temperature, self.top_k, self.top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def validate_sampling(temperature: float, top_k: int, top_p: float) -> None:
    if not isinstance(temperature, (int, float)) or temperature != temperature or temperature < 0:
        raise ValueError(f"temperature must be a number >= 0 (0 = greedy), got {temperature!r}")
    if not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0 = off), got {top_k!r}")
    if not isinstance(top_p, (int, float)) or not (0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")


def greedy_token(logits: jax.Array) -> jax.Array:
    """logits [..., V] -> int32 [...]: the index of the largest logit, the first on ties (a NaN counts as the
    largest, as in jnp.argmax). Two plain reductions (the max, then the first index holding it) rather than
    argmax's paired value-index reduction, which XLA:CPU runs about 5x slower over a vocabulary."""
    top = jnp.max(logits, axis=-1, keepdims=True)
    index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    hit = (logits == top) | jnp.isnan(logits)
    return jnp.min(jnp.where(hit, index, logits.shape[-1]), axis=-1)


def probabilities(logits: jax.Array, sp: SamplingParams) -> jax.Array:
    """logits [..., V] -> float32 probabilities [..., V] after temperature, top-k and top-p."""
    logits = logits.astype(jnp.float32)
    if sp.greedy:
        return jax.nn.one_hot(greedy_token(logits), logits.shape[-1], dtype=jnp.float32)
    logits = logits / sp.temperature
    if sp.top_k and sp.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, sp.top_k)[0][..., -1:]
        logits = jnp.where(logits >= kth, logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    if sp.top_p < 1.0:
        # Keep the smallest set of most likely tokens whose mass reaches top_p; ties at the cut are kept (as in
        # top-k), so the rule is a threshold on p and needs no scatter.
        sorted_p = -jnp.sort(-probs, axis=-1)
        before = jnp.cumsum(sorted_p, axis=-1) - sorted_p            # mass strictly above each sorted token
        num_keep = jnp.sum(before < sp.top_p, axis=-1, keepdims=True)
        cutoff = jnp.take_along_axis(sorted_p, num_keep - 1, axis=-1)
        probs = jnp.where(probs >= cutoff, probs, 0.0)
        probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
    return probs


def sample(key: jax.Array, probs: jax.Array) -> jax.Array:
    """Draw one index per row of probs [..., V] (int32 [...])."""
    return jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32)
