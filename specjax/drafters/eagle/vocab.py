"""EAGLE-3's draft vocabulary maps: draft id i is target id i + d2t[i] (d2t int64 [N]); t2d bool [V] says which
target tokens the draft vocabulary holds (the published layouts store both)."""
from __future__ import annotations

import dataclasses

import numpy as np

from specjax.drafters.eagle.config import EagleWeights


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


def restrict_draft_vocab(weights: EagleWeights, counts, draft_vocab_size: int) -> EagleWeights:
    """An EAGLE-3 drafter cut down to the draft_vocab_size most frequent of its draft tokens (counts [V] over
    TARGET ids, e.g. of target-generated text), without retraining: the kept lm_head columns and d2t entries. A
    smaller draft vocabulary makes the drafter's LM head (its largest matmul) cheaper and misses more tokens."""
    if weights.kind != "eagle3":
        raise ValueError(f"only EAGLE-3 drafters have a draft vocabulary; {weights.name!r} is {weights.kind!r}")
    have = draft_to_target(weights.d2t)
    n = int(draft_vocab_size)
    if not 1 <= n <= len(have):
        raise ValueError(f"draft_vocab_size={n} must be in [1, {len(have)}] (the drafter's draft vocabulary)")
    counts = np.asarray(counts)
    if counts.shape != (weights.config.vocab_size,):
        raise ValueError(f"counts must have one entry per target token ({weights.config.vocab_size}), got shape "
                         f"{list(counts.shape)}")
    keep = np.sort(np.lexsort((have, -counts[have]))[:n])               # draft ids, ascending = target order
    ids = have[keep]
    params = dict(weights.params, lm_head=weights.params["lm_head"][:, keep])
    config = dataclasses.replace(weights.config, draft_vocab_size=n)
    return EagleWeights(config, params, (ids - np.arange(n)).astype(np.int64), f"{weights.name}[{n}]")


def check_vocab_map(d2t, vocab_size: int, draft_vocab_size: int, where: str, t2d=None) -> np.ndarray:
    """Validate an EAGLE-3 d2t map against the target vocabulary; returns it as int64."""
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
