"""The pure-jnp reference of small_m_matmul: what XLA computes for the same product."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def small_m_matmul_reference(x: jax.Array, w: jax.Array, transposed: bool = False) -> jax.Array:
    """x [M, K] @ w [K, N] (transposed: w [N, K], i.e. x @ w.T) -> [M, N]."""
    return x @ (w.T if transposed else w)


def unpack_panels(panels: jax.Array) -> jax.Array:
    """A PanelMatrix's panels [2, N / 16, K / 2, 16] -> the row-major float32 w [K, N] they hold."""
    _, P, half, width = panels.shape
    return panels.transpose(0, 2, 1, 3).reshape(2 * half, P * width)


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


def quantize_rows_q8(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [M, K] float32 -> its rows in 8-bit blocks of 32 (llama.cpp's Q8_1 activations): q int32 [M, K / 32, 32]
    in -127..127, d [M, K / 32] = max |x| / 127, s [M, K / 32] = d * sum q; x ~ d * q. Ties round to even."""
    M, K = x.shape
    xb = x.reshape(M, K // 32, 32)
    d = jnp.max(jnp.abs(xb), axis=-1) / 127.0
    inverse = jnp.where(d != 0, 1.0 / jnp.where(d != 0, d, 1.0), 0.0)
    q = jnp.round(xb * inverse[..., None]).astype(jnp.int32)
    return q, d, d * jnp.sum(q, axis=-1).astype(jnp.float32)


def unpack_q4_1_int8(packed: jax.Array) -> jax.Array:
    """Q4_1Int8Matrix's packed [N / 16, K / 8, 64] -> q [K, N] int32 in 0..15: byte 4 n + j of octet o of panel p
    holds q[8 o + j, 16 p + n] low and q[8 o + 4 + j, 16 p + n] high."""
    P, O, _ = packed.shape
    b = packed.reshape(P, O, 16, 4).astype(jnp.int32)                       # [p, o, n, j]
    q = jnp.stack([b & 15, b >> 4], axis=2)                                  # [p, o, half, n, j]
    return q.transpose(1, 2, 4, 0, 3).reshape(8 * O, 16 * P)


def q4_1_int8_reference(x: jax.Array, packed: jax.Array, scale: jax.Array, minimum: jax.Array) -> jax.Array:
    """x [M, K] @ Q4_1 blocks in llama.cpp's arithmetic (small_m_matmul_q4_1_int8): x's rows quantized to 8 bits
    per block of 32, exact integer dot products per block, y = sum over blocks of (scale * d) * I + minimum * s.
    Equal to the kernel up to the float rounding of that last sum."""
    M, K = x.shape
    q = unpack_q4_1_int8(packed).reshape(K // 32, 32, -1)                   # [B, 32, N]
    xq, d, s = quantize_rows_q8(x)                                           # [M, B, 32], [M, B], [M, B]
    dots = jnp.einsum("mbk,bkn->mbn", xq, q, preferred_element_type=jnp.int32).astype(jnp.float32)
    terms = (scale[None] * d[..., None]) * dots + minimum[None] * s[..., None]      # [M, B, N]
    return jnp.sum(terms, axis=1)


def unpack_q8_0_int8(packed: jax.Array) -> jax.Array:
    """Q8_0Int8Matrix's packed [N / 16, K / 4, 64] -> q [N, K] int32 in -128..127: byte 4 n + j of quad r of panel p
    holds q[16 p + n, 4 r + j] + 128."""
    P, R, _ = packed.shape
    b = packed.reshape(P, R, 16, 4).astype(jnp.int32) - 128                  # [p, r, n, j]
    return b.transpose(0, 2, 1, 3).reshape(16 * P, 4 * R)


def q8_0_int8_reference(x: jax.Array, packed: jax.Array, scale: jax.Array) -> jax.Array:
    """x [M, K] @ w.T for Q8_0 rows w [N, K] in llama.cpp's arithmetic (small_m_matmul_q8_0_int8): x's rows
    quantized to 8 bits per block of 32, exact integer dot products, y = sum over blocks of (scale * d) * I."""
    M, K = x.shape
    q = unpack_q8_0_int8(packed).reshape(-1, K // 32, 32)                   # [N, B, 32]
    xq, d, _ = quantize_rows_q8(x)                                           # [M, B, 32], [M, B]
    dots = jnp.einsum("mbk,nbk->mbn", xq, q, preferred_element_type=jnp.int32).astype(jnp.float32)
    return jnp.sum((scale[None] * d[..., None]) * dots, axis=1)
