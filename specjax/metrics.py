"""Acceptance statistics from a decode run: alpha, tau, per-position acceptance, throughput."""
from __future__ import annotations

import numpy as np


def summarize(stats, num_new, wall_s: float, k: int) -> dict:
    """stats: DecodeStats as numpy (steps, drafted, accepted [B]; accept_hist [B, k+1])."""
    steps = int(np.sum(stats.steps))
    drafted = int(np.sum(stats.drafted))
    accepted = int(np.sum(stats.accepted))
    hist = np.sum(np.asarray(stats.accept_hist), axis=0)                    # [k+1]
    generated = int(np.sum(num_new))
    # P(draft i accepted) = P(at least i+1 accepted in a step) among steps.
    per_position = [float(hist[i + 1:].sum() / max(steps, 1)) for i in range(k)]
    return {
        "generated_tokens": generated,
        "target_passes": steps,                               # verify passes after prefill
        "drafted": drafted,
        "accepted": accepted,
        "rejected": drafted - accepted,
        "alpha": accepted / drafted if drafted else float("nan"),
        # Tokens per target pass, bonus included; the first token comes from prefill and is not counted.
        "tau": (generated - np.count_nonzero(num_new)) / steps if steps else float("nan"),
        "accept_hist": hist.tolist(),
        "accept_per_position": per_position,
        "wall_s": wall_s,
        "tokens_per_s": generated / wall_s if wall_s > 0 else float("nan"),
    }
