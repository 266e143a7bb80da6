"""Fused verify attention: T draft positions per row attend to the KV cache in one pass.

Public entry: `verify_attention(q, k_cache, v_cache, lengths, mask=None, *, implementation="pallas", ...)`.

  q        [B, T, Hq, D]     the T new query positions of each row
  k_cache  [B, Hkv, S, D]    cache; slots 0 .. lengths-1 valid, the new positions' own K/V at lengths-T .. lengths-1
  v_cache  [B, Hkv, S, D]
  lengths  [B] int32         valid slots INCLUDING the T new ones. Requires T <= lengths <= S (values are traced,
                             so this is NOT checked; out-of-range lengths give unspecified results)
  mask     None (causal chain) or bool [T, T] / [B, T, T] tree ancestor mask, mask[i, j]: node i sees node j
                             (see `validate_tree_mask` for the required structure; checkable only outside jit)

Returns out [B, T, Hq, D] in q's dtype, and with return_lse=True also lse [B, T, Hq] float32.

implementation: "xla" (the pure-jnp reference), "pallas" (by platform: gpu -> Triton kernel, tpu -> Mosaic kernel,
cpu -> Triton kernel in generic interpret mode), "pallas_gpu", "pallas_tpu" (on CPU: TPU interpret mode).
Columns at or past `lengths` are never read into the output, so they may hold anything (stale drafts, NaN).
Registered as the "pallas" backend of specjax.ops.attention (picked per call by SpecConfig.implementation, or by
SPECJAX_ATTENTION_BACKEND=pallas; never by "auto"); its gradient there is the op definition's.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.ops import Backend, register_backend
from specjax.ops.attention import MASK_VALUE, verify_attention_reference, visibility

__all__ = ["MASK_VALUE", "verify_attention", "verify_attention_reference", "visibility", "validate_tree_mask",
           "validate_inputs", "IMPLEMENTATIONS"]

IMPLEMENTATIONS = ("xla", "pallas", "pallas_gpu", "pallas_tpu")


def validate_inputs(q, k_cache, v_cache, lengths, mask=None) -> None:
    """Static-shape checks (work on tracers). Raises ValueError with a readable message."""
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, Hq, D], got shape {q.shape}")
    if k_cache.ndim != 4:
        raise ValueError(f"k_cache must be [B, Hkv, S, D], got shape {k_cache.shape}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache shapes differ: {k_cache.shape} vs {v_cache.shape}")
    B, T, Hq, D = q.shape
    Bk, Hkv, S, Dk = k_cache.shape
    if Bk != B:
        raise ValueError(f"batch mismatch: q has B={B}, cache has B={Bk}")
    if Dk != D:
        raise ValueError(f"head_dim mismatch: q has D={D}, cache has D={Dk}")
    if T < 1:
        raise ValueError(f"need at least one query position, got T={T}")
    if T > S:
        raise ValueError(f"T={T} new positions do not fit in a cache of S={S} slots")
    if Hkv < 1 or Hq % Hkv != 0:
        raise ValueError(f"Hq={Hq} query heads is not a multiple of Hkv={Hkv} kv heads")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache dtype {k_cache.dtype} != v_cache dtype {v_cache.dtype}")
    if tuple(lengths.shape) != (B,):
        raise ValueError(f"lengths must have shape [B]=({B},), got {tuple(lengths.shape)}")
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"lengths must be integer, got {lengths.dtype}")
    if mask is not None:
        if tuple(mask.shape) not in ((T, T), (B, T, T), (1, T, T)):
            raise ValueError(f"mask must be [T, T] or [B, T, T] with T={T}, B={B}; got {tuple(mask.shape)}")


def validate_tree_mask(mask, *, single_root: bool = True) -> None:
    """Concrete (numpy) check that `mask` [T, T] or [B, T, T] is an ancestor-closed tree mask, nodes in topological
    order: every node sees itself; node i sees j only for j <= i; i's ancestors (the j < i it sees) are exactly its
    parent (the largest of them) plus the parent's ancestors. With single_root, node 0 is the only root (every
    other node sees a parent). Call it outside jit; raises ValueError naming the first bad node."""
    m = np.asarray(mask)
    if m.ndim == 2:
        m = m[None]
    if m.ndim != 3 or m.shape[1] != m.shape[2]:
        raise ValueError(f"tree mask must be [T, T] or [B, T, T], got shape {np.shape(mask)}")
    if m.dtype != np.bool_:
        if not np.isin(m, (0, 1)).all():
            raise ValueError("tree mask must be boolean (0/1)")
        m = m.astype(bool)
    T = m.shape[1]
    for b in range(m.shape[0]):
        mb = m[b]
        for i in range(T):
            if not mb[i, i]:
                raise ValueError(f"tree mask (batch {b}): node {i} does not see itself")
            if mb[i, i + 1:].any():
                raise ValueError(f"tree mask (batch {b}): node {i} sees a later node "
                                 f"{i + 1 + int(np.argmax(mb[i, i + 1:]))}")
            anc = np.flatnonzero(mb[i, :i])
            if anc.size == 0:
                if single_root and i > 0:
                    raise ValueError(f"tree mask (batch {b}): node {i} does not see its parent (no ancestor)")
                continue
            parent = int(anc[-1])
            want = mb[parent, :i].copy()                                # the parent's ancestors and the parent
            if not np.array_equal(mb[i, :i], want):
                missing = np.flatnonzero(want & ~mb[i, :i])
                if missing.size:
                    raise ValueError(f"tree mask (batch {b}): node {i} sees {parent} but not its ancestor(s) "
                                     f"{missing.tolist()}")
                extra = np.flatnonzero(mb[i, :i] & ~want)
                raise ValueError(f"tree mask (batch {b}): node {i}'s ancestors {anc.tolist()} are not a "
                                 f"root-to-node path (node(s) {extra.tolist()} are not ancestors of {parent})")


def _platform() -> str:
    return jax.default_backend()


def verify_attention(q, k_cache, v_cache, lengths, mask=None, *, implementation: str = "pallas",
                     sm_scale: float | None = None, return_lse: bool = False, block_kv: int | None = None,
                     num_splits: int | None = None, block_m: int | None = None, num_warps: int | None = None,
                     num_stages: int | None = None, interpret=None):
    """See the module docstring. Tunables (static): block_kv (KV block; GPU default 64, TPU 512), num_splits (GPU
    flash-decoding KV splits; None = heuristic on GPU, 1 in interpret mode), block_m (GPU row tile), num_warps,
    num_stages (Triton). interpret: None = automatic (on when running on CPU); True / False; for the TPU kernel
    also a pltpu.InterpretParams."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown implementation {implementation!r}; expected one of {IMPLEMENTATIONS}")
    validate_inputs(q, k_cache, v_cache, lengths, mask)
    D = q.shape[-1]
    scale = float(D ** -0.5 if sm_scale is None else sm_scale)
    lengths = lengths.astype(jnp.int32)
    if mask is not None and mask.dtype != jnp.bool_:
        mask = mask != 0                                                # 0/1 masks are accepted

    if implementation == "xla":
        return verify_attention_reference(q, k_cache, v_cache, lengths, mask, sm_scale=scale, return_lse=return_lse)

    platform = _platform()
    if implementation == "pallas":
        implementation = "pallas_tpu" if platform == "tpu" else "pallas_gpu"
    if mask is not None and mask.ndim == 2:
        mask = mask[None]

    if implementation == "pallas_gpu":
        from pallas_kernels.verify_attention.gpu import verify_attention_gpu
        if interpret is None:
            interpret = platform != "gpu"
        if num_splits is None and interpret:
            num_splits = 1
        out, lse = verify_attention_gpu(
            q, k_cache, v_cache, lengths, mask, scale=scale, block_kv=block_kv or 64, block_m=block_m,
            num_splits=num_splits, num_warps=num_warps or 4, num_stages=num_stages or 2, interpret=bool(interpret))
    else:
        from jax.experimental.pallas import tpu as pltpu
        from pallas_kernels.verify_attention.tpu import verify_attention_tpu
        if interpret is None:
            interpret = platform != "tpu"
        if interpret is True:
            interpret = pltpu.InterpretParams()
        out, lse = verify_attention_tpu(q, k_cache, v_cache, lengths, mask, scale=scale, block_kv=block_kv or 512,
                                        interpret=interpret)
    return (out, lse) if return_lse else out


def _takes(q, k_cache, v_cache, lengths, mask, q_positions, *, sliding_window, keys_transposed) -> bool:
    return sliding_window is None                       # the kernels have no sliding window


def _kernel(q, k_cache, v_cache, lengths, mask, q_positions, *, sliding_window, keys_transposed,
            implementation: str = "pallas") -> jax.Array:
    # The kernels read [S, D] tiles; a CPU cache keeps its keys transposed, so interpreting a kernel there reads a
    # transposed copy (on accelerators the cache is in the kernels' layout).
    keys = jnp.swapaxes(k_cache, 2, 3) if keys_transposed else k_cache
    return verify_attention(q, keys, v_cache, lengths, mask, implementation=implementation)


register_backend("attention", Backend("pallas", _kernel, platforms=None, takes=_takes, auto=False))
