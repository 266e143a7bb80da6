"""The ONE transform from logits to probabilities, shared by the target and every drafter.

Temperature, then top-k, then top-p (Leviathan et al.: any of them is sampling from an adjusted distribution, and
speculative sampling is exact for the adjusted one as long as p and q both go through the same transform).
temperature == 0 means greedy: the distribution is one-hot at the argmax (first index on ties).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

# The index of the largest logit, the first on ties (a NaN counts as the largest, as in jnp.argmax): a kernel on a
# CPU, the reference's two reductions elsewhere.
from specjax.ops import greedy_token


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


SAMPLE_BLOCK = 128


def sample(key: jax.Array, probs: jax.Array) -> jax.Array:
    """Draw one index per row of probs [..., V] (int32 [...]), each with probability its entry over the row's sum;
    an entry of 0 is never drawn. The inverse of the distribution function at two uniforms per row: a block of
    SAMPLE_BLOCK indices by the blocks' masses, then an index inside it by its own entries, so that every float32
    cumulative sum is short (V / SAMPLE_BLOCK block masses, then SAMPLE_BLOCK entries relative to their block's mass)
    and an entry's share is kept to about the precision of a Gumbel draw. A Gumbel draw per entry
    (jax.random.categorical) made threefry over the whole vocabulary the largest cost of a sampled step beside the
    forwards on CPU (the results page's sampled-step table)."""
    batch, V = probs.shape[:-1], probs.shape[-1]
    p = probs.astype(jnp.float32)
    p = jnp.pad(p, [(0, 0)] * len(batch) + [(0, -V % SAMPLE_BLOCK)])
    blocks = p.reshape(*batch, -1, SAMPLE_BLOCK)                              # [..., V / S, S]
    u = jax.random.uniform(key, (*batch, 2), jnp.float32)                      # [..., 2]
    block = _inverse_cdf(blocks.sum(axis=-1), u[..., 0])                      # [...]
    inside = jnp.take_along_axis(blocks, block[..., None, None], axis=-2)[..., 0, :]   # [..., S]
    return (block * SAMPLE_BLOCK + _inverse_cdf(inside, u[..., 1])).astype(jnp.int32)


def _inverse_cdf(weights: jax.Array, u: jax.Array) -> jax.Array:
    """The first index whose cumulative weight exceeds u times the total: weights [..., n] >= 0, u [...] in
    [0, 1). An index of weight 0 never comes first (its cumulative weight equals the one before it)."""
    cdf = jnp.cumsum(weights, axis=-1)                                         # [..., n]
    index = jnp.sum(cdf <= u[..., None] * cdf[..., -1:], axis=-1)
    # u * total can round up to the total itself: then the last index of positive weight
    last = weights.shape[-1] - 1 - jnp.argmax(jnp.flip(weights > 0, axis=-1), axis=-1)
    return jnp.minimum(index, last).astype(jnp.int32)
