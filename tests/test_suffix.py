"""Suffix decoding: the on-device match and frequency-scored tree, the global cache, its options and errors.
(Greedy identity, batches, sampled exactness and the mesh: tests/test_conformance.py.)"""
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import SpecConfig
from specjax.drafters import registry, suffix
from specjax.drafters.suffix import SuffixCache, match_lengths, propose_row
from tiny import ragged_prompts


def test_match_lengths_counts_the_matched_suffix_before_each_position():
    src = jnp.array([1, 2, 3, 4, -1, 9, 2, 3, 5, -1], jnp.int32)
    m = match_lengths(src, jnp.array([-2, 1, 2, 3], jnp.int32))     # -2: a query slot before the text starts
    assert m.tolist() == [0, 0, 0, 3, 0, 0, 0, 0, 2, 0]


def _tree(src, query, root=7, k=3, depth=2, factor=2.0, min_prob=0.0):
    return propose_row(jnp.array(src, jnp.int32), jnp.array(query, jnp.int32), jnp.int32(root), k, depth, factor,
                       min_prob)


# Three earlier texts continue "1 2 3" with 4 4 and once with 5 6.
SRC = [1, 2, 3, 4, 4, -1, 1, 2, 3, 5, 6, -1, 1, 2, 3, 4, 4, -1]


def test_tree_is_the_trie_of_continuations_ranked_by_frequency():
    t = _tree(SRC, [1, 2, 3], k=4)
    # Node 1: "4" (2 of 3 occurrences), node 2: "5" (1/3), then their children "4 4" and "5 6"; ranked by count,
    # laid out depth-major so parents come first.
    assert t.tokens.tolist() == [7, 4, 5, 4, 6]
    assert t.parents.tolist() == [-1, 0, 0, 1, 2]
    assert t.depths.tolist() == [0, 1, 1, 2, 2]
    np.testing.assert_allclose(t.scores, [0, 2 / 3, 1 / 3, 2 / 3, 1 / 3], rtol=1e-6)


def test_min_token_prob_and_max_spec_factor_prune_the_tree():
    t = _tree(SRC, [1, 2, 3], k=4, min_prob=0.5)               # "5" and "5 6" (1/3) are dropped
    assert t.tokens.tolist()[:3] == [7, 4, 4] and t.parents.tolist()[:3] == [-1, 0, 1]
    assert t.tokens.tolist()[3:] == [7, 7] and t.parents.tolist()[3:] == [0, 0]    # unused slots: root children
    t = _tree(SRC, [1, 2, 3], k=4, factor=0.34)                 # floor(0.34 * 3) = 1 token
    assert t.tokens.tolist() == [7, 4, 7, 7, 7]
    t = _tree(SRC, [8, 8, 8], k=2)                              # no match: nothing proposed
    assert t.tokens.tolist() == [7, 7, 7] and t.parents.tolist() == [-1, 0, 0]


def test_the_longest_match_wins():
    src = [0, 3, 9, -1, 2, 3, 5, -1]
    assert _tree(src, [2, 3], k=1).tokens.tolist() == [7, 5]   # "2 3" -> 5 beats "3" -> 9 / 5
    assert _tree(src, [4, 3], k=2).tokens.tolist() == [7, 5, 9]     # "3" alone: both, the later first on ties
    assert _tree(src, [4, 3], k=2, factor=1.0).tokens.tolist() == [7, 5, 7]    # 1.0 x a 1-token match: 1 token


def test_cache_keeps_the_latest_outputs_separated_and_padded():
    c = SuffixCache([[1, 2]])
    c.add([[3], [], [4, 5, 6]], max_requests=2)                 # the empty output is skipped; [1, 2] evicted
    assert len(c) == 2 and c.num_tokens == 4
    arr = c.arrays(max_requests=2)
    assert arr.shape == (4096,) and arr[:6].tolist() == [3, -1, 4, 5, 6, -1] and (arr[6:] == -1).all()
    assert c.arrays(max_requests=1)[:4].tolist() == [4, 5, 6, -1]
    assert (c.arrays(max_requests=0, min_size=1) == -1).all()
    assert SuffixCache([[1] * 300]).arrays(10, min_size=64).shape == (512,)   # a power of two: few recompiles
    assert SuffixCache([[1] * 5000]).arrays(10).shape == (8192,)


def test_global_cache_persists_across_generate_calls_and_raises_acceptance(target):
    prompts = ragged_prompts(3, seed=4)
    cfg = SpecConfig(method="suffix", num_speculative_tokens=4, max_new_tokens=24)
    plain = specjax.generate(target, prompts, SpecConfig(max_new_tokens=24)).tokens
    suffix.global_cache("test-persist").clear()
    first = specjax.generate(target, prompts, cfg, drafter="test-persist")
    assert len(suffix.global_cache("test-persist")) == 3
    second = specjax.generate(target, prompts, cfg, drafter="test-persist")
    assert first.tokens == plain and second.tokens == plain
    assert second.stats["tau"] > first.stats["tau"], (first.stats["tau"], second.stats["tau"])
    off = SuffixCache()
    specjax.generate(target, prompts[:1], SpecConfig(method="suffix", num_speculative_tokens=4, max_new_tokens=4,
                                                     drafter_options={"suffix_decoding_max_cached_requests": 0}),
                     drafter=off)
    assert len(off) == 0                                        # 0 turns the global cache off


@pytest.mark.parametrize("name, value", [
    ("suffix_decoding_max_tree_depth", 0), ("suffix_decoding_max_tree_depth", 65),
    ("suffix_decoding_max_spec_factor", 0), ("suffix_decoding_min_token_prob", 1.5),
    ("suffix_decoding_max_cached_requests", -1)])
def test_bad_options_are_refused_by_name(name, value):
    with pytest.raises(ValueError, match=f"drafter option {name}={value}"):
        registry.resolve(SpecConfig(method="suffix", num_speculative_tokens=4, drafter_options={name: value}))


def test_a_cache_larger_than_memory_is_refused(target):
    cfg = SpecConfig(method="suffix", num_speculative_tokens=2, max_new_tokens=4,
                     drafter_options={"suffix_decoding_max_cached_requests": 10 ** 12})
    with pytest.raises(ValueError, match="suffix_decoding_max_cached_requests=1000000000000 is larger than memory"):
        specjax.generate(target, [[1, 2, 3]], cfg, drafter=SuffixCache())
    with pytest.raises(TypeError, match="method='suffix' takes drafter=None"):
        specjax.generate(target, [[1, 2, 3]], SpecConfig(method="suffix", num_speculative_tokens=2), drafter=3)
