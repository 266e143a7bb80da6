"""Pure-jnp rotary position embedding: the semantics of the CPU kernel and the model's path everywhere else."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def rope_reference(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """x [B, T, H, D], positions [B, T], inv_freq [D / 2]; Hugging Face's rotate-half convention."""
    ang = positions[..., None].astype(jnp.float32) * inv_freq              # [B, T, D/2]
    cos = jnp.concatenate([jnp.cos(ang)] * 2, -1)[:, :, None, :]
    sin = jnp.concatenate([jnp.sin(ang)] * 2, -1)[:, :, None, :]
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-x[..., half:], x[..., :half]], -1)
    return (x.astype(jnp.float32) * cos + rot.astype(jnp.float32) * sin).astype(x.dtype)
