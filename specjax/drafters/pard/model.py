"""PARD's maths beyond a Llama forward (specjax.models.llama.forward runs the draft's layers), shared by the drafter
and its training loss (train.losses.pard): the input embeddings of a draft that reads the target's embedding
(embed_tokens: target tokens from the target's rows, masks from the draft's own)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def embed_tokens(mask_embed: jax.Array, embed: jax.Array, tokens: jax.Array) -> jax.Array:
    """Input embeddings [..., H] of tokens [...] of the target's vocabulary (rows of the target's embed [V, H]) or
    masks (ids V + j: row j of mask_embed [m, H])."""
    V = embed.shape[0]
    own = embed[jnp.minimum(tokens, V - 1)]
    masks = mask_embed[jnp.clip(tokens - V, 0, mask_embed.shape[0] - 1)].astype(own.dtype)
    return jnp.where((tokens >= V)[..., None], masks, own)
