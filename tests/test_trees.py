"""Static trees (choices), per-row jnp tree helpers and EAGLE-2 dynamic trees."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import trees as tr

# Hand tree:            0 (root)
#                     /   \
#              1 (0,)      2 (1,)
#              /    \          \
#        3 (0,0)  4 (0,1)    5 (1,0)
#           |
#       6 (0,0,0)
HAND = [(1, 0), (0,), (0, 0, 0), (1,), (0, 1), (0, 0)]        # deliberately unsorted


def test_hand_tree_structure():
    s = tr.TreeSpec.from_choices(HAND)
    assert s.choices == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert s.num_nodes == 7 and s.max_depth == 3 and s.num_leaves == 3 and s.topk == 2
    np.testing.assert_array_equal(s.parents, [-1, 0, 0, 1, 1, 2, 3])
    np.testing.assert_array_equal(s.depths, [0, 1, 1, 2, 2, 2, 3])          # positions relative to the root
    np.testing.assert_array_equal(s.ranks, [0, 0, 1, 0, 1, 0, 0])
    expected_mask = np.array([
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],
        [1, 0, 1, 0, 0, 1, 0],
        [1, 1, 0, 1, 0, 0, 1]], bool)
    np.testing.assert_array_equal(s.mask, expected_mask)
    np.testing.assert_array_equal(s.retrieve_indices, [[0, 1, 4, -1], [0, 2, 5, -1], [0, 1, 3, 6]])
    np.testing.assert_array_equal(s.children, [[1, 2], [3, 4], [5, -1], [6, -1], [-1, -1], [-1, -1], [-1, -1]])


def test_treespec_hashable_and_static_arg():
    a, b = tr.TreeSpec.from_choices(HAND), tr.TreeSpec.from_choices(sorted(HAND))
    assert a == b and hash(a) == hash(b) and a != tr.TreeSpec.from_choices(tr.chain_choices(3))
    with pytest.raises(ValueError):
        a.parents[0] = 3                                    # arrays are read-only

    calls = []

    def count_depths(spec, x):
        calls.append(1)
        return x + jnp.asarray(spec.depths)

    f = jax.jit(count_depths, static_argnums=0)
    f(a, jnp.zeros(7, jnp.int32))
    f(b, jnp.zeros(7, jnp.int32))
    assert len(calls) == 1                                  # equal specs hit the same compilation


@jax.jit
def _helpers_impl(parents):
    return tr.mask_from_parents(parents), tr.depths_from_parents(parents), tr.is_leaf(parents)


def _helpers(parents, max_depth):
    paths = jax.jit(tr.paths_from_parents, static_argnums=1)(parents, max_depth)
    return (*_helpers_impl(parents), paths)


def test_jnp_helpers_match_static_tree():
    for choices in (HAND, tr.MEDUSA_63, tr.chain_choices(5), tr.full_tree_choices(3, 2)):
        s = tr.TreeSpec.from_choices(choices)
        parents = jnp.asarray(np.stack([s.parents, s.parents]))         # [2, T]
        mask, depths, leaf, paths = jax.device_get(_helpers(parents, s.max_depth))
        np.testing.assert_array_equal(mask[1], s.mask)
        np.testing.assert_array_equal(depths[0], s.depths)
        leaves = np.flatnonzero(leaf[0])
        np.testing.assert_array_equal(leaves, [row[row >= 0][-1] for row in s.retrieve_indices])
        np.testing.assert_array_equal(paths[0, leaves], s.retrieve_indices)            # paths [2, T, D + 1]
        node = jnp.array([leaves[-1], 0])
        p = jax.jit(tr.path_to_node, static_argnums=2)(parents, node, s.max_depth)
        np.testing.assert_array_equal(p[0], s.retrieve_indices[-1])
        np.testing.assert_array_equal(p[1], [0] + [-1] * s.max_depth)


def test_tree_from_spec():
    s = tr.TreeSpec.from_choices(HAND)
    toks = jnp.arange(14, dtype=jnp.int32).reshape(2, 7)
    t = tr.tree_from_spec(s, toks)
    assert t.mask.shape == (2, 7, 7) and t.parents.shape == (2, 7)
    np.testing.assert_array_equal(t.source[0], np.arange(-1, 6))
    with pytest.raises(ValueError):
        tr.tree_from_spec(s, toks[:, :5])


def test_medusa_63():
    assert len(tr.MEDUSA_63) == 63
    s = tr.TreeSpec.from_choices(tr.MEDUSA_63)
    assert s.num_nodes == 64 and s.max_depth == 4 and s.topk == 10
    assert s.num_leaves == 42
    assert np.all(s.parents[1:] < np.arange(1, 64))
    assert np.all(s.depths[1:] == s.depths[s.parents[1:]] + 1)
    assert np.all(np.diff(s.depths) >= 0)                   # breadth-first
    np.testing.assert_array_equal(s.mask.sum(1), s.depths + 1)
    # Children are listed by rank.
    for row in s.children:
        kids = row[row >= 0]
        assert np.all(np.diff(s.ranks[kids]) > 0)


def test_chain_and_full_tree():
    s = tr.TreeSpec.from_choices(tr.chain_choices(4))
    np.testing.assert_array_equal(s.parents, [-1, 0, 1, 2, 3])
    np.testing.assert_array_equal(s.mask, np.tril(np.ones((5, 5), bool)))   # a chain is causal attention
    np.testing.assert_array_equal(s.retrieve_indices, [[0, 1, 2, 3, 4]])
    f = tr.TreeSpec.from_choices(tr.full_tree_choices(3, 3))
    assert f.num_nodes == 1 + 3 + 9 + 27 and f.num_leaves == 27 and f.children.shape == (40, 3)
    with pytest.raises(ValueError):
        tr.chain_choices(0)
    with pytest.raises(ValueError):
        tr.full_tree_choices(0, 2)


@pytest.mark.parametrize("choices,kwargs,match", [
    ([], {}, "empty"),
    ([(0,), (0, 1, 0)], {}, "no parent"),
    ([(0,), (0,)], {}, "duplicate"),
    ([(0,), [0]], {}, "duplicate"),
    ([(-1,)], {}, "negative"),
    ([()], {}, "non-empty"),
    ([(0,), "ab"], {}, "non-empty"),
    ([(0.5,)], {}, "int"),
    (tr.chain_choices(5), {"max_depth": 4}, "max_depth"),
    (tr.full_tree_choices(2, 2), {"max_nodes": 6}, "max_nodes"),
])
def test_validation_errors(choices, kwargs, match):
    with pytest.raises(ValueError, match=match):
        tr.TreeSpec.from_choices(choices, **kwargs)


def test_mask_from_parents_unordered_and_jit():
    # Works without parent < child too (walks up, not down).
    parents = jnp.array([[-1, 3, 0, 2]])                    # chain 0 -> 2 -> 3 -> 1
    m = jax.jit(tr.mask_from_parents)(parents)[0]
    np.testing.assert_array_equal(m[1], [1, 1, 1, 1])
    np.testing.assert_array_equal(m[3], [1, 0, 1, 1])


# ----- dynamic trees -------------------------------------------------------------------------------------------

def _random_expansion(seed: int, b: int, d: int, w: int, k: int, vocab: int = 50):
    """Simulate an EAGLE-2 drafter: random per-step log-probs, frontier picked with expand_frontier."""
    rng = np.random.default_rng(seed)
    logp = np.log(rng.dirichlet(np.ones(k + 3), size=(b, d, w))[..., :k]).astype(np.float32)  # [B, D, W, K]
    toks = rng.integers(0, vocab, size=(b, d, w, k)).astype(np.int32)
    fparent = np.full((b, d, w), -1, np.int32)
    parent_scores = jnp.concatenate([jnp.zeros((b, 1)), jnp.full((b, w - 1), -jnp.inf)], axis=1)
    cums = []
    expand = jax.jit(tr.expand_frontier, static_argnums=2)
    for depth in range(d):
        cum, nxt, parent_scores = expand(parent_scores, jnp.asarray(logp[:, depth]), w)
        cums.append(cum)
        if depth + 1 < d:
            fparent[:, depth + 1] = np.asarray(nxt)
    return toks, logp, fparent, jnp.stack(cums, axis=1)


def _brute_force_top(logp, fparent, n):
    """Enumerate every candidate (d, w, k), sum log-probs along its path, return the flat ids of the top n."""
    d, w, k = logp.shape
    score = {}
    for dd, ww, kk in itertools.product(range(d), range(w), range(k)):
        if dd == 0 and ww > 0:
            continue                                        # empty frontier slots at depth 0
        s, cd, cw, ck = 0.0, dd, ww, kk
        while True:
            s += float(logp[cd, cw, ck])
            if cd == 0:
                break
            flat = fparent[cd, cw]
            cd, cw, ck = cd - 1, flat // k, flat % k
        score[(dd * w + ww) * k + kk] = s
    return set(sorted(score, key=lambda i: -score[i])[:n]), score


@pytest.mark.parametrize("seed,d,w,k,num_nodes", [(0, 4, 3, 4, 12), (1, 3, 2, 2, 9), (2, 5, 4, 5, 26),
                                                  (3, 1, 1, 4, 3)])
def test_dynamic_tree_is_top_by_cumulative_logprob(seed, d, w, k, num_nodes):
    b = 3
    toks, logp, fparent, cum = _random_expansion(seed, b, d, w, k)
    root = jnp.arange(b, dtype=jnp.int32) + 100
    build = jax.jit(tr.build_dynamic_tree, static_argnames=("num_nodes", "cumulative"))
    t = build(root, jnp.asarray(toks), jnp.asarray(logp), jnp.asarray(fparent), num_nodes=num_nodes)
    t_cum = build(root, jnp.asarray(toks), cum, jnp.asarray(fparent), num_nodes=num_nodes, cumulative=True)
    mask, depths, _ = jax.device_get(_helpers_impl(t.parents))
    t, t_cum = jax.device_get((t, t_cum))
    for f in ("tokens", "parents", "depths", "mask", "source"):
        np.testing.assert_array_equal(getattr(t, f), getattr(t_cum, f))
    assert t.tokens.shape == (b, num_nodes) and t.mask.shape == (b, num_nodes, num_nodes)

    parents = t.parents
    assert np.all(parents[:, 0] == -1)
    assert np.all((parents[:, 1:] >= 0) & (parents[:, 1:] < np.arange(1, num_nodes)))
    np.testing.assert_array_equal(t.mask, mask)
    np.testing.assert_array_equal(t.depths, depths)
    np.testing.assert_array_equal(t.tokens[:, 0], root)
    for row in range(b):
        top, score = _brute_force_top(logp[row], fparent[row], num_nodes - 1)
        src = np.asarray(t.source[row, 1:])
        assert set(src.tolist()) == top
        flat_toks = toks[row].reshape(-1)
        np.testing.assert_array_equal(t.tokens[row, 1:], flat_toks[src])
        np.testing.assert_allclose(t.scores[row, 1:], [score[i] for i in src], rtol=1e-5)
        # Each node's parent is the candidate it was expanded from.
        for node in range(1, num_nodes):
            dd, ww = divmod(int(src[node - 1]) // k, w)
            par = parents[row, node]
            if dd == 0:
                assert par == 0
            else:
                assert src[par - 1] == (dd - 1) * w * k + fparent[row, dd, ww]


def test_dynamic_tree_closed_under_ancestors_with_ties():
    # All log-probs equal: every candidate ties, the earlier (shallower) ones must win and parents precede.
    b, d, w, k = 2, 3, 2, 2
    logp = jnp.full((b, d, w, k), -0.5)
    fparent = jnp.broadcast_to(jnp.array([[-1, -1], [0, 1], [0, 1]], jnp.int32), (b, d, w))
    build = jax.jit(tr.build_dynamic_tree, static_argnums=4)
    t = jax.device_get(build(jnp.zeros(b, jnp.int32), jnp.ones((b, d, w, k), jnp.int32), logp, fparent, 6))
    parents = np.asarray(t.parents)
    assert np.all((parents[:, 1:] >= 0) & (parents[:, 1:] < np.arange(1, 6)))
    np.testing.assert_array_equal(t.depths[0], [0, 1, 1, 2, 2, 2])


def test_dynamic_tree_validation():
    z = jnp.zeros((1, 2, 2, 2))
    with pytest.raises(ValueError):
        tr.build_dynamic_tree(jnp.zeros(1, jnp.int32), z.astype(jnp.int32), z, jnp.zeros((1, 2, 2), jnp.int32),
                              num_nodes=8)                  # only 2 + 4 = 6 candidates
    with pytest.raises(ValueError):
        tr.expand_frontier(jnp.zeros((1, 3)), jnp.zeros((1, 3, 2)), 3)
