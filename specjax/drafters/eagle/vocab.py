"""EAGLE-3's draft vocabulary: the maps are specjax.drafters.draft_vocab's (shared with DFlash); cutting a trained
drafter's vocabulary down is EAGLE-3's own."""
from __future__ import annotations

import dataclasses

import numpy as np

from specjax.drafters.draft_vocab import (check_vocab_map, draft_to_target, t2d_from_d2t, target_to_draft,
                                         vocab_map_from_counts)
from specjax.drafters.eagle.config import EagleWeights

__all__ = ["check_vocab_map", "draft_to_target", "restrict_draft_vocab", "t2d_from_d2t", "target_to_draft",
           "vocab_map_from_counts"]


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
