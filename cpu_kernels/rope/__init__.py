"""Rotary position embedding on a CPU as an XLA FFI kernel, float32.

Its point is that a position's rotated vector is the same bits whatever the call: XLA:CPU fuses a product into a
following add (one rounding) where both land in one fusion, and RoPE's fusion follows the shapes (a decode step's
keys were fused into the one-slot cache write and came out a bit away from the same keys of a verify pass). With
the CPU verify-attention kernel it makes a T = k + 1 verify pass give each position the bits of k + 1 one-position
steps. Semantics: specjax.ops.rope_reference (cos and sin from the C library, each product rounded before the
sum). Registered as the "cpu_kernel" backend of specjax.ops.rope and rope_qkv.
rope_qkv is the same rotation of the q and k parts of a fused q | k | v projection's output, split in the same call
(XLA copied each part out of the fused rows, slowly, before two rope calls computed the same angles twice).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from cpu_kernels import build
from specjax.ops import Backend, register_backend

__all__ = ["rope_cpu", "rope_qkv_cpu"]


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


def _qkv_problem(qkv, positions, inv_freq, num_heads, num_kv_heads) -> str | None:
    heads = num_heads + 2 * num_kv_heads
    if (qkv.ndim != 3 or num_heads < 1 or num_kv_heads < 1 or qkv.shape[-1] % heads
            or (qkv.shape[-1] // heads) % 2 or positions.shape != qkv.shape[:2]
            or inv_freq.shape != (qkv.shape[-1] // heads // 2,)):
        return (f"rope_qkv takes qkv [B, T, (Hq + 2 Hkv) D] (D even), positions [B, T] and inv_freq [D / 2], got "
                f"{qkv.shape}, {positions.shape} and {inv_freq.shape} for Hq = {num_heads}, Hkv = {num_kv_heads}")
    return None


def _rope_takes(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> bool:
    return x.dtype == jnp.float32 and x.ndim == 4 and positions.ndim == 2


def _rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    # one row of positions may stand for every batch row
    return rope_cpu(x, jnp.broadcast_to(positions, x.shape[:2]), inv_freq)


def _rope_qkv_takes(qkv: jax.Array, positions: jax.Array, inv_freq: jax.Array, *, num_heads: int,
                    num_kv_heads: int) -> bool:
    if not (qkv.dtype == jnp.float32 and qkv.ndim == 3 and positions.ndim == 2):
        return False
    return _qkv_problem(qkv, jnp.broadcast_to(positions, qkv.shape[:2]), inv_freq, num_heads, num_kv_heads) is None


def _rope_qkv(qkv: jax.Array, positions: jax.Array, inv_freq: jax.Array, *, num_heads: int,
              num_kv_heads: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    return rope_qkv_cpu(qkv, jnp.broadcast_to(positions, qkv.shape[:2]), inv_freq, num_heads, num_kv_heads)


register_backend("rope", Backend("cpu_kernel", _rope, platforms=("cpu",), takes=_rope_takes, available=build.available))
register_backend("rope_qkv", Backend("cpu_kernel", _rope_qkv, platforms=("cpu",), takes=_rope_qkv_takes,
                                     available=build.available))
