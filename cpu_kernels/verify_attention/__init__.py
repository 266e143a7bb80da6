"""Verify attention on a CPU as an XLA FFI kernel, float32, over a CPU KVCache (keys stored slots-last).

Its point is the order of the sums, not only speed: a query row is computed by the same float32 operations whatever
the number of new positions T, the batch, the tree mask and the rows beside it in the call, and it reads its columns
in one sequence (the committed prefix ascending, then its visible new columns ascending), which is the sequence a
later pass reads once an accepted path is committed. So a T = k + 1 verify pass gives each position the bits k + 1
one-position steps give it, and greedy speculative decoding equals plain greedy decoding by construction, not by a
float32 margin (XLA's dots and reductions sum in an order that follows the shapes).

Semantics: specjax.ops.verify_attention_reference (the same visibility: prefix, causal or tree mask, sliding
window), up to float32 rounding; its exp is a polynomial of about 1 ulp. Registered as the "cpu_kernel" backend of
specjax.ops.attention, where `applies`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels import build
from cpu_kernels.small_m_matmul import cores
from specjax.ops import Backend, register_backend

__all__ = ["applies", "verify_attention_cpu"]


def applies(dtype, keys_transposed: bool) -> str | None:
    """Why the kernel cannot take this attention (None: it can). Static: the dtype and the key layout."""
    if not keys_transposed:
        return "keys stored [B, Hkv, S, D] (the kernel reads a CPU cache's slots-last keys)"
    if jnp.dtype(dtype) != jnp.float32:
        return f"dtype {jnp.dtype(dtype)} (the kernel is float32)"
    return None


def _operands(q, lengths, mask, q_positions):
    B, T = q.shape[:2]
    if mask is None:
        mask = jnp.tril(jnp.ones((T, T), bool))
    mask = (mask if mask.ndim == 3 else mask[None]).astype(jnp.uint8)               # [1 | B, T, T]
    if q_positions is None:
        q_positions = (lengths - T)[:, None] + jnp.arange(T, dtype=jnp.int32)[None]   # [B, T]
    return lengths.astype(jnp.int32), mask, jnp.broadcast_to(q_positions, (B, T)).astype(jnp.int32)


def verify_attention_cpu(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array,
                         mask: jax.Array | None = None, *, sm_scale: float | None = None,
                         q_positions: jax.Array | None = None, sliding_window: int | None = None) -> jax.Array:
    """The kernel itself (CPU only): q [B, T, Hq, D]; k_cache [B, Hkv, D, S] (slots last); v_cache [B, Hkv, S, D];
    lengths [B] (valid slots, the T new ones included); mask None (causal) or bool [T, T] / [B, T, T] -> out
    [B, T, Hq, D] float32."""
    build.require()
    B, T, Hq, D = q.shape
    if k_cache.ndim != 4 or k_cache.shape[:3] != (B, v_cache.shape[1], D) or v_cache.shape != (
            B, k_cache.shape[1], k_cache.shape[3], D):
        raise ValueError(f"verify_attention_cpu takes k_cache [B, Hkv, D, S] and v_cache [B, Hkv, S, D] for q "
                         f"{q.shape}, got {k_cache.shape} and {v_cache.shape}")
    reason = applies(q.dtype, True)
    if reason or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"verify_attention_cpu cannot take this attention: {reason or 'cache dtype differs'}")
    if Hq % k_cache.shape[1]:
        raise ValueError(f"Hq={Hq} query heads is not a multiple of Hkv={k_cache.shape[1]} kv heads")
    scale = D ** -0.5 if sm_scale is None else sm_scale
    call = jax.ffi.ffi_call(build.VERIFY_ATTENTION_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32),
                            vmap_method="sequential")
    return call(q, k_cache, v_cache, *_operands(q, lengths, mask, q_positions), scale=np.float32(scale),
                window=np.int64(sliding_window or 0), parts=np.int64(cores()))


def _takes(q, k_cache, v_cache, lengths, mask, q_positions, *, sliding_window, keys_transposed) -> bool:
    return k_cache.dtype == q.dtype == v_cache.dtype and applies(q.dtype, keys_transposed) is None


def _kernel(q, k_cache, v_cache, lengths, mask, q_positions, *, sliding_window, keys_transposed) -> jax.Array:
    return verify_attention_cpu(q, k_cache, v_cache, lengths, mask, q_positions=q_positions,
                                sliding_window=sliding_window)


register_backend("attention", Backend("cpu_kernel", _kernel, platforms=("cpu",), takes=_takes,
                                      available=build.available))
