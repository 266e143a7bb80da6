"""Verify attention on TPU: Pallas Mosaic, lengths scalar-prefetched, KV cache streamed from HBM in blocks.

Grid (B, S / block_kv): the KV axis is the innermost, "arbitrary" (sequential) axis. One block of the
[B, Hkv, S, D] cache is [Hkv, block_kv, D]: every kv head's slots of that KV block in one DMA, each head a
contiguous [block_kv, D] tile whose last dim spans the array (legal TPU tiling; lane-dense for head_dim 128). The
block index map clamps the KV block to the last block that holds valid slots (`lengths` is scalar-prefetched),
so blocks past the length repeat the previous index and the pipeline skips their DMA; the kernel body skips their
compute with pl.when.

Inside a step, for every kv head h (static loop) the T x G query rows sharing that head form one [M, D] tile
(GQA packing, M padded to a multiple of 16) and update a float32 online softmax held in VMEM scratch. Blocks that
lie wholly in the committed prefix need no mask; the block(s) that reach the T new columns apply the causal or tree
visibility (tree: a one-hot matmul gathers mask[r, col - new_start]) and zero V rows past `lengths`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from specjax.ops.attention import MASK_VALUE

_LANES = 128


def _round_up(x: int, m: int) -> int:
    return -(-int(x) // m) * m


def _kernel(lengths_ref, q_ref, k_ref, v_ref, *refs, num_new, group, num_kv_heads, head_dim, block_kv, scale,
            has_mask, num_kv_blocks):
    # lengths_ref: [B] int32 in SMEM (scalar prefetch)
    # q_ref: [Hkv, M, D]             rows r = t * G + g, zero padded to M
    # k_ref, v_ref: [Hkv, block_kv, D]  one KV block of row b, all kv heads
    # mask_ref (tree only): [M, Tp] float32, mask_ref[r, j] = mask[b, r // G, j]
    # o_ref: [Hkv, M, D] (q dtype); lse_ref: [Hkv, M, 128] float32 (lane-replicated)
    # scratch: m_sc, l_sc [Hkv, M, 128] float32; acc_sc [Hkv, M, D] float32
    if has_mask:
        mask_ref, o_ref, lse_ref, m_sc, l_sc, acc_sc = refs
    else:
        mask_ref = None
        o_ref, lse_ref, m_sc, l_sc, acc_sc = refs
    b = pl.program_id(0)
    i = pl.program_id(1)
    length = lengths_ref[b]
    new_start = length - num_new
    block_start = i * block_kv
    m_rows = q_ref.shape[1]

    @pl.when(i == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, MASK_VALUE, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    def update(vis, v_ok):
        # vis: [M, block_kv] bool or None (all visible); v_ok: [block_kv, D] bool or None (all readable)
        for h in range(num_kv_heads):
            q = q_ref[h]                                                          # [M, D]
            k = k_ref[h]                                                          # [N, D]
            v = v_ref[h]                                                          # [N, D]
            s = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32) * scale      # [M, N]
            if vis is not None:
                s = jnp.where(vis, s, MASK_VALUE)
            m_prev = m_sc[h]                                                      # [M, 128]
            m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))       # [M, 128]
            alpha = jnp.exp(m_prev - m_new)                                       # [M, 128]
            p = jnp.exp(s - m_new[:, :1])                                         # [M, N]
            if vis is not None:
                p = jnp.where(vis, p, 0.0)
            l_sc[h] = alpha * l_sc[h] + jnp.sum(p, axis=1, keepdims=True)
            if v_ok is not None:
                v = jnp.where(v_ok, v, jnp.zeros_like(v))                         # NaN-safe unused slots
            pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                 preferred_element_type=jnp.float32)             # [M, D]
            acc_sc[h] = acc_sc[h] * alpha[:, :1] + pv
            m_sc[h] = m_new

    # Block wholly inside the committed prefix: no masking at all.
    @pl.when(block_start + block_kv <= new_start)
    def _prefix_block():
        update(None, None)

    # Block that reaches the new columns (or the ragged end): full visibility.
    @pl.when((block_start < length) & (block_start + block_kv > new_start))
    def _edge_block():
        cols = block_start + lax.broadcasted_iota(jnp.int32, (m_rows, block_kv), 1)     # [M, N]
        rows = lax.broadcasted_iota(jnp.int32, (m_rows, block_kv), 0)
        j = cols - new_start
        in_new = (j >= 0) & (j < num_new)
        if has_mask:
            tp = mask_ref.shape[1]
            jj = block_start - new_start + lax.broadcasted_iota(jnp.int32, (tp, block_kv), 1)
            onehot = (lax.broadcasted_iota(jnp.int32, (tp, block_kv), 0) == jj).astype(jnp.float32)
            seen = lax.dot_general(mask_ref[...], onehot, (((1,), (0,)), ((), ())),
                                   preferred_element_type=jnp.float32)                # [M, N]
            new_vis = seen > 0.5
        else:
            new_vis = j * group <= rows                                                 # causal: j <= r // G
        vis = (cols < new_start) | (in_new & new_vis)
        v_rows = block_start + lax.broadcasted_iota(jnp.int32, (block_kv, head_dim), 0)
        update(vis, v_rows < length)

    @pl.when(i == num_kv_blocks - 1)
    def _finish():
        for h in range(num_kv_heads):
            l = l_sc[h]
            l_safe = jnp.where(l == 0.0, 1.0, l)                                        # [M, 128]
            o_ref[h] = (acc_sc[h] / l_safe[:, :1]).astype(o_ref.dtype)
            lse_ref[h] = m_sc[h] + jnp.log(l_safe)


@functools.partial(jax.jit, static_argnames=("scale", "block_kv", "interpret", "vmem_limit_bytes"))
def verify_attention_tpu(q, k_cache, v_cache, lengths, mask=None, *, scale: float, block_kv: int = 512,
                         interpret=False, vmem_limit_bytes: int | None = None):
    """q [B, T, Hq, D]; k_cache, v_cache [B, Hkv, S, D]; lengths [B] int32; mask None or bool [B, T, T].
    Returns (out [B, T, Hq, D] in q's dtype, lse [B, T, Hq] float32). Shapes are validated by the caller.
    `interpret`: False on TPU, or a pltpu.InterpretParams to simulate TPU semantics on CPU."""
    B, T, Hq, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    rows = T * G
    m_pad = _round_up(rows, 16)
    block_kv = S if S <= block_kv else _round_up(min(block_kv, S), 8)
    num_kv_blocks = -(-S // block_kv)

    qp = q.reshape(B, T, Hkv, G, D).transpose(0, 2, 1, 3, 4).reshape(B, Hkv, rows, D)
    qp = jnp.pad(qp, ((0, 0), (0, 0), (0, m_pad - rows), (0, 0)))      # [B, Hkv, M, D]

    def kv_index(b, i, lengths_ref):
        last = jnp.maximum(lax.div(lengths_ref[b] + block_kv - 1, block_kv) - 1, 0)
        return (b, 0, jnp.minimum(i, last), 0)                          # no fetch past the valid length

    has_mask = mask is not None
    inputs = [qp, k_cache, v_cache]
    in_specs = [
        pl.BlockSpec((None, Hkv, m_pad, D), lambda b, i, lengths_ref: (b, 0, 0, 0)),
        pl.BlockSpec((None, Hkv, block_kv, D), kv_index),
        pl.BlockSpec((None, Hkv, block_kv, D), kv_index),
    ]
    if has_mask:
        tp = _round_up(T, _LANES)
        mrows = jnp.repeat(jnp.broadcast_to(mask, (B, T, T)), G, axis=1).astype(jnp.float32)   # [B, T*G, T]
        mrows = jnp.pad(mrows, ((0, 0), (0, m_pad - rows), (0, tp - T)))                      # [B, M, Tp]
        inputs.append(mrows)
        in_specs.append(pl.BlockSpec((None, m_pad, tp), lambda b, i, lengths_ref: (b, 0, 0)))

    out_shape = [jax.ShapeDtypeStruct((B, Hkv, m_pad, D), q.dtype),
                 jax.ShapeDtypeStruct((B, Hkv, m_pad, _LANES), jnp.float32)]
    out_specs = [pl.BlockSpec((None, Hkv, m_pad, D), lambda b, i, lengths_ref: (b, 0, 0, 0)),
                 pl.BlockSpec((None, Hkv, m_pad, _LANES), lambda b, i, lengths_ref: (b, 0, 0, 0))]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(B, num_kv_blocks), in_specs=in_specs, out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((Hkv, m_pad, _LANES), jnp.float32),
                        pltpu.VMEM((Hkv, m_pad, _LANES), jnp.float32),
                        pltpu.VMEM((Hkv, m_pad, D), jnp.float32)])
    kernel = functools.partial(_kernel, num_new=T, group=G, num_kv_heads=Hkv, head_dim=D, block_kv=block_kv,
                               scale=scale, has_mask=has_mask, num_kv_blocks=num_kv_blocks)
    o, lse = pl.pallas_call(
        kernel, out_shape=out_shape, grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=vmem_limit_bytes),
        interpret=interpret, name="verify_attention_tpu",
    )(lengths.astype(jnp.int32), *inputs)
    o = o[:, :, :rows].reshape(B, Hkv, T, G, D).transpose(0, 2, 1, 3, 4).reshape(B, T, Hq, D)
    lse = lse[:, :, :rows, 0].reshape(B, Hkv, T, G).transpose(0, 2, 1, 3).reshape(B, T, Hq)
    return o, lse
