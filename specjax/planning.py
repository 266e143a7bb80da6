"""How a batch of requests is laid out before the decode loop runs: padded prompt widths (prompt buckets), the
token/KV buffer's length, the prefill plan (rows grouped by prompt length, each group at its own width) and each
group's own cache size. Pure arithmetic over lengths; the loop (specjax.decode) and generate() read it."""
from __future__ import annotations

from typing import Sequence

import numpy as np


def round_up(n: int, m: int) -> int:
    """n rounded up to a multiple of m."""
    return -(-n // m) * m


def buffer_length(prompt_width: int, max_new_tokens: int, num_speculative_tokens: int) -> int:
    """The token/KV buffer generate() allocates for prompts padded to prompt_width: every new token plus the k + 1
    slots of a verify pass, rounded up to 16."""
    return round_up(prompt_width + max_new_tokens + num_speculative_tokens + 1, 16)


def prompt_bucket(n: int) -> int:
    """A padded prompt width for an n-token prompt: at least 16, rounded up to a quarter of its octave (at most
    25% padding; a power-of-two bucket wasted up to half, 512 slots for a 319-token prompt), so recompiles stay
    logarithmic in the prompt length."""
    if n <= 16:
        return 16
    return round_up(n, 1 << ((n - 1).bit_length() - 3))


def plan_prefill(lengths: Sequence[int], width: int, max_groups: int) -> tuple[np.ndarray, tuple]:
    """Rows sorted by prompt length and cut into at most max_groups groups of consecutive sorted rows, each
    prefilled at its own padded width (prompt_bucket of its longest; `width` for the last) so as to minimise the
    padded prompt tokens -> (order [B] int32: the rows' indices in sorted order, ((num_rows, width), ...))."""
    order = np.argsort(np.asarray(lengths), kind="stable").astype(np.int32)
    sl = [int(lengths[i]) for i in order]
    B = len(sl)
    # A group can end only where the bucket grows, or at the last row: O(max_groups * ends^2) on a few buckets.
    ends = [j for j in range(B - 1) if prompt_bucket(sl[j]) < prompt_bucket(sl[j + 1])] + [B - 1]
    w_at = lambda j: width if j == B - 1 else min(prompt_bucket(sl[j]), width)
    # best[g][e]: (padded tokens, cuts) of rows 0..ends[e] in g + 1 groups, the last ending at ends[e].
    best = [[((ends[e] + 1) * w_at(ends[e]), (ends[e],)) for e in range(len(ends))]]
    for _ in range(1, max(max_groups, 1)):
        prev, row = best[-1], []
        for e in range(len(ends)):
            options = [prev[e]] + [(prev[d][0] + (ends[e] - ends[d]) * w_at(ends[e]), prev[d][1] + (ends[e],))
                                   for d in range(e)]
            row.append(min(options))
        best.append(row)
    cuts, start, groups = best[-1][-1][1], 0, []
    for end in cuts:
        groups.append((end + 1 - start, w_at(end)))
        start = end + 1
    return order, tuple(groups)


# What a group's own cache costs the decode loop per step (gathers and an attention call of its own in every
# layer), counted as the (row, slot) pairs an attention pass over one buffer reads in the same time on a CPU. A
# heuristic: a ragged batch whose groups spare fewer pairs than this per extra group keeps one buffer.
GROUP_CACHE_COST_SLOTS = 320


def group_cache_sizes(groups: tuple[tuple[int, int], ...], buffer_len: int, max_new_tokens: int,
                      num_speculative_tokens: int) -> tuple[int, ...] | None:
    """The slots of each prefill group's own cache in the decode loop (the buffer_length of its width, at most
    buffer_len), or None when one buffer of buffer_len slots serves the batch: a single group, or groups that
    together spare fewer (row, slot) pairs than GROUP_CACHE_COST_SLOTS per extra group."""
    sizes = tuple(min(buffer_len, buffer_length(width, max_new_tokens, num_speculative_tokens)) for _, width in groups)
    spared = sum(rows * (buffer_len - size) for (rows, _), size in zip(groups, sizes))
    return sizes if len(groups) > 1 and spared >= GROUP_CACHE_COST_SLOTS * (len(groups) - 1) else None
