"""verify.accept, the decode loop's one acceptance entry point: a SpecConfig picks greedy (temperature 0), exact
speculative sampling or typical_lossy, on a chain or a tree. (The rules themselves: test_sampling.py,
test_trees_decode.py; end to end: test_conformance.py.)"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import SpecConfig, verify
from specjax.trees import TreeSpec, tree_from_spec

B, V = 4, 6
TREE = TreeSpec.from_choices([(0,), (1,), (0, 0), (0, 1)])                 # 5 nodes, depth 2

GREEDY = SpecConfig(method="ngram", num_speculative_tokens=3)
EXACT = SpecConfig(method="ngram", num_speculative_tokens=3, temperature=1.0)
TYPICAL = SpecConfig(method="ngram", num_speculative_tokens=3, temperature=1.0, acceptance_method="typical_lossy",
                     posterior_threshold=0.2, posterior_alpha=0.5)


def _inputs(T: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
    logits = jnp.asarray(rng.normal(size=(B, T, V)) * 2, jnp.float32)
    q = jax.nn.softmax(jnp.asarray(rng.normal(size=(B, T, V)), jnp.float32))
    keys = jax.random.split(jax.random.PRNGKey(seed), B)
    return keys, tokens, q, logits


def _same(got, want):
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("spec, rule", [
    (GREEDY, lambda keys, d, q, logits, sp: verify.chain_greedy(d, logits)),
    (EXACT, lambda keys, d, q, logits, sp: verify.chain_sampled(keys, d, q, jax.nn.softmax(logits))),
    (TYPICAL, lambda keys, d, q, logits, sp: verify.chain_typical_lossy(keys, d, jax.nn.softmax(logits), 0.2, 0.5)),
], ids=["greedy", "exact", "typical_lossy"])
def test_chain_takes_the_configs_rule(spec, rule):
    keys, tokens, q, logits = _inputs(4)
    acc = verify.accept(spec, keys, tokens[:, :3], q[:, :3], logits)
    assert acc.path is None
    _same((acc.num_accepted, acc.next_token), rule(keys, tokens[:, :3], q[:, :3], logits, spec.sampling))


@pytest.mark.parametrize("spec, rule", [
    (GREEDY, lambda keys, t, q, logits: verify.tree_greedy(t.tokens, t.parents, logits, t.max_depth)),
    (EXACT, lambda keys, t, q, logits: verify.tree_sampled(keys, t.tokens, t.parents, q, jax.nn.softmax(logits),
                                                           t.max_depth)),
    (TYPICAL, lambda keys, t, q, logits: verify.tree_typical_lossy(keys, t.tokens, t.parents, jax.nn.softmax(logits),
                                                                   0.2, 0.5, t.max_depth)),
], ids=["greedy", "exact", "typical_lossy"])
def test_tree_takes_the_configs_rule(spec, rule):
    keys, tokens, q, logits = _inputs(TREE.num_nodes, seed=1)
    tree = tree_from_spec(TREE, tokens)
    acc = verify.accept(spec, keys, tree.tokens[:, 1:], q, logits, tree)
    path, n, nxt = rule(keys, tree, q, logits)
    _same((acc.path, acc.num_accepted, acc.next_token), (path, n, nxt))


def test_the_three_rules_differ_on_these_inputs():
    """The tests above could pass with every config mapped to one rule if the rules agreed here: they do not."""
    keys, tokens, q, logits = _inputs(4)
    chains = [verify.accept(s, keys, tokens[:, :3], q[:, :3], logits) for s in (GREEDY, EXACT, TYPICAL)]
    keys, tokens, q, logits = _inputs(TREE.num_nodes, seed=1)
    tree = tree_from_spec(TREE, tokens)
    trees = [verify.accept(s, keys, tree.tokens[:, 1:], q, logits, tree) for s in (GREEDY, EXACT, TYPICAL)]
    for outs in (chains, trees):
        for i, a in enumerate(outs):
            for b in outs[i + 1:]:
                assert not (np.array_equal(a.num_accepted, b.num_accepted)
                            and np.array_equal(a.next_token, b.next_token))
