"""Bad input gets a clear error naming the problem; ragged batches decode exactly as one-at-a-time; the prefill in
length groups equals one padded prefill."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import SpecConfig
from specjax.drafters import registry
from specjax.inputs import right_pad
from specjax.decode import prefill_forward
from specjax.planning import GROUP_CACHE_COST_SLOTS, group_cache_sizes, plan_prefill, prompt_bucket, round_up
from tiny import ragged_prompts, tiny_model


def test_ragged_batch_equals_one_at_a_time(target):
    prompts = ragged_prompts(6, seed=4)
    cfg = SpecConfig(max_new_tokens=20)
    batched = specjax.generate(target, prompts, cfg).tokens
    alone = [specjax.generate(target, [p], cfg).tokens[0] for p in prompts]
    assert batched == alone


def test_prompt_bucket_wastes_at_most_a_quarter():
    widths = [prompt_bucket(n) for n in range(1, 2050)]
    assert all(w >= n and (n <= 16 or w <= 1.25 * n) for n, w in enumerate(widths, 1))
    assert widths == sorted(widths) and len(set(widths)) < 40        # few programs across 1..2049 tokens


@pytest.mark.parametrize("seed", range(6))
def test_plan_prefill_is_the_cheapest_cut_of_the_sorted_rows(seed):
    """Against every cut of the sorted rows into at most 3 groups (brute force)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 300, size=int(rng.integers(1, 9))).tolist()
    width = prompt_bucket(max(lengths))
    order, groups = plan_prefill(lengths, width, 3)
    sorted_lengths = [lengths[i] for i in order]
    assert sorted(sorted_lengths) == sorted_lengths and sorted(order.tolist()) == list(range(len(lengths)))
    assert sum(r for r, _ in groups) == len(lengths) and groups[-1][1] == width
    start = 0
    for rows, w in groups:
        assert max(sorted_lengths[start:start + rows]) <= w <= width
        start += rows
    B = len(lengths)
    cost = lambda cuts: sum((b - a) * (width if b == B else min(prompt_bucket(sorted_lengths[b - 1]), width))
                            for a, b in zip((0,) + cuts, cuts + (B,)))
    best = min(cost(c) for n in range(3) for c in itertools.combinations(range(1, B), n))
    assert sum(r * w for r, w in groups) == best


def test_grouped_prefill_equals_one_padded_prefill(target):
    """Logits, hidden states at the prompt positions and every valid cache entry, row by row. Fails if a group's
    rows land in the wrong batch rows or slots."""
    prompts = ragged_prompts(7, seed=11) + [list(range(1, 40))]
    lengths = [len(p) for p in prompts]
    P = prompt_bucket(max(lengths))
    order, groups = plan_prefill(lengths, P, 4)
    assert len(groups) > 1, groups
    cfg, params = target.config, target.params
    arr, plen = jnp.asarray(right_pad(prompts, P)), jnp.asarray(lengths, jnp.int32)
    run = jax.jit(prefill_forward, static_argnums=(1, 4, 5, 6), static_argnames="cache_sizes")
    one = run(params, cfg, arr, plen, ((len(prompts), P),), 96, (0,))
    grouped = run(params, cfg, arr, plen, groups, 96, (0,), order=jnp.asarray(order))
    sizes = tuple(width + 8 for _, width in groups[:-1]) + (96,)
    own_caches = run(params, cfg, arr, plen, groups, 96, (0,), order=jnp.asarray(order), cache_sizes=sizes)
    assert [part.size for part in own_caches.cache.parts] == list(sizes)
    keys = lambda cache: [cache.keys(i) for i in range(len(cache.k))]
    host = lambda out: [np.asarray(x) for x in (out.hidden, out.layer_hidden[0], *keys(out.cache), *out.cache.v)]
    for got, want in zip(host(grouped), host(one)):      # [B, P, H] states, then [B, Hkv, S, D] caches
        for b, n in enumerate(lengths):
            np.testing.assert_allclose(got[b, :n] if got.ndim == 3 else got[b, :, :n],
                                       want[b, :n] if want.ndim == 3 else want[b, :, :n], atol=1e-5)
    np.testing.assert_allclose(own_caches.logits, one.logits, atol=1e-5)
    one_cache = host(one)[2:]
    for part, rows in zip(own_caches.cache.parts, own_caches.cache.rows):
        for got, want in zip(keys(part) + list(part.v), one_cache):
            for j, b in enumerate(np.asarray(rows)):
                np.testing.assert_allclose(got[j, :, :lengths[b]], want[b, :, :lengths[b]], atol=1e-5)


@pytest.mark.parametrize("method, k, extra", [
    ("none", 0, {}), ("predicted", 3, {}),
    pytest.param("draft_model", 3, {}, marks=pytest.mark.slow), pytest.param("ngram", 3, {}, marks=pytest.mark.slow),
    pytest.param("draft_model", 4, {"tree_choices": ((0,), (1,), (0, 0), (0, 0, 0))}, marks=pytest.mark.slow)])
def test_prefill_groups_do_not_change_the_output(target, draft, method, k, extra, monkeypatch):
    """Grouped prefills and each group's own KV cache in the loop against one, sampled at temperature 1, with
    trees (their compaction), hidden states read by a drafter's init and a per-request drafter argument."""
    monkeypatch.setattr("specjax.planning.GROUP_CACHE_COST_SLOTS", 0)          # a tiny batch gets its own caches too
    prompts = ragged_prompts(6, seed=12) + [list(range(1, 45))]
    cfg = SpecConfig(method=method, num_speculative_tokens=k, max_new_tokens=16, temperature=1.0, **extra)
    drafter = {"draft_model": draft, "predicted": [p[::-1] for p in prompts]}.get(method)
    run = lambda g: specjax.generate(target, prompts, cfg, drafter=drafter, prefill_groups=g)
    grouped, one = run(4), run(1)
    assert len(grouped.stats["prefill_groups"]) > 1 and len(one.stats["prefill_groups"]) == 1
    slots = grouped.stats["cache_slots"]
    assert len(slots) > 1 and max(slots) == grouped.stats["buffer_len"] > min(slots), slots
    assert grouped.tokens == one.tokens
    for key in ("accepted", "drafted", "target_passes"):
        assert grouped.stats[key] == one.stats[key], key


def test_group_caches_only_where_they_spare_enough():
    cost = GROUP_CACHE_COST_SLOTS
    assert group_cache_sizes(((30, 64), (2, 256)), 400, 128, 4) == (208, 400)  # 64 + 128 + 5 rounded up to 16
    assert group_cache_sizes(((32, 256),), 400, 128, 4) is None                 # one group: one buffer
    w = 880 - round_up(cost, 16)                       # one row of width w spares 880 - w slots of a 1024 buffer
    assert group_cache_sizes(((1, w), (3, 880)), 1024, 143, 0) == (w + 144, 1024)
    assert group_cache_sizes(((1, w + 16), (3, 880)), 1024, 143, 0) is None   # spares under the cost
    with pytest.raises(ValueError, match="do not fit prefill groups"):
        prefill_forward({}, None, jnp.zeros((32, 256), jnp.int32), None, ((30, 64), (2, 256)), 400,
                        cache_sizes=(32, 400))


def test_bad_prefill_groups(target):
    with pytest.raises(ValueError, match="prefill_groups must be a positive int"):
        specjax.generate(target, [[1, 2]], SpecConfig(max_new_tokens=2), prefill_groups=0)


@pytest.mark.parametrize("kwargs,match", [
    (dict(method="draft_model", num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(method="ngram", num_speculative_tokens=65), r"\[1, 64\]"),
    (dict(method="ngram"), "num_speculative_tokens"),
    (dict(method="medusa-ish", num_speculative_tokens=2), "unknown speculative method"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.01), "top_p"),
    (dict(top_k=-3), "top_k"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(method="ngram", num_speculative_tokens=2, prompt_lookup_min=4, prompt_lookup_max=2), "prompt_lookup"),
])
def test_bad_config(kwargs, match):
    """Refused by SpecConfig (what holds whatever the method) or by registry.resolve (what depends on it), which
    generate() runs first."""
    with pytest.raises(ValueError, match=match):
        registry.resolve(SpecConfig(**kwargs))


def test_vocabulary_mismatch(target):
    other = tiny_model(5, vocab=target.config.vocab_size + 3)
    with pytest.raises(ValueError, match="vocabulary mismatch"):
        specjax.generate(target, [[1, 2]], SpecConfig(method="draft_model", num_speculative_tokens=2), drafter=other)


def test_empty_prompt(target):
    with pytest.raises(ValueError, match="empty"):
        specjax.generate(target, [[1, 2], []], SpecConfig())


def test_out_of_vocab_token(target):
    with pytest.raises(ValueError, match="outside"):
        specjax.generate(target, [[1, target.config.vocab_size]], SpecConfig())


def test_prompt_longer_than_cache(target):
    with pytest.raises(ValueError, match="prompt too long for the cache"):
        specjax.generate(target, [list(range(1, 40))], SpecConfig(max_new_tokens=8, max_cache_len=32))
    # k beyond the cache headroom is the same check: k + 1 verify slots must fit.
    with pytest.raises(ValueError, match="prompt too long for the cache"):
        specjax.generate(target, [[1, 2, 3]], SpecConfig(method="ngram", num_speculative_tokens=30,
                                                         max_new_tokens=8, max_cache_len=32))


def test_single_prompt_not_in_a_list(target):
    with pytest.raises(TypeError, match="one entry per request"):
        specjax.generate(target, [1, 2, 3], SpecConfig())


def test_a_prompt_that_is_neither_text_ids_nor_chat_is_named(target):
    """A list of plain strings is neither token ids nor chat messages: the error names the prompt and says what a
    prompt may be (not int()'s "invalid literal")."""
    what = (r"prompt 1 holds str 'hello': a prompt is a string, a list of token ids \(ints\) or a list of chat "
            r"messages \(\{'role': \.\.\., 'content': \.\.\.\} dicts\)")
    with pytest.raises(ValueError, match=what):
        specjax.generate(target, [[1, 2], ["hello", "world"]], SpecConfig(max_new_tokens=2))
    for bad, shown in (([1, 2.0], "float 2.0"), ([1, True], "bool True"), ([[1, 2]], "list \\[1, 2\\]")):
        with pytest.raises(ValueError, match=f"prompt 0 holds {shown}: a prompt is a string"):
            specjax.generate(target, [bad], SpecConfig(max_new_tokens=2))
    ids = np.asarray([[1, 2, 3]], np.int32)                     # NumPy and JAX integers are token ids
    plain = specjax.generate(target, [[1, 2, 3]], SpecConfig(max_new_tokens=2)).tokens
    assert specjax.generate(target, list(ids), SpecConfig(max_new_tokens=2)).tokens == plain
    assert specjax.generate(target, [list(jnp.asarray(ids[0]))], SpecConfig(max_new_tokens=2)).tokens == plain


def test_predicted_needs_one_prediction_per_prompt(target):
    with pytest.raises(ValueError, match="one prediction per prompt"):
        specjax.generate(target, [[1, 2], [3]], SpecConfig(method="predicted", num_speculative_tokens=2),
                         drafter=[[1, 2]])


def test_unknown_shipped_model():
    with pytest.raises(FileNotFoundError, match="no shipped model"):
        specjax.load_model("no-such-model")
