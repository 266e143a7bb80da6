"""The KV cache write on a CPU as an XLA FFI kernel, float32: one layer's new keys and values into its buffers, in
place.

Its point is speed: XLA:CPU runs the reference's scatter of T > 1 slots index by index (a strided store per element
into keys stored slots-last) after copying the new block into the scatter's layout, where the kernel copies runs of
T or D floats. The result is specjax.ops.write_kv_reference's to the bit: a write only moves values.
Registered as the "cpu_kernel" backend of specjax.ops.write_kv (outside a mesh: under one XLA partitions the
definition's scatter over the sharded buffers, where the kernel would need them whole).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from cpu_kernels import build
from specjax.ops import Backend, register_backend

__all__ = ["write_kv_cpu"]


def write_kv_cpu(k_buf: jax.Array, v_buf: jax.Array, k_new: jax.Array, v_new: jax.Array, starts: jax.Array,
                 keys_transposed: bool) -> tuple[jax.Array, jax.Array]:
    """The kernel itself (CPU only): specjax.ops.write_kv_reference's arguments, every array float32 but starts [B] int. The
    buffers are aliased to the outputs: under jit with the buffers donated or carried, the write is in place."""
    build.require()
    problem = _shape_problem(k_buf, v_buf, k_new, v_new, starts, keys_transposed)
    if problem:
        raise ValueError(problem)
    call = jax.ffi.ffi_call(build.CACHE_WRITE_TARGET,
                            (jax.ShapeDtypeStruct(k_buf.shape, jnp.float32),
                             jax.ShapeDtypeStruct(v_buf.shape, jnp.float32)),
                            input_output_aliases={0: 0, 1: 1}, vmap_method="sequential")
    return call(k_buf, v_buf, k_new, v_new, starts.astype(jnp.int32), keys_transposed=bool(keys_transposed))


def _shape_problem(k_buf, v_buf, k_new, v_new, starts, keys_transposed) -> str | None:
    if k_new.ndim != 4 or v_new.shape != k_new.shape or v_buf.ndim != 4 or starts.shape != k_new.shape[:1]:
        return (f"write_kv takes new keys and values [B, T, Hkv, D], one layer's buffers and starts [B], got "
                f"{k_new.shape}, {v_new.shape}, {k_buf.shape}, {v_buf.shape} and {starts.shape}")
    B, T, H, D = k_new.shape
    S = v_buf.shape[2]
    k_shape = (B, H, D, S) if keys_transposed else (B, H, S, D)
    if v_buf.shape != (B, H, S, D) or k_buf.shape != k_shape or T > S:
        return (f"write_kv: new entries {k_new.shape} do not fit keys {k_buf.shape} (expected {k_shape}) and values "
                f"{v_buf.shape} (expected {(B, H, S, D)}, at least {T} slots)")
    return None


def _takes(k_buf, v_buf, k_new, v_new, starts, *, keys_transposed: bool) -> bool:
    return (all(a.dtype == jnp.float32 for a in (k_buf, v_buf, k_new, v_new))
            and _shape_problem(k_buf, v_buf, k_new, v_new, starts, keys_transposed) is None
            and jax.sharding.get_abstract_mesh().empty)


def _kernel(k_buf, v_buf, k_new, v_new, starts, *, keys_transposed: bool) -> tuple[jax.Array, jax.Array]:
    return write_kv_cpu(k_buf, v_buf, k_new, v_new, starts, keys_transposed)


register_backend("cache_write", Backend("cpu_kernel", _kernel, platforms=("cpu",), takes=_takes,
                                        available=build.available))
