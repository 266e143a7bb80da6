"""One-position steps: a drafter that reports how much it proposed (Draft.num_drafted) gets a one-position target
step, instead of a verify pass over k + 1 positions of filler, whenever no active row of the batch proposed
anything. Greedy output stays plain greedy output; the steps are counted as plain passes, leave the acceptance
trace at -1 and draft nothing; the drafter's commit still sees them; sampled output keeps the target's
distribution (with a planted bug that must fail the same test)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
import specjax.decode as decode
from specjax import SpecConfig
from specjax.drafters.base import Draft, last_tokens
from specjax.drafters.registry import DrafterSpec, register
from conformance_factories import N_SAMPLES, PROMPT, SP, sampled_pvalue, with_planted_bug
from tiny import BASELINE_MAX_NEW, ragged_prompts


def check_counts(stats, k: int) -> None:
    """Batch of one: every pass is a verify step (k drafts, one acceptance-histogram entry, a trace entry >= 0) or
    a one-position step (none of those)."""
    trace = stats["accept_trace"][0]
    verify_steps = stats["target_passes"] - stats["plain_passes"]
    assert int(np.sum(trace < 0)) == stats["plain_passes"] and int(np.sum(trace >= 0)) == verify_steps
    assert sum(stats["accept_hist"]) == verify_steps and stats["drafted"] == k * verify_steps


@pytest.mark.parametrize("batch", [1, 3])
def test_prompt_lookup_takes_one_position_steps_when_nothing_matches(target, baselines, batch):
    """5-gram lookup on prompts with few repeats: most steps find nothing, some find a match."""
    config = SpecConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=5,
                        max_new_tokens=BASELINE_MAX_NEW)
    res = specjax.generate(target, ragged_prompts(batch, seed=batch), config)
    assert res.tokens == baselines[batch]
    assert 0 < res.stats["plain_passes"] < res.stats["target_passes"], res.stats
    if batch == 1:
        check_counts(res.stats, 4)


def test_suffix_and_predicted_take_them_too(target, baselines):
    """Suffix decoding with no cache and nothing repeated proposes nothing; a prediction that runs out proposes
    nothing after its end."""
    prompts = ragged_prompts(1, seed=1)
    suffix = specjax.generate(target, prompts, SpecConfig(
        method="suffix", num_speculative_tokens=4, max_new_tokens=BASELINE_MAX_NEW,
        drafter_options=dict(suffix_decoding_max_cached_requests=0)))
    assert suffix.tokens == baselines[1] and suffix.stats["plain_passes"] > 0, suffix.stats
    half = BASELINE_MAX_NEW // 2
    predicted = specjax.generate(target, prompts, SpecConfig(method="predicted", num_speculative_tokens=4,
                                                             max_new_tokens=BASELINE_MAX_NEW),
                                 drafter=[baselines[1][0][:half]])
    assert predicted.tokens == baselines[1]
    check_counts(predicted.stats, 4)
    # the prediction is the output's first half, all accepted: ceil(half / 5) verify steps reach its end, one
    # more proposes its last token(s); the rest of the output comes one position at a time
    assert predicted.stats["plain_passes"] >= BASELINE_MAX_NEW - half - 5, predicted.stats


@dataclasses.dataclass(frozen=True)
class EveryOtherStepDrafter:
    """Proposes k copies of the last token after an even number of commits and nothing after an odd number: the
    steps alternate only if commit is called after one-position steps too."""
    k: int
    target_layers = ()
    target_weights = ()

    def init(self, params, ctx, target_out, sp):
        return jnp.zeros(ctx.length.shape, jnp.int32)                               # [B] commits seen

    def propose(self, params, state, ctx, keys, sp):
        proposed = jnp.where(state % 2 == 0, self.k, 0).astype(jnp.int32)
        return Draft(jnp.repeat(last_tokens(ctx, 1), self.k, axis=1), num_drafted=proposed), state

    def commit(self, params, state, ctx, num_accepted, target_out, verified):
        assert target_out.logits.shape[1] == verified.tokens.shape[1]             # one position, or k + 1
        return state + 1


register(DrafterSpec("every_other_step", lambda req: (EveryOtherStepDrafter(req.config.k), ())), replace=True)


def test_commit_sees_one_position_steps(target, baselines):
    res = specjax.generate(target, ragged_prompts(1, seed=1), SpecConfig(
        method="every_other_step", num_speculative_tokens=3, max_new_tokens=BASELINE_MAX_NEW))
    assert res.tokens == baselines[1]
    assert res.stats["plain_passes"] == res.stats["target_passes"] // 2, res.stats
    check_counts(res.stats, 3)
    trace = res.stats["accept_trace"][0]
    assert np.all(trace[0::2] >= 0) and np.all(trace[1::2] < 0)                 # wide, narrow, wide, ...


@dataclasses.dataclass(frozen=True)
class CacheSharingCounter(EveryOtherStepDrafter):
    """Drafts over the target's cache as a self-speculative drafter does: it scribbles over every slot past the
    committed entries, which the next target pass (one position or k + 1) must overwrite or mask."""
    shares_target_cache = True

    def propose(self, params, state, ctx, keys, sp):
        draft, state = super().propose(params, state, ctx, keys, sp)
        cache = ctx.target_cache

        def scribble(x, slot_axis):
            slots = jnp.arange(x.shape[slot_axis]).reshape((-1,) + (1,) * (x.ndim - 1 - slot_axis))
            return jnp.where(slots >= cache.lengths.reshape((-1,) + (1,) * (x.ndim - 1)), 1e3, x)
        k_axis = 3 if cache.keys_transposed else 2
        return draft, state, cache.replace(k=tuple(scribble(x, k_axis) for x in cache.k),
                                           v=tuple(scribble(x, 2) for x in cache.v))


register(DrafterSpec("cache_sharing_counter", lambda req: (CacheSharingCounter(req.config.k), ())), replace=True)


def test_a_drafter_sharing_the_target_cache_reports_num_drafted_too(target, baselines):
    """The proposal is made once per step, as the step before ends, so a drafter writing into the target's cache
    may report what it proposed: its writes past the committed entries never reach the output."""
    res = specjax.generate(target, ragged_prompts(1, seed=1), SpecConfig(
        method="cache_sharing_counter", num_speculative_tokens=3, max_new_tokens=BASELINE_MAX_NEW))
    assert res.tokens == baselines[1]
    trace = res.stats["accept_trace"][0]
    assert np.all(trace[0::2] >= 0) and np.all(trace[1::2] < 0)                 # wide, narrow, wide, ...


def narrow_sampled_run(target):
    """N_SAMPLES requests of PROMPT, 5-gram lookup: nothing repeats within the first tokens, so tokens 2 and 3
    of every request come from one-position steps."""
    return specjax.generate(target, [PROMPT] * N_SAMPLES, SpecConfig(
        method="ngram", num_speculative_tokens=3, prompt_lookup_min=5, prompt_lookup_max=5, max_new_tokens=3,
        temperature=SP.temperature, top_k=SP.top_k, top_p=SP.top_p), seed=5)


def test_sampled_distribution_through_one_position_steps(target, exact_three):
    res = narrow_sampled_run(target)
    assert res.stats["plain_passes"] == res.stats["target_passes"] > 0, res.stats   # every step one position
    p = sampled_pvalue(res, target, exact_three)
    print(f"p-value {p:.3g}")
    assert p > 1e-4, p


@pytest.mark.slow
def test_planted_bug_fails_the_one_position_test(target, exact_three, monkeypatch):
    """The target's token taken as the argmax instead of a sample: the same test must fail."""
    argmax = lambda logits, keys, spec: jax.numpy.argmax(logits, -1).astype(jax.numpy.int32)
    res = with_planted_bug(monkeypatch, decode, "_target_token", argmax, lambda: narrow_sampled_run(target))
    p = sampled_pvalue(res, target, exact_three)
    print(f"planted bug p-value {p:.3g}")
    assert p < 1e-6, p
