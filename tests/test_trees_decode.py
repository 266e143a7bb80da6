"""Token trees end to end: greedy tree decoding == plain greedy; tree sampling is exact (analytic enumeration of
the acceptance rule, Monte Carlo of the implementation, and a generate()-level goodness-of-fit test that a planted
bug fails); malformed trees give clear errors."""
import itertools
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
import specjax.verify as verify
from specjax import SamplingParams, SpecConfig
from specjax.drafters import registry
from specjax.trees import MEDUSA_63, TreeSpec, full_tree_choices
from tiny import BASELINE_MAX_NEW, ragged_prompts
from _stats import exact_joint, gof_pvalue, joint_counts

MAX_NEW = BASELINE_MAX_NEW
CHAIN = [(0,), (0, 0), (0, 0, 0)]
WIDE = [(0,), (1,), (2,), (3,), (0, 0), (1, 0)]
DYNAMIC = dict(num_steps=3, topk=3, num_draft_tokens=8)


# Every tree at some batch size and every batch size with some tree, without the full product (each pair is one
# ~10 s compile on a loaded CPU).
@pytest.mark.parametrize("tree, batch", [
    ("chain", 3), ("wide", 1), ("wide", 3), ("wide", 8), ("medusa63", 8), ("dynamic", 1), ("dynamic", 8)])
def test_greedy_tree_equals_plain(target, near_draft, baselines, tree, batch):
    kw = {"chain": dict(tree_choices=CHAIN), "wide": dict(tree_choices=WIDE),
          "medusa63": dict(tree_choices=MEDUSA_63), "dynamic": DYNAMIC}[tree]
    cfg = SpecConfig(method="draft_model", max_new_tokens=MAX_NEW, **kw)
    prompts = ragged_prompts(batch, seed=batch)
    res = specjax.generate(target, prompts, cfg, drafter=near_draft)
    assert res.tokens == baselines[batch]
    assert res.stats["accepted"] > 0 and res.stats["rejected"] > 0
    if tree != "chain":                   # the same shapes with the target as drafter: no new compile
        self_draft = specjax.generate(target, prompts, cfg, drafter=target)
        assert self_draft.tokens == baselines[batch]
        hist = self_draft.stats["accept_hist"]
        if "tree_choices" in kw:                     # these trees hold the all-rank-0 path at full depth
            assert hist[TreeSpec.from_choices(kw["tree_choices"]).max_depth] == self_draft.stats["target_passes"]
        else:                                        # EAGLE-2 may prune the deep end of the top-1 path
            assert hist[0] == 0 and self_draft.stats["accepted"] > self_draft.stats["target_passes"]


def test_chain_tree_matches_chain_statistics(target, near_draft, baselines):
    """A chain-shaped tree drafts and accepts exactly what the k-chain does (same compile as test above)."""
    prompts = ragged_prompts(3, seed=3)
    tree = specjax.generate(target, prompts, SpecConfig(method="draft_model", max_new_tokens=MAX_NEW,
                                                        tree_choices=CHAIN), drafter=near_draft)
    chain = specjax.generate(target, prompts, SpecConfig(method="draft_model", max_new_tokens=MAX_NEW,
                                                         num_speculative_tokens=3), drafter=near_draft)
    assert tree.tokens == chain.tokens
    for key in ("accept_hist", "target_passes", "drafted", "accepted"):
        assert tree.stats[key] == chain.stats[key]


def test_tree_eos_stops_each_row(target, baselines):
    """EOS inside an accepted path ends the row there (the tokens after it in the same step are dropped)."""
    import dataclasses
    from specjax.models import Model
    base = baselines[3]
    eos = base[1][5]
    t_eos = Model(dataclasses.replace(target.config, eos_token_id=eos), target.params, None, "eos")
    out = specjax.generate(t_eos, ragged_prompts(3, seed=3), SpecConfig(method="draft_model", max_new_tokens=MAX_NEW,
                                                                         tree_choices=WIDE), drafter=target).tokens
    for b, o in zip(base, out):
        assert o == (b[: b.index(eos) + 1] if eos in b else b)


# ---------------------------------------------------------------------------------------------------------------
# The acceptance rules on a hand-built tree, vocab 4:  root -> 1 (rank 0) -> {3, 4};  root -> 2 (rank 1)
# ---------------------------------------------------------------------------------------------------------------

HAND = TreeSpec.from_choices([(0,), (1,), (0, 0), (0, 1)])
V = 4
rng = np.random.default_rng(0)
# Target and draft distributions for every prefix of up to 2 tokens (the tree is 2 deep; +1 bonus token).
P_TABLE = {pre: rng.dirichlet(np.ones(V)) for n in range(3) for pre in itertools.product(range(V), repeat=n)}
for pre in list(P_TABLE)[::3]:                        # zeros, as top-k / top-p leave them
    P_TABLE[pre][rng.integers(V)] = 0.0
    P_TABLE[pre] /= P_TABLE[pre].sum()
Q_TABLE = {pre: rng.dirichlet(np.ones(V)) for n in range(2) for pre in itertools.product(range(V), repeat=n)}


def test_hand_tree_structure():
    np.testing.assert_array_equal(HAND.parents, [-1, 0, 0, 1, 1])
    np.testing.assert_array_equal(HAND.children[:2], [[1, 2], [3, 4]])


def _node_prefix(tokens, node):
    """Drafted tokens on the path root -> node (root excluded)."""
    path = []
    while node > 0:
        path.append(int(tokens[node]))
        node = int(HAND.parents[node])
    return tuple(reversed(path))


def rule_output(tokens, one_hot: bool, q_update: bool = True) -> dict:
    """Exact distribution of the emitted tokens (accepted path + next token) for drafted tokens [T], by
    enumerating every accept/reject branch of the rule in verify.tree_sampled's docstring. q_update=False keeps
    the sibling q unchanged in case (b) (the with-replacement rule on without-replacement drafts: a bug)."""
    out = Counter()

    def walk(node, prob, emitted):
        pre = _node_prefix(tokens, node)
        p, q = P_TABLE[pre].copy(), (None if one_hot else Q_TABLE.get(pre))
        for c in [c for c in HAND.children[node] if c >= 0]:
            x = int(tokens[c])
            q_c = np.eye(V)[x] if one_hot else q
            if q_c[x] == 0:
                continue
            acc = min(1.0, p[x] / q_c[x])
            if acc > 0:
                walk(c, prob * acc, emitted + (x,))
            prob *= 1 - acc
            r = np.maximum(p - q_c, 0)
            p = r / r.sum() if r.sum() > 0 else p            # verify.residual_distribution
            if not one_hot and q_update:
                q = np.where(np.arange(V) == x, 0.0, q)
                q = q / q.sum()
        for y in range(V):
            out[emitted + (y,)] += prob * p[y]

    walk(0, 1.0, ())
    return out


def extend_to_target(dist: dict) -> np.ndarray:
    """Continue every emitted sequence with target samples to 3 tokens: [V, V, V] joint. Exactness means this is
    the target's own joint distribution."""
    joint = np.zeros((V,) * 3)
    for seq, pr in dist.items():
        for rest in itertools.product(range(V), repeat=3 - len(seq)):
            full = seq + rest
            joint[full] += pr * np.prod([P_TABLE[full[:i]][full[i]] for i in range(len(seq), 3)])
    return joint


TARGET_JOINT = np.einsum("a,ab,abc->abc", P_TABLE[()], np.array([P_TABLE[(a,)] for a in range(V)]),
                         np.array([[P_TABLE[(a, b)] for b in range(V)] for a in range(V)]))


def _without_replacement(q, n):
    """Every ordered draw of n distinct tokens from q, with its probability."""
    for draw in itertools.permutations(range(V), n):
        pr, left = 1.0, 1.0
        for x in draw:
            pr *= q[x] / left
            left -= q[x]
        yield draw, pr


def test_rule_a_deterministic_children_is_exact():
    """Case (a): q_c = one_hot(child). Any fixed drafted tokens, duplicates and zero-p tokens included."""
    for root_kids, kids in [((0, 1), (2, 3)), ((1, 1), (0, 0)), ((3, 2), (1, 3))]:
        tokens = np.array([0, *root_kids, *kids])
        np.testing.assert_allclose(extend_to_target(rule_output(tokens, one_hot=True)), TARGET_JOINT, atol=1e-12)


def test_rule_b_without_replacement_is_exact():
    """Case (b): siblings drawn without replacement from q, q_c = q minus the earlier siblings, renormalised.
    Marginalised over every draw of the tree's tokens the output is the target's joint distribution; with the
    sibling q left unchanged (the with-replacement rule applied to without-replacement drafts) it is not."""
    def marginal(q_update: bool):
        joint = np.zeros((V,) * 3)
        for (a, b), pr_root in _without_replacement(Q_TABLE[()], 2):
            for (c, d), pr_kids in _without_replacement(Q_TABLE[(a,)], 2):
                dist = rule_output(np.array([0, a, b, c, d]), one_hot=False, q_update=q_update)
                joint += pr_root * pr_kids * extend_to_target(dist)
        return joint
    np.testing.assert_allclose(marginal(True), TARGET_JOINT, atol=1e-12)
    assert np.abs(marginal(False) - TARGET_JOINT).max() > 1e-5      # float error is ~1e-16


def _sample_tree(tokens, one_hot: bool, n: int, seed: int = 0) -> Counter:
    """n draws of verify.tree_sampled on one fixed tree -> Counter of emitted token tuples."""
    T = HAND.num_nodes
    p = np.stack([P_TABLE[_node_prefix(tokens, t)] for t in range(T)])                  # [T, V]
    q = None if one_hot else np.stack([Q_TABLE.get(_node_prefix(tokens, t), np.ones(V) / V) for t in range(T)])
    bcast = lambda a, dtype=jnp.float32: jnp.broadcast_to(jnp.asarray(a, dtype), (n,) + a.shape)
    keys = jax.random.split(jax.random.PRNGKey(seed), n)
    run = jax.jit(lambda k, t, q, p: verify.tree_sampled(k, t, HAND, q, p))
    path, num, nxt = run(keys, bcast(np.asarray(tokens), jnp.int32), None if one_hot else bcast(q), bcast(p))
    path, num, nxt = map(np.asarray, (path, num, nxt))
    return Counter(tuple(int(tokens[i]) for i in path[r, 1:num[r] + 1]) + (int(nxt[r]),) for r in range(n))


@pytest.mark.parametrize("one_hot", [True, False])
def test_tree_sampled_implements_the_rule(one_hot):
    """The JAX implementation emits each sequence with the enumerated probability (fixed drafts, both cases)."""
    tokens = np.array([0, 1, 2, 3, 0])               # root's kids 1, 2; node 1's kids 3, 0
    n = 40_000
    p = gof_pvalue(_sample_tree(tokens, one_hot, n), rule_output(tokens, one_hot))
    assert p > 1e-4, p


def test_tree_greedy_hand_tree():
    tokens = jnp.array([[0, 1, 2, 3, 0], [0, 1, 2, 3, 0], [0, 3, 3, 3, 3]], jnp.int32)
    # Target argmax after each node; row 0: root->1 ok, then node 1 wants 0 -> node 4 accepted (a leaf).
    want = np.array([[1, 0, 0, 0, 2], [2, 0, 1, 0, 0], [0, 0, 0, 0, 0]])
    logits = jnp.asarray(np.eye(V)[want] * 5.0)
    path, n, nxt = verify.tree_greedy(tokens, HAND, logits)
    np.testing.assert_array_equal(path, [[0, 1, 4], [0, 2, -1], [0, -1, -1]])
    np.testing.assert_array_equal(n, [2, 1, 0])
    np.testing.assert_array_equal(nxt, [2, 1, 0])
    # Per-row parents give the same answer as the TreeSpec.
    same = verify.tree_greedy(tokens, jnp.broadcast_to(jnp.asarray(HAND.parents), (3, 5)), logits, max_depth=2)
    for a, b in zip(same, (path, n, nxt)):
        np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------------------------------------------------------
# generate(): tree sampling at temperature 0.8 with top-k and top-p is distributed as the target
# ---------------------------------------------------------------------------------------------------------------

SP = SamplingParams(temperature=0.8, top_k=5, top_p=0.9)
PROMPT = [5, 17, 33, 5, 17, 40]
N_SAMPLES = 1500


def _tree_sample_counts(target, draft) -> np.ndarray:
    cfg = SpecConfig(method="draft_model", num_steps=2, topk=3, num_draft_tokens=5, max_new_tokens=3,
                     temperature=SP.temperature, top_k=SP.top_k, top_p=SP.top_p)
    res = specjax.generate(target, [PROMPT] * N_SAMPLES, cfg, drafter=draft, seed=11)
    assert res.stats["accepted"] > 0 and res.stats["rejected"] > 0
    return joint_counts(res.tokens, target.config.vocab_size)


@pytest.fixture(scope="module")
def exact_three(target):
    return exact_joint(target, PROMPT, SP)


def test_tree_sampling_matches_target(target, near_draft, exact_three):
    p = gof_pvalue(_tree_sample_counts(target, near_draft), exact_three)
    print("tree sampling p-value", p)
    assert p > 1e-4, p


def test_planted_bug_fails_the_sampling_test(target, near_draft, exact_three, monkeypatch):
    """Dropping the residual update between siblings (p kept after a rejected child) must be caught."""
    monkeypatch.setattr(verify, "residual_distribution", lambda p, q: p)
    jax.clear_caches()                                # the compiled decode loop must be re-traced with the bug
    try:
        p = gof_pvalue(_tree_sample_counts(target, near_draft), exact_three)
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    print("planted bug p-value", p)
    assert p < 1e-8, p


# ---------------------------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, match", [
    (dict(tree_choices=[(0,), (1, 0)]), "no parent"),
    (dict(tree_choices=[(0,), (0,)]), "duplicate"),
    (dict(tree_choices=[(0,), (-1,)]), "negative"),
    (dict(tree_choices=[]), "empty"),
    (dict(tree_choices=[(0,), "ab"]), "non-empty tuple"),
    (dict(tree_choices=full_tree_choices(3, 4)), "max_nodes"),
    (dict(tree_choices=CHAIN, num_steps=2), "not both"),
    (dict(num_steps=3, topk=2), "missing"),
    (dict(num_steps=2, topk=2, num_draft_tokens=8), "num_draft_tokens"),
    (dict(num_steps=0, topk=2, num_draft_tokens=2), "num_steps"),
    (dict(tree_choices=CHAIN, num_speculative_tokens=4), "disagrees"),
])
def test_malformed_tree_config(kw, match):
    with pytest.raises(ValueError, match=match):
        SpecConfig(method="draft_model", **kw)


def test_tree_config_errors(target, near_draft):
    with pytest.raises(ValueError, match="cannot draft token trees"):
        registry.resolve(SpecConfig(method="ngram", tree_choices=CHAIN))
    cfg = SpecConfig(method="draft_model", tree_choices=WIDE)
    assert cfg.k == 6 and cfg.tree.num_nodes == 7 and hash(cfg) == hash(SpecConfig(method="draft_model",
                                                                                    tree_choices=list(WIDE)))
    assert SpecConfig(method="draft_model", **DYNAMIC).k == 7
    # The cache needs the tree's nodes as headroom: a deep tree in a tight cache is refused up front.
    with pytest.raises(ValueError, match="too long for the cache"):
        specjax.generate(target, [[1, 2, 3]], SpecConfig(method="draft_model", tree_choices=MEDUSA_63,
                                                         max_new_tokens=8, max_cache_len=40), drafter=near_draft)
    with pytest.raises(ValueError, match="vocabulary has only"):
        specjax.generate(target, [[1, 2, 3]], SpecConfig(method="draft_model", tree_choices=[(i,) for i in range(62)],
                                                         max_new_tokens=8), drafter=near_draft)
