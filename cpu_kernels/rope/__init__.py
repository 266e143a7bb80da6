"""Rotary position embedding on a CPU as an XLA FFI kernel, float32.

Its point is that a position's rotated vector is the same bits whatever the call: XLA:CPU fuses a product into a
following add (one rounding) where both land in one fusion, and RoPE's fusion follows the shapes (a decode step's
keys were fused into the one-slot cache write and came out a bit away from the same keys of a verify pass). With
the CPU verify-attention kernel it makes a T = k + 1 verify pass give each position the bits of k + 1 one-position
steps. Semantics: rope_reference (cos and sin from the C library, each product rounded before the sum).
rope_qkv is the same rotation of the q and k parts of a fused q | k | v projection's output, split in the same call
(XLA copied each part out of the fused rows, slowly, before two rope calls computed the same angles twice).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from cpu_kernels import build
from cpu_kernels.rope.reference import rope_qkv_reference, rope_reference

__all__ = ["rope", "rope_cpu", "rope_qkv", "rope_qkv_cpu", "rope_qkv_reference", "rope_reference"]

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


def rope_qkv_cpu(qkv: jax.Array, positions: jax.Array, inv_freq: jax.Array, num_heads: int,
                 num_kv_heads: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The fused kernel itself (CPU only): rope_qkv_reference's arguments, qkv float32."""
    build.require()
    problem = _qkv_problem(qkv, positions, inv_freq, num_heads, num_kv_heads)
    if problem:
        raise ValueError(problem)
    if qkv.dtype != jnp.float32:
        raise ValueError(f"the rope kernel is float32, got {qkv.dtype}")
    B, T, C = qkv.shape
    D = C // (num_heads + 2 * num_kv_heads)
    out = (jax.ShapeDtypeStruct((B, T, num_heads, D), jnp.float32),
           jax.ShapeDtypeStruct((B, T, num_kv_heads, D), jnp.float32),
           jax.ShapeDtypeStruct((B, T, num_kv_heads, D), jnp.float32))
    call = jax.ffi.ffi_call(build.ROPE_QKV_TARGET, out, vmap_method="sequential")
    return call(qkv, positions.astype(jnp.int32), inv_freq.astype(jnp.float32))


def rope_qkv(qkv: jax.Array, positions: jax.Array, inv_freq: jax.Array, num_heads: int,
             num_kv_heads: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """rope_qkv_reference's arguments and result: the fused kernel on a CPU for float32 qkv, else the reference.
    q and k are rope's bits to the bit (the same angles, products and sums); gradients are the reference's."""
    usable = qkv.dtype == jnp.float32 and qkv.ndim == 3 and positions.ndim == 2 and not build.turned_off(SWITCH)
    if usable:
        positions = jnp.broadcast_to(positions, qkv.shape[:2])   # e.g. one row of positions for every batch row
        usable = _qkv_problem(qkv, positions, inv_freq, num_heads, num_kv_heads) is None
    return build.kernel_or_reference(
        lambda *a: _differentiable_qkv_kernel(*a, num_heads, num_kv_heads),
        lambda *a: rope_qkv_reference(*a, num_heads, num_kv_heads), qkv, positions, inv_freq, usable=usable)


def _qkv_problem(qkv, positions, inv_freq, num_heads, num_kv_heads) -> str | None:
    heads = num_heads + 2 * num_kv_heads
    if (qkv.ndim != 3 or num_heads < 1 or num_kv_heads < 1 or qkv.shape[-1] % heads
            or (qkv.shape[-1] // heads) % 2 or positions.shape != qkv.shape[:2]
            or inv_freq.shape != (qkv.shape[-1] // heads // 2,)):
        return (f"rope_qkv takes qkv [B, T, (Hq + 2 Hkv) D] (D even), positions [B, T] and inv_freq [D / 2], got "
                f"{qkv.shape}, {positions.shape} and {inv_freq.shape} for Hq = {num_heads}, Hkv = {num_kv_heads}")
    return None


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _differentiable_qkv_kernel(qkv, positions, inv_freq, num_heads, num_kv_heads):
    return rope_qkv_cpu(qkv, positions, inv_freq, num_heads, num_kv_heads)


def _qkv_kernel_forward(qkv, positions, inv_freq, num_heads, num_kv_heads):
    return rope_qkv_cpu(qkv, positions, inv_freq, num_heads, num_kv_heads), (positions, inv_freq)


def _qkv_kernel_backward(num_heads, num_kv_heads, residuals, g):
    positions, inv_freq = residuals
    B, T = g[0].shape[:2]
    qkv = jax.ShapeDtypeStruct((B, T, sum(x.shape[2] * x.shape[3] for x in g)), g[0].dtype)
    # the reference is linear in qkv: its transpose (the split undone, each rotation by minus the angle)
    transpose = jax.linear_transpose(lambda x: rope_qkv_reference(x, positions, inv_freq, num_heads, num_kv_heads),
                                     qkv)
    return transpose(tuple(g))[0], None, None


_differentiable_qkv_kernel.defvjp(_qkv_kernel_forward, _qkv_kernel_backward)
