"""KV cache: fixed-size buffers plus per-row lengths.

Rows of a batch sit at different lengths. Writing T entries puts them at each row's own offset; rolling back
rejected drafts is only length bookkeeping (stale entries past `lengths` are never read and get overwritten).
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from specjax.layout import constrain_cache
from specjax.ops import block_index, write_kv


def keys_transposed_by_default() -> bool:
    """Whether a cache stores its keys slots-last ([B, Hkv, D, S]) unless told: on a CPU. There the decode step is
    bound by the attention's pass over the cache, and XLA runs the scores q.K reduced over D as the minor axis (a
    few dozen elements per output) much slower than the same sums over a minor axis of slots. Accelerators and
    their Pallas kernels read [S, D] tiles."""
    return jax.default_backend() == "cpu"


@flax.struct.dataclass
class KVCache:
    k: tuple            # L arrays [B, Hkv, S, D], or [B, Hkv, D, S] when keys_transposed, one per layer
    v: tuple            # L arrays [B, Hkv, S, D]
    lengths: jax.Array  # [B] int32: valid entries per row
    keys_transposed: bool = flax.struct.field(pytree_node=False, default=False)

    @classmethod
    def init(cls, num_layers: int, batch: int, size: int, num_kv_heads: int, head_dim: int,
             dtype=jnp.float32, keys_transposed: bool | None = None) -> "KVCache":
        """keys_transposed: None picks keys_transposed_by_default()."""
        # One buffer per layer: attention reads its layer's buffer where it lies. Slicing a layer out of one
        # [L, ...] buffer made XLA copy that layer's K and V on every forward.
        # Heads before slots: the attention then reads each (row, kv head) as one contiguous matrix. With slots
        # first, XLA transposed every layer's K and V into that order on every forward.
        if keys_transposed is None:
            keys_transposed = keys_transposed_by_default()
        shape = (batch, num_kv_heads, size, head_dim)
        k_shape = (batch, num_kv_heads, head_dim, size) if keys_transposed else shape
        zeros = lambda s: tuple(jnp.zeros(s, dtype) for _ in range(num_layers))
        cache = cls(zeros(k_shape), zeros(shape), jnp.zeros((batch,), jnp.int32), keys_transposed)
        return constrain_cache(cache)      # under a mesh: batch over "data", kv heads over "model"

    @property
    def size(self) -> int:
        return self.v[0].shape[2]

    def keys(self, layer: int) -> jax.Array:
        """Layer `layer`'s keys as [B, Hkv, S, D] whatever the storage (a transposed copy when keys_transposed)."""
        return jnp.swapaxes(self.k[layer], 2, 3) if self.keys_transposed else self.k[layer]

    def _index(self, keys: bool, rows, slots) -> tuple:
        """block_index in this cache's keys (keys=True) or values."""
        return block_index(rows, slots, keys, self.keys_transposed)

    def write(self, layer: int, k_new: jax.Array, v_new: jax.Array, starts: jax.Array) -> "KVCache":
        """Write k_new/v_new [B, T, Hkv, D] at slots starts[b] .. starts[b] + T - 1 of `layer` (a start past
        size - T is clamped to it, as lax.dynamic_update_slice does), in place under jit (specjax.ops.write_kv)."""
        k, v = write_kv(self.k[layer], self.v[layer], k_new, v_new, starts, self.keys_transposed)
        return self.replace(k=self.k[:layer] + (k,) + self.k[layer + 1:], v=self.v[:layer] + (v,) + self.v[layer + 1:])

    def compact(self, src_slots: jax.Array, dst_start: jax.Array) -> "KVCache":
        """Move the entries at src_slots [B, P] to contiguous slots dst_start[b] .. dst_start[b] + P - 1 (all
        layers). Used after a tree step: the accepted root-to-leaf path becomes the committed prefix."""
        B, P = src_slots.shape
        rows = jnp.arange(B)[:, None]                                   # [B, 1]
        dst = jnp.clip(dst_start, 0, self.size - P)[:, None] + jnp.arange(P)[None, :]     # [B, P]

        def move(buf, keys):                                            # a [B, P, Hkv, D] block
            return buf.at[self._index(keys, rows, dst)].set(buf[self._index(keys, rows, src_slots)],
                                                            unique_indices=True)
        return self.replace(k=tuple(move(b, True) for b in self.k), v=tuple(move(b, False) for b in self.v))

    def place(self, rows: jax.Array | slice, part: "KVCache") -> "KVCache":
        """Copy `part`'s buffers (its slots 0 .. part.size - 1, every layer) into rows `rows` of this cache, which
        must share its layout; lengths untouched. How a prefill computed over a narrower cache lands in the
        decode loop's buffer."""
        if part.keys_transposed != self.keys_transposed:
            raise ValueError("KVCache.place: the two caches store their keys in different layouts")
        k_at, v_at = (self._index(keys, rows, slice(None, part.size)) for keys in (True, False))
        return self.replace(k=tuple(f.at[k_at].set(p) for f, p in zip(self.k, part.k)),
                            v=tuple(f.at[v_at].set(p) for f, p in zip(self.v, part.v)))


@flax.struct.dataclass
class GroupedKVCache:
    """A batch's KV cache in groups of rows, each group a KVCache only as many slots wide as its own rows need.

    In one buffer every row's attention passes over as many slots as the longest prompt needs; on a ragged batch
    (prompts of very different lengths) most of that pass is over slots a row never fills. The groups are the
    prefill's prompt-length groups. Rows are named by index arrays, so the batch keeps the caller's row order: each
    layer gathers its new entries and queries per group and gathers the attention outputs back into batch order.
    Writes, compaction and lengths behave as KVCache's."""
    parts: tuple             # G KVCaches; the lengths each carries are never read (`lengths` is)
    rows: tuple              # G int32 arrays [B_g]: the batch rows part g holds, in its row order
    inverse: jax.Array       # [B] int32: where batch row b sits in the concatenation of every part's rows
    lengths: jax.Array       # [B] int32: valid entries per row

    @classmethod
    def of(cls, parts: tuple, rows: tuple, lengths: jax.Array) -> "GroupedKVCache":
        """parts [G] KVCaches holding the batch rows rows[g] [B_g] (together every row once)."""
        return cls(tuple(parts), tuple(rows), jnp.argsort(jnp.concatenate(rows)).astype(jnp.int32), lengths)

    @property
    def keys_transposed(self) -> bool:
        return self.parts[0].keys_transposed

    def write(self, layer: int, k_new: jax.Array, v_new: jax.Array, starts: jax.Array) -> "GroupedKVCache":
        """As KVCache.write, each row into its own group (a start is clamped to its group's size)."""
        return self.replace(parts=tuple(part.write(layer, k_new[r], v_new[r], starts[r])
                                        for part, r in zip(self.parts, self.rows)))

    def compact(self, src_slots: jax.Array, dst_start: jax.Array) -> "GroupedKVCache":
        """As KVCache.compact, each row within its own group."""
        return self.replace(parts=tuple(part.compact(src_slots[r], dst_start[r])
                                        for part, r in zip(self.parts, self.rows)))

    def per_group(self, fn, *row_args) -> jax.Array:
        """fn(part, *args of the part's rows) -> [B_g, ...] for every group, back in batch order [B, ...]. row_args:
        arrays with a leading batch axis (sliced to each group's rows) or None (passed as is)."""
        outs = [fn(part, *(None if a is None else a[r] for a in row_args)) for part, r in zip(self.parts, self.rows)]
        return jnp.concatenate(outs)[self.inverse]
