"""SwiGLU on a CPU as an XLA FFI kernel, float32: silu(gate) * up of a fused gate | up projection's output.

Its point is speed: XLA:CPU's fused silu * up, with the split of its operand, took several times the kernel's vectors
(one polynomial exp, a reciprocal estimate). An element's bits do not depend on the call (the kernel's exp and
reciprocal are its own, a float32 ulp or so from XLA's: specjax.ops.swiglu_reference's values within rounding).
Registered as the "cpu_kernel" backend of specjax.ops.swiglu.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels import build
from cpu_kernels.small_m_matmul import cores
from specjax.ops import Backend, register_backend

__all__ = ["swiglu_cpu"]


def swiglu_cpu(gate_up: jax.Array) -> jax.Array:
    """The kernel itself (CPU only): gate_up [..., 2 I] float32 -> [..., I]."""
    build.require()
    if gate_up.ndim < 1 or gate_up.shape[-1] % 2 or gate_up.shape[-1] == 0:
        raise ValueError(f"swiglu takes a fused gate | up output [..., 2 I], got {gate_up.shape}")
    if gate_up.dtype != jnp.float32:
        raise ValueError(f"the swiglu kernel is float32, got {gate_up.dtype}")
    out = jax.ShapeDtypeStruct((*gate_up.shape[:-1], gate_up.shape[-1] // 2), jnp.float32)
    call = jax.ffi.ffi_call(build.SWIGLU_TARGET, out, vmap_method="sequential")
    return call(gate_up, parts=np.int64(cores()))


def _takes(gate_up: jax.Array) -> bool:
    return (gate_up.dtype == jnp.float32 and gate_up.ndim >= 1 and gate_up.shape[-1] % 2 == 0
            and gate_up.shape[-1] > 0)


register_backend("swiglu", Backend("cpu_kernel", swiglu_cpu, platforms=("cpu",), takes=_takes, available=build.available))
