"""Drafter conformance: every drafter configuration in FACTORIES passes every check here.

  (a) greedy output == plain greedy output, token for token, over k and batch sizes with ragged prompts;
  (b) sampled output is distributed as the target's (chi-square on the exact joint of the first 3 tokens; a
      planted bug in the residual distribution fails the same test);
  (c) a request's sampled output does not depend on its batch mates (batched == alone);
  (d) EOS ends each row right after its first EOS (one case of the greedy matrix runs with an EOS token);
  (e) greedy output on a (2, 4) mesh of 8 virtual devices == one device (tests/_conformance_mesh_worker.py).

Adding a drafter = its file + one FACTORIES line (tests/conformance_factories.py). The factories cover every
drafter module: base (none), draft_model (chains, static and dynamic trees; a Model, and a draft reading the target's
embedding with and without a draft vocabulary), ngram, predicted, medusa (chain, static and dynamic trees), eagle
(eagle, eagle-2 dynamic tree, eagle3, eagle3.1, P-EAGLE chain and trees), mtp (mtp, mtp_heads), suffix, lookahead,
pard, dflash, layer_skip, and the repeat_last test drafter (tests/_repeat_last_drafter.py, written as a user would).
Each factory's drafter must get some drafts accepted and some rejected on the test target, so that acceptance and
rollback both run (asserted below).

Nearly all the time here is XLA compiles (~5-15 s per new program on a 2-core CPU, a run takes well under a
second), so the checks share programs: (b) and (c) share one batch, (a) and (d) one matrix.
"""
from __future__ import annotations

import dataclasses

import pytest

import specjax
import specjax.verify as verify
from specjax import SpecConfig
from specjax.drafters import registry
from specjax.models import Model
from conformance_factories import FACTORIES, MATES, N_SAMPLES, SP, Case, run, sampled_pvalue, with_planted_bug
from tiny import BASELINE_MAX_NEW, ragged_prompts
from workers import run_worker


def assert_both_paths(name: str, config: SpecConfig, stats: dict) -> None:
    if registry.get(config.method).speculates:
        assert stats["accepted"] > 0, f"{name}: no draft accepted, acceptance is not exercised"
        assert stats["rejected"] > 0, f"{name}: no draft rejected, rollback is not exercised"


# ---- (a) greedy == plain greedy, (d) EOS per row ---------------------------------------------------------------

# make test runs one drafter of each verification path (a draft model's chain with its probabilities, drafts
# without probabilities, a static and a dynamic tree, heads on target features); CI's test-slow runs the rest.
SAMPLED_FAST = ("draft_model", "ngram", "draft_model-static_tree", "eagle2-dynamic_tree", "medusa", "mtp")
KS, BATCHES = (1, 3), (1, 3, 8)
EOS_CASE = (3, 3)           # (k, batch) run with an EOS token (one compile serves (a) and (d))


def _greedy_params():
    for name in FACTORIES:
        # trees of 1 node are chains: trees run at k = 3 only (each case is a compile; make test has a budget)
        for k in ((0,) if name == "none" else KS[-1:] if "tree" in name else KS):
            for b in BATCHES:
                eos = (k, b) == EOS_CASE or (name == "none" and b == EOS_CASE[1])
                # k = 1 with batch mates adds little that k = 3 at the same batch does not: CI runs it in test-slow.
                # PARD at k = 1 (no mask at all) is a draft model's T = 2 catch-up step: test-slow too (budget).
                # k = 3 alone in a batch of 1: make test keeps it for draft_model; k = 3 in a batch of 8 for one
                # drafter of each verification path (SAMPLED_FAST). CI's test-slow runs every case.
                slow = (k == 1 and (b > 1 or name.startswith("pard"))) or (k == 3 and b == 1 and name != "draft_model") \
                    or (k == 3 and b == 8 and name not in SAMPLED_FAST)
                marks = [pytest.mark.slow] if slow else []
                yield pytest.param(name, k, b, eos, id=f"{name}-k{k}-b{b}" + ("-eos" if eos else ""), marks=marks)


@pytest.mark.parametrize("name, k, batch, eos", list(_greedy_params()))
def test_greedy_equals_plain(target, baselines, name, k, batch, eos):
    """Greedy output is plain greedy output; with an EOS token each row ends right after its first EOS (tokens
    accepted after it in the same step are dropped) while the other rows go on."""
    base, model = baselines[batch], target
    if eos:      # a token first generated at step 5 of row 1 (not before): rows stop at different steps
        eos_id = next(t for i, t in enumerate(base[1]) if i >= 4 and t not in base[1][:i])
        model = Model(dataclasses.replace(target.config, eos_token_id=eos_id), target.params, None, "eos")
        base = [b[: b.index(eos_id) + 1] if eos_id in b else b for b in base]
        assert len(set(map(len, base))) > 1, base
    config, res = run(name, Case(model, k, ragged_prompts(batch, seed=batch), baselines[batch]),
                      max_new_tokens=BASELINE_MAX_NEW)
    assert res.tokens == base
    if batch > 1:                # over one row a drafter may never be right (repeat_last never is at batch 1)
        assert_both_paths(name, config, res.stats)


# ---- (b) sampled output is distributed as the target's, (c) batch mates ---------------------------------------

# The sampled batch is conftest.py's sampled_case (N_SAMPLES requests of one prompt, then MATES), decoded once per
# factory; exact_three (conftest.py) is the target's own joint distribution of its first 3 tokens.
_sampled: dict = {}


def sampled_run(name: str, case: Case, fresh: bool = False, gate: float | None = None):
    """-> (config, result) of factory `name` at SP, 8 new tokens per request (computed once per factory and
    draft_confidence_threshold `gate`)."""
    if fresh or (name, gate) not in _sampled:
        out = run(name, case, seed=11, max_new_tokens=8, temperature=SP.temperature, top_k=SP.top_k,
                  top_p=SP.top_p, draft_confidence_threshold=gate)
        if fresh:
            return out
        _sampled[name, gate] = out
    return _sampled[name, gate]


@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n in SAMPLED_FAST else [pytest.mark.slow])
                                  for n in FACTORIES])
def test_sampled_distribution_matches_target(target, exact_three, sampled_case, name):
    """The joint distribution of the first 3 sampled tokens is the target's (by enumeration)."""
    config, res = sampled_run(name, sampled_case)
    assert_both_paths(name, config, res.stats)
    p = sampled_pvalue(res, target, exact_three)
    print(f"{name}: p-value {p:.3g}")
    assert p > 1e-4, p


def test_planted_bug_fails_the_sampling_test(target, exact_three, sampled_case, monkeypatch):
    """Resampling from p instead of norm(max(0, p - q)) after a rejection biases the output toward the drafts:
    the same test must fail. (test_trees_decode plants the same bug for tree sampling.)"""
    _, res = with_planted_bug(monkeypatch, verify, "residual_distribution", lambda p, q: p,
                              lambda: sampled_run("draft_model", sampled_case, fresh=True))
    p = sampled_pvalue(res, target, exact_three)
    print(f"planted bug p-value {p:.3g}")
    assert p < 1e-6, p


@pytest.mark.slow          # 4 more decodes per factory; make test has a 20-minute budget, CI runs it in test-slow
@pytest.mark.parametrize("name", list(FACTORIES))
def test_batch_mates_do_not_change_a_request(target, sampled_case, name):
    """A request's sampled output depends only on (seed, request_id): decoded alone it is what it was in the
    batch of N_SAMPLES + 3 above (other prompts, lengths, acceptance; another padding)."""
    config, batched = sampled_run(name, sampled_case)
    per_request = registry.get(config.method).per_request_params
    for i in [0] + list(range(N_SAMPLES, N_SAMPLES + len(MATES))):
        # the drafter as the batch had it (suffix decoding's cache learns each call's outputs: a fresh one each)
        _, drafter = FACTORIES[name](sampled_case)
        alone = specjax.generate(target, [sampled_case.prompts[i]], config, seed=11, request_ids=[i],
                                 drafter=drafter[i:i + 1] if per_request else drafter)
        assert alone.tokens[0] == batched.tokens[i], i


# ---- (e) a (2, 4) mesh of virtual devices ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def mesh_result() -> dict:
    return run_worker("_conformance_mesh_worker.py")


@pytest.mark.slow          # one 8-device subprocess compiling every factory (~1-2 min): CI runs it in test-slow
@pytest.mark.parametrize("name", list(FACTORIES))
def test_mesh_same_tokens_as_one_device(mesh_result, name):
    """Greedy output on a (2, 4) mesh (weights split 4 ways, 5 requests padded to 6 over 2) == plain greedy output
    on one device."""
    assert mesh_result["tokens"][name] == mesh_result["plain"]
    if name != "none":
        stats = mesh_result["stats"][name]
        assert stats["accepted"] > 0 and stats["rejected"] > 0, stats
