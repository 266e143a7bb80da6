"""Acceptance statistics from a decode run: alpha, tau, per-position acceptance, throughput."""
from __future__ import annotations

import numpy as np


def rates(generated: int, first_tokens: int, target_passes: int, accepted: int, drafted: int, accept_hist,
          wall_s: float) -> dict:
    """The ratios every report uses, from counts (one call's or summed over many): alpha, tau (tokens per target
    pass after prefill, bonus included; each row's first token comes from prefill and is not counted), P(draft
    i accepted) among the steps that verified drafts, tokens/s."""
    hist = np.asarray(accept_hist)                                         # [k+1]
    speculative = int(hist.sum())                                          # steps that verified drafts
    return {
        "alpha": accepted / drafted if drafted else float("nan"),
        "tau": (generated - first_tokens) / target_passes if target_passes else float("nan"),
        # P(draft i accepted) = P(at least i+1 accepted in a step)
        "accept_per_position": [float(hist[i + 1:].sum() / max(speculative, 1)) for i in range(len(hist) - 1)],
        "tokens_per_s": generated / wall_s if wall_s > 0 else float("nan"),
    }


def summarize(stats, num_new, wall_s: float) -> dict:
    """stats: DecodeStats as numpy (steps, drafted, accepted, plain_steps [B]; accept_hist, verify_hist [B, k+1];
    accept_trace [B, max_new_tokens])."""
    steps = int(np.sum(stats.steps))
    drafted = int(np.sum(stats.drafted))
    accepted = int(np.sum(stats.accepted))
    hist = np.sum(np.asarray(stats.accept_hist), axis=0)                    # [k+1]
    generated = int(np.sum(num_new))
    return {
        "generated_tokens": generated,
        "target_passes": steps,                               # target passes after prefill
        # of which plain one-token steps, after the acceptance policy switched speculation off
        "plain_passes": int(np.sum(stats.plain_steps)),
        "drafted": drafted,
        "accepted": accepted,
        "rejected": drafted - accepted,
        "accept_hist": hist.tolist(),
        # [B, loop steps] drafts accepted per row and step (-1: row finished, or a plain step): the per-step
        # acceptance trace experiments.simulate replays
        "accept_trace": np.asarray(stats.accept_trace)[:, :int(np.max(stats.steps, initial=0))],
        # target passes by the drafts each verified (0: one position; SpecConfig.verify_widths), over rows
        "verify_hist": np.sum(np.asarray(stats.verify_hist), axis=0).tolist(),
        "wall_s": wall_s,
        **rates(generated, int(np.count_nonzero(num_new)), steps, accepted, drafted, hist, wall_s),
    }
