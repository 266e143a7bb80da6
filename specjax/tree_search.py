"""Tree search: how every tree-drafting drafter turns its draft distributions into a token tree.

Three searches, all fixed-shape and jit-compatible:
  - `static_tree`: a fixed TreeSpec (Medusa/EAGLE choices) filled depth by depth; a node of rank r gets its
    parent's r-th most likely child under the drafter (SpecInfer, EAGLE-1 static trees).
  - `static_tree_from_candidates`: a fixed TreeSpec filled from per-depth candidate lists that do not depend on
    the parent (Medusa: head d's top-k tokens are the candidates at depth d for every parent).
  - `dynamic_tree`: EAGLE-2: keep a frontier of the `topk` best nodes by cumulative draft log-probability,
    expand each into its `topk` children for `num_steps` depths, then rerank all candidates and keep the best
    num_nodes - 1 (trees.build_dynamic_tree).
`tree_from_position_logits` runs the first or the last for drafters whose distributions depend on the depth only.

The drafter supplies one callback, `node_logits(state, tokens, parents, depths) -> (logits, state)`: the draft
logits [B, n, V] after each of n new nodes (tokens [B, n]; parents [B, n] index into the concatenation of all nodes
passed to node_logits so far in this search, -1 = the root; depths [n]: the nodes' depth, 1 = child of the root).
`state` is the drafter's own (e.g. the nodes fed so far, or a KV cache holding them); the search threads it
through and returns it. Children are deterministic top-k (verify.tree_sampled case (a)), exact at any temperature.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from specjax.trees import Tree, TreeSpec, build_dynamic_tree, expand_frontier, mask_from_parents, tree_from_spec

NodeLogits = Callable[[Any, jax.Array, jax.Array, np.ndarray], tuple[jax.Array, Any]]


def static_tree(spec: TreeSpec, root: jax.Array, root_logits: jax.Array, node_logits: NodeLogits,
                state: Any = None) -> tuple[Tree, Any]:
    """root [B], root_logits [B, V] (draft logits after the root) -> (Tree of spec.num_nodes nodes, state).

    Nodes are fed to node_logits one depth at a time in node order, so block index = node index - 1."""
    B = root.shape[0]
    ends = np.searchsorted(spec.depths, np.arange(spec.max_depth + 1), side="right")    # nodes of depth <= d
    tokens = jnp.zeros((B, spec.num_nodes), jnp.int32).at[:, 0].set(root)
    logits = root_logits[:, None]                                           # [B, n, V] after depth d-1 nodes
    first = 0                                                               # node index of logits[:, 0]
    for d in range(1, spec.max_depth + 1):
        top = lax.top_k(logits, spec.topk)[1].astype(jnp.int32)             # [B, n, K]
        nodes = np.arange(ends[d - 1], ends[d])                              # depth d, breadth-first order
        tokens = tokens.at[:, nodes].set(top[:, spec.parents[nodes] - first, spec.ranks[nodes]])
        if d < spec.max_depth:                                               # the deepest nodes have no children
            parents = np.broadcast_to(spec.parents[nodes] - 1, (B, len(nodes)))
            logits, state = node_logits(state, tokens[:, nodes], jnp.asarray(parents, jnp.int32),
                                        np.full(len(nodes), d, np.int32))
            first = int(nodes[0])
    return tree_from_spec(spec, tokens), state


def static_tree_from_candidates(spec: TreeSpec, root: jax.Array, candidates: jax.Array) -> Tree:
    """root [B], candidates [B, D, K] (the top-K tokens proposed for depth d + 1, best first) -> Tree.
    A node of depth d and rank r holds candidates[:, d - 1, r], whatever its parent."""
    B, D, K = candidates.shape
    if D < spec.max_depth or K < spec.topk:
        raise ValueError(f"the tree needs candidates for {spec.max_depth} depths x top-{spec.topk}, got "
                         f"{D} depths x top-{K}")
    depth_idx = np.maximum(spec.depths - 1, 0)
    picked = candidates[:, depth_idx, spec.ranks]                           # [B, T]
    tokens = jnp.where(jnp.arange(spec.num_nodes) == 0, root[:, None], picked)
    return tree_from_spec(spec, tokens)


def dynamic_tree(root: jax.Array, root_logits: jax.Array, node_logits: NodeLogits, num_steps: int, topk: int,
                 num_nodes: int, state: Any = None) -> tuple[Tree, Any]:
    """EAGLE-2 search -> (Tree of num_nodes nodes, state). node_logits sees the frontier (topk nodes) of each
    depth 1 .. num_steps - 1; its parents index the frontier block of the depth before (-1 at depth 1)."""
    B, W = root.shape[0], topk
    logp, tok = lax.top_k(jax.nn.log_softmax(root_logits), W)              # [B, K] children of the root
    cand_tok, cand_logp = [jnp.broadcast_to(tok[:, None], (B, W, W))], [jnp.broadcast_to(logp[:, None], (B, W, W))]
    frontier_parent = [jnp.zeros((B, W), jnp.int32)]                       # unused at depth 0
    start = jnp.where(jnp.arange(W) == 0, 0.0, -jnp.inf)                   # the root sits in slot 0
    _, nxt, scores = expand_frontier(jnp.broadcast_to(start, (B, W)), cand_logp[0], W)
    for d in range(1, num_steps):
        frontier = jnp.take_along_axis(cand_tok[-1].reshape(B, W * W), nxt, axis=1)          # [B, W]
        parents = jnp.full((B, W), -1, jnp.int32) if d == 1 else (d - 2) * W + nxt // W
        frontier_parent.append(nxt)
        logits, state = node_logits(state, frontier, parents, np.full(W, d, np.int32))      # [B, W, V]
        logp, tok = lax.top_k(jax.nn.log_softmax(logits), W)                # [B, W, K]
        cand_tok.append(tok)
        cand_logp.append(logp)
        _, nxt, scores = expand_frontier(scores, logp, W)
    tree = build_dynamic_tree(root, jnp.stack(cand_tok, 1).astype(jnp.int32), jnp.stack(cand_logp, 1),
                              jnp.stack(frontier_parent, 1), num_nodes)
    return tree, state


def search(tree: TreeSpec | None, num_steps: int, topk: int, num_nodes: int, root: jax.Array,
           root_logits: jax.Array, node_logits: NodeLogits, state: Any = None) -> tuple[Tree, Any]:
    """The drafter's configured search: the static `tree` when given, else the EAGLE-2 dynamic search."""
    if tree is not None:
        return static_tree(tree, root, root_logits, node_logits, state)
    return dynamic_tree(root, root_logits, node_logits, num_steps, topk, num_nodes, state)


def search_by_rerun(tree: TreeSpec | None, num_steps: int, topk: int, num_nodes: int, root: jax.Array,
                    root_logits: jax.Array, run: Callable[[jax.Array, np.ndarray, jax.Array], jax.Array]) -> Tree:
    """search() for a drafter that re-runs one forward over the whole partial tree at each depth (nothing of it
    committed): run(tokens [B, n] of every node fed so far, their depths below the root's children [n] (the
    root's children are at 0), their ancestor mask [B, n, n]) -> logits [B, n, V]."""
    B = root.shape[0]
    block = (jnp.zeros((B, 0), jnp.int32), jnp.zeros((B, 0), jnp.int32), np.zeros(0, np.int32))

    def node_logits(block, tokens, parents, depths):
        toks, pars, deps = block
        toks, pars = jnp.concatenate([toks, tokens], 1), jnp.concatenate([pars, parents], 1)
        deps = np.concatenate([deps, depths])
        logits = run(toks, deps - 1, mask_from_parents(pars))
        return logits[:, -tokens.shape[1]:], (toks, pars, deps)

    found, _ = search(tree, num_steps, topk, num_nodes, root, root_logits, node_logits, block)
    return found


def tree_from_position_logits(tree: TreeSpec | None, num_steps: int, topk: int, num_nodes: int, root: jax.Array,
                              logits: jax.Array) -> Tree:
    """The configured tree for a drafter whose draft distributions depend on the position only, not on the drafts
    before it (a block drafter's positions, P-EAGLE's parallel depths; DDTree's idea): logits [B, D, V], position
    d's distribution for depth d + 1. A static tree takes position d's top tokens as every depth-(d + 1) node's
    candidates; the dynamic search ranks paths by the sum of their positions' log-probabilities, each depth's
    frontier expanded with that position's distribution."""
    if tree is not None:
        return static_tree_from_candidates(tree, root, lax.top_k(logits, tree.topk)[1].astype(jnp.int32))
    B, W = root.shape[0], topk

    def node_logits(state, frontier, parents, depths):      # depth d's frontier: position d
        return jnp.broadcast_to(logits[:, int(depths[0])][:, None], (B, W, logits.shape[-1])), state
    return dynamic_tree(root, logits[:, 0], node_logits, num_steps, W, num_nodes)[0]


def max_dynamic_nodes(num_steps: int, topk: int) -> int:
    """Most nodes (root included) a dynamic search of this shape can return."""
    return 1 + topk + (num_steps - 1) * topk * topk
