"""Suffix decoding (SuffixDecoding, Oliaro et al. 2024; vLLM's method "suffix", same knob names): match the
longest suffix of the committed text against the request's own prompt + output and against a global cache of
earlier requests' outputs, and propose a token tree of the continuations that followed the match, scored by
frequency.

Jit-compatible: no pointer-based suffix tree. The sources are fixed-shape token arrays searched on device every
step, inside the one compiled loop (no host step between device steps):
  - per request: `ctx.tokens` itself (prompt + output so far), as prompt lookup reads it;
  - global: `params` = the cached outputs of earlier generate() calls, concatenated with -1 separators, padded
    to a power of two (so the compiled loop is re-used until the cache doubles). The cache lives on the host
    (SuffixCache), persists across generate() calls of one process, keeps the latest
    suffix_decoding_max_cached_requests outputs (FIFO; 0 turns it off) and is extended by the `finish` hook
    after each generate() call.
What a suffix tree node holds is recomputed from the arrays: the node of the matched pattern (length M, at most
suffix_decoding_max_tree_depth) is the set of its occurrences, a child's count is how many of those continue
with that token, so the subtree below the match is the trie of the continuations src[e : e + D] of the
occurrences e. A candidate's probability is count(node) / count(match) (Arctic Inference's estimate: the
product of child/parent frequencies along the path); nodes under suffix_decoding_min_token_prob are dropped and
the best min(k, floor(suffix_decoding_max_spec_factor * M)) nodes are proposed (the set is closed under ancestors
since a node never outscores its parent). Unused tree slots (a short match, rare continuations) are filled with
the root's token as extra children of the root: the tree keeps its fixed k + 1 nodes and those slots cost
verify width but never change the output.

Bounded approximations of the paper's structure (documented, they only change which tokens are proposed):
  - counts come from the MAX_OCCURRENCES most recent occurrences of the matched pattern (request text after
    cache, later first), not from every occurrence;
  - the draft depth is bounded by min(k, max_tree_depth) rather than by max_tree_depth - M (the arrays hold
    whole outputs, not depth-limited suffixes).
Cost per step: O(B * (C + L) * max_tree_depth) token compares (C cached tokens, L the loop's buffer) plus
O(B * MAX_OCCURRENCES^2 * depth) for the trie counts.

Drafts are deterministic (q one-hot), so the existing tree verification is exact: greedy output is plain greedy
output, sampled output is distributed as the target's (verify.tree_sampled, case a).
"""
from __future__ import annotations

import collections
import dataclasses
import os
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from specjax.drafters.base import Context, Draft, last_tokens
from specjax.drafters.registry import BuildRequest, DrafterSpec, Option, register
from specjax.trees import Tree, mask_from_parents

MAX_OCCURRENCES = 32        # occurrences of the matched pattern whose continuations are counted
# The padded global-cache array has a power-of-two size >= min(_MIN_CACHE_SLOTS, the configured bound): the
# compiled loop is re-used until the cache outgrows it (each doubling recompiles once; a small bound never does).
# Matching 4096 slots costs ~0.1M token compares a step, noise beside a target forward.
_MIN_CACHE_SLOTS = 4096


class SuffixCache:
    """The global cache: earlier requests' outputs (token-id tuples), oldest first. Host-side; its device form is
    `arrays()`. One per name per process (`global_cache(name)`), or a private one passed as `drafter=`."""

    def __init__(self, outputs: Iterable[Sequence[int]] = (), name: str = ""):
        self.name = name
        self._outputs: collections.deque = collections.deque(tuple(int(t) for t in o) for o in outputs)

    def __len__(self) -> int:
        return len(self._outputs)

    @property
    def num_tokens(self) -> int:
        return sum(map(len, self._outputs))

    def add(self, outputs: Iterable[Sequence[int]], max_requests: int) -> None:
        """Append outputs (empty ones are skipped), then evict the oldest beyond max_requests."""
        for o in outputs:
            if len(o):
                self._outputs.append(tuple(int(t) for t in o))
        while len(self._outputs) > max_requests:
            self._outputs.popleft()

    def clear(self) -> None:
        self._outputs.clear()

    def arrays(self, max_requests: int, min_size: int = _MIN_CACHE_SLOTS) -> np.ndarray:
        """int32 [C]: the latest max_requests outputs, each followed by -1 (a separator no token matches), padded
        with -1 to a power of two > their length and >= min_size."""
        kept = list(self._outputs)[-max_requests:] if max_requests > 0 else []
        flat = [t for o in kept for t in (*o, -1)]
        size = max(min_size, 1 << len(flat).bit_length())               # > len(flat): always ends in -1
        out = np.full(size, -1, np.int32)
        out[:len(flat)] = flat
        return out


_CACHES: dict[str, SuffixCache] = {}


def global_cache(name: str = "default") -> SuffixCache:
    """The process-wide cache of that name (created empty on first use)."""
    if name not in _CACHES:
        _CACHES[name] = SuffixCache(name=name)
    return _CACHES[name]


def match_lengths(src: jax.Array, query: jax.Array) -> jax.Array:
    """src [S] (-1: no token), query [Q] (the last Q committed tokens, oldest first; -2 where absent) -> m [S]
    int32: how many of the query's last tokens end right before position e (src[e - m : e] == query[Q - m :])."""
    S, Q = src.shape[0], query.shape[0]
    ends = jnp.arange(S)
    run = jnp.ones((S,), bool)
    m = jnp.zeros((S,), jnp.int32)
    for i in range(Q):                                           # Q = max_tree_depth: small and static
        run &= (ends > i) & (jnp.roll(src, i + 1) == query[Q - 1 - i])     # src[e - 1 - i]
        m += run
    return m


def propose_row(src: jax.Array, query: jax.Array, root: jax.Array, k: int, depth: int, max_spec_factor: float,
                min_token_prob: float) -> Tree:
    """One row: src [S] (global cache then the request's own text, -1 elsewhere), query [Q], root [] -> a tree of
    k + 1 nodes (leading batch dim 1 stripped by the caller's vmap)."""
    S, D = src.shape[0], depth
    O = min(MAX_OCCURRENCES, S)
    m = jnp.where(src >= 0, match_lengths(src, query), 0)                   # a continuation token must exist
    M = jnp.max(m)
    key = jnp.where((m == M) & (M > 0), jnp.arange(S), -1)
    occ_key, occ = lax.top_k(key, O)                                         # latest occurrences first
    idx = jnp.minimum(occ[:, None] + jnp.arange(D)[None, :], S - 1)          # [O, D]
    cont = src[idx]
    valid = (occ_key[:, None] >= 0) & (jnp.cumprod(cont >= 0, axis=1) > 0) \
        & (occ[:, None] + jnp.arange(D)[None, :] < S)                        # [O, D] inside one text
    # Trie nodes: (o, d) is the prefix cont[o, :d + 1]; same[o, o', d] iff o' shares it.
    same = jnp.cumprod(cont[:, None, :] == cont[None, :, :], axis=2).astype(bool) & valid[None, :, :]
    count = jnp.sum(same, axis=1)                                            # [O, D]
    rep = jnp.argmax(same, axis=1)                                           # [O, D] first occurrence of the node
    total = jnp.maximum(jnp.sum(valid[:, 0]), 1)
    prob = count / total
    ok = valid & (rep == jnp.arange(O)[:, None]) & (prob >= min_token_prob)
    # Rank by count, ties to the shallower node, so an ancestor always ranks above its descendants.
    score = jnp.where(ok, count * (D + 1) + (D - jnp.arange(D))[None, :], -1).T.reshape(D * O)   # depth-major
    limit = jnp.minimum(k, jnp.floor(max_spec_factor * M).astype(jnp.int32))
    if D * O < k:                                                            # a tiny source: pad the ranking
        score = jnp.concatenate([score, jnp.full((k - D * O,), -1, score.dtype)])
    top, cand = lax.top_k(score, k)
    real = (top >= 0) & (jnp.arange(k) < limit)
    cand = jnp.sort(jnp.where(real, cand, D * O + cand))                    # real ones first, depth-major order
    real = cand < D * O
    cand = cand % (D * O)
    d, o = cand // O, cand % O
    node_of = jnp.full((D * O,), -1, jnp.int32).at[jnp.where(real, cand, D * O)].set(
        jnp.arange(1, k + 1, dtype=jnp.int32), mode="drop")
    parent_cand = jnp.maximum(d - 1, 0) * O + rep[o, jnp.maximum(d - 1, 0)]
    parent = jnp.where(real & (d > 0), node_of[parent_cand], 0)
    tokens = jnp.where(real, cont[o, d], root)
    neg1 = jnp.full((1,), -1, jnp.int32)
    parents = jnp.concatenate([neg1, parent.astype(jnp.int32)])
    return Tree(tokens=jnp.concatenate([root[None], tokens]).astype(jnp.int32), parents=parents,
                depths=jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.where(real, d + 1, 1).astype(jnp.int32)]),
                mask=mask_from_parents(parents),
                scores=jnp.concatenate([jnp.zeros((1,)), jnp.where(real, prob[o, d], 0.0)]).astype(jnp.float32),
                source=jnp.concatenate([neg1, jnp.where(real, cand, -1).astype(jnp.int32)]), max_depth=D)


@dataclasses.dataclass(frozen=True)
class SuffixDrafter:
    k: int                            # tree nodes besides the root (vLLM: the most tokens proposed per step)
    max_tree_depth: int = 24
    max_spec_factor: float = 1.0
    min_token_prob: float = 0.1
    target_layers = ()                # reads nothing of the target but its tokens
    target_weights = ()

    # params: the global cache, int32 [C] (-1 separated and padded); state: ()

    @property
    def depth(self) -> int:
        return min(self.k, self.max_tree_depth)

    def init(self, params, ctx, target_out, sp):
        return ()

    def propose(self, params, state, ctx: Context, keys, sp):
        B, L = ctx.tokens.shape
        Q = self.max_tree_depth
        own = jnp.where(jnp.arange(L)[None, :] < ctx.length[:, None], ctx.tokens, -1)   # [B, L] stale: no token
        src = jnp.concatenate([jnp.broadcast_to(params[None, :], (B, params.shape[0])), own], axis=1)   # [B, S]
        present = ctx.length[:, None] - Q + jnp.arange(Q)[None, :] >= 0
        query = jnp.where(present, last_tokens(ctx, Q), -2)                      # [B, Q] -2 matches nothing
        root = last_tokens(ctx, 1)[:, 0]
        tree = jax.vmap(lambda s, q, r: propose_row(s, q, r, self.k, self.depth, self.max_spec_factor,
                                                    self.min_token_prob))(src, query, root)
        tree = dataclasses.replace(tree, max_depth=self.depth)   # vmap keeps the static field; restate it
        proposed = jnp.sum(tree.source[:, 1:] >= 0, axis=1).astype(jnp.int32)   # [B] real nodes (listed first)
        return Draft(tree.tokens[:, 1:], None, tree, proposed), state

    def commit(self, params, state, ctx, num_accepted, target_out, verified):
        return state


OPTIONS = {
    "suffix_decoding_max_tree_depth": Option(
        24, lambda v: isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 64,
        "the longest suffix of the context matched (and a bound on the draft depth): an int in [1, 64]"),
    "suffix_decoding_max_spec_factor": Option(
        1.0, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0,
        "tokens proposed per step <= max_spec_factor * (matched suffix length): a number > 0"),
    "suffix_decoding_min_token_prob": Option(
        0.1, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1,
        "drop tree nodes whose estimated probability (frequency among the match's continuations) is below "
        "this: a number in [0, 1]"),
    "suffix_decoding_max_cached_requests": Option(
        10000, lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
        "how many earlier requests' outputs the global cache keeps (FIFO; 0 = no global cache): an int >= 0"),
}


def _cache(req: BuildRequest) -> SuffixCache:
    d = req.drafter
    if d is None:
        return global_cache()
    if isinstance(d, str):
        return global_cache(d)
    if isinstance(d, SuffixCache):
        return d
    raise TypeError("method='suffix' takes drafter=None (the process-wide global cache), a cache name (str) or a "
                    f"suffix.SuffixCache, got {type(d).__name__}")


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


def _build(req: BuildRequest):
    cfg = req.config
    cache = _cache(req)
    max_requests = cfg.option("suffix_decoding_max_cached_requests")
    # What a full cache costs per step: every row matches against all of it ([B, C] int32 source, match lengths
    # and masks, ~16 bytes per entry). Refuse a bound this machine cannot hold rather than fail mid-run.
    worst = max_requests * (cfg.max_new_tokens + 1) + req.buffer_len
    need = 16 * worst * len(req.prompts)
    if need > _memory_bytes() // 2:
        raise ValueError(f"suffix_decoding_max_cached_requests={max_requests} is larger than memory allows: a full "
                         f"cache of {max_requests} outputs of up to {cfg.max_new_tokens} tokens, matched by "
                         f"{len(req.prompts)} requests, needs ~{need / 2**30:.1f} GiB per step, more than half of "
                         f"this machine's {_memory_bytes() / 2**30:.1f} GiB; lower it (0 turns the cache off)")
    drafter = SuffixDrafter(cfg.k, cfg.option("suffix_decoding_max_tree_depth"),
                            float(cfg.option("suffix_decoding_max_spec_factor")),
                            float(cfg.option("suffix_decoding_min_token_prob")))
    # Outputs are at most max_new_tokens long: a small bound fixes the array size for good (no recompiles).
    bound = max_requests * (cfg.max_new_tokens + 1) if max_requests > 0 else 0
    min_size = 1 << min(bound, _MIN_CACHE_SLOTS).bit_length()
    return drafter, jnp.asarray(cache.arrays(max_requests, min_size))


def _finish(req: BuildRequest, outputs: list) -> None:
    max_requests = req.config.option("suffix_decoding_max_cached_requests")
    if max_requests > 0:
        _cache(req).add(outputs, max_requests)


def _verify_widths(k: int) -> tuple[int, ...]:
    """A proposal is as long as max_spec_factor times the matched suffix, often 1-2 tokens on open chat: the
    powers of two below k as narrower passes."""
    return tuple(1 << i for i in range(k.bit_length()) if 1 << i < k)


register(DrafterSpec("suffix", _build, accepts="None (the process-wide global cache), a cache name, or a "
                     "suffix.SuffixCache", options=OPTIONS, finish=_finish, verify_widths=_verify_widths))
