"""The greedy token on a CPU as an XLA FFI kernel: the index of a float32 row's largest logit, the first on ties, a
NaN counting as the largest (jnp.argmax's rule), in one vectorised pass over the row.

Its point is speed: XLA:CPU runs the reference's two reductions (the max, then the first index holding it) at
several times the time of reading the logits, which a verify pass's B x (k + 1) rows of a vocabulary make
milliseconds. Its result is specjax.ops.greedy_token_reference's exactly (an index, no rounding).
Registered as the "cpu_kernel" backend of specjax.ops.greedy_token (no gradient: an index has none).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels import build
from cpu_kernels.small_m_matmul import cores
from specjax.ops import Backend, register_backend

__all__ = ["greedy_token_cpu"]


def greedy_token_cpu(logits: jax.Array) -> jax.Array:
    """The kernel itself (CPU only): logits [..., V] float32 (V >= 1, at least one row) -> int32 [...]."""
    build.require()
    if logits.ndim < 1 or logits.shape[-1] == 0 or logits.size == 0:
        raise ValueError(f"greedy_token takes logits [..., V] with V >= 1 and at least one row, got {logits.shape}")
    if logits.dtype != jnp.float32:
        raise ValueError(f"the greedy_token kernel is float32, got {logits.dtype}")
    out = jax.ShapeDtypeStruct(logits.shape[:-1], jnp.int32)
    call = jax.ffi.ffi_call(build.GREEDY_TOKEN_TARGET, out, vmap_method="broadcast_all")
    return call(logits, parts=np.int64(cores()))


def _takes(logits: jax.Array) -> bool:
    return logits.dtype == jnp.float32 and logits.ndim >= 1 and logits.size > 0


register_backend("greedy_token", Backend("cpu_kernel", greedy_token_cpu, platforms=("cpu",), takes=_takes,
                                         available=build.available, gradient=False))
