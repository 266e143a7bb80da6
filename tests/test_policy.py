"""The dynamic speculation policy: draft_len_schedule (k from the batch size) and the acceptance-rate switch (plain
steps for good once the batch's acceptance over a window of speculative steps falls below a threshold).

Greedy output stays plain greedy output for every drafter with the switch taken mid-run; the switch comes exactly
where the rule says, read off the per-step acceptance trace; sampled output keeps the target's distribution
across the switch (with a planted bug that must fail the same test)."""
from __future__ import annotations

import jax
import numpy as np
import pytest

import specjax
import specjax.decode as decode
from specjax import SpecConfig
from specjax.drafters import registry
from conformance_factories import FACTORIES, SP, Case, run, sampled_pvalue, with_planted_bug
from tiny import BASELINE_MAX_NEW, ragged_prompts

# make test runs one drafter across the switch (the switch is drafter-agnostic: it stops calling the drafter); CI's
# test-slow runs every other factory.
FAST = ("draft_model",)


@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n in FAST else [pytest.mark.slow])
                                  for n in FACTORIES if n != "none"])
def test_greedy_equals_plain_across_the_switch(target, baselines, name):
    """Threshold 1.0 over a window of 2: the first rejection switches the batch to plain steps. Every factory's
    drafter has drafts rejected on this batch (the conformance suite asserts it), so the switch must happen."""
    config, res = run(name, Case(target, 3, ragged_prompts(3, seed=3), baselines[3]),
                      max_new_tokens=BASELINE_MAX_NEW, acceptance_rate_threshold=1.0, acceptance_rate_window_size=2)
    assert res.tokens == baselines[3]
    assert res.stats["rejected"] > 0, res.stats                  # the case rejects a draft ...
    assert res.stats["plain_passes"] > 0, res.stats              # ... so the switch happened: plain steps ran
    assert sum(res.stats["accept_hist"]) > 0                     # and speculative steps before it


def test_no_switch_while_every_draft_is_accepted(target, baselines):
    """The target drafting for itself accepts every draft: an acceptance rate of 1.0 is not below the threshold
    1.0, so the batch speculates to the end and takes no plain step."""
    res = specjax.generate(target, ragged_prompts(3, seed=3), SpecConfig(
        method="draft_model", num_speculative_tokens=3, max_new_tokens=BASELINE_MAX_NEW,
        acceptance_rate_threshold=1.0, acceptance_rate_window_size=2), drafter=target)
    assert res.tokens == baselines[3]
    assert res.stats["alpha"] == 1.0 and res.stats["plain_passes"] == 0, res.stats


def switch_step(trace: np.ndarray, k: int, threshold: float, window: int) -> int | None:
    """The loop step after which the rule switches speculation off (None: never), from an acceptance trace
    [B, steps] (-1: row finished or plain step), recomputed here independently of the loop's ring buffer."""
    accepted, drafted = [], []
    for t in range(trace.shape[1]):
        col = trace[:, t]
        if not np.any(col >= 0):
            return None
        accepted.append(int(col[col >= 0].sum()))
        drafted.append(k * int(np.sum(col >= 0)))
        if len(accepted) >= window and sum(accepted[-window:]) < threshold * sum(drafted[-window:]):
            return t
    return None


@pytest.mark.parametrize("threshold, window", [(0.6, 3), pytest.param(0.3, 1, marks=pytest.mark.slow),
                                               pytest.param(0.0, 2, marks=pytest.mark.slow)])
def test_switch_comes_where_the_rule_says(target, near_draft, baselines, threshold, window):
    prompts = ragged_prompts(8, seed=8)
    res = specjax.generate(target, prompts, SpecConfig(
        method="draft_model", num_speculative_tokens=3, max_new_tokens=BASELINE_MAX_NEW,
        acceptance_rate_threshold=threshold, acceptance_rate_window_size=window), drafter=near_draft)
    assert res.tokens == baselines[8]
    trace = res.stats["accept_trace"]                                   # [B, steps]
    speculative = np.flatnonzero(np.any(trace >= 0, axis=0))            # steps that verified drafts
    expected = switch_step(trace, 3, threshold, window)
    if threshold == 0.0:
        assert expected is None and res.stats["plain_passes"] == 0
        return
    assert expected is not None, "the case must switch (pick a threshold its acceptance falls below)"
    assert speculative.max() == expected and len(speculative) == expected + 1
    assert res.stats["plain_passes"] > 0


def test_draft_len_schedule_picks_k_by_batch_size(target, near_draft, baselines):
    config = SpecConfig(method="draft_model", num_speculative_tokens=3, max_new_tokens=BASELINE_MAX_NEW,
                        draft_len_schedule={1: 3, 3: 2})
    assert config.for_batch(1).num_speculative_tokens == 3 and config.for_batch(2).num_speculative_tokens == 2
    assert config.for_batch(4).method == "none"
    for batch, k in ((1, 3), (3, 2), (8, 0)):
        res = specjax.generate(target, ragged_prompts(batch, seed=batch), config, drafter=near_draft)
        assert res.tokens == baselines[batch]
        assert res.stats["num_speculative_tokens"] == k
        assert (res.stats["drafted"] > 0) == (k > 0)


def switched_run(case):
    """The conformance suite's sampled batch with the switch after the first speculative step."""
    return run("draft_model", case, seed=11, max_new_tokens=8, temperature=SP.temperature, top_k=SP.top_k,
               top_p=SP.top_p, acceptance_rate_threshold=1.0, acceptance_rate_window_size=1)


@pytest.mark.slow       # 1503 requests, two compiles: CI runs the pair in test-slow (make test's 20-minute budget)
def test_sampled_distribution_across_the_switch(target, exact_three, sampled_case):
    """Tokens 2 and 3 come from a speculative step or from plain steps after it: the joint of the first three is
    still the target's."""
    _, res = switched_run(sampled_case)
    assert res.stats["plain_passes"] > 0 and res.stats["accepted"] > 0
    p = sampled_pvalue(res, target, exact_three)
    print(f"p-value {p:.3g}")
    assert p > 1e-4, p


@pytest.mark.slow
def test_planted_bug_fails_the_switch_test(target, exact_three, sampled_case, monkeypatch):
    """The plain steps (and the first token) taking the argmax instead of sampling: the same test must fail."""
    argmax = lambda logits, keys, spec: jax.numpy.argmax(logits, -1).astype(jax.numpy.int32)
    _, res = with_planted_bug(monkeypatch, decode, "_target_token", argmax, lambda: switched_run(sampled_case))
    p = sampled_pvalue(res, target, exact_three)
    print(f"planted bug p-value {p:.3g}")
    assert p < 1e-6, p


@pytest.mark.parametrize("fields, message", [
    (dict(draft_len_schedule={1: 4}), "must be in \\[0, num_speculative_tokens=3\\]"),
    (dict(draft_len_schedule={0: 1}), "batch size 0 must be >= 1"),
    (dict(draft_len_schedule={}), "non-empty dict"),
    (dict(draft_len_schedule={1: 1.5}), "of ints"),
    (dict(draft_len_schedule="4:2"), "non-empty dict"),
    (dict(acceptance_rate_threshold=1.5), "must be in \\[0, 1\\]"),
    (dict(acceptance_rate_threshold=0.5, acceptance_rate_window_size=0), "int >= 1"),
    (dict(acceptance_rate_window_size=4), "only applies with an acceptance_rate_threshold"),
])
def test_bad_policy_settings(fields, message):
    with pytest.raises(ValueError, match=message):
        SpecConfig(method="draft_model", num_speculative_tokens=3, **fields)


def test_policy_needs_a_speculative_method_and_whole_trees():
    with pytest.raises(ValueError, match="not used by method='none'"):
        registry.resolve(SpecConfig(acceptance_rate_threshold=0.5))
    with pytest.raises(ValueError, match="a tree cannot be cut"):
        SpecConfig(method="draft_model", tree_choices=((0,), (1,), (0, 0)), draft_len_schedule={4: 2})
    tree = SpecConfig(method="draft_model", tree_choices=((0,), (1,), (0, 0)), draft_len_schedule={4: 3})
    assert tree.for_batch(4).is_tree and tree.for_batch(5).method == "none"


def test_a_schedule_is_checked_against_the_k_its_method_derives():
    """lookahead's options fix k: the schedule's k are checked once registry.resolve has derived it (SpecConfig
    alone cannot know it), and each scheduled config must be one the method takes."""
    config = SpecConfig(method="lookahead", draft_len_schedule={2: 20})          # k = (4 + 4) * (3 - 1) = 16
    with pytest.raises(ValueError, match="must be in \\[0, num_speculative_tokens=16\\]"):
        registry.resolve(config)
    with pytest.raises(ValueError, match="draft_len_schedule: the config for batches up to 2: "
                                         "num_speculative_tokens=8 disagrees with k = 16"):
        registry.resolve(SpecConfig(method="lookahead", draft_len_schedule={2: 8}))
    done = registry.resolve(SpecConfig(method="lookahead", draft_len_schedule={2: 16}))
    assert done.for_batch(2).k == 16 and done.for_batch(3).method == "none"
    assert registry.resolve(done.for_batch(2)) == done.for_batch(2)          # already resolved
