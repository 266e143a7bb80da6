"""Statistics shared by the distribution tests: the target's exact joint distribution of its first three sampled
tokens (by enumeration) and a chi-square goodness-of-fit p-value that an impossible outcome fails outright."""
from __future__ import annotations

import itertools
from typing import Mapping

import numpy as np
from scipy import stats as scistats

from specjax.sampling import probabilities


def exact_joint(model, prompt: list[int], sp) -> np.ndarray:
    """P(t1, t2, t3 | prompt) [V, V, V] under the sampling transform `sp` (a SamplingParams), from one causal
    forward over prompt + every (a, b): positions -3, -2, -1 give the distributions of tokens 1, 2, 3."""
    V = model.config.vocab_size
    ab = np.array(list(itertools.product(range(V), repeat=2)), np.int32)              # [V*V, 2]
    seqs = np.concatenate([np.tile(np.asarray(prompt, np.int32), (len(ab), 1)), ab], axis=1)
    probs = np.asarray(probabilities(model.logits(seqs)[:, -3:], sp), np.float64)     # [V*V, 3, V]
    p1, p2, p3 = probs[0, 0], probs[::V, 1], probs[:, 2].reshape(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3


def joint_counts(tokens, V: int) -> np.ndarray:
    """Generated token lists (at least 3 each) -> counts [V, V, V] of their first three tokens."""
    t = np.array([row[:3] for row in tokens])
    return np.bincount(t[:, 0] * V * V + t[:, 1] * V + t[:, 2], minlength=V ** 3).reshape(V, V, V)


def gof_pvalue(counts, probs) -> float:
    """Chi-square goodness of fit of observed counts to probabilities: arrays of one shape, or dicts outcome ->
    count / probability (missing = 0). Cells with expected count < 5 are pooled into one; an outcome of
    probability 0 that was observed gives 0 (no amount of pooling may hide it)."""
    if isinstance(probs, Mapping):
        keys = sorted(set(probs) | set(counts))
        counts = [counts.get(key, 0) for key in keys]
        probs = [probs.get(key, 0.0) for key in keys]
    obs, p = np.ravel(np.asarray(counts, np.float64)), np.ravel(np.asarray(probs, np.float64))
    if np.any(obs[p <= 0] > 0):
        return 0.0
    expected = p / p.sum() * obs.sum()
    big = expected >= 5
    obs, expected = np.append(obs[big], obs[~big].sum()), np.append(expected[big], expected[~big].sum())
    keep = expected > 0
    return float(scistats.chisquare(obs[keep], expected[keep] * obs[keep].sum() / expected[keep].sum()).pvalue)
