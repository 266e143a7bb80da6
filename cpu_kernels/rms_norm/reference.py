"""Pure-jnp RMS norm: the semantics of the CPU kernel and the model's path everywhere else."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm_reference(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * w).astype(x.dtype)
