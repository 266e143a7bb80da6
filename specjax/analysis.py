"""The analytic speedup model of speculative decoding (Leviathan et al. 2023, arXiv 2211.17192, Section 3).

Pure Python/numpy: these functions predict what the engine should measure, so every measured speedup can be
printed next to its prediction; a gap between the two is the engine's overhead (or a wrong assumption), made
visible.

Vocabulary:
  alpha        probability that one drafted token is accepted, assumed i.i.d. across positions
  k            number of drafted tokens per step (chain)
  tau          expected tokens committed per draft-verify step, INCLUDING the bonus/corrected target token
  c            cost of one draft step / cost of one plain target decode step (1 position)
  verify_cost  cost of one target pass over k+1 positions / cost of one plain target decode step.
               1.0 is the memory-bound ideal Leviathan assumes; a measured curve can be plugged in.
"""
from __future__ import annotations

import math
from typing import Callable, Mapping, Sequence, Union

import numpy as np

VerifyCost = Union[float, Callable[[int], float], Mapping[int, float]]


def expected_tokens_per_step(alpha, k):
    """tau = E[tokens per step] = (1 - alpha^(k+1)) / (1 - alpha) for a chain of k drafts (Leviathan eq. 1).

    The accepted prefix length is min(first rejection, k) and one target token always follows, so
    tau = sum_{i=0..k} alpha^i. alpha == 1 gives k + 1. Works elementwise on arrays.
    """
    a = np.asarray(alpha, dtype=np.float64)
    k = np.asarray(k)
    if np.any((a < 0) | (a > 1)):
        raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
    if np.any(k < 0):
        raise ValueError(f"k must be >= 0, got {k!r}")
    one = a == 1.0
    safe = np.where(one, 0.5, a)                      # avoid 0/0; the alpha == 1 branch is taken below
    # 1 - a^(k+1) via expm1(log) stays accurate as a -> 1, where the naive difference cancels; 1 - a is exact
    # there (Sterbenz), so tau is continuous up to the alpha == 1 branch and alpha_from_tau can invert it.
    with np.errstate(divide="ignore"):                # log(0) = -inf is fine: expm1(-inf) = -1
        tau = np.where(one, k + 1.0, -np.expm1((k + 1) * np.log(safe)) / (1.0 - safe))
    return float(tau) if tau.ndim == 0 else tau


def verify_cost_at(verify_cost: VerifyCost, k: int) -> float:
    """Resolve a verify-cost spec to the cost ratio of a (k+1)-position target pass.

    - float: the same ratio for every k > 0 (1.0 = Leviathan's assumption)
    - callable: called with k (number of drafted tokens; the pass covers k + 1 positions)
    - mapping {T: ratio}: a measured curve keyed by the number of verified positions T = k + 1, linearly
      interpolated; clamped at the ends (np.interp), so measure the range you ask about.
    k == 0 is plain decoding: its cost is 1 by definition, whatever the spec says.
    """
    if k == 0:
        return 1.0
    if callable(verify_cost):
        return float(verify_cost(k))
    if isinstance(verify_cost, Mapping):
        if not verify_cost:
            raise ValueError("verify_cost mapping is empty")
        ts = np.array(sorted(verify_cost), dtype=np.float64)
        rs = np.array([verify_cost[t] for t in sorted(verify_cost)], dtype=np.float64)
        return float(np.interp(k + 1, ts, rs))
    return float(verify_cost)


def walltime_speedup(alpha: float, k: int, c: float, verify_cost: VerifyCost = 1.0) -> float:
    """Expected wall-time speedup of speculative over plain decoding: tau / (k c + verify_cost(k)).

    With verify_cost = 1 this is Leviathan's (1 - alpha^(k+1)) / ((1 - alpha)(k c + 1)).
    """
    if c < 0:
        raise ValueError(f"c must be >= 0, got {c!r}")
    return float(expected_tokens_per_step(alpha, k)) / (k * c + verify_cost_at(verify_cost, k))


def speedup_from_tau(tau: float, draft_cost: float, verify_cost: float = 1.0,
                     one_position_share: float = 0.0) -> float:
    """Speedup for any drafter (chain or tree) from a measured tau and measured costs.

    draft_cost: total drafting cost per step in plain-decode-step units (k c for a chain; depth c for an EAGLE
    tree whose levels are one batched draft pass each; ~0 for prompt lookup).
    verify_cost: cost of the target pass over all drafted positions (k+1, or T tree nodes), same units.
    one_position_share: the steps' share that verified one position because nothing was drafted (they cost the
    drafter's proposal and one decode step); tau counts their one token too.
    """
    if not 0.0 <= one_position_share <= 1.0:
        raise ValueError(f"one_position_share must be in [0, 1], got {one_position_share!r}")
    return float(tau) / (draft_cost + one_position_share + (1.0 - one_position_share) * verify_cost)


def optimal_k(alpha: float, c: float, verify_cost: VerifyCost = 1.0, k_max: int = 16) -> tuple[int, float]:
    """(k, speedup) maximising walltime_speedup over k in 0..k_max.

    k = 0 (speedup 1.0, plain decoding) is returned when no k beats it, e.g. a slow draft or low acceptance:
    that is the honest answer to "speculation slower than plain decoding" reports.
    """
    best_k, best = 0, 1.0
    for k in range(1, k_max + 1):
        s = walltime_speedup(alpha, k, c, verify_cost)
        if s > best + 1e-12:
            best_k, best = k, s
    return best_k, best


def alpha_from_tau(tau: float, k: int, tol: float = 1e-12) -> float:
    """Invert tau = (1 - a^(k+1)) / (1 - a) for a in [0, 1] by bisection (tau is increasing in a).

    tau must lie in [1, k+1] (tau counts the bonus token). Values within 1e-9 of the ends are clipped.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1 to infer alpha, got {k}")
    if not (1.0 - 1e-9 <= tau <= k + 1.0 + 1e-9):
        raise ValueError(f"tau must be in [1, k+1] = [1, {k + 1}] (it includes the bonus token), got {tau}")
    tau = min(max(tau, 1.0), k + 1.0)
    lo, hi = 0.0, 1.0
    while hi - lo > tol:
        mid = 0.5 * (lo + hi)
        if expected_tokens_per_step(mid, k) < tau:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def expected_tokens_tree(accept_probs: Sequence[float], parents: Sequence[int]) -> float:
    """tau for a static token tree: 1 + E[accepted depth].

    accept_probs [T]: for each node, the probability that it is accepted GIVEN its parent was accepted and its
        earlier siblings were rejected (entry 0, the root, is ignored).
    parents [T]: parent index of each node, root at index 0 with parent -1, parent index < child index.

    Assumptions (document them next to any number this produces):
      - verification walks down from the root; at each accepted node its children are tried in index order
        (for a TreeSpec, index order among siblings is top-k rank order), the first accepted child is taken
        and the rest are not tried. This is exact for greedy verification (at most one child matches the
        target argmax) and for multi-draft recursive rejection sampling, with conditional probabilities.
      - acceptance events are independent with the given conditional probabilities (no dependence on context).
    Then P(reach n) = P(reach parent) * p_n * prod_{earlier siblings s}(1 - p_s) and
    E[accepted depth] = sum_{n != root} P(reach n). A chain with p = alpha recovers (1 - a^(k+1)) / (1 - a).
    """
    p = np.asarray(accept_probs, dtype=np.float64)
    par = np.asarray(parents, dtype=np.int64)
    if p.shape != par.shape or p.ndim != 1 or len(p) == 0:
        raise ValueError(f"accept_probs and parents must be 1-D of the same length, got {p.shape}, {par.shape}")
    if par[0] != -1 or np.any(par[1:] < 0) or np.any(par[1:] >= np.arange(1, len(par))):
        raise ValueError("parents must have the root at 0 (parent -1) and parent index < child index")
    if np.any((p[1:] < 0) | (p[1:] > 1)):
        raise ValueError("accept_probs must be in [0, 1]")
    reach = np.zeros(len(p))                          # [T] P(node is on the accepted path)
    reach[0] = 1.0
    untried = np.ones(len(p))                         # [T] P(no earlier child of this node was accepted)
    for n in range(1, len(p)):                        # parents precede children, so reach[par] is final
        parent = par[n]
        reach[n] = reach[parent] * untried[parent] * p[n]
        untried[parent] *= 1.0 - p[n]
    return 1.0 + float(reach[1:].sum())


def roofline_step_time(batch: np.ndarray, positions: int, param_bytes: float, kv_bytes_per_token: float,
                       context_len: int, flops_per_token: float, peak_flops: float,
                       bandwidth: float) -> np.ndarray:
    """Roofline time of one target pass over `positions` new tokens per row for batch sizes `batch` [N].

    Memory: all weights once + every row's KV cache of context_len tokens (the dominant reads of decoding).
    Compute: flops_per_token for each of batch * positions tokens. Time = max(memory, compute): the pass is
    bound by whichever resource saturates first; overlap is assumed perfect.
    """
    b = np.asarray(batch, dtype=np.float64)
    mem = (param_bytes + b * context_len * kv_bytes_per_token) / bandwidth
    compute = b * positions * flops_per_token / peak_flops
    return np.maximum(mem, compute)


def batch_roofline(batch_sizes: Sequence[int], *, param_bytes: float, kv_bytes_per_token: float,
                   context_len: int, flops_per_token: float, peak_flops: float, bandwidth: float,
                   alpha: float, k: int, c: float) -> np.ndarray:
    """Predicted speculative speedup [len(batch_sizes)] versus batch size, from a roofline.

    For each batch size B:
      t_plain(B)  = roofline time of a target pass over B tokens (1 position per row)
      t_verify(B) = roofline time of a target pass over B * (k+1) tokens (same weights and KV reads)
      t_draft(B)  = c * t_plain(B) per draft step (the draft's cost ratio is held fixed across B)
      speedup(B)  = tau * t_plain / (k * t_draft + t_verify) = tau / (k c + t_verify / t_plain)
    At small B both passes are memory-bound, t_verify ~ t_plain, and this is Leviathan's formula. As B grows
    the verify pass reaches the compute roof first (it has k+1 times the flops), t_verify / t_plain -> k+1, and
    the speedup falls to tau / (k c + k + 1) < 1: speculation costs throughput at large batch, which is what
    EAGLE-3 Table 5 and vLLM #8439 show. Per-row KV reads grow with B too, so a long context keeps both
    passes memory-bound to larger batches (speculation pays longer there). flops_per_token should include
    attention at context_len (~ 2 * n_params + 4 * n_layers * d_model * context_len).
    Rejected drafts' wasted compute is in t_verify.
    """
    b = np.asarray(batch_sizes, dtype=np.float64)
    if np.any(b < 1):
        raise ValueError("batch sizes must be >= 1")
    args = dict(param_bytes=param_bytes, kv_bytes_per_token=kv_bytes_per_token, context_len=context_len,
                flops_per_token=flops_per_token, peak_flops=peak_flops, bandwidth=bandwidth)
    t_plain = roofline_step_time(b, 1, **args)                 # [N]
    t_verify = roofline_step_time(b, k + 1, **args)            # [N]
    tau = expected_tokens_per_step(alpha, k)
    return tau / (k * c + t_verify / t_plain)


def roofline_crossover_batch(*, param_bytes: float, kv_bytes_per_token: float, context_len: int,
                             flops_per_token: float, peak_flops: float, bandwidth: float,
                             alpha: float, k: int, c: float) -> float:
    """The batch size B* above which batch_roofline's speedup is below 1 (real-valued; same arguments).

    The speedup tau / (k c + t_verify / t_plain) is below 1 exactly when the cost ratio t_verify / t_plain exceeds
    r = tau - k c. Write the memory time as a + b B (weights a = param_bytes / bandwidth, KV per row
    b = context_len * kv_bytes_per_token / bandwidth) and the compute time per row and position as
    f = flops_per_token / peak_flops. The ratio is 1 while the verify pass is memory-bound, then
    (k+1) f B / (a + b B) while plain decoding still is, then k+1: non-decreasing in B, so it crosses r once,
    at B* = r a / ((k+1) f - r b), provided r >= 1 (else speculation loses at every batch: 0.0), r < k+1 (at
    alpha = 1, c = 0 the ratio never exceeds r: math.inf) and (k+1) f > r b (else the per-row KV reads keep the
    ratio below r at every batch: math.inf). The first integer batch with speedup < 1 is floor(B*) + 1.
    """
    r = expected_tokens_per_step(alpha, k) - k * c
    if r < 1.0:
        return 0.0
    if r >= k + 1:
        return math.inf
    a = param_bytes / bandwidth
    b = context_len * kv_bytes_per_token / bandwidth
    f = flops_per_token / peak_flops
    denominator = (k + 1) * f - r * b
    return math.inf if denominator <= 0 else r * a / denominator


# ---- replaying recorded acceptance (generate()'s stats["accept_trace"]) to predict other k and the policy ----
# Exact for a greedy chain drafter whose proposal at a position depends only on the committed prefix (a draft
# model: accepted drafts ARE the prefix), up to the positions the recorded run never tested; an approximation for
# drafters that continue one match (prompt lookup). experiments/simulate.py checks it against real runs.

def positions_from_trace(trace: np.ndarray, k_max: int, generated: list[int]) -> list[np.ndarray]:
    """accept_trace [B, steps] (-1: row finished or plain step) and each row's generated token count -> per row,
    one entry per generated token after the first (which the prefill gives): 1 the drafter agreed with it, 0 it
    did not, -1 untested (the bonus token after a fully accepted step). A row's last step may have accepted
    past its budget: those positions are cut off."""
    rows = []
    for row, count in zip(np.asarray(trace), generated):
        seq = []
        for n in row[row >= 0]:
            seq += [1] * int(n) + [0 if n < k_max else -1]
        rows.append(np.asarray(seq[:count - 1], np.int8))
    return rows


def fill_untested(rows: list[np.ndarray], rate: float, rng: np.random.Generator) -> list[np.ndarray]:
    return [np.where(r >= 0, r, (rng.random(len(r)) < rate).astype(np.int8)) for r in rows]


def replay(rows: list[np.ndarray], k: int, threshold: float | None = None, window: int = 16) -> dict:
    """Replay agreement sequences (0/1 per position, one per row) with chain length k, all rows stepping together
    as in the loop, and the acceptance switch if `threshold` is given (SpecConfig.acceptance_rate_threshold:
    accepted / drafted of active rows over the last `window` speculative steps). -> {"iterations": loop
    iterations, "speculative": speculative iterations, "accepted": drafts accepted, "drafted": drafts proposed}."""
    pos = np.zeros(len(rows), int)
    ends = np.array([len(r) for r in rows])
    history: list[tuple[int, int]] = []
    iterations = speculative = accepted_total = drafted_total = 0
    speculating = k > 0
    while np.any(pos < ends):
        active = pos < ends
        if not speculating:               # plain steps: one token per row until the longest row is done
            iterations += int(np.max(ends - pos))
            break
        accepted = drafted = 0
        for b in np.flatnonzero(active):
            r, p = rows[b], pos[b]
            n = 0
            while n < k and p + n < ends[b] and r[p + n] == 1:
                n += 1
            pos[b] = p + n + 1
            accepted += n
            drafted += k
        iterations += 1
        speculative += 1
        accepted_total += accepted
        drafted_total += drafted
        history.append((accepted, drafted))
        if threshold is not None and len(history) >= window:
            acc, dr = map(sum, zip(*history[-window:]))
            speculating = acc >= threshold * dr
    return dict(iterations=iterations, speculative=speculative, accepted=accepted_total, drafted=drafted_total)


def expected_replay(rows: list[np.ndarray], k: int, rate: float, draws: int, seed: int = 0, **policy) -> dict:
    """replay() averaged over `draws` fills of the untested positions."""
    rng = np.random.default_rng(seed)
    runs = [replay(fill_untested(rows, rate, rng), k, **policy) for _ in range(draws)]
    return {key: float(np.mean([r[key] for r in runs])) for key in runs[0]}
