"""Confidence-gated drafting (SpecConfig.draft_confidence_threshold): a chain drafter reports its top probability
at each draft position (Draft.confidence); a row proposes the leading drafts whose running product stays at or above the
threshold, and a step where no active row proposes anything is one target position. Greedy output stays plain
greedy output for every drafter that reports confidence; sampled output keeps the target's distribution (with a
planted bug that must fail the same test); a request's output does not depend on its batch mates; bad settings
are refused by name."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
import specjax.verify as verify
from specjax import SpecConfig
from specjax.drafters import registry
from specjax.drafters.base import Context, chain_scan
from specjax.drafters.draft_model import drafter as draft_model_drafter
from conformance_factories import FACTORIES, N_SAMPLES, Case, run, sampled_pvalue, with_planted_bug
from test_conformance import sampled_run
from test_one_position_steps import check_counts
from tiny import BASELINE_MAX_NEW, ragged_prompts

# Every chain factory whose drafter reports confidence (all the model drafters; lookup drafters do not).
GATED = ["draft_model", "medusa", "medusa-target_head", "eagle", "eagle3", "eagle3.1", "mtp", "mtp_heads", "pard",
         "dflash", "dflash-draft_vocab", "layer_skip"]
# Factories whose drafts on the toy straddle the threshold below: some steps wide, some one position.
STRADDLING = {"draft_model", "eagle3", "medusa", "mtp", "pard", "layer_skip", "eagle"}
THRESHOLD = 0.3
FAST = {"draft_model", "eagle3", "dflash", "layer_skip"}     # make test's share; CI's test-slow runs the rest


def counts_agree(stats: dict, k: int, batch: int) -> None:
    """Every verify row-step drafted k and has one histogram entry and a trace entry >= 0; a batch of one is
    checked step by step (test_one_position_steps.check_counts)."""
    assert int((stats["accept_trace"] >= 0).sum()) == sum(stats["accept_hist"]) == stats["drafted"] // k
    if batch == 1:
        check_counts(stats, k)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n in FAST else [pytest.mark.slow]) for n in GATED])
def test_greedy_equals_plain_through_the_gate(target, baselines, name, batch):
    case = Case(target, 3, ragged_prompts(batch, seed=batch), baselines[batch])
    _, res = run(name, case, max_new_tokens=BASELINE_MAX_NEW, draft_confidence_threshold=THRESHOLD)
    assert res.tokens == baselines[batch]
    counts_agree(res.stats, 3, batch)
    if name in STRADDLING:
        assert 0 < res.stats["plain_passes"] < res.stats["target_passes"], res.stats


def test_a_higher_threshold_drafts_less(target, baselines):
    case = Case(target, 3, ragged_prompts(3, seed=3), baselines[3])
    drafted = [run("draft_model", case, max_new_tokens=BASELINE_MAX_NEW, draft_confidence_threshold=t)[1]
               .stats["drafted"] for t in (None, 0.6, 1.0)]       # one compiled loop per threshold
    assert drafted[0] > drafted[1] > drafted[2] == 0, drafted


def test_sampled_distribution_through_the_gate(target, exact_three, sampled_case):
    _, res = sampled_run("draft_model", sampled_case, gate=THRESHOLD)
    assert 0 < res.stats["plain_passes"] and res.stats["drafted"] > 0, res.stats
    p = sampled_pvalue(res, target, exact_three)
    print(f"gated draft_model: p-value {p:.3g}")
    assert p > 1e-4, p


@pytest.mark.slow          # a second sampled batch of 1,503 requests: CI runs it in test-slow
def test_planted_bug_fails_the_gated_sampling_test(target, exact_three, sampled_case, monkeypatch):
    """Resampling from p rather than norm(max(0, p - q)) after a rejection: the gated run must fail the same test."""
    _, res = with_planted_bug(monkeypatch, verify, "residual_distribution", lambda p, q: p,
                              lambda: sampled_run("draft_model", sampled_case, fresh=True, gate=THRESHOLD))
    p = sampled_pvalue(res, target, exact_three)
    print(f"gated planted bug p-value {p:.3g}")
    assert p < 1e-6, p


@pytest.mark.slow          # a third sampled batch: CI runs it in test-slow
def test_gating_on_the_sampled_token_fails_the_sampling_test(target, exact_three, sampled_case, monkeypatch):
    """Gating on the probability of the token drawn (rather than the distribution's top probability) verifies a
    sampled draft or not according to the draw: biased, and the same test must say so."""
    real = draft_model_drafter.pick_tokens

    def on_the_draw(logits, key, sp):
        tokens, probs, _ = real(logits, key, sp)
        return tokens, probs, jnp.take_along_axis(probs, tokens[..., None], axis=-1)[..., 0]
    _, res = with_planted_bug(monkeypatch, draft_model_drafter, "pick_tokens", on_the_draw,
                              lambda: sampled_run("draft_model", sampled_case, fresh=True, gate=THRESHOLD))
    p = sampled_pvalue(res, target, exact_three)
    print(f"gated on the draw: p-value {p:.3g}")
    assert p < 1e-6, p


@pytest.mark.slow          # decodes requests alone: CI runs it in test-slow
@pytest.mark.parametrize("name", ["draft_model", "eagle3"])
def test_batch_mates_do_not_change_a_gated_request(target, sampled_case, name):
    """Whether a step is one position or k + 1 depends on the batch; a request's sampled output does not."""
    config, batched = sampled_run(name, sampled_case, gate=THRESHOLD)
    _, drafter = FACTORIES[name](sampled_case)
    for i in [0, N_SAMPLES, N_SAMPLES + 2]:
        alone = specjax.generate(target, [sampled_case.prompts[i]], config, seed=11, request_ids=[i], drafter=drafter)
        assert alone.tokens[0] == batched.tokens[i], i


def test_bad_settings_are_refused(target):
    prompts = ragged_prompts(1, seed=1)
    for bad in (0, 0.0, 1.5, -0.2, True, "0.5"):
        with pytest.raises(ValueError, match="draft_confidence_threshold must be in"):
            SpecConfig(method="draft_model", num_speculative_tokens=3, draft_confidence_threshold=bad)
    with pytest.raises(ValueError, match="applies to chains"):
        SpecConfig(method="draft_model", num_steps=2, topk=2, num_draft_tokens=4, draft_confidence_threshold=0.5)
    with pytest.raises(ValueError, match="draft_confidence_threshold is not used by method='none'"):
        registry.resolve(SpecConfig(draft_confidence_threshold=0.5))
    with pytest.raises(ValueError, match="method='ngram' does not report the confidence"):
        specjax.generate(target, prompts, SpecConfig(method="ngram", num_speculative_tokens=3, max_new_tokens=4,
                                                     draft_confidence_threshold=0.5))


def test_a_gated_chain_is_drafted_only_where_a_row_proposes():
    """base.chain_scan under the gate: where no row's first confidence reaches the threshold the loop verifies one
    position, so the chain is not computed (filler: tokens 0, confidence 0, q a point mass); where some row's does,
    the whole chain is the scan's. A first pick inside the scan (running None) decides the same way."""
    V, n = 5, 4

    def body(carry, key):
        i, calls = carry
        probs = jax.nn.one_hot(jnp.full((2,), i % V), V) * 0.5 + 0.1
        return (i + 1, calls + 1), (jnp.full((2,), 7 + i, jnp.int32), probs, jnp.full((2,), 0.2))

    keys = jnp.zeros((n, 2), jnp.uint32)
    ctx = lambda t: Context(jnp.zeros((2, 4), jnp.int32), jnp.ones(2, jnp.int32), jnp.ones(2, jnp.int32),
                            draft_confidence_threshold=t)
    start = (jnp.int32(0), jnp.int32(0))
    (_, calls), scanned = chain_scan(body, start, keys, ctx(None), jnp.array([0.1, 0.1]))
    assert int(calls) == n
    gated = jax.jit(lambda k, r: chain_scan(body, start, k, ctx(0.3), r))
    (_, calls), drafted = gated(keys, jnp.array([0.1, 0.5]))          # row 1 proposes: the whole chain
    assert int(calls) == n
    for a, b in zip(drafted, scanned):
        np.testing.assert_array_equal(a, b)
    (_, calls), (tok, q, conf) = gated(keys, jnp.array([0.1, 0.29]))  # nobody proposes: nothing drafted
    assert int(calls) == 0
    assert (np.asarray(tok) == 0).all() and (np.asarray(conf) == 0).all()
    np.testing.assert_array_equal(q, np.broadcast_to(np.eye(V)[0], (n, 2, V)))
    # The first pick inside the scan (layer skip): drafted, then it decides (0.2 < 0.3: the rest is filler).
    (_, calls), (tok, _, conf) = chain_scan(body, start, keys, ctx(0.3))
    assert int(calls) == 1 and int(tok[0, 0]) == 7 and float(conf[0, 0]) == pytest.approx(0.2)
    assert (np.asarray(conf[1:]) == 0).all()
    (_, calls), _ = chain_scan(body, start, keys, ctx(0.1))
    assert int(calls) == n
    # Greedy picks (q None) alike.
    greedy = lambda carry, key: (lambda c, p: (c, (p[0], None, p[2])))(*body(carry, key))
    (_, calls), (_, none, _) = chain_scan(greedy, start, keys, ctx(0.3), jnp.array([0.1, 0.29]))
    assert int(calls) == 0 and none is None
