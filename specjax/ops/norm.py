"""The RMS norm op."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.ops import backends

__all__ = ["rms_norm", "rms_norm_reference"]


def rms_norm_reference(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """The definition: x / sqrt(mean(x^2) + eps) * w over the last axis, in float32, cast back to x's dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * w).astype(x.dtype)


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """x [..., H], w [H] -> [..., H]. A traced eps is the definition's (a backend's kernel takes a number)."""
    if not isinstance(eps, (int, float, np.floating)):
        return rms_norm_reference(x, w, eps)
    return backends.call("rms_norm", rms_norm_reference, x, w, eps=eps)
