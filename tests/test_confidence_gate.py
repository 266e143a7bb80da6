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
import specjax.drafters.draft_model as draft_model
import specjax.verify as verify
from specjax import SpecConfig
from specjax.drafters.base import Context, chain_scan
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
               .stats["drafted"] for t in (None, 0.3, 0.6, 1.0)]
    assert drafted[0] > drafted[1] > drafted[2] > drafted[3] == 0, drafted


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
    real = draft_model.pick_tokens

    def on_the_draw(logits, key, sp):
        tokens, probs, _ = real(logits, key, sp)
        return tokens, probs, jnp.take_along_axis(probs, tokens[..., None], axis=-1)[..., 0]
    _, res = with_planted_bug(monkeypatch, draft_model, "pick_tokens", on_the_draw,
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
        SpecConfig(draft_confidence_threshold=0.5)
    with pytest.raises(ValueError, match="method='ngram' does not report the confidence"):
        specjax.generate(target, prompts, SpecConfig(method="ngram", num_speculative_tokens=3, max_new_tokens=4,
                                                     draft_confidence_threshold=0.5))


def test_a_gated_chain_stops_once_no_row_can_be_verified():
    """base.chain_scan: under the gate the chain's positions stop once every row's running product of confidences
    has fallen below the threshold (the loop verifies none past that); the positions computed are the scan's,
    the rest filler the gate cuts (confidence 0; q a point mass, so even an unguarded verifier stays exact)."""
    conf = jnp.array([[0.9, 0.5, 0.9, 0.9, 0.9, 0.9],        # row 0: 0.9 * 0.9 = 0.81, then 0.405 at step 2
                      [0.9, 0.9, 0.9, 0.9, 0.9, 0.9]])       # row 1: 0.81, 0.73, 0.66, 0.59 < 0.6 at step 4
    V = 5

    def body(carry, key):
        i, calls = carry
        c = conf[:, i]
        probs = jax.nn.one_hot(jnp.full((2,), i % V), V) * 0.5 + 0.1
        return (i + 1, calls + 1), (jnp.full((2,), 7 + i, jnp.int32), probs, c)

    keys = jnp.zeros((6, 2), jnp.uint32)
    ctx = lambda t: Context(jnp.zeros((2, 4), jnp.int32), jnp.ones(2, jnp.int32), jnp.ones(2, jnp.int32),
                            draft_confidence_threshold=t)
    first = jnp.array([0.9, 0.9])
    (_, every), (tok, q, c) = chain_scan(body, (jnp.int32(0), jnp.int32(0)), keys, ctx(None), first)
    assert int(every) == 6
    (_, calls), (gtok, gq, gc) = jax.jit(lambda k: chain_scan(body, (jnp.int32(0), jnp.int32(0)), k, ctx(0.6),
                                                              first))(keys)
    # Row 0's running product falls below 0.6 after two scanned positions, row 1's after four (0.9^5 = 0.59).
    assert int(calls) == 4, int(calls)
    np.testing.assert_array_equal(gtok[:4], tok[:4])
    np.testing.assert_array_equal(gq[:4], q[:4])
    np.testing.assert_array_equal(gc[:4], c[:4])
    assert (np.asarray(gtok[4:]) == 0).all() and (np.asarray(gc[4:]) == 0).all()
    np.testing.assert_array_equal(gq[4:], np.broadcast_to(np.eye(V)[0], (2, 2, V)))
    # What the loop's gate reads from them: row 0 proposes 2 drafts (0.9, 0.81, then 0.405), row 1 four (0.9 ..
    # 0.656, then 0.59).
    full = jnp.concatenate([first[:, None], gc.T], axis=1)
    np.testing.assert_array_equal(jnp.sum(jnp.cumprod(full, axis=1) >= 0.6, axis=1), [2, 4])
    # Greedy picks (q None) stop the same way.
    greedy = lambda carry, key: (lambda c, p: (c, (p[0], None, p[2])))(*body(carry, key))
    (_, calls), (_, none, _) = chain_scan(greedy, (jnp.int32(0), jnp.int32(0)), keys, ctx(0.6), first)
    assert int(calls) == 4 and none is None
