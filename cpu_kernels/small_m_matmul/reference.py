"""The pure-jnp reference of small_m_matmul: what XLA computes for the same product."""
from __future__ import annotations

import jax


def small_m_matmul_reference(x: jax.Array, w: jax.Array, transposed: bool = False) -> jax.Array:
    """x [M, K] @ w [K, N] (transposed: w [N, K], i.e. x @ w.T) -> [M, N]."""
    return x @ (w.T if transposed else w)
