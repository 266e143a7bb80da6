"""The greedy token on a CPU as an XLA FFI kernel: the index of a float32 row's largest logit, the first on ties, a
NaN counting as the largest (jnp.argmax's rule), in one vectorised pass over the row.

Its point is speed: XLA:CPU runs the reference's two reductions (the max, then the first index holding it) at
several times the time of reading the logits, which a verify pass's B x (k + 1) rows of a vocabulary make
milliseconds. Its result is the reference's exactly (an index, no rounding).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels import build
from cpu_kernels.greedy_token.reference import greedy_token_reference
from cpu_kernels.small_m_matmul import cores

__all__ = ["greedy_token", "greedy_token_cpu", "greedy_token_reference"]

SWITCH = "SPECJAX_GREEDY_TOKEN_KERNEL"     # "0": XLA computes it (the reference)


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


def greedy_token(logits: jax.Array) -> jax.Array:
    """greedy_token_reference's argument and result: the kernel on a CPU for float32, else the reference. An index
    has no gradient: a differentiated caller's logits reach the kernel through stop_gradient."""
    logits = jax.lax.stop_gradient(logits)
    usable = (logits.dtype == jnp.float32 and logits.ndim >= 1 and logits.size > 0
              and not build.turned_off(SWITCH))
    return build.kernel_or_reference(greedy_token_cpu, greedy_token_reference, logits, usable=usable)
