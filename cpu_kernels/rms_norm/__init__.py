"""RMS norm on a CPU as an XLA FFI kernel, float32.

Its point is that a row's bits do not depend on the array it is normalized in: XLA:CPU splits the sum of squares
into partial sums laid out by the whole array's shape, so a row in a batch of two came out a bit away from the same
row alone (and with it every later layer: greedy speculation over a batch was exact by a float32 margin only).
Semantics: rms_norm_reference (1 / sqrt in place of XLA's rsqrt; the same formula otherwise).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels import build
from cpu_kernels.rms_norm.reference import rms_norm_reference

__all__ = ["rms_norm", "rms_norm_cpu", "rms_norm_reference"]

SWITCH = "SPECJAX_RMS_NORM_KERNEL"     # "0": XLA computes it (the reference)


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


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """rms_norm_reference's arguments: the kernel on a CPU for float32 x and weight, else the reference (a CPU
    program lowered for another platform lowers the reference there; a traced eps takes the reference too).
    Gradients are the reference's."""
    usable = (isinstance(eps, (int, float, np.floating)) and x.dtype == jnp.float32 and weight.dtype == jnp.float32
              and weight.ndim == 1 and x.shape[-1:] == weight.shape and not build.turned_off(SWITCH))
    return build.kernel_or_reference(lambda x, w: _differentiable_kernel(x, w, eps),
                                     lambda x, w: rms_norm_reference(x, w, eps), x, weight, usable=usable)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _differentiable_kernel(x, weight, eps):
    return rms_norm_cpu(x, weight, eps)


def _kernel_forward(x, weight, eps):
    return rms_norm_cpu(x, weight, eps), (x, weight)


def _kernel_backward(eps, residuals, g):
    _, pullback = jax.vjp(lambda x, w: rms_norm_reference(x, w, eps), *residuals)
    return pullback(g)


_differentiable_kernel.defvjp(_kernel_forward, _kernel_backward)
