"""Narrower verify passes (SpecConfig.verify_widths): a drafter that reports how much it proposed
(Draft.num_drafted) gets each step verified at the fewest of the widths that hold every active row's proposal.
Greedy output stays plain greedy output (a test drafter whose proposals alternate between 1 and 2 drafts, suffix
decoding with its default widths, the confidence-gated chain drafters); the passes are counted by width
(stats["verify_hist"]) and drafted counts what they verified; sampled output keeps the target's distribution
through narrowed passes of sampled drafts (with a planted bug that must fail the same test); bad settings are
refused by name."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
import specjax.verify as verify
from specjax import SpecConfig
from specjax.inputs import encode_all
from specjax.drafters import registry, suffix
from specjax.drafters.base import Draft
from specjax.drafters.registry import DrafterSpec, register
from conformance_factories import N_SAMPLES, PROMPT, SP, run, sampled_pvalue, with_planted_bug, Case
from tiny import BASELINE_MAX_NEW, ragged_prompts

# Drafts of the sampled test: PROMPT ends in a repeat, after which the target often samples 50.
FIXED_DRAFT_TOKENS = (50, 40, 5, 17)


@dataclasses.dataclass(frozen=True)
class OneThenTwoDrafter:
    """Proposes 1 draft (of k) where the committed sequence has an even length and 2 where odd, drawn
    independently from a fixed distribution over FIXED_DRAFT_TOKENS (sampled: q is that distribution; greedy: its
    first tokens). A proposal's length never depends on its draws, so verifying only it is exact; rows of a batch
    differ in it, so a pass is often wider than a row's own proposal."""
    k: int
    vocab_size: int
    target_layers = ()
    target_weights = ()

    def init(self, params, ctx, target_out, sp):
        return jnp.zeros(ctx.length.shape, jnp.int32)                               # [B] commits seen

    def propose(self, params, state, ctx, keys, sp):
        B = ctx.length.shape[0]
        proposed = jnp.where(ctx.length % 2 == 0, 1, 2).astype(jnp.int32)
        if sp.greedy:
            tokens = jnp.broadcast_to(jnp.asarray(FIXED_DRAFT_TOKENS[:self.k], jnp.int32), (B, self.k))
            return Draft(tokens, num_drafted=proposed), state
        q = jnp.zeros((self.vocab_size,)).at[jnp.asarray(FIXED_DRAFT_TOKENS)].set(
            jnp.asarray([0.4, 0.3, 0.2, 0.1]))                                      # [V]
        tokens = jax.vmap(lambda key: jax.random.categorical(key, jnp.log(q), shape=(self.k,)))(keys)   # [B, k]
        return Draft(tokens.astype(jnp.int32), jnp.broadcast_to(q, (B, self.k, self.vocab_size)),
                     num_drafted=proposed), state

    def commit(self, params, state, ctx, num_accepted, target_out, verified):
        assert target_out.logits.shape[1] == verified.tokens.shape[1]             # the pass's own width
        return state + 1


register(DrafterSpec("one_then_two", lambda req: (OneThenTwoDrafter(req.config.k, req.target.config.vocab_size),
                                                  ())), replace=True)


def check_widths(stats: dict, k: int) -> None:
    """Passes counted by width: each is a one-position step or verified some drafts, drafted counts those (a
    batch of one: every verify pass drafted)."""
    hist = stats["verify_hist"]
    assert len(hist) == k + 1 and sum(hist) == stats["target_passes"], stats
    assert stats["drafted"] <= sum(w * n for w, n in enumerate(hist)), stats


@pytest.mark.parametrize("batch", [1, 3])
def test_passes_take_the_narrowest_width_that_holds_the_proposals(target, baselines, batch):
    config = SpecConfig(method="one_then_two", num_speculative_tokens=3, max_new_tokens=BASELINE_MAX_NEW,
                        verify_widths=(1, 2))
    res = specjax.generate(target, ragged_prompts(batch, seed=batch), config)
    assert res.tokens == baselines[batch]
    check_widths(res.stats, 3)
    hist = res.stats["verify_hist"]
    assert hist[0] == hist[3] == 0 and hist[2] > 0, hist
    if batch == 1:                       # one row: both widths, and every pass verified its own proposal
        assert hist[1] > 0 and res.stats["drafted"] == hist[1] + 2 * hist[2], res.stats
    else:                                # some row offered one draft in a 2-draft pass
        assert res.stats["drafted"] < 2 * hist[2], res.stats
    wide = specjax.generate(target, ragged_prompts(batch, seed=batch), dataclasses.replace(config, verify_widths=()))
    assert wide.tokens == baselines[batch] and wide.stats["verify_hist"][3] == wide.stats["target_passes"]
    # a width between them: both proposals fit in 2 drafts
    two = specjax.generate(target, ragged_prompts(batch, seed=batch), dataclasses.replace(config, verify_widths=(2,)))
    assert two.tokens == baselines[batch] and two.stats["verify_hist"][2] == two.stats["target_passes"]


@pytest.mark.parametrize("batch", [1, 3])
def test_suffix_decoding_narrows_by_default_and_keeps_greedy_output(target, baselines, batch):
    """Suffix decoding's proposals grow with the matched suffix: matching the request's own repeats (an empty
    cache), some steps propose a few tokens, some nothing."""
    cache = suffix.SuffixCache([])
    config = SpecConfig(method="suffix", num_speculative_tokens=8, max_new_tokens=BASELINE_MAX_NEW)
    assert config.verify_widths is None and registry.resolve(config).verify_widths == (1, 2, 4)
    res = specjax.generate(target, ragged_prompts(batch, seed=batch), config, drafter=cache)
    assert res.tokens == baselines[batch]
    check_widths(res.stats, 8)
    hist = res.stats["verify_hist"]
    assert hist[0] > 0 and sum(hist[1:8]) > 0, hist


@pytest.mark.parametrize("name", ["draft_model", "eagle3"])
def test_gated_chains_verify_only_their_confident_drafts(target, baselines, name):
    case = Case(target, 3, ragged_prompts(3, seed=3), baselines[3])
    _, res = run(name, case, max_new_tokens=BASELINE_MAX_NEW, draft_confidence_threshold=0.3, verify_widths=(1, 2))
    assert res.tokens == baselines[3]
    check_widths(res.stats, 3)
    assert sum(res.stats["verify_hist"][1:3]) > 0, res.stats


def widths_sampled_run(target, seed: int = 5):
    """N_SAMPLES requests of PROMPT: every pass verifies 1 or 2 sampled drafts of k = 3."""
    return specjax.generate(target, [PROMPT] * N_SAMPLES, SpecConfig(
        method="one_then_two", num_speculative_tokens=3, max_new_tokens=3, verify_widths=(1, 2),
        temperature=SP.temperature, top_k=SP.top_k, top_p=SP.top_p), seed=seed)


def test_sampled_distribution_through_narrower_passes(target, exact_three):
    res = widths_sampled_run(target)
    hist = res.stats["verify_hist"]
    assert hist[1] > 0 and hist[2] > 0 and hist[0] == hist[3] == 0 and res.stats["accepted"] > 0, res.stats
    p = sampled_pvalue(res, target, exact_three)
    print(f"p-value {p:.3g}")
    assert p > 1e-4, p


def test_batch_mates_do_not_change_a_request(target):
    """Each row is verified at its own width when a batch mate's proposal makes the pass wider: decoded alone, a
    request's sampled output is what it was in the batch."""
    prompts = ragged_prompts(3, seed=3) + [PROMPT]
    config = SpecConfig(method="one_then_two", num_speculative_tokens=3, max_new_tokens=12, verify_widths=(1, 2),
                        temperature=SP.temperature, top_k=SP.top_k, top_p=SP.top_p)
    batched = specjax.generate(target, prompts, config, seed=7)
    assert batched.stats["drafted"] < sum(w * n for w, n in enumerate(batched.stats["verify_hist"])), batched.stats
    width = max(map(len, encode_all(target, prompts, "prompt")))
    for i, prompt in enumerate(prompts):    # padded to one width: one compiled program serves every row alone
        alone = specjax.generate(target, [prompt], config, seed=7, request_ids=[i], pad_to=width)
        assert alone.tokens[0] == batched.tokens[i], i


@pytest.mark.slow
def test_planted_bug_fails_the_narrower_pass_test(target, exact_three, monkeypatch):
    """Resampling from p rather than norm(max(0, p - q)) after a rejection: the same test must fail."""
    res = with_planted_bug(monkeypatch, verify, "residual_distribution", lambda p, q: p,
                           lambda: widths_sampled_run(target))
    p = sampled_pvalue(res, target, exact_three)
    print(f"planted bug p-value {p:.3g}")
    assert p < 1e-6, p


def test_bad_settings_are_refused(target):
    for bad in ((0,), (3,), (1, 4), "12", (True,), 2):
        with pytest.raises(ValueError, match=r"verify_widths must be draft counts in \[1, k\)"):
            SpecConfig(method="ngram", num_speculative_tokens=3, verify_widths=bad)
    with pytest.raises(ValueError, match="verify_widths is not used by method='none'"):
        registry.resolve(SpecConfig(verify_widths=(1,)))
    with pytest.raises(ValueError, match="a configured tree verifies all its nodes"):
        SpecConfig(method="draft_model", num_steps=2, topk=2, num_draft_tokens=4, verify_widths=(1,))
    with pytest.raises(ValueError, match="does not say how much it drafted"):
        specjax.generate(target, ragged_prompts(1, seed=1), SpecConfig(
            method="draft_model", num_speculative_tokens=3, max_new_tokens=4, verify_widths=(1,)),
            drafter=target)
    # a schedule's smaller k drops the widths it no longer has
    config = registry.resolve(SpecConfig(method="suffix", num_speculative_tokens=8, draft_len_schedule={1: 8, 4: 2}))
    assert config.for_batch(1).verify_widths == (1, 2, 4) and config.for_batch(4).verify_widths == (1,)
    assert registry.resolve(SpecConfig(method="suffix", num_speculative_tokens=8, verify_widths=())).verify_widths == ()
    assert registry.resolve(SpecConfig(method="ngram", num_speculative_tokens=8)).verify_widths is None
    # a method whose options fix k: the widths are checked against it once resolved
    with pytest.raises(ValueError, match=r"verify_widths must be draft counts in \[1, k\) = \[1, 16\)"):
        registry.resolve(SpecConfig(method="lookahead", verify_widths=(2, 16)))
