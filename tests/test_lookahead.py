"""Lookahead decoding: the combined tree (the paper's attention mask), the n-gram pool, the Jacobi update, and
errors for W, N, G out of range. (Greedy identity, batches, sampled exactness and the mesh: test_conformance.py.)"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import SpecConfig
from specjax.drafters import registry
from specjax.drafters.base import Context, Verified
from specjax.drafters.lookahead import LookaheadDrafter, LookaheadState, pool_insert, tree_layout
from specjax.models.llama import ForwardOut


@pytest.mark.parametrize("W, N, G", [(1, 2, 1), (3, 3, 2), (4, 4, 1)])
def test_tree_mask_is_the_papers_lookahead_and_verification_mask(W, N, G):
    parents, depths, mask = tree_layout(W, N, G)
    look = lambda j, i: 1 + j * W + i
    assert mask.shape == (1 + (W + G) * (N - 1),) * 2
    for j in range(N - 1):
        for i in range(W):
            # (j, i) sees the root, level-0 tokens 0 .. i-j and the diagonal (1, i-j+1) .. (j, i): i + 2 tokens
            seen = {0} | {look(0, p) for p in range(i - j + 1)} | {look(j - d, i - d) for d in range(min(j, i) + 1)}
            assert set(np.flatnonzero(mask[look(j, i)])) == seen, (j, i)
            assert depths[look(j, i)] == i + 1
    for g in range(G):                        # each guess is a chain from the root
        first = 1 + (N - 1) * W + g * (N - 1)
        for s in range(N - 1):
            assert set(np.flatnonzero(mask[first + s])) == {0} | set(range(first, first + s + 1))
    assert (parents[1:] < np.arange(1, len(parents))).all()


def test_pool_dedupes_and_overwrites_the_oldest_slot():
    pool = jnp.full((2, 5, 2, 2), -1, jnp.int32)
    ptr = jnp.zeros((2, 5), jnp.int32)
    ins = lambda pool, ptr, key, cont, ok=(True, True): pool_insert(pool, ptr, jnp.array(key), jnp.array(cont),
                                                                     jnp.array(ok))
    pool, ptr = ins(pool, ptr, [1, 1], [[2, 3], [2, 3]])
    pool, ptr = ins(pool, ptr, [1, 4], [[2, 3], [0, 0]], ok=(True, False))    # a duplicate; a skipped row
    assert pool[0, 1].tolist() == [[2, 3], [-1, -1]] and ptr[0, 1] == 1 and (pool[1, 4] == -1).all()
    pool, ptr = ins(pool, ptr, [1, 1], [[4, 4], [3, -1]])                     # row 1: a missing token, skipped
    pool, ptr = ins(pool, ptr, [1, 1], [[5, 5], [0, 1]])
    assert pool[0, 1].tolist() == [[5, 5], [4, 4]] and ptr[0, 1] == 1         # FIFO: [2, 3] overwritten
    assert pool[1, 1].tolist() == [[2, 3], [0, 1]]


def test_commit_takes_a_jacobi_step_and_pools_the_trajectories():
    W, N, G, V = 3, 3, 1, 16
    d = LookaheadDrafter((W + G) * (N - 1), W, N, G, V)
    window = jnp.array([[[1, 2, 3], [4, 5, 6]]], jnp.int32)                  # levels 0 and 1
    state = LookaheadState(window, jnp.full((1, V, G, N - 1), -1, jnp.int32), jnp.zeros((1, V), jnp.int32))
    T = 1 + (W + G) * (N - 1)
    guess = jnp.array([[9, 10, 11, 12, 13, 14, 15, 0, 0]], jnp.int32)        # the target's argmax after each node
    logits = jax.nn.one_hot(guess, V) * 10.0
    ctx = Context(jnp.zeros((1, 8), jnp.int32), jnp.array([1]), jnp.array([1]))
    out = ForwardOut(logits, jnp.zeros((1, T, 1)), (), None)
    new = d.commit((), state, ctx, jnp.array([0]), out, Verified(jnp.zeros((1, T), jnp.int32), None, out))
    # New level: [after root, after (1, 0), after (1, 1)] = [9, 13, 14]; level 1 becomes level 0.
    assert new.window.tolist() == [[[4, 5, 6], [9, 13, 14]]]
    # Diagonals (0, i-1), (1, i) plus the output after (1, i), for i = 1, 2: [1, 5, 14] and [2, 6, 15].
    assert new.pool[0, 1, 0].tolist() == [5, 14] and new.pool[0, 2, 0].tolist() == [6, 15]


def test_propose_verifies_the_window_and_the_root_tokens_pooled_ngrams():
    W, N, G, V = 2, 3, 2, 16
    d = LookaheadDrafter((W + G) * (N - 1), W, N, G, V)
    pool = jnp.full((1, V, G, N - 1), -1, jnp.int32).at[0, 7, 0].set(jnp.array([8, 9]))
    state = LookaheadState(jnp.array([[[1, 2], [3, 4]]], jnp.int32), pool, jnp.zeros((1, V), jnp.int32))
    ctx = Context(jnp.array([[5, 7, 0, 0]], jnp.int32), jnp.array([2]), jnp.array([1]))
    draft, _ = d.propose((), state, ctx, None, None)
    # root 7; window level-major; guess 0 = the pooled [8, 9]; the empty guess slot holds the root token.
    assert draft.tree.tokens.tolist() == [[7, 1, 2, 3, 4, 8, 9, 7, 7]]
    assert draft.tree.max_depth == 2 and draft.tokens.shape == (1, 8)


@pytest.mark.parametrize("opts, match", [
    (dict(window_size=0), "drafter option window_size=0"),
    (dict(ngram_size=1), "drafter option ngram_size=1"),
    (dict(guess_set_size=0), "drafter option guess_set_size=0"),
    (dict(window_size=2.5), "drafter option window_size=2.5"),
    (dict(window_size=1, ngram_size=4, guess_set_size=1), "window_size=1 must be >= ngram_size - 1 = 3"),
    (dict(window_size=20, ngram_size=4, guess_set_size=5), "= 75 tokens verified per step > 64"),
])
def test_bad_window_ngram_guess_are_refused_by_name(opts, match):
    with pytest.raises(ValueError, match=match):
        registry.resolve(SpecConfig(method="lookahead", num_speculative_tokens=4, drafter_options=opts))


def test_num_speculative_tokens_must_be_the_tree_size():
    with pytest.raises(ValueError, match=r"num_speculative_tokens=4 disagrees with k = 8, .* set it to 8"):
        registry.resolve(SpecConfig(method="lookahead", num_speculative_tokens=4,
                                    drafter_options=dict(window_size=2, ngram_size=3, guess_set_size=2)))
    registry.resolve(SpecConfig(method="lookahead", num_speculative_tokens=16))   # defaults W=4, N=3, G=4


def test_options_fix_k_when_it_is_not_given(target):
    """(W + G)(N - 1) is derived (registry.resolve, which generate() runs) when num_speculative_tokens is unset,
    and the loop drafts that many per step."""
    assert registry.resolve(SpecConfig(method="lookahead")).k == 16            # defaults W=4, N=3, G=4
    config = SpecConfig(method="lookahead", max_new_tokens=6, stop_at_eos=False,
                        drafter_options=dict(window_size=2, ngram_size=3, guess_set_size=2))
    resolved = registry.resolve(config)
    assert config.num_speculative_tokens is None and resolved.num_speculative_tokens == resolved.k == 8
    res = specjax.generate(target, [[1, 2, 3, 1, 2, 3]], config)
    assert res.stats["num_speculative_tokens"] == 8
    assert len(res.stats["accept_hist"]) == 9                                   # 0 .. 8 accepted per step
    assert res.stats["drafted"] == 8 * res.stats["target_passes"] > 0
