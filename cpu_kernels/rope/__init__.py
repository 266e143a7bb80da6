"""Rotary position embedding on a CPU as an XLA FFI kernel, float32.

Its point is that a position's rotated vector is the same bits whatever the call: XLA:CPU fuses a product into a
following add (one rounding) where both land in one fusion, and RoPE's fusion follows the shapes (a decode step's
keys were fused into the one-slot cache write and came out a bit away from the same keys of a verify pass). With
the CPU verify-attention kernel it makes a T = k + 1 verify pass give each position the bits of k + 1 one-position
steps. Semantics: rope_reference (cos and sin from the C library, each product rounded before the sum).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from cpu_kernels import build
from cpu_kernels.rope.reference import rope_reference

__all__ = ["rope", "rope_cpu", "rope_reference"]

SWITCH = "SPECJAX_ROPE_KERNEL"     # "0": XLA computes it (the reference)


def rope_cpu(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """The kernel itself (CPU only): x [B, T, H, D] float32, positions [B, T], inv_freq [D / 2] -> [B, T, H, D]."""
    build.require()
    if x.ndim != 4 or positions.shape != x.shape[:2] or inv_freq.shape != (x.shape[-1] // 2,) or x.shape[-1] % 2:
        raise ValueError(f"rope takes x [B, T, H, D] (D even), positions [B, T] and inv_freq [D / 2], got "
                         f"{x.shape}, {positions.shape} and {inv_freq.shape}")
    if x.dtype != jnp.float32:
        raise ValueError(f"the rope kernel is float32, got {x.dtype}")
    call = jax.ffi.ffi_call(build.ROPE_TARGET, jax.ShapeDtypeStruct(x.shape, jnp.float32),
                            vmap_method="sequential")
    return call(x, positions.astype(jnp.int32), inv_freq.astype(jnp.float32))


def rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """rope_reference's arguments: the kernel on a CPU for float32 x, else the reference (a CPU program lowered for
    another platform lowers the reference there). Gradients are the reference's (it is linear in x)."""
    usable = x.dtype == jnp.float32 and x.ndim == 4 and positions.ndim == 2 and not build.turned_off(SWITCH)
    if usable:
        positions = jnp.broadcast_to(positions, x.shape[:2])   # e.g. one row of positions for every batch row
    return build.kernel_or_reference(_differentiable_kernel, rope_reference, x, positions, inv_freq, usable=usable)


@jax.custom_vjp
def _differentiable_kernel(x, positions, inv_freq):
    return rope_cpu(x, positions, inv_freq)


def _kernel_forward(x, positions, inv_freq):
    return rope_cpu(x, positions, inv_freq), (positions, inv_freq)


def _kernel_backward(residuals, g):
    positions, inv_freq = residuals
    # The transpose of a rotation by the angle is the rotation by minus the angle.
    return rope_reference(g, positions, -inv_freq), None, None


_differentiable_kernel.defvjp(_kernel_forward, _kernel_backward)
