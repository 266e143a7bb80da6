"""RMS norm on a CPU as an XLA FFI kernel, float32.

Its point is that a row's bits do not depend on the array it is normalized in: XLA:CPU splits the sum of squares
into partial sums laid out by the whole array's shape, so a row in a batch of two came out a bit away from the same
row alone (and with it every later layer: greedy speculation over a batch was exact by a float32 margin only).
Semantics: specjax.ops.rms_norm_reference (1 / sqrt in place of XLA's rsqrt; the same formula otherwise).
Registered as the "cpu_kernel" backend of specjax.ops.rms_norm.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels import build
from specjax.ops import Backend, register_backend

__all__ = ["rms_norm_cpu"]


def rms_norm_cpu(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """The kernel itself (CPU only): x [..., H] float32, weight [H] -> [..., H]."""
    build.require()
    if weight.ndim != 1 or x.shape[-1:] != weight.shape:
        raise ValueError(f"rms_norm takes x [..., H] and weight [H], got {x.shape} and {weight.shape}")
    if x.dtype != jnp.float32 or weight.dtype != jnp.float32:
        raise ValueError(f"the rms_norm kernel is float32, got {x.dtype} and {weight.dtype}")
    call = jax.ffi.ffi_call(build.RMS_NORM_TARGET, jax.ShapeDtypeStruct(x.shape, jnp.float32),
                            vmap_method="sequential")
    return call(x, weight, eps=np.float32(eps))


def _takes(x: jax.Array, weight: jax.Array, *, eps: float) -> bool:
    return (x.dtype == jnp.float32 and weight.dtype == jnp.float32 and weight.ndim == 1
            and x.shape[-1:] == weight.shape)


def _kernel(x: jax.Array, weight: jax.Array, *, eps: float) -> jax.Array:
    return rms_norm_cpu(x, weight, eps)


register_backend("rms_norm", Backend("cpu_kernel", _kernel, platforms=("cpu",), takes=_takes, available=build.available))
