"""Acceptance rules. Every function works on a batch; rows accept different numbers of tokens (ragged) while
shapes stay fixed.

Chains (Leviathan et al. 2023, Chen et al. 2023): with draft tokens d_1..d_k drawn from q_1..q_k and the target's
distributions p_1..p_{k+1} (p_i conditions on d_<i), accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); at
the first rejection sample from norm(max(0, p_i - q_i)); if all k are accepted sample the bonus token from p_{k+1}.
The output is distributed exactly as the target's. A deterministic drafter (prompt lookup, predictions) has a
one-hot q, which makes the rule: accept with probability p(d), else sample from p with d removed.

The decode loop calls one function, `accept`, which picks the rule a SpecConfig asks for on a chain or a tree.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from specjax.config import SpecConfig
from specjax.sampling import greedy_token, probabilities, sample
from specjax.trees import Tree, TreeSpec, children_from_parents, mask_from_parents, path_to_node


def leading_true(accept: jax.Array) -> jax.Array:
    """[B, k] bool -> [B] int32: length of the all-True prefix of each row."""
    return jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def _offered(draft_tokens: jax.Array, limit: jax.Array | None) -> jax.Array:
    """[B, k] bool: the drafts each row offers, its first limit[b] (None: all k)."""
    k = draft_tokens.shape[1]
    return jnp.ones(draft_tokens.shape, bool) if limit is None else jnp.arange(k)[None, :] < limit[:, None]


def chain_greedy(draft_tokens: jax.Array, target_logits: jax.Array,
                 limit: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """draft_tokens [B, k], target_logits [B, k+1, V] -> (num_accepted [B], next_token [B]). limit [B]: each row
    offers only its first limit[b] drafts (the result is what a chain of that length gives); None: all k."""
    target_tokens = greedy_token(target_logits)                                     # [B, k+1]
    n = leading_true((draft_tokens == target_tokens[:, :-1]) & _offered(draft_tokens, limit))
    next_token = jnp.take_along_axis(target_tokens, n[:, None], axis=1)[:, 0]
    return n, next_token


def residual_distribution(p: jax.Array, q: jax.Array) -> jax.Array:
    """norm(max(0, p - q)) over the last axis; falls back to p where p == q (rejection then has probability 0)."""
    r = jnp.maximum(p - q, 0.0)
    total = jnp.sum(r, axis=-1, keepdims=True)
    return jnp.where(total > 0, r / jnp.where(total > 0, total, 1.0), p)


def chain_sampled(keys: jax.Array, draft_tokens: jax.Array, draft_probs: jax.Array | None,
                  target_probs: jax.Array, limit: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """keys [B] (one PRNG key per row), draft_tokens [B, k], draft_probs [B, k, V] or None (one-hot drafts),
    target_probs [B, k+1, V] -> (num_accepted [B], next_token [B]). limit [B]: as chain_greedy's; a row's draw is
    then the one a chain of limit[b] drafts gets from its key (the uniforms of its first drafts are the first of
    the k: jax's partitionable threefry draws element i from the key and i alone)."""
    B, k = draft_tokens.shape
    V = target_probs.shape[-1]
    if draft_probs is None:
        draft_probs = jax.nn.one_hot(draft_tokens, V, dtype=target_probs.dtype)
    p_d = jnp.take_along_axis(target_probs[:, :k], draft_tokens[..., None], axis=-1)[..., 0]   # [B, k]
    q_d = jnp.take_along_axis(draft_probs, draft_tokens[..., None], axis=-1)[..., 0]           # [B, k]

    def row(key, p_d, q_d, p, q, offered, lim):
        k_accept, k_next = jax.random.split(key)
        u = jax.random.uniform(k_accept, (k,))
        n = leading_true((u * q_d < p_d) & offered)      # u < p/q without dividing; p == 0 never accepts
        q_n = jnp.where(n < lim, q[jnp.minimum(n, k - 1)], 0.0) if k else 0.0
        dist = residual_distribution(p[n], q_n)          # n == lim: q_n = 0, so this is p_{lim+1} (the bonus)
        return n, sample(k_next, dist)

    lim = jnp.full((B,), k, jnp.int32) if limit is None else limit
    return jax.vmap(row)(keys, p_d, q_d, target_probs, draft_probs, _offered(draft_tokens, limit), lim)


# ---------------------------------------------------------------------------------------------------------------
# Trees. Node 0 is the root (the last committed token); every other node t has a parent < t; target_*[:, t] is
# the target's distribution for the token AFTER node t (it attends to t and t's ancestors), so a child c of t is
# checked against target_*[:, t]. Paths are root-first node indices, -1 padded to max_depth + 1.
# ---------------------------------------------------------------------------------------------------------------

def _tree_parents(parents: jax.Array | TreeSpec, batch: int, num_nodes: int,
                  max_depth: int | None) -> tuple[jax.Array, int]:
    """-> (parents [B, T] int32, static max_depth). A TreeSpec gives both; otherwise max_depth defaults to T - 1."""
    if isinstance(parents, TreeSpec):
        if parents.num_nodes != num_nodes:
            raise ValueError(f"the tree has {parents.num_nodes} nodes, the tokens have {num_nodes} per row")
        max_depth = parents.max_depth if max_depth is None else max_depth
        parents = parents.parents
    parents = jnp.broadcast_to(jnp.asarray(parents, jnp.int32), (batch, num_nodes))
    return parents, (num_nodes - 1 if max_depth is None else max_depth)


def _deepest_accepted(tree_tokens: jax.Array, parents: jax.Array, ok: jax.Array,
                      max_depth: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """ok [B, T]: node t passes its own test (the root always). -> (path, num_accepted, best node): the deepest
    node whose whole root path passes, first in node order on ties."""
    ok = ok | (parents < 0)                                                          # the root is committed
    mask = mask_from_parents(parents)                                                # [B, T, T]
    good = jnp.all(~mask | ok[:, None, :], axis=-1)                                 # [B, T] whole path passes
    depths = jnp.sum(mask, axis=-1).astype(jnp.int32) - 1                            # [B, T]
    best = jnp.argmax(jnp.where(good, depths, -1), axis=1).astype(jnp.int32)        # [B]
    n = jnp.take_along_axis(depths, best[:, None], axis=1)[:, 0]
    return path_to_node(parents, best, max_depth), n, best


def tree_greedy(tree_tokens: jax.Array, parents: jax.Array | TreeSpec, target_logits: jax.Array,
                max_depth: int | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """tree_tokens [B, T] (root first), parents [B, T] / [T] / TreeSpec, target_logits [B, T, V] ->
    (path [B, D+1] root-first node indices, -1 padded; num_accepted [B] drafted nodes on it; next_token [B]).

    The path is the deepest node whose every node matches the target's argmax at its parent (first in node
    order on ties), and next_token is the target's argmax after it.
    """
    B, T = tree_tokens.shape
    parents, max_depth = _tree_parents(parents, B, T, max_depth)
    target_tokens = greedy_token(target_logits)                                     # [B, T]
    wanted = jnp.take_along_axis(target_tokens, jnp.maximum(parents, 0), axis=1)    # [B, T] argmax at parent
    path, n, best = _deepest_accepted(tree_tokens, parents, tree_tokens == wanted, max_depth)
    return path, n, jnp.take_along_axis(target_tokens, best[:, None], axis=1)[:, 0]


# ---------------------------------------------------------------------------------------------------------------
# LOSSY: Medusa's typical acceptance (Cai et al. 2024, Sec. 2.3.1). Opt-in via
# SpecConfig(acceptance_method="typical_lossy"); the output is NOT distributed as the target's.
# ---------------------------------------------------------------------------------------------------------------

def typical_threshold(p: jax.Array, posterior_threshold: float, posterior_alpha: float) -> jax.Array:
    """p [..., V] -> [...]: min(epsilon, delta * exp(-H(p))), the probability a draft token must exceed."""
    entropy = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), axis=-1)
    return jnp.minimum(posterior_threshold, posterior_alpha * jnp.exp(-entropy))


def chain_typical_lossy(keys: jax.Array, draft_tokens: jax.Array, target_probs: jax.Array,
                        posterior_threshold: float, posterior_alpha: float,
                        limit: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """LOSSY. keys [B], draft_tokens [B, k], target_probs [B, k+1, V] -> (num_accepted, next_token): accept the
    longest prefix whose every token has target probability above the typical threshold, then sample the next
    token from the target's distribution there. limit: as chain_greedy's."""
    k = draft_tokens.shape[1]
    p_d = jnp.take_along_axis(target_probs[:, :k], draft_tokens[..., None], axis=-1)[..., 0]   # [B, k]
    typical = p_d > typical_threshold(target_probs[:, :k], posterior_threshold, posterior_alpha)
    n = leading_true(typical & _offered(draft_tokens, limit))
    p_next = jnp.take_along_axis(target_probs, n[:, None, None], axis=1)[:, 0]                  # [B, V]
    return n, jax.vmap(sample)(keys, p_next)


def tree_typical_lossy(keys: jax.Array, tree_tokens: jax.Array, parents: jax.Array | TreeSpec,
                       target_probs: jax.Array, posterior_threshold: float, posterior_alpha: float,
                       max_depth: int | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """LOSSY. The tree form of chain_typical_lossy (what the Medusa repository runs on its candidate paths):
    the deepest node whose every token passes the typical test at its parent, then a sample from the target's
    distribution after it. Returns what tree_greedy returns."""
    B, T = tree_tokens.shape
    parents, max_depth = _tree_parents(parents, B, T, max_depth)
    at_parent = jnp.take_along_axis(target_probs, jnp.maximum(parents, 0)[..., None], axis=1)     # [B, T, V]
    p_tok = jnp.take_along_axis(at_parent, tree_tokens[..., None], axis=-1)[..., 0]              # [B, T]
    ok = p_tok > typical_threshold(at_parent, posterior_threshold, posterior_alpha)
    path, n, best = _deepest_accepted(tree_tokens, parents, ok, max_depth)
    p_next = jnp.take_along_axis(target_probs, best[:, None, None], axis=1)[:, 0]
    nxt = jax.vmap(sample)(keys, p_next)
    return path, n, nxt


def tree_sampled(keys: jax.Array, tree_tokens: jax.Array, parents: jax.Array | TreeSpec,
                 draft_probs: jax.Array | None, target_probs: jax.Array,
                 max_depth: int | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Multi-draft recursive rejection sampling (SpecInfer; EAGLE): the output is distributed as the target's.

    keys [B], tree_tokens [B, T], parents [B, T] / [T] / TreeSpec, target_probs [B, T, V]; returns what
    tree_greedy returns. Starting at the root with p = target_probs[node], try the node's children in rank
    (index) order; accept child c (token x) with probability min(1, p(x) / q_c(x)), then descend into c with
    p = target_probs[c]. On rejection p <- norm(max(0, p - q_c)) (residual_distribution). When every child is
    rejected, sample from the residual; at an accepted leaf, sample the bonus token from its p. Each sibling
    test is an ordinary speculative-sampling step for p_c against q_c, and p_{c+1} (the residual) does not
    depend on which token was drafted, so by induction from the last sibling each level outputs p.

    Which q_c the children of a node were drafted from (draft_probs decides; both cases are exact):
      (a) draft_probs None: deterministic children (top-k of the drafter, any fixed rule). q_c = one_hot(x_c):
          accept with probability p(x_c); on rejection p loses x_c and is renormalised.
      (b) draft_probs [B, T, V]: children of node t sampled WITHOUT replacement from q = draft_probs[:, t]
          (e.g. Gumbel top-k), in sampling order. Sibling c's token is then distributed as q with the earlier
          siblings' tokens removed and renormalised, so that is q_c (a child with q_c(x) = 0, e.g. support
          exhausted, is skipped). The residual uses the same q_c.
    """
    B, T = tree_tokens.shape
    V = target_probs.shape[-1]
    parents, max_depth = _tree_parents(parents, B, T, max_depth)
    kids = children_from_parents(parents, T - 1 if T > 1 else 1)                       # [B, T, C]
    C = kids.shape[-1]
    one_hot = draft_probs is None
    if one_hot:                                                                      # never read; keeps one loop
        draft_probs = jnp.zeros((B, 1, 1), target_probs.dtype)

    def row(key, tokens, kids, q_all, p_all):              # one row: tokens [T], kids [T, C], p_all [T, V]
        k_accept, k_next = jax.random.split(key)
        u = jax.random.uniform(k_accept, (T,))             # one uniform per node: each is tested at most once

        def level(s):                                      # test `node`'s children; descend or stop
            node, p, q, _ = s

            def try_child(t):
                j, p, q, _ = t
                c = kids[node, j]
                x = tokens[c]
                if one_hot:
                    accept = u[c] < p[x]
                    p = jnp.where(accept, p, residual_distribution(p, jax.nn.one_hot(x, V, dtype=p.dtype)))
                else:
                    qx = q[x]
                    accept = (qx > 0) & (u[c] * qx < p[x])  # u < p/q without dividing
                    p = jnp.where(accept | (qx == 0), p, residual_distribution(p, q))
                    q = jnp.where(jnp.arange(V) == x, 0.0, q)   # the next sibling was drawn without x
                    q = q / jnp.maximum(jnp.sum(q), 1e-30)
                return j + 1, p, q, jnp.where(accept, c, -1)

            more = lambda t: (t[0] < C) & (t[3] < 0) & (kids[node, jnp.minimum(t[0], C - 1)] >= 0)
            _, p, _, chosen = lax.while_loop(more, try_child, (jnp.int32(0), p, q, jnp.int32(-1)))
            down = chosen >= 0
            node = jnp.where(down, chosen, node)
            return node, jnp.where(down, p_all[node], p), q_all[0 if one_hot else node], ~down

        node, p, _, _ = lax.while_loop(lambda s: ~s[3], level,
                                       (jnp.int32(0), p_all[0], q_all[0], jnp.bool_(False)))
        return node, sample(k_next, p)

    node, next_token = jax.vmap(row)(keys, tree_tokens, kids, draft_probs, target_probs)
    path = path_to_node(parents, node, max_depth)
    n = jnp.sum(path >= 0, axis=1).astype(jnp.int32) - 1
    return path, n, next_token


# ---------------------------------------------------------------------------------------------------------------
# The decode loop's one entry point: which rule a config asks for, on a chain or a tree.
# ---------------------------------------------------------------------------------------------------------------

class Accepted(NamedTuple):
    num_accepted: jax.Array       # [B] drafted tokens accepted (a tree: drafted nodes on the accepted path)
    next_token: jax.Array         # [B] the target's token after them
    path: jax.Array | None        # a tree: [B, D+1] root-first node indices of the accepted path, -1 padded


def accept(spec: SpecConfig, keys: jax.Array, draft_tokens: jax.Array, draft_probs: jax.Array | None,
           target_logits: jax.Array, tree: Tree | None = None, limit: jax.Array | None = None) -> Accepted:
    """The acceptance rule `spec` asks for: greedy at temperature 0 (the target's argmax decides), else its
    acceptance_method: "exact" speculative sampling (chain_sampled / tree_sampled) or Medusa's "typical_lossy".

    A chain (tree None): keys [B], draft_tokens [B, k], draft_probs [B, k, V] or None (deterministic drafts),
    target_logits [B, k+1, V]. A tree: its T = k + 1 nodes (root first), draft_probs [B, T, V] or None as
    tree_sampled takes them, target_logits [B, T, V]; draft_tokens (its nodes past the root) are not read.
    limit [B] or None: each row offers only its first limit[b] drafts (a tree: nodes 1..limit[b]; the others are
    cut off it), and gets what a pass over only those gives it from its key (a row's result does not depend on
    how much wider its batch mates made the pass)."""
    sp = spec.sampling
    if tree is None:
        if sp.greedy:
            n, nxt = chain_greedy(draft_tokens, target_logits, limit)
        elif spec.acceptance_method == "typical_lossy":
            n, nxt = chain_typical_lossy(keys, draft_tokens, probabilities(target_logits, sp),
                                         spec.posterior_threshold, spec.posterior_alpha, limit)
        else:
            n, nxt = chain_sampled(keys, draft_tokens, draft_probs, probabilities(target_logits, sp), limit)
        return Accepted(n, nxt, None)
    parents = tree.parents
    if limit is not None:             # a node past the limit has no parent: never on a path from the root
        parents = jnp.where(jnp.arange(parents.shape[1])[None, :] <= limit[:, None], parents, -1)
    if sp.greedy:
        path, n, nxt = tree_greedy(tree.tokens, parents, target_logits, tree.max_depth)
    elif spec.acceptance_method == "typical_lossy":
        path, n, nxt = tree_typical_lossy(keys, tree.tokens, parents, probabilities(target_logits, sp),
                                          spec.posterior_threshold, spec.posterior_alpha, tree.max_depth)
    else:
        path, n, nxt = tree_sampled(keys, tree.tokens, parents, draft_probs, probabilities(target_logits, sp),
                                    tree.max_depth)
    return Accepted(n, nxt, path)
