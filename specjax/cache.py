"""KV cache: fixed-size buffers plus per-row lengths.

Rows of a batch sit at different lengths. Writing T entries puts them at each row's own offset; rolling back
rejected drafts is only length bookkeeping (stale entries past `lengths` are never read and get overwritten).
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from specjax.sharding import constrain_cache


@flax.struct.dataclass
class KVCache:
    k: tuple            # L arrays [B, Hkv, S, D], one per layer
    v: tuple            # L arrays [B, Hkv, S, D]
    lengths: jax.Array  # [B] int32: valid entries per row

    @classmethod
    def init(cls, num_layers: int, batch: int, size: int, num_kv_heads: int, head_dim: int,
             dtype=jnp.float32) -> "KVCache":
        # One buffer per layer: attention reads its layer's buffer where it lies. Slicing a layer out of one
        # [L, ...] buffer made XLA copy that layer's K and V on every forward.
        # Heads before slots: the attention then reads each (row, kv head) as one contiguous [S, D] matrix. With
        # slots first, XLA transposed every layer's K and V into that order on every forward.
        shape = (batch, num_kv_heads, size, head_dim)
        zeros = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))
        cache = cls(zeros(), zeros(), jnp.zeros((batch,), jnp.int32))
        return constrain_cache(cache)      # under a mesh: batch over "data", kv heads over "model"

    @property
    def size(self) -> int:
        return self.k[0].shape[2]

    def write(self, layer: int, k_new: jax.Array, v_new: jax.Array, starts: jax.Array) -> "KVCache":
        """Write k_new/v_new [B, T, Hkv, D] at slots starts[b] .. starts[b] + T - 1 of `layer` (a start past
        size - T is clamped to it, as lax.dynamic_update_slice does).

        One scatter over (row, slot) index pairs, which XLA updates in place. A vmap of dynamic_update_slice over
        the batch axis instead moved that axis to the front and back again: two copies of the whole cache per
        write, which at batch 32 cost the decode loop as much as the forward itself."""
        B, T = k_new.shape[:2]
        rows = jnp.arange(B)[:, None]                                   # [B, 1]
        slots = jnp.clip(starts, 0, self.size - T)[:, None] + jnp.arange(T)[None, :]     # [B, T]
        # The (rows, slots) pair is split by the heads slice, so the indexed block is [B, T, Hkv, D] like k_new.
        put = lambda bufs, new: bufs[:layer] + (bufs[layer].at[rows, :, slots].set(
            new.astype(bufs[layer].dtype), unique_indices=True),) + bufs[layer + 1:]
        return self.replace(k=put(self.k, k_new), v=put(self.v, v_new))

    def compact(self, src_slots: jax.Array, dst_start: jax.Array) -> "KVCache":
        """Move the entries at src_slots [B, P] to contiguous slots dst_start[b] .. dst_start[b] + P - 1 (all
        layers). Used after a tree step: the accepted root-to-leaf path becomes the committed prefix."""
        B, P = src_slots.shape
        rows = jnp.arange(B)[:, None]                                   # [B, 1]
        dst = jnp.clip(dst_start, 0, self.size - P)[:, None] + jnp.arange(P)[None, :]     # [B, P]
        move = lambda buf: buf.at[rows, :, dst].set(buf[rows, :, src_slots], unique_indices=True)  # [B, P, Hkv, D]
        return self.replace(k=tuple(map(move, self.k)), v=tuple(map(move, self.v)))
