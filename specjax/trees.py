"""Token trees as fixed-shape arrays: static trees from Medusa/EAGLE "choices", dynamic EAGLE-2 trees, masks
and root-to-node paths.

Conventions (those of the Medusa, EAGLE and SGLang implementations, so their tree choices load unchanged):
  - node 0 is the root: the last committed token, not yet in the KV cache; it is verified with the tree
  - every other node t has a parent p < t, so node order is a topological order (parents first)
  - mask[i, j]: node i attends to node j iff j is i itself or one of its ancestors (the root included)
  - positions of the tree tokens = start + depths (root depth 0 at position start)
  - -1 pads: the root's parent, and path/children arrays shorter than their width
"""
from __future__ import annotations

import dataclasses
import heapq
from itertools import product
from typing import Optional, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Choice = tuple[int, ...]

# ---------------------------------------------------------------------------------------------------------------
# Static trees
# ---------------------------------------------------------------------------------------------------------------

# Medusa repo (FasterDecoding/Medusa, medusa/model/medusa_choices.py) `mc_sim_7b_63`: the tree found by Medusa's
# simulated-acceptance search for Vicuna-7B; 63 nodes plus the implicit root. Each tuple is the top-k rank of the
# token at every depth along the path from the root. (EAGLE's repo has a different list under the same name.)
MEDUSA_63: tuple[Choice, ...] = (
    (0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0), (0, 2), (3,), (0, 3), (4,), (0, 4), (2, 0), (0, 5),
    (0, 0, 1), (5,), (0, 6), (6,), (0, 7), (0, 1, 0), (1, 1), (7,), (0, 8), (0, 0, 2), (3, 0), (0, 9), (8,),
    (9,), (1, 0, 0), (0, 2, 0), (1, 2), (0, 0, 3), (4, 0), (2, 1), (0, 0, 4), (0, 0, 5), (0, 0, 0, 0),
    (0, 1, 1), (0, 0, 6), (0, 3, 0), (5, 0), (1, 3), (0, 0, 7), (0, 0, 8), (0, 0, 9), (6, 0), (0, 4, 0),
    (1, 4), (7, 0), (0, 1, 2), (2, 0, 0), (3, 1), (2, 2), (8, 0), (0, 5, 0), (1, 5), (1, 0, 1), (0, 2, 1),
    (9, 0), (0, 6, 0), (0, 0, 0, 1), (1, 6), (0, 7, 0),
)


def chain_choices(k: int) -> list[Choice]:
    """A chain of k drafted tokens (top-1 at every depth): [(0,), (0, 0), ...]."""
    if not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"a chain needs k >= 1 drafted tokens, got {k!r}")
    return [(0,) * d for d in range(1, k + 1)]


def full_tree_choices(depth: int, branching: int) -> list[Choice]:
    """Every path of length 1..depth with ranks < branching: branching + branching^2 + ... nodes."""
    if depth < 1 or branching < 1:
        raise ValueError(f"depth and branching must be >= 1, got depth={depth}, branching={branching}")
    return [c for d in range(1, depth + 1) for c in product(range(branching), repeat=d)]


def choices_from_accuracies(rank_accuracy: Sequence[Sequence[float]], num_nodes: int) -> tuple[Choice, ...]:
    """The tree of num_nodes drafted nodes that maximises the expected number of accepted tokens when the drafter
    at depth d puts the right token at rank r with probability rank_accuracy[d][r] independently of the path
    (Medusa's construction from measured per-head top-k accuracies). A node's value is the product of its
    path's accuracies; best-first search adds the most valuable node whose parent is in the tree, which is
    optimal because a child is never worth more than its parent."""
    acc = [list(map(float, row)) for row in rank_accuracy]
    if not acc or any(not row or min(row) < 0 or max(row) > 1 for row in acc):
        raise ValueError("rank_accuracy must be a non-empty [depth][rank] table of probabilities in [0, 1]")
    if num_nodes < 1:
        raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
    heap = [(-acc[0][r], (r,)) for r in range(len(acc[0]))]
    heapq.heapify(heap)
    chosen: list[Choice] = []
    while heap and len(chosen) < num_nodes:
        neg, node = heapq.heappop(heap)
        chosen.append(node)
        if len(node) < len(acc):
            for r, a in enumerate(acc[len(node)]):
                heapq.heappush(heap, (neg * a, node + (r,)))
    return normalize_choices(chosen)


def normalize_choices(choices: Sequence[Sequence[int]], max_depth: Optional[int] = None,
                      max_nodes: Optional[int] = None) -> tuple[Choice, ...]:
    """Validate choices and sort them breadth-first: by depth, then lexicographically (the Medusa repo's order).

    Raises ValueError for an empty list, a malformed or negative rank, a duplicate node, a node whose parent
    path is missing, a node deeper than max_depth, or more than max_nodes nodes including the root (the cache
    headroom a step may write).
    """
    if choices is None or len(choices) == 0:
        raise ValueError("choices is empty: a tree needs at least one node besides the root "
                         "(use chain_choices(k) for a chain)")
    seen: set[Choice] = set()
    for i, c in enumerate(choices):
        if isinstance(c, (str, bytes)) or not isinstance(c, Sequence) or len(c) == 0:
            raise ValueError(f"choice #{i} {c!r} must be a non-empty tuple of top-k ranks")
        if not all(isinstance(r, (int, np.integer)) and not isinstance(r, bool) for r in c):
            raise ValueError(f"choice #{i} {c!r} must contain int ranks")
        node = tuple(int(r) for r in c)
        if min(node) < 0:
            raise ValueError(f"choice #{i} {node} has a negative rank")
        if node in seen:
            raise ValueError(f"duplicate node {node} in choices")
        if max_depth is not None and len(node) > max_depth:
            raise ValueError(f"node {node} has depth {len(node)} > max_depth {max_depth}")
        seen.add(node)
    for node in seen:
        if len(node) > 1 and node[:-1] not in seen:
            raise ValueError(f"node {node} has no parent: {node[:-1]} is missing from choices")
    if max_nodes is not None and len(seen) + 1 > max_nodes:
        raise ValueError(f"tree has {len(seen) + 1} nodes (root included) > max_nodes {max_nodes}")
    return tuple(sorted(seen, key=lambda c: (len(c), c)))


def _readonly(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


def draft_depth(tree: "TreeSpec | None", num_steps: int | None, k: int) -> int:
    """How many tokens deep one proposal drafts: a static tree's depth, a dynamic tree's search steps, else the
    chain's k (what a drafter whose distributions depend on the depth only must produce at once)."""
    return tree.max_depth if tree is not None else num_steps or k


@dataclasses.dataclass(frozen=True, eq=False)
class TreeSpec:
    """A static token tree. Hashable and compared by its choices, so it can be a static argument of jax.jit.

    Build with TreeSpec.from_choices(choices). T = num_nodes (root included), D = max_depth.
    """
    choices: tuple[Choice, ...]     # sorted breadth-first; node t (t >= 1) is choices[t - 1]
    parents: np.ndarray             # [T] int32, root -1
    depths: np.ndarray              # [T] int32, root 0 (the position offset of each node)
    ranks: np.ndarray               # [T] int32, top-k rank among siblings (root 0, so it is safe to gather)
    mask: np.ndarray                # [T, T] bool, node i sees j iff j is i or an ancestor of i
    retrieve_indices: np.ndarray    # [num_leaves, D + 1] int32, root-to-leaf node indices, -1 padded
    children: np.ndarray            # [T, max_children] int32, ordered by rank, -1 padded

    @classmethod
    def from_choices(cls, choices: Sequence[Sequence[int]], max_depth: Optional[int] = None,
                     max_nodes: Optional[int] = None) -> "TreeSpec":
        nodes = normalize_choices(choices, max_depth, max_nodes)
        t = len(nodes) + 1
        index = {(): 0}
        index.update({c: i + 1 for i, c in enumerate(nodes)})
        parents = np.array([-1] + [index[c[:-1]] for c in nodes], np.int32)
        depths = np.array([0] + [len(c) for c in nodes], np.int32)
        ranks = np.array([0] + [c[-1] for c in nodes], np.int32)

        mask = np.eye(t, dtype=bool)
        for i in range(1, t):                          # parents come first, so their rows are complete
            mask[i] |= mask[parents[i]]

        kids: list[list[int]] = [[] for _ in range(t)]
        for i in range(1, t):                          # breadth-first lexicographic order = rank order
            kids[parents[i]].append(i)
        width = max(len(k) for k in kids)
        children = np.full((t, width), -1, np.int32)
        for i, k in enumerate(kids):
            children[i, :len(k)] = k

        leaves = [i for i in range(t) if not kids[i]]  # in node order
        d = int(depths.max())
        retrieve = np.full((len(leaves), d + 1), -1, np.int32)
        for row, leaf in enumerate(leaves):
            path = np.flatnonzero(mask[leaf])          # ancestors have smaller indices and smaller depths
            retrieve[row, :len(path)] = path
        return cls(nodes, *(_readonly(a) for a in (parents, depths, ranks, mask, retrieve, children)))

    @property
    def num_nodes(self) -> int:
        return len(self.choices) + 1

    @property
    def max_depth(self) -> int:
        return int(self.depths.max())

    @property
    def num_leaves(self) -> int:
        return self.retrieve_indices.shape[0]

    @property
    def topk(self) -> int:
        """How many top-k candidates per depth the drafter must produce to fill this tree."""
        return int(self.ranks.max()) + 1

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TreeSpec) and self.choices == other.choices

    def __hash__(self) -> int:
        return hash(self.choices)

    def __repr__(self) -> str:
        return f"TreeSpec(num_nodes={self.num_nodes}, max_depth={self.max_depth}, num_leaves={self.num_leaves})"


# ---------------------------------------------------------------------------------------------------------------
# Per-row trees (jnp): the form the decode loop consumes, static or dynamic
# ---------------------------------------------------------------------------------------------------------------

@flax.struct.dataclass
class Tree:
    """A batch of token trees with T nodes per row; root at index 0; parents[b, t] < t for t >= 1."""
    tokens: jax.Array    # [B, T] int32, tokens[:, 0] = the root (last committed token)
    parents: jax.Array   # [B, T] int32, root -1
    depths: jax.Array    # [B, T] int32, root 0
    mask: jax.Array      # [B, T, T] bool, node sees itself and its ancestors
    scores: jax.Array    # [B, T] float32, cumulative draft log-prob of each node (root 0; 0 for static trees)
    source: jax.Array    # [B, T] int32, flat candidate index each node came from (root -1); static: t - 1
    # Static bound on node depth: verification walks this many levels and returns paths of max_depth + 1 nodes.
    # None = unknown (consumers fall back to T - 1, enough for any tree).
    max_depth: Optional[int] = flax.struct.field(pytree_node=False, default=None)


def tree_from_spec(spec: TreeSpec, tokens: jax.Array) -> Tree:
    """Per-row arrays of a static tree filled with tokens [B, T] (root token first)."""
    b, t = tokens.shape
    if t != spec.num_nodes:
        raise ValueError(f"tokens has {t} nodes per row, the tree has {spec.num_nodes}")
    rows = lambda a: jnp.broadcast_to(jnp.asarray(a), (b,) + a.shape)
    return Tree(tokens=tokens.astype(jnp.int32), parents=rows(spec.parents), depths=rows(spec.depths),
                mask=rows(spec.mask), scores=jnp.zeros((b, t), jnp.float32),
                source=rows(np.arange(-1, t - 1, dtype=np.int32)), max_depth=spec.max_depth)


def first_nodes(tree: Tree, num_nodes: int) -> Tree:
    """The tree of the first num_nodes nodes of every row (root included): a tree again, since each node's parent
    precedes it."""
    cut = lambda a: a[:, :num_nodes]
    depth = num_nodes - 1 if tree.max_depth is None else min(tree.max_depth, num_nodes - 1)
    return Tree(tokens=cut(tree.tokens), parents=cut(tree.parents), depths=cut(tree.depths),
                mask=tree.mask[:, :num_nodes, :num_nodes], scores=cut(tree.scores), source=cut(tree.source),
                max_depth=depth)


def _walk_up(parents: jax.Array, start: jax.Array, steps: int) -> jax.Array:
    """[..., N, steps + 1] of start, parent(start), parent(parent(start)), ..., -1 once past the root.

    parents [..., T]; start [..., N] node indices (-1 allowed: yields all -1).
    """
    out = [start]
    cur = start
    for _ in range(steps):                             # steps <= tree depth: small, unrolled
        up = jnp.take_along_axis(parents, jnp.maximum(cur, 0), axis=-1)
        cur = jnp.where(cur >= 0, up, -1)
        out.append(cur)
    return jnp.stack(out, axis=-1)


def mask_from_parents(parents: jax.Array) -> jax.Array:
    """parents [..., T] (root -1) -> ancestor mask [..., T, T] bool: node i sees j iff j is i or an ancestor.

    Walks every node up T - 1 steps (enough for any tree, including a chain), inside a fori_loop so the
    compiled size does not grow with T. Does not need parent < child.
    """
    t = parents.shape[-1]
    iota = jnp.arange(t, dtype=parents.dtype)
    cur0 = jnp.broadcast_to(iota, parents.shape)                     # [..., T]
    mask0 = jnp.broadcast_to(jnp.eye(t, dtype=bool), parents.shape + (t,))

    def body(_, carry):
        cur, mask = carry
        up = jnp.take_along_axis(parents, jnp.maximum(cur, 0), axis=-1)
        cur = jnp.where(cur >= 0, up, -1)
        return cur, mask | (cur[..., None] == iota)                   # -1 matches no column

    return lax.fori_loop(0, t - 1, body, (cur0, mask0))[1]


def depths_from_parents(parents: jax.Array) -> jax.Array:
    """parents [..., T] -> depths [..., T] (root 0)."""
    return mask_from_parents(parents).sum(-1).astype(jnp.int32) - 1


def is_leaf(parents: jax.Array) -> jax.Array:
    """parents [..., T] -> [..., T] bool: no node names this one as its parent."""
    t = parents.shape[-1]
    return ~jnp.any(parents[..., :, None] == jnp.arange(t), axis=-2)


def children_from_parents(parents: jax.Array, width: int) -> jax.Array:
    """parents [..., T] -> children [..., T, width] int32: each node's children in index order, -1 padded.

    Index order is rank order for static trees (breadth-first lexicographic) and for build_dynamic_tree
    (candidates of one parent are its top-K in descending draft probability). width must be >= the largest
    number of children of any node (static); extra children would be dropped.
    """
    t = parents.shape[-1]
    iota = jnp.arange(t, dtype=jnp.int32)
    is_child = parents[..., None, :] == iota[:, None]                   # [..., T parent, T child]
    key = jnp.where(is_child, -iota, -t)                               # top_k picks the smallest indices first
    vals, idx = lax.top_k(key, min(width, t))
    kids = jnp.where(vals > -t, idx, -1).astype(jnp.int32)
    if width > t:
        kids = jnp.concatenate([kids, jnp.full(kids.shape[:-1] + (width - t,), -1, jnp.int32)], axis=-1)
    return kids


def path_to_node(parents: jax.Array, node: jax.Array, max_depth: int) -> jax.Array:
    """Root-to-node path of node indices, -1 padded: parents [..., T], node [...] -> [..., max_depth + 1].

    The decode loop uses it on the accepted node: the path is the accepted tokens and the KV slots to compact.
    max_depth must be >= the node's depth (static).
    """
    up = _walk_up(parents, node[..., None], max_depth)[..., 0, :]     # [..., D + 1] node first, then -1
    return _reverse_valid(up)


def paths_from_parents(parents: jax.Array, max_depth: int) -> jax.Array:
    """Root-to-node paths for every node: parents [..., T] -> [..., T, max_depth + 1], -1 padded.

    Row t is the path to node t; rows of the leaves are the static tree's retrieve_indices.
    """
    t = parents.shape[-1]
    start = jnp.broadcast_to(jnp.arange(t, dtype=parents.dtype), parents.shape)
    return _reverse_valid(_walk_up(parents, start, max_depth))


def _reverse_valid(up: jax.Array) -> jax.Array:
    """[..., L] node-to-root lists (then -1s) -> root-to-node lists (then -1s)."""
    n_valid = (up >= 0).sum(-1, keepdims=True)                       # [..., 1] = depth + 1
    idx = n_valid - 1 - jnp.arange(up.shape[-1])                     # [..., L]
    return jnp.where(idx >= 0, jnp.take_along_axis(up, jnp.maximum(idx, 0), axis=-1), -1)


# ---------------------------------------------------------------------------------------------------------------
# Dynamic trees (EAGLE-2)
# ---------------------------------------------------------------------------------------------------------------

def expand_frontier(parent_scores: jax.Array, child_logp: jax.Array, width: int) -> tuple[jax.Array, jax.Array,
                                                                                          jax.Array]:
    """One EAGLE-2 expansion step, run by the drafter between draft passes.

    parent_scores [B, W]: cumulative log-prob of each frontier node (-inf for an empty slot).
    child_logp [B, W, K]: per-step log-probs of each frontier node's top-K children.
    Returns cum [B, W, K] (cumulative child scores), next_parent [B, width] (flat index w * K + k of the children
    to expand next, best first) and next_scores [B, width]. At depth 0 pass parent_scores = [0, -inf, ...]: the
    root sits in slot 0 and the other slots are empty. Needs K >= width so no empty slot is ever picked.
    """
    b, w, k = child_logp.shape
    if k < width:
        raise ValueError(f"need K >= width to fill the frontier from the root, got K={k}, width={width}")
    cum = parent_scores[:, :, None] + child_logp                    # [B, W, K]
    next_scores, next_parent = lax.top_k(cum.reshape(b, w * k), width)
    return cum, next_parent.astype(jnp.int32), next_scores


# Valid candidates never score below this, so an -inf log-prob (e.g. cut by top-p) still outranks padding.
_SCORE_FLOOR = -1e30


def build_dynamic_tree(root_token: jax.Array, cand_tokens: jax.Array, cand_logp: jax.Array,
                       frontier_parent: jax.Array, num_nodes: int, cumulative: bool = False) -> Tree:
    """Rerank an EAGLE-2 expansion into a fixed-size tree: the root plus the num_nodes - 1 candidates with the
    highest cumulative draft log-prob.

    Inputs (D = depth, W = frontier width, K = children per frontier node):
      root_token [B]: the last committed token (node 0).
      cand_tokens [B, D, W, K]: at depth d, the top-K child tokens of frontier slot w.
      cand_logp [B, D, W, K]: their log-probs: per-step log q(child | path) by default, or already cumulative
        (sum along the path) when cumulative=True (expand_frontier's `cum`).
      frontier_parent [B, D, W]: for d >= 1, which depth d-1 candidate frontier slot w is, as a flat index
        w' * K + k' into depth d-1's [W, K] (expand_frontier's next_parent). At depth 0 the frontier is the root
        in slot 0: slots 1..W-1 of depth 0 and frontier_parent[:, 0] are ignored.
    Output: a Tree with T = num_nodes, nodes in candidate order (depth-major, as EAGLE-2's sorted indices), so
    parent index < child index. Ties go to the earlier candidate.

    The top set is closed under ancestors because a child's cumulative log-prob never exceeds its parent's; as a
    guard against unnormalised scores (log-prob > 0) a node's ranking score is capped at its parent's.
    """
    b, d, w, k = cand_tokens.shape
    n_valid = k + (d - 1) * w * k
    if not 1 <= num_nodes - 1 <= n_valid:
        raise ValueError(f"num_nodes={num_nodes} needs 1..{n_valid} candidates besides the root "
                         f"(depth {d}, width {w}, top-k {k})")
    logp = cand_logp.astype(jnp.float32)

    cum, rank_score = [], []                                         # per depth: [B, W, K]
    parent_cum = jnp.zeros((b, w), jnp.float32)
    parent_rank = jnp.zeros((b, w), jnp.float32)
    for depth in range(d):                                           # D is small and static
        if depth > 0:
            fp = frontier_parent[:, depth].astype(jnp.int32)         # [B, W]
            parent_cum = jnp.take_along_axis(cum[-1].reshape(b, w * k), fp, axis=1)
            parent_rank = jnp.take_along_axis(rank_score[-1].reshape(b, w * k), fp, axis=1)
        c = logp[:, depth] if cumulative else logp[:, depth] + parent_cum[:, :, None]
        cum.append(c)
        rank_score.append(jnp.minimum(jnp.maximum(c, _SCORE_FLOOR), parent_rank[:, :, None]))
    cum = jnp.stack(cum, axis=1).reshape(b, d * w * k)               # [B, N]
    key = jnp.stack(rank_score, axis=1)                              # [B, D, W, K]
    key = key.at[:, 0, 1:].set(-jnp.inf).reshape(b, d * w * k)       # empty depth-0 slots never win

    # Global flat index of every candidate's parent candidate (-1: the root).
    fp = frontier_parent.astype(jnp.int32)
    parent_flat = jnp.where(jnp.arange(d)[None, :, None] == 0, -1,
                            (jnp.arange(d)[None, :, None] - 1) * w * k + fp)          # [B, D, W]
    parent_flat = jnp.broadcast_to(parent_flat[..., None], (b, d, w, k)).reshape(b, d * w * k)

    _, top = lax.top_k(key, num_nodes - 1)                           # [B, n] lower index first on ties
    chosen = jnp.sort(top, axis=-1).astype(jnp.int32)                # [B, n] candidate order = topological
    node_of = jnp.full((b, d * w * k), -1, jnp.int32)
    node_of = node_of.at[jnp.arange(b)[:, None], chosen].set(jnp.arange(1, num_nodes, dtype=jnp.int32))
    par_cand = jnp.take_along_axis(parent_flat, chosen, axis=1)      # [B, n]
    par_node = jnp.where(par_cand < 0, 0, jnp.take_along_axis(node_of, jnp.maximum(par_cand, 0), axis=1))

    neg1 = jnp.full((b, 1), -1, jnp.int32)
    tokens = jnp.take_along_axis(cand_tokens.reshape(b, d * w * k), chosen, axis=1)
    parents = jnp.concatenate([neg1, par_node], axis=1)
    depths = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), chosen // (w * k) + 1], axis=1)
    return Tree(tokens=jnp.concatenate([root_token.reshape(b, 1), tokens], axis=1).astype(jnp.int32),
                parents=parents, depths=depths, mask=mask_from_parents(parents),
                scores=jnp.concatenate([jnp.zeros((b, 1)), jnp.take_along_axis(cum, chosen, axis=1)], axis=1),
                source=jnp.concatenate([neg1, chosen], axis=1), max_depth=d)
