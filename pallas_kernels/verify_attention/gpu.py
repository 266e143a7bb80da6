"""Verify attention on GPU: Pallas with the Triton backend (flash-decoding style, GQA rows packed).

Layout inside the kernel. For each (batch b, kv head h) the T query positions times the G = Hq / Hkv query heads
that share kv head h are packed into rows r = t * G + g of one [M, D] tile (GQA packing), padded to a power of two
>= 16 rows so Triton's dot has a legal M. A program walks the committed prefix of the cache (columns below
lengths - T) in blocks of `block_kv` with an online softmax in float32, then does one "tail" step over the T new
columns where the causal / tree mask applies. With `num_splits > 1` the prefix is split across programs
(flash-decoding) and the partial (acc, m, l) are merged in XLA; the last split also does the tail.

Robustness: every load window lies inside [0, S) (a window that would run past S is shifted back and the columns it
re-reads are masked), masked scores use MASK_VALUE (never -inf), l == 0 is guarded, and V rows of columns that are
not read are zeroed before the P @ V product so NaN in unused cache slots never reaches the output.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from specjax.ops.attention import MASK_VALUE


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def _prev_pow2(x: int) -> int:
    return 1 << (int(x).bit_length() - 1)


def _update(carry, q, k, v, vis, col_ok, *, scale, precision):
    """One online-softmax step. q [M, D]; k, v [N, D]; vis [M, N] bool; col_ok [N] bool (column may be read)."""
    m_i, l_i, acc = carry                                               # [M], [M], [M, D] float32
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                        preferred_element_type=jnp.float32) * scale      # [M, N]
    s = jnp.where(vis, s, MASK_VALUE)
    m_new = jnp.maximum(m_i, jnp.max(s, axis=1))                        # [M]
    alpha = jnp.exp(m_i - m_new)                                        # [M]
    p = jnp.exp(s - m_new[:, None])
    p = jnp.where(vis, p, 0.0)                                          # [M, N]
    l_new = alpha * l_i + jnp.sum(p, axis=1)
    v = jnp.where(col_ok[:, None], v, jnp.zeros_like(v))                # NaN-safe: unread columns contribute 0
    pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                         preferred_element_type=jnp.float32)            # [M, D]
    return m_new, l_new, acc * alpha[:, None] + pv


def _kernel(lengths_ref, q_ref, k_ref, v_ref, *refs, num_new, group, block_m, block_kv, tail_n, tail_block,
            num_splits, num_cols, scale, has_mask, precision, normalize):
    # lengths_ref: [B] int32 (whole array)
    # q_ref: [block_m, D]          rows r = t * G + g of this (b, kv head, row block)
    # k_ref, v_ref: [S, D]         this (b, kv head)'s cache, left in place; read in windows
    # mask_ref (tree only): [block_m, tail_n] float32, mask_ref[r, j] = mask[b, r // G, j]
    # outputs: normalize -> o_ref [block_m, D] (q dtype), lse_ref [block_m] float32
    #          else       -> acc_ref [block_m, D], m_ref [block_m], l_ref [block_m] (float32 partials)
    if has_mask:
        mask_ref, *out_refs = refs
    else:
        mask_ref, out_refs = None, refs
    b = pl.program_id(0)
    row_block = pl.program_id(2)
    split = pl.program_id(3)
    length = lengths_ref[b]
    new_start = length - num_new                                        # first new column (lengths >= T required)
    q = q_ref[...]                                                      # [block_m, D]
    d = q.shape[-1]
    carry = (jnp.full((block_m,), MASK_VALUE, jnp.float32), jnp.zeros((block_m,), jnp.float32),
             jnp.zeros((block_m, d), jnp.float32))
    update = functools.partial(_update, q=q, scale=scale, precision=precision)

    # Committed prefix [0, new_start): every column visible to every row.
    n_prefix = lax.div(jnp.maximum(new_start, 0) + block_kv - 1, block_kv)
    per_split = lax.div(n_prefix + num_splits - 1, num_splits)
    lo = split * per_split
    hi = jnp.minimum(lo + per_split, n_prefix)

    def body(i, carry):
        start = i * block_kv
        ws = jnp.minimum(start, num_cols - block_kv)                    # keep the window in bounds
        cols = ws + lax.broadcasted_iota(jnp.int32, (block_kv,), 0)     # [N]
        col_ok = (cols >= start) & (cols < new_start)
        k = k_ref[pl.ds(ws, block_kv), :]                               # [N, D]
        v = v_ref[pl.ds(ws, block_kv), :]
        vis = jnp.broadcast_to(col_ok[None, :], (block_m, block_kv))
        return update(carry, k=k, v=v, vis=vis, col_ok=col_ok)

    carry = lax.fori_loop(lo, hi, body, carry)

    # Tail: the T new columns [new_start, length), causal or tree visibility, in windows of tail_block columns
    # (a prefill's T new columns in one window would not fit a GPU's shared memory). Only the last split counts it.
    rows = row_block * block_m + lax.broadcasted_iota(jnp.int32, (block_m, tail_block), 0)

    def tail(c, carry, mask_cols=None):
        start = new_start + c * tail_block
        ws = jnp.clip(start, 0, num_cols - tail_block)
        cols = ws + lax.broadcasted_iota(jnp.int32, (tail_block,), 0)   # [Tb]
        j = cols - new_start                                            # index inside the new block
        col_ok = (cols >= start) & (j >= 0) & (j < num_new) & (split == num_splits - 1)
        if mask_cols is None:
            new_vis = j[None, :] * group <= rows                        # causal: j <= r // G
        else:
            # Gather mask[r, j(col)] with a one-hot matmul: onehot[jj, col] = (j(col) == c * Tb + jj); exact for
            # 0/1 values. Columns outside this window match no jj.
            jj = lax.broadcasted_iota(jnp.int32, (tail_block, tail_block), 0) + c * tail_block
            onehot = (jj == j[None, :]).astype(jnp.float32)
            seen = lax.dot_general(mask_cols, onehot, (((1,), (0,)), ((), ())),
                                   preferred_element_type=jnp.float32)  # [block_m, Tb]
            new_vis = seen > 0.5
        k = k_ref[pl.ds(ws, tail_block), :]
        v = v_ref[pl.ds(ws, tail_block), :]
        return update(carry, k=k, v=v, vis=new_vis & col_ok[None, :], col_ok=col_ok)

    if has_mask:                                                        # a tree: few windows, static mask slices
        for c in range(tail_n // tail_block):
            carry = tail(c, carry, mask_ref[:, c * tail_block:(c + 1) * tail_block])
    else:
        carry = lax.fori_loop(0, tail_n // tail_block, tail, carry)
    m_i, l_i, acc = carry

    if normalize:
        o_ref, lse_ref = out_refs
        l_safe = jnp.where(l_i == 0.0, 1.0, l_i)
        o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
        lse_ref[...] = m_i + jnp.log(l_safe)
    else:
        acc_ref, m_ref, l_ref = out_refs
        acc_ref[...] = acc
        m_ref[...] = m_i
        l_ref[...] = l_i


def default_num_splits(batch: int, num_kv_heads: int, num_row_blocks: int, num_cols: int, block_kv: int,
                       target_programs: int = 264, min_blocks_per_split: int = 4) -> int:
    """Flash-decoding split count: enough programs to fill ~2 waves of an H100/H200 (132 SMs)."""
    programs = batch * num_kv_heads * num_row_blocks
    want = -(-target_programs // programs)
    cap = max(1, num_cols // (block_kv * min_blocks_per_split))
    return int(max(1, min(want, cap)))


@functools.partial(jax.jit, static_argnames=("scale", "block_kv", "block_m", "num_splits", "num_warps",
                                             "num_stages", "interpret"))
def verify_attention_gpu(q, k_cache, v_cache, lengths, mask=None, *, scale: float, block_kv: int = 64,
                         block_m: int | None = None, num_splits: int | None = 1, num_warps: int = 4,
                         num_stages: int = 2, interpret: bool = False):
    """q [B, T, Hq, D]; k_cache, v_cache [B, Hkv, S, D]; lengths [B] int32; mask None or bool [B, T, T].
    Returns (out [B, T, Hq, D] in q's dtype, lse [B, T, Hq] float32). Shapes are validated by the caller."""
    B, T, Hq, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    rows = T * G

    # Triton wants power-of-two tiles; pad head_dim (a copy of the cache: only for unusual head sizes).
    Dp = max(16, _next_pow2(D))
    if Dp != D:
        pad = ((0, 0), (0, 0), (0, 0), (0, Dp - D))                    # last axis of q and of the cache
        q, k_cache, v_cache = jnp.pad(q, pad), jnp.pad(k_cache, pad), jnp.pad(v_cache, pad)
    tail_n = max(16, _next_pow2(T))
    block_kv = max(16, _next_pow2(block_kv))
    block_kv = min(block_kv, max(16, _prev_pow2(S)))                   # no wider than the cache
    tail_block = min(tail_n, max(64, block_kv))                         # both powers of two: it divides tail_n
    min_cols = max(block_kv, tail_n)
    if S < min_cols:                                                    # tiny caches only (tests)
        pad = ((0, 0), (0, 0), (0, min_cols - S), (0, 0))
        k_cache, v_cache = jnp.pad(k_cache, pad), jnp.pad(v_cache, pad)
        S = min_cols

    m_pad = max(16, _next_pow2(rows))
    if block_m is None:
        block_m = min(m_pad, 64)
    block_m = max(16, _next_pow2(block_m))
    m_pad = -(-m_pad // block_m) * block_m
    n_row_blocks = m_pad // block_m
    if num_splits is None:
        num_splits = default_num_splits(B, Hkv, n_row_blocks, S, block_kv)

    qp = q.reshape(B, T, Hkv, G, Dp).transpose(0, 2, 1, 3, 4).reshape(B, Hkv, rows, Dp)
    qp = jnp.pad(qp, ((0, 0), (0, 0), (0, m_pad - rows), (0, 0)))      # [B, Hkv, Mp, Dp]

    has_mask = mask is not None
    inputs = [lengths.astype(jnp.int32), qp, k_cache, v_cache]
    in_specs = [
        pl.BlockSpec((B,), lambda b, h, r, s: (0,)),
        pl.BlockSpec((None, None, block_m, Dp), lambda b, h, r, s: (b, h, r, 0)),
        pl.BlockSpec((None, None, S, Dp), lambda b, h, r, s: (b, h, 0, 0)),
        pl.BlockSpec((None, None, S, Dp), lambda b, h, r, s: (b, h, 0, 0)),
    ]
    if has_mask:
        mrows = jnp.repeat(jnp.broadcast_to(mask, (B, T, T)), G, axis=1).astype(jnp.float32)   # [B, T*G, T]
        mrows = jnp.pad(mrows, ((0, 0), (0, m_pad - rows), (0, tail_n - T)))                  # [B, Mp, Tn]
        inputs.append(mrows)
        in_specs.append(pl.BlockSpec((None, block_m, tail_n), lambda b, h, r, s: (b, r, 0)))

    normalize = num_splits == 1
    grid = (B, Hkv, n_row_blocks, num_splits)
    if normalize:
        out_shape = [jax.ShapeDtypeStruct((B, Hkv, m_pad, Dp), q.dtype),
                     jax.ShapeDtypeStruct((B, Hkv, m_pad), jnp.float32)]
        out_specs = [pl.BlockSpec((None, None, block_m, Dp), lambda b, h, r, s: (b, h, r, 0)),
                     pl.BlockSpec((None, None, block_m), lambda b, h, r, s: (b, h, r))]
    else:
        out_shape = [jax.ShapeDtypeStruct((B, Hkv, num_splits, m_pad, Dp), jnp.float32),
                     jax.ShapeDtypeStruct((B, Hkv, num_splits, m_pad), jnp.float32),
                     jax.ShapeDtypeStruct((B, Hkv, num_splits, m_pad), jnp.float32)]
        out_specs = [pl.BlockSpec((None, None, None, block_m, Dp), lambda b, h, r, s: (b, h, s, r, 0)),
                     pl.BlockSpec((None, None, None, block_m), lambda b, h, r, s: (b, h, s, r)),
                     pl.BlockSpec((None, None, None, block_m), lambda b, h, r, s: (b, h, s, r))]

    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    kernel = functools.partial(
        _kernel, num_new=T, group=G, block_m=block_m, block_kv=block_kv, tail_n=tail_n, tail_block=tail_block,
        num_splits=num_splits, num_cols=S, scale=scale, has_mask=has_mask, precision=precision, normalize=normalize)
    outs = pl.pallas_call(
        kernel, out_shape=out_shape, grid=grid, in_specs=in_specs, out_specs=out_specs,
        compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="verify_attention_gpu",
    )(*inputs)

    if normalize:
        o, lse = outs
    else:
        acc, m, l = outs                                                # [B, Hkv, P, Mp, Dp], [B, Hkv, P, Mp]
        m_all = jnp.max(m, axis=2)
        w = jnp.exp(m - m_all[:, :, None])
        l_all = jnp.sum(w * l, axis=2)
        l_safe = jnp.where(l_all == 0.0, 1.0, l_all)
        o = (jnp.sum(w[..., None] * acc, axis=2) / l_safe[..., None]).astype(q.dtype)
        lse = m_all + jnp.log(l_safe)
    o = o[:, :, :rows, :D].reshape(B, Hkv, T, G, D).transpose(0, 2, 1, 3, 4).reshape(B, T, Hq, D)
    lse = lse[:, :, :rows].reshape(B, Hkv, T, G).transpose(0, 2, 1, 3).reshape(B, T, Hq)
    return o, lse
