"""The pure-jnp reference of small_m_matmul: what XLA computes for the same product."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def small_m_matmul_reference(x: jax.Array, w: jax.Array, transposed: bool = False) -> jax.Array:
    """x [M, K] @ w [K, N] (transposed: w [N, K], i.e. x @ w.T) -> [M, N]."""
    return x @ (w.T if transposed else w)


def dequantize_q4_1(nibbles: jax.Array, scale: jax.Array, minimum: jax.Array) -> jax.Array:
    """Q4_1 blocks (small_m_matmul.Q4_1Matrix's arrays) -> float32 w [K, N]: scale * q + minimum, q in 0..15; byte
    (k, 16 g + j) of nibbles holds q[k, 32 g + j] low and q[k, 32 g + 16 + j] high. scale * q is exact in float32,
    so this is gguf's own dequantization bit for bit."""
    K, half = nibbles.shape
    b = nibbles.reshape(K, half // 16, 16)
    q = jnp.concatenate([b & 15, b >> 4], axis=-1).reshape(K, 2 * half).astype(jnp.float32)     # [K, N]
    rows = lambda a: jnp.repeat(a, K // a.shape[0], axis=0)                                       # [K, N]
    return rows(scale) * q + rows(minimum)


def dequantize_q8_0(values: jax.Array, scale: jax.Array) -> jax.Array:
    """Q8_0 rows (small_m_matmul.Q8_0Matrix's arrays) -> float32 w [N, K] = scale * q, exact in float32: gguf's
    own dequantization bit for bit."""
    N, K = values.shape
    return jnp.repeat(scale, K // scale.shape[1], axis=1) * values.astype(jnp.float32)
