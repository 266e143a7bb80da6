"""The Drafter protocol every proposer implements, and the null drafter (plain decoding).

A drafter is a hashable, array-free object (it is a static argument of the compiled loop); its arrays travel
separately as `params` (weights, predictions, ...), so one compiled program serves any weights of the same shape.
All methods are pure functions over pytrees and run inside jit / lax.while_loop.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp

from specjax.models.llama import ForwardOut
from specjax.sampling import SamplingParams
from specjax.trees import Tree


class Context(NamedTuple):
    """The committed sequence as the loop sees it (read-only for drafters)."""
    tokens: jax.Array          # [B, L] prompt + generated tokens; entries at or past `length` are stale
    length: jax.Array          # [B] committed tokens; the last one (length - 1) is not yet in the target cache
    prompt_length: jax.Array   # [B]


class Draft(NamedTuple):
    """A chain (tree None): tokens [B, k], probs [B, k, V] the distributions they were sampled from.
    A tree: tokens = tree.tokens[:, 1:] (the drafted nodes), probs [B, T, V] per node t the distribution
    t's children were sampled from without replacement (verify.tree_sampled case b). None = deterministic."""
    tokens: jax.Array                 # [B, k] proposed continuation of the committed sequence
    probs: jax.Array | None = None    # chain [B, k, V] / tree [B, T, V]; None = deterministic drafts
    tree: Tree | None = None          # T = k + 1 nodes; node 0 is the last committed token


class Drafter(Protocol):
    num_tokens: int                   # k, static

    def init(self, params: Any, ctx: Context, target_out: ForwardOut, sp: SamplingParams) -> Any: ...

    def propose(self, params: Any, state: Any, ctx: Context, keys: jax.Array,
                sp: SamplingParams) -> tuple[Draft, Any]: ...

    def commit(self, params: Any, state: Any, ctx: Context, num_accepted: jax.Array,
               target_out: ForwardOut) -> Any: ...


class NullDrafter:
    """k = 0: the loop degenerates to plain autoregressive decoding (same code path as every drafter)."""
    num_tokens = 0

    def __hash__(self):
        return hash(type(self))

    def __eq__(self, other):
        return type(other) is type(self)

    def init(self, params, ctx, target_out, sp):
        return ()

    def propose(self, params, state, ctx, keys, sp):
        B = ctx.tokens.shape[0]
        return Draft(jnp.zeros((B, 0), jnp.int32)), state

    def commit(self, params, state, ctx, num_accepted, target_out):
        return state


def last_tokens(ctx: Context, n: int) -> jax.Array:
    """[B, n]: the n most recent committed tokens (positions length-n .. length-1; clipped at 0)."""
    idx = ctx.length[:, None] - n + jnp.arange(n)[None, :]
    return jnp.take_along_axis(ctx.tokens, jnp.maximum(idx, 0), axis=1)
