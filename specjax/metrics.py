"""Acceptance statistics from a decode run: alpha, tau, per-position acceptance, throughput."""
from __future__ import annotations

import numpy as np


def summarize(stats, num_new, wall_s: float, k: int) -> dict:
    """stats: DecodeStats as numpy (steps, drafted, accepted, plain_steps [B]; accept_hist [B, k+1];
    accept_trace [B, max_new_tokens])."""
    steps = int(np.sum(stats.steps))
    drafted = int(np.sum(stats.drafted))
    accepted = int(np.sum(stats.accepted))
    hist = np.sum(np.asarray(stats.accept_hist), axis=0)                    # [k+1]
    generated = int(np.sum(num_new))
    speculative = int(hist.sum())                                          # steps that verified drafts
    # P(draft i accepted) = P(at least i+1 accepted in a step) among speculative steps.
    per_position = [float(hist[i + 1:].sum() / max(speculative, 1)) for i in range(k)]
    return {
        "generated_tokens": generated,
        "target_passes": steps,                               # target passes after prefill
        # of which plain one-token steps, after the acceptance policy switched speculation off
        "plain_passes": int(np.sum(stats.plain_steps)),
        "drafted": drafted,
        "accepted": accepted,
        "rejected": drafted - accepted,
        "alpha": accepted / drafted if drafted else float("nan"),
        # Tokens per target pass, bonus included; the first token comes from prefill and is not counted.
        "tau": (generated - np.count_nonzero(num_new)) / steps if steps else float("nan"),
        "accept_hist": hist.tolist(),
        # [B, loop steps] drafts accepted per row and step (-1: row finished, or a plain step): the per-step
        # acceptance trace experiments.simulate replays
        "accept_trace": np.asarray(stats.accept_trace)[:, :int(np.max(stats.steps, initial=0))],
        "accept_per_position": per_position,
        "wall_s": wall_s,
        "tokens_per_s": generated / wall_s if wall_s > 0 else float("nan"),
    }
