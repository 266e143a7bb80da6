"""The cache-write op: one layer's new keys and values into its KV cache buffers, at each row's own offset."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.ops import backends

__all__ = ["block_index", "write_kv", "write_kv_reference"]


def write_kv_reference(k_buf: jax.Array, v_buf: jax.Array, k_new: jax.Array, v_new: jax.Array, starts: jax.Array,
                       keys_transposed: bool) -> tuple[jax.Array, jax.Array]:
    """k_new / v_new [B, T, Hkv, D] into one layer's buffers (keys [B, Hkv, D, S] when keys_transposed, else
    [B, Hkv, S, D]; values [B, Hkv, S, D]) at slots starts[b] .. starts[b] + T - 1, a start past S - T clamped to
    it (as lax.dynamic_update_slice clamps) -> (keys, values).

    One scatter over (row, slot) index pairs, which XLA updates in place. A vmap of dynamic_update_slice over the
    batch axis instead moved that axis to the front and back again: two copies of the whole cache per write, which
    at batch 32 cost the decode loop as much as the forward itself."""
    k_at, v_at = _indices(k_new.shape[:2], v_buf.shape[2], starts, keys_transposed)
    return (k_buf.at[k_at].set(k_new.astype(k_buf.dtype), unique_indices=True),
            v_buf.at[v_at].set(v_new.astype(v_buf.dtype), unique_indices=True))


def block_index(rows, slots, keys: bool, keys_transposed: bool) -> tuple:
    """Index of (rows, slots) in a keys (keys=True) or values buffer: slots are axis 3 of keys stored slots-last,
    axis 2 otherwise. With index arrays for both, split by slices, numpy's rules put their broadcast dims first in
    either layout, so the indexed block is [B, T, Hkv, D]; with a slice of slots it keeps the buffer's layout."""
    return (rows, slice(None), slice(None), slots) if keys and keys_transposed else (rows, slice(None), slots)


def _indices(batch_positions: tuple[int, int], size: int, starts: jax.Array, keys_transposed: bool):
    """block_index of each row's T slots from its start (clamped to size - T), in the keys and the values."""
    B, T = batch_positions
    rows = jnp.arange(B)[:, None]                                                       # [B, 1]
    slots = jnp.clip(starts, 0, size - T)[:, None] + jnp.arange(T)[None, :]             # [B, T]
    return tuple(block_index(rows, slots, keys, keys_transposed) for keys in (True, False))


def write_kv(k_buf: jax.Array, v_buf: jax.Array, k_new: jax.Array, v_new: jax.Array, starts: jax.Array,
             keys_transposed: bool) -> tuple[jax.Array, jax.Array]:
    """write_kv_reference's arguments and result, in place under jit."""
    return backends.call("cache_write", write_kv_reference, k_buf, v_buf, k_new, v_new, starts,
                         keys_transposed=keys_transposed)
