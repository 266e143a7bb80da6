"""Reduced draft vocabularies (EAGLE-3's convention, also DFlash's): a drafter scores N of the target's V tokens.
Draft id i is target id i + d2t[i] (d2t int64 [N], ascending target ids); t2d bool [V] says which target tokens the
draft vocabulary holds (the published EAGLE-3 layouts store both). Drafts and their probabilities live over the
target's vocabulary: full_vocab_logits puts a drafter's N logits there, every other token at probability 0, so
speculative sampling against the target stays exact (q is what the draft was drawn from)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

NEG_LOGIT = -1e30                 # logits of target tokens outside a draft vocabulary (probability 0)


def full_vocab_logits(draft_logits: jax.Array, vocab_map: jax.Array, vocab_size: int) -> jax.Array:
    """[..., N] logits over a draft vocabulary (vocab_map int32 [N]: the target id of each draft id) -> float32
    [..., V] over the target's vocabulary, NEG_LOGIT outside it."""
    full = jnp.full(draft_logits.shape[:-1] + (vocab_size,), NEG_LOGIT, jnp.float32)
    return full.at[..., vocab_map].set(draft_logits.astype(jnp.float32))


def vocab_map_from_counts(counts, draft_vocab_size: int) -> np.ndarray:
    """EAGLE-3's reference construction: the draft vocabulary is the N most frequent target tokens (ties: lower
    id), in ascending id order -> d2t int64 [N] (target id = draft id + d2t[draft id])."""
    counts = np.asarray(counts)
    order = np.lexsort((np.arange(len(counts)), -counts))[:draft_vocab_size]
    ids = np.sort(order)
    return (ids - np.arange(len(ids))).astype(np.int64)


def draft_to_target(d2t) -> np.ndarray:
    """d2t [N] offsets -> the target id of every draft id [N]."""
    d2t = np.asarray(d2t, np.int64)
    return np.arange(len(d2t)) + d2t


def t2d_from_d2t(d2t, vocab_size: int) -> np.ndarray:
    """bool [V]: which target tokens the draft vocabulary holds (the published `t2d`)."""
    out = np.zeros(vocab_size, bool)
    out[draft_to_target(d2t)] = True
    return out


def target_to_draft(d2t, vocab_size: int) -> np.ndarray:
    """int32 [V]: the draft id of every target token, -1 outside the draft vocabulary (training labels)."""
    out = np.full(vocab_size, -1, np.int32)
    out[draft_to_target(d2t)] = np.arange(len(d2t))
    return out


def check_vocab_map(d2t, vocab_size: int, draft_vocab_size: int, where: str, t2d=None) -> np.ndarray:
    """Validate a d2t map against the target vocabulary; returns it as int64."""
    d2t = np.asarray(d2t)
    if d2t.shape != (draft_vocab_size,):
        raise ValueError(f"{where}: d2t must hold {draft_vocab_size} offsets (one per draft token), got shape "
                         f"{list(d2t.shape)}")
    if not np.issubdtype(d2t.dtype, np.integer):
        if not np.all(np.isfinite(d2t)) or not np.all(d2t == np.round(d2t)):
            raise ValueError(f"{where}: d2t must hold integer offsets, got dtype {d2t.dtype}")
        d2t = np.round(d2t)
    ids = draft_to_target(d2t.astype(np.int64))
    bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if bad.size:
        raise ValueError(f"{where}: the d2t map does not fit the target vocabulary of {vocab_size}: draft id "
                         f"{int(bad[0])} maps to target id {int(ids[bad[0]])} ({bad.size} out of range)")
    if len(np.unique(ids)) != len(ids):
        raise ValueError(f"{where}: the d2t map sends two draft tokens to the same target token")
    if t2d is not None:
        t2d = np.asarray(t2d).astype(bool)
        if t2d.shape != (vocab_size,) or not np.array_equal(t2d, t2d_from_d2t(d2t, vocab_size)):
            raise ValueError(f"{where}: t2d (shape {list(t2d.shape)}) disagrees with d2t over the target "
                             f"vocabulary of {vocab_size}")
    return d2t.astype(np.int64)
