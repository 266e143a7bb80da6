"""The rotary position embedding op (Hugging Face's rotate-half convention), also over a fused q | k | v."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.ops import backends

__all__ = ["rope", "rope_qkv", "rope_qkv_reference", "rope_reference"]


def rope_reference(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """The definition: x [B, T, H, D] rotated at positions [B, T] by the frequencies inv_freq [D / 2]."""
    ang = positions[..., None].astype(jnp.float32) * inv_freq              # [B, T, D/2]
    cos = jnp.concatenate([jnp.cos(ang)] * 2, -1)[:, :, None, :]
    sin = jnp.concatenate([jnp.sin(ang)] * 2, -1)[:, :, None, :]
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-x[..., half:], x[..., :half]], -1)
    return (x.astype(jnp.float32) * cos + rot.astype(jnp.float32) * sin).astype(x.dtype)


def rope_qkv_reference(qkv: jax.Array, positions: jax.Array, inv_freq: jax.Array, num_heads: int,
                       num_kv_heads: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The definition: a fused projection's output qkv [B, T, (Hq + 2 Hkv) D] (the columns of wq | wk | wv) -> q
    [B, T, Hq, D] and k [B, T, Hkv, D] rotated at positions [B, T], v [B, T, Hkv, D]."""
    B, T, C = qkv.shape
    D = C // (num_heads + 2 * num_kv_heads)
    q, k, v = jnp.split(qkv, [num_heads * D, (num_heads + num_kv_heads) * D], axis=-1)
    return (rope_reference(q.reshape(B, T, num_heads, D), positions, inv_freq),
            rope_reference(k.reshape(B, T, num_kv_heads, D), positions, inv_freq), v.reshape(B, T, num_kv_heads, D))


def rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """x [B, T, H, D] at positions [B, T] (or one row of them for every batch row) -> [B, T, H, D]."""
    return backends.call("rope", rope_reference, x, positions, inv_freq)


def rope_qkv(qkv: jax.Array, positions: jax.Array, inv_freq: jax.Array, num_heads: int,
             num_kv_heads: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """rope_qkv_reference's arguments and result; q and k are rope's to the bit. Its backends are chosen by the
    "rope" setting."""
    return backends.call("rope_qkv", rope_qkv_reference, qkv, positions, inv_freq, num_heads=num_heads,
                         num_kv_heads=num_kv_heads)
