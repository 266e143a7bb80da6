"""A new backend for one op, written as a user would write one: RMS norm with the mean of squares summed in two
halves. This file is everything it takes; SPECJAX_RMS_NORM_BACKEND=two_pass_rms_norm (or
settings.use_backends(rms_norm="two_pass_rms_norm")) selects it, and its gradient is the op definition's."""
import jax
import jax.numpy as jnp

from specjax.ops import Backend, register_backend

TRACED = []                   # one entry per trace that took this backend (the tests read it)


def two_pass_rms_norm(x: jax.Array, w: jax.Array, *, eps: float) -> jax.Array:
    TRACED.append(x.shape)
    half = x.shape[-1] // 2
    x32 = x.astype(jnp.float32)
    squares = jnp.sum(x32[..., :half] ** 2, -1, keepdims=True) + jnp.sum(x32[..., half:] ** 2, -1, keepdims=True)
    return (x32 / jnp.sqrt(squares / x.shape[-1] + eps) * w).astype(x.dtype)


register_backend("rms_norm", Backend("two_pass_rms_norm", two_pass_rms_norm, platforms=("cpu", "gpu", "tpu"),
                                     auto=False))
