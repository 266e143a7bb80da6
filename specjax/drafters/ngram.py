"""Prompt lookup (n-gram) drafting: find the most recent earlier occurrence of the last n committed tokens
(n from prompt_lookup_max down to prompt_lookup_min) in a source sequence and propose what followed it.

The same matcher serves `ngram` (source = prompt + generated text) and `predicted` (source = the user's prediction).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.drafters.base import Context, Draft, last_tokens
from specjax.drafters.registry import BuildRequest, DrafterSpec, register


def match_ends(source: jax.Array, source_len: jax.Array, query: jax.Array) -> jax.Array:
    """source [L], source_len [], query [n] -> bool [L]: hit[e] iff source[e-n : e] == query and a continuation
    token source[e] exists (e < source_len)."""
    n, L = query.shape[0], source.shape[0]
    ends = jnp.arange(L)
    hit = (ends >= n) & (ends < source_len)
    for i in range(n):                                     # n is small and static
        hit &= jnp.roll(source, n - i) == query[i]         # source[e - n + i]
    return hit


def lookup(source: jax.Array, source_len: jax.Array, query: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Latest earlier occurrence of `query` (which is the tail of `source[:source_len]` itself, so that
    occurrence cannot match: it has no continuation) -> (following [] int32: how many tokens followed it, at most
    k, 0 = no occurrence; continuation [k]), the continuation clipped to the valid part (the last valid token
    repeats)."""
    e = jnp.max(jnp.where(match_ends(source, source_len, query), jnp.arange(source.shape[0]), -1))
    following = jnp.where(e >= 0, jnp.clip(source_len - e, 0, k), 0).astype(jnp.int32)
    return following, continuation(source, source_len, e, k)


def continuation(source: jax.Array, source_len: jax.Array, start: jax.Array, k: int) -> jax.Array:
    idx = jnp.clip(start + jnp.arange(k), 0, jnp.maximum(source_len - 1, 0))
    return source[idx]


@dataclasses.dataclass(frozen=True)
class NgramDrafter:
    k: int
    min_n: int = 5
    max_n: int = 5
    target_layers = ()                # reads nothing of the target but its tokens
    target_weights = ()

    def init(self, params, ctx, target_out, sp):
        return ()

    def propose(self, params, state, ctx: Context, keys, sp):
        k = self.k
        query = last_tokens(ctx, self.max_n)                                    # [B, max_n]
        proposed = jnp.zeros(ctx.length.shape, jnp.int32)                     # [B] tokens proposed
        proposal = jnp.repeat(query[:, -1:], k, axis=1)                         # fallback: repeat last token
        for n in range(self.max_n, self.min_n - 1, -1):                        # longest match first
            f, cont = jax.vmap(lambda s, l, q: lookup(s, l, q, k))(ctx.tokens, ctx.length, query[:, -n:])
            take = (f > 0) & (proposed == 0)
            proposal = jnp.where(take[:, None], cont, proposal)
            proposed = jnp.where(take, f, proposed)
        return Draft(proposal.astype(jnp.int32), num_drafted=proposed), state

    def commit(self, params, state, ctx, num_accepted, target_out, verified):
        return state


def _build(req: BuildRequest):
    if req.drafter is not None:
        raise ValueError("method='ngram' (prompt lookup) takes no drafter; it drafts from the prompt and output")
    lo, hi = req.config.lookup_range
    return NgramDrafter(req.config.k, lo, hi), ()


register(DrafterSpec("ngram", _build, reads=("prompt_lookup_min", "prompt_lookup_max")))
