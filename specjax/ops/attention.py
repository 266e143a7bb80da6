"""The attention op over a KV cache: T new query positions per row (a decode step, a verify chain or a tree's
nodes) against the cache they were just written into.

T new query positions per row attend to a KV cache whose first `lengths[b]` slots are valid and whose LAST T valid
slots (lengths - T .. lengths - 1) hold the new positions' own keys/values. Columns below `lengths - T` (the
committed prefix) are always visible; the last T columns are visible through `mask` (causal when None, a tree
ancestor mask otherwise); columns at or past `lengths` are never read (they may hold stale drafts or NaN).
verify_attention_reference is the definition every backend matches: cpu_kernels registers a fixed-order CPU kernel
(the same bits for a position whatever T), pallas_kernels the fused Pallas kernels for GPU and TPU (chosen per
call by SpecConfig.implementation, or by the settings).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.ops import backends

__all__ = ["FORMULATIONS", "MASK_VALUE", "attention", "attention_reference", "verify_attention_reference",
           "visibility"]

# Large negative instead of -inf so that a fully masked row gives exp(0 - 0) style finite math, never inf - inf.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def visibility(lengths: jax.Array, num_new: int, num_cols: int, mask: jax.Array | None = None,
               q_positions: jax.Array | None = None, sliding_window: int | None = None) -> jax.Array:
    """Boolean [B, T, S]: may query t of row b read cache column s."""
    cols = jnp.arange(num_cols)[None, None, :]                      # [1, 1, S]
    new_start = (lengths - num_new)[:, None, None]                  # [B, 1, 1]
    in_prefix = cols < new_start                                    # [B, 1, S]
    rel = cols - new_start                                          # column index inside the new block
    in_new = (rel >= 0) & (rel < num_new)
    if mask is None:
        new_visible = rel <= jnp.arange(num_new)[None, :, None]     # causal: [1, T, S] via broadcast
    else:
        batch = lengths.shape[0]
        mask = mask if mask.ndim == 3 else mask[None]               # [B|1, T, T]
        mask = jnp.broadcast_to(mask, (batch, num_new, num_new))    # [B, T, T]
        idx = jnp.clip(rel, 0, num_new - 1)                         # [B, 1, S]
        idx = jnp.broadcast_to(idx, (batch, num_new, num_cols))     # [B, T, S]
        new_visible = jnp.take_along_axis(mask, idx, axis=2)        # [B, T, S]
    vis = in_prefix | (in_new & new_visible)
    if sliding_window is not None:
        if q_positions is None:
            q_positions = new_start[:, :, 0] + jnp.arange(num_new)[None, :]   # [B, T]
        vis = vis & (cols > q_positions[:, :, None] - sliding_window)
    return vis


# Where the fused formulation pays on a CPU (measured on 2 cores, float32, 4 query rows per kv head or fewer): over
# keys laid out [S, D], from about 4 MB of K and V per layer up it runs faster than the dots, which are faster
# below (batch 1). Over keys stored slots-last (a CPU cache's layout) the two run at about the same speed above
# that size, so the rule serves both layouts.
FUSED_MAX_ROWS = 16
FUSED_MIN_KV_BYTES = 4 << 20
FORMULATIONS = ("auto", "dot", "fused", "fused_scores")


def _formulation(formulation: str, batch: int, num_new: int, rows: int, kv_bytes: int,
                 keys_transposed: bool) -> tuple[bool, bool]:
    """-> (scores by the fused reduction, output by the fused reduction); dots where False."""
    if formulation not in FORMULATIONS:
        raise ValueError(f"unknown formulation {formulation!r}; expected one of {FORMULATIONS}")
    if formulation != "auto":
        return formulation != "dot", formulation == "fused"
    if jax.default_backend() != "cpu":
        return False, False
    if batch * num_new == 1 and keys_transposed:
        # One new entry in all (a batch-1 decode step): XLA:CPU writes it into the cache with a one-slot
        # dynamic-update-slice, which it duplicates into an elementwise consumer of the updated buffer (the
        # scores dot's operand, the values' mask) and then copies the whole buffer for, every layer of every
        # step (much of a step at a long context). It does not fuse the write into the scores' reduction or
        # the values' dot, and that pair also reads the cache fastest at this shape.
        return True, False
    fused = rows <= FUSED_MAX_ROWS and kv_bytes >= FUSED_MIN_KV_BYTES
    return fused, fused


def verify_attention_reference(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array,
                               mask: jax.Array | None = None, *, sm_scale: float | None = None,
                               q_positions: jax.Array | None = None, sliding_window: int | None = None,
                               return_lse: bool = False, formulation: str = "auto", keys_transposed: bool = False):
    """q [B, T, Hq, D]; k_cache, v_cache [B, Hkv, S, D] (k_cache [B, Hkv, D, S] when keys_transposed); lengths [B]
    (valid slots, the T new ones included); mask None (causal) or bool [T, T] / [B, T, T] (mask[i, j]: node i sees
    node j). Returns out [B, T, Hq, D] (q's dtype) and, if return_lse, the log-sum-exp [B, T, Hq] in float32.

    formulation (static): "dot" computes scores and output with batched matmuls over (row, kv head); "fused" with
    elementwise products and sums that XLA fuses into passes over K and V; "fused_scores" the scores fused and the
    output by the dot. The same math in a different summation order. On a CPU, decoding a batch is bound by
    reading the cache, and over keys laid out [S, D] the matmuls, each only T x G rows tall, read it far slower
    than the fused loops. "auto": on a CPU, fused_scores for one new entry in all over keys stored slots-last (a
    batch-1 decode step), fused for at most FUSED_MAX_ROWS query rows per kv head over at least
    FUSED_MIN_KV_BYTES of K and V; dots otherwise (prefill, large trees, accelerators).

    keys_transposed (static): K stored slots-last. On a CPU the scores then reduce over the slots' axis as the
    minor one instead of over D (a few dozen elements per output), which XLA runs much faster in either
    formulation."""
    B, T, Hq, D = q.shape
    Hkv, S = v_cache.shape[1], v_cache.shape[2]
    group = Hq // Hkv
    M = group * T
    scale = D ** -0.5 if sm_scale is None else sm_scale
    fused_scores, fused_values = _formulation(formulation, B, T, M, 2 * k_cache.size * k_cache.dtype.itemsize,
                                              keys_transposed)
    vis = visibility(lengths, T, S, mask, q_positions, sliding_window)        # [B, T, S]
    # Rows m = g * T + t of one kv head: the products then read the cache where it lies, no transposed copy of it.
    vis = jnp.broadcast_to(vis[:, None, None], (B, 1, group, T, S)).reshape(B, 1, M, S)
    qg = q.reshape(B, T, Hkv, group, D).transpose(0, 2, 3, 1, 4).reshape(B, Hkv, M, D)
    if fused_scores and keys_transposed:
        s = jnp.sum(qg.astype(jnp.float32)[..., None] * k_cache.astype(jnp.float32)[:, :, None], axis=3)
    elif fused_scores:
        s = jnp.sum(qg.astype(jnp.float32)[:, :, :, None, :] * k_cache.astype(jnp.float32)[:, :, None], axis=-1)
    else:
        layout = "bkds" if keys_transposed else "bksd"
        s = jnp.einsum(f"bkmd,{layout}->bkms", qg, k_cache, preferred_element_type=jnp.float32)
    s = jnp.where(vis, s * scale, MASK_VALUE)                                 # [B, Hkv, M, S]
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - m)
    p = jnp.where(vis, p, 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    # Unused slots may hold NaN (tests poison them); 0 * NaN is NaN, so zero the values we never read.
    col_ok = jnp.arange(S)[None, :] < lengths[:, None]                        # [B, S]
    v = jnp.where(col_ok[:, None, :, None], v_cache, 0).astype(jnp.float32)
    if fused_values:
        o = jnp.sum(p[..., None] * v[:, :, None], axis=3)                     # [B, Hkv, M, D]
    else:
        o = jnp.einsum("bkms,bksd->bkmd", p, v)
    o = o / jnp.where(l == 0, 1.0, l)
    out = o.reshape(B, Hkv, group, T, D).transpose(0, 3, 1, 2, 4).reshape(B, T, Hq, D).astype(q.dtype)
    if not return_lse:
        return out
    lse = (m + jnp.log(jnp.where(l == 0, 1.0, l)))[..., 0]                   # [B, Hkv, M]
    return out, lse.reshape(B, Hkv, group, T).transpose(0, 3, 1, 2).reshape(B, T, Hq)


def attention_reference(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array,
                        mask: jax.Array | None = None, q_positions: jax.Array | None = None, *,
                        sliding_window: int | None = None, keys_transposed: bool = False) -> jax.Array:
    """The op's definition with its arguments in the op's order: verify_attention_reference."""
    return verify_attention_reference(q, k_cache, v_cache, lengths, mask, q_positions=q_positions,
                                      sliding_window=sliding_window, keys_transposed=keys_transposed)


def attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array,
              mask: jax.Array | None = None, *, q_positions: jax.Array | None = None,
              sliding_window: int | None = None, keys_transposed: bool = False,
              implementation: str = "xla") -> jax.Array:
    """q [B, T, Hq, D] over one cache layer (k_cache [B, Hkv, S, D], or [B, Hkv, D, S] when keys_transposed;
    v_cache [B, Hkv, S, D]); lengths [B] valid slots, the T new ones included; mask None (causal) or a tree mask
    [T, T] / [B, T, T]; q_positions [B, T] (for a sliding window) -> [B, T, Hq, D].
    implementation (SpecConfig.implementation): "xla" leaves the choice to the settings; "pallas", "pallas_gpu",
    "pallas_tpu" ask the Pallas backend and that lowering of it (not for a sliding window, which the Pallas kernels
    do not take: the settings' choice computes it)."""
    choice = None if implementation == "xla" or sliding_window is not None else "pallas"
    options = None if choice is None else {"implementation": implementation}
    return backends.call("attention", attention_reference, q, k_cache, v_cache, lengths, mask, q_positions,
                         choice=choice, options=options, sliding_window=sliding_window,
                         keys_transposed=keys_transposed)
