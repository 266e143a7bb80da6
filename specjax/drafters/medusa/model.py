"""The Medusa heads' maths as pure functions over their params, shared by the drafter and the training losses
(train.losses.medusa): each head's ResBlocks on the target's feature (head_hidden) and the heads' logits
(head_logits)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.ops import linear


def head_hidden(params: dict, hidden: jax.Array) -> jax.Array:
    """hidden [..., H] -> [..., K, H]: each head's ResBlock stack applied to the same target feature."""
    x = jnp.broadcast_to(hidden[..., None, :], hidden.shape[:-1] + (params["w"].shape[0], hidden.shape[-1]))
    for r in range(params["w"].shape[1]):
        x = x + jax.nn.silu(jnp.einsum("...kh,khg->...kg", x, params["w"][:, r]) + params["b"][:, r])
    return x


def head_logits(params: dict, hidden: jax.Array, lm_head: jax.Array | None = None) -> jax.Array:
    """hidden [..., H] -> logits [..., K, V] float32. lm_head [H, V]: the target's, for heads without a projection
    of their own (layout target_head)."""
    x = head_hidden(params, hidden)
    if "proj" not in params:
        if lm_head is None:
            raise ValueError("these Medusa heads project through the target's LM head: pass lm_head")
        return (x @ lm_head).astype(jnp.float32)
    if params["proj"].ndim == 3:                              # per-head LM heads: K separate projections
        return jnp.einsum("...kh,khv->...kv", x, params["proj"]).astype(jnp.float32)
    return linear(x, params["proj"].astype(x.dtype)).astype(jnp.float32)   # one shared projection, K rows at once
