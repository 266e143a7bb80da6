"""KV cache: fixed-size buffers plus per-row lengths.

Rows of a batch sit at different lengths. Writing T entries puts them at each row's own offset; rolling back
rejected drafts is only length bookkeeping (stale entries past `lengths` are never read and get overwritten).
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax

from specjax.sharding import constrain_cache


@flax.struct.dataclass
class KVCache:
    k: jax.Array        # [L, B, S, Hkv, D]
    v: jax.Array        # [L, B, S, Hkv, D]
    lengths: jax.Array  # [B] int32: valid entries per row

    @classmethod
    def init(cls, num_layers: int, batch: int, size: int, num_kv_heads: int, head_dim: int,
             dtype=jnp.float32) -> "KVCache":
        shape = (num_layers, batch, size, num_kv_heads, head_dim)
        cache = cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))
        return constrain_cache(cache)      # under a mesh: batch over "data", kv heads over "model"

    @property
    def size(self) -> int:
        return self.k.shape[2]

    def write(self, layer: int, k_new: jax.Array, v_new: jax.Array, starts: jax.Array) -> "KVCache":
        """Write k_new/v_new [B, T, Hkv, D] at slots starts[b] .. starts[b] + T - 1 of `layer`."""
        def put(buf, new):
            def row(buf_b, new_b, s):                                   # buf_b [L, S, Hkv, D]
                return lax.dynamic_update_slice(buf_b, new_b[None].astype(buf_b.dtype), (layer, s, 0, 0))
            return jax.vmap(row, in_axes=(1, 0, 0), out_axes=1)(buf, new, starts)
        return self.replace(k=put(self.k, k_new), v=put(self.v, v_new))

    def compact(self, src_slots: jax.Array, dst_start: jax.Array) -> "KVCache":
        """Move the entries at src_slots [B, P] to contiguous slots dst_start[b] .. dst_start[b] + P - 1 (all
        layers). Used after a tree step: the accepted root-to-leaf path becomes the committed prefix."""
        def move(buf):                                                  # [L, B, S, Hkv, D]
            def row(buf_b, src, dst):                                   # buf_b [L, S, Hkv, D]
                picked = jnp.take(buf_b, src, axis=1)                   # [L, P, Hkv, D]
                return lax.dynamic_update_slice(buf_b, picked, (0, dst, 0, 0))
            return jax.vmap(row, in_axes=(1, 0, 0), out_axes=1)(buf, src_slots, dst_start)
        return self.replace(k=move(self.k), v=move(self.v))
