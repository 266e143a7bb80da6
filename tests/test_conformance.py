"""Drafter conformance: every drafter configuration in FACTORIES passes every check here.

  (a) greedy output == plain greedy output, token for token, over k and batch sizes with ragged prompts;
  (b) sampled output is distributed as the target's (chi-square on the exact joint of the first 3 tokens; a
      planted bug in the residual distribution fails the same test);
  (c) a request's sampled output does not depend on its batch mates (batched == alone);
  (d) EOS ends each row right after its first EOS (one case of the greedy matrix runs with an EOS token);
  (e) greedy output on a (2, 4) mesh of 8 virtual devices == one device (tests/_conformance_mesh_worker.py).

Adding a drafter = its file + one FACTORIES line: a factory gets a Case (the target, k, the prompts and the
target's plain greedy continuations of them, which is what a user's prediction would be) and returns the
SpecConfig fields and the `drafter=` argument. Each factory's drafter must get some drafts accepted and some
rejected on the test target, so that acceptance and rollback both run (asserted below).

Nearly all the time here is XLA compiles (~5-15 s per new program on a 2-core CPU, a run takes well under a
second), so the checks share programs: (b) and (c) share one batch, (a) and (d) one matrix.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import pytest

import specjax
import specjax.verify as verify
from specjax import SamplingParams, SpecConfig
from specjax.models import Model
from specjax.drafters import registry
from conftest import BASELINE_MAX_NEW, perturbed, ragged_prompts
from _stats import exact_joint, gof_pvalue, joint_counts
import _repeat_last_drafter  # noqa: F401  (registers method "repeat_last")


class Case(NamedTuple):
    target: Model
    k: int                        # drafted tokens per step (a tree's nodes besides the root); ignored by "none"
    prompts: list                 # token-id lists
    plain: list                   # the target's plain greedy continuation of each prompt


_near: dict = {}


def near(target: Model) -> Model:
    """The target plus noise (one copy per target): agrees with it often but not always."""
    if id(target) not in _near:
        _near[id(target)] = (target, perturbed(target, 0.02))
    return _near[id(target)][1]


def binary_tree(k: int) -> list:
    """A static tree of k nodes: two children per node, breadth first, rank 0 first."""
    choices, frontier = [], [()]
    while len(choices) < k:
        frontier = [node + (r,) for node in frontier for r in (0, 1)]
        choices += frontier[:k - len(choices)]
    return choices


def edited(row: list, vocab: int) -> list:
    """A prediction with edits: every 5th token substituted and one token dropped (resync after both)."""
    out = [(t + 1) % vocab if i % 5 == 4 else t for i, t in enumerate(row)]
    return out[:7] + out[8:]


def earlier_answers(c: "Case"):
    from specjax.drafters.suffix import SuffixCache
    distinct = list(dict.fromkeys(tuple(p) for p in c.plain))
    return SuffixCache(edited(list(p), c.target.config.vocab_size) for p in distinct)


def lookahead_fields(window: int, ngram: int, guesses: int) -> dict:
    return dict(method="lookahead", num_speculative_tokens=(window + guesses) * (ngram - 1),
                drafter_options=dict(window_size=window, ngram_size=ngram, guess_set_size=guesses))


_heads: dict = {}


def cached(kind: str, target: Model, build):
    """One drafter artifact per (kind, target), built on first use."""
    if (kind, id(target)) not in _heads:
        _heads[(kind, id(target))] = (target, build(target))
    return _heads[(kind, id(target))][1]


def identity_medusa(target: Model):
    """Medusa heads as initialised for training (ResBlocks at zero, the target's LM head as the projection):
    every head proposes the target's own next-token guess, right whenever the text repeats."""
    from specjax.drafters import medusa
    from specjax.drafters.base import target_weight
    return medusa.MedusaHeads(4, 1, "shared", medusa.init_heads(None, 4, 1, target_weight(target.params, "lm_head"),
                                                                 "shared"), "identity")


def near_pard(target: Model):
    """A PARD draft: near(target) with 7 mean-embedding mask rows appended, so draft 1 is (nearly) the target's own
    guess and the mask drafts are an untrained model's guesses: some accepted, many rejected."""
    from specjax.drafters import pard
    params, cfg = pard.add_mask_rows(near(target).params, target.config, 7)
    return pard.PardModel(Model(cfg, params, None, "near-pard"), tuple(range(target.config.vocab_size,
                                                                               cfg.vocab_size)))


def informative_eagle(kind: str):
    from test_eagle import informative
    return lambda target: informative(target, kind)


def informative_mtp(kind: str):
    from test_mtp import informative
    return lambda target: informative(target, kind, 3)


FACTORIES = {
    "none": lambda c: (dict(), None),
    "draft_model": lambda c: (dict(method="draft_model", num_speculative_tokens=c.k), near(c.target)),
    "draft_model-static_tree": lambda c: (dict(method="draft_model", tree_choices=binary_tree(c.k)),
                                          near(c.target)),
    "draft_model-dynamic_tree": lambda c: (dict(method="draft_model", num_steps=min(c.k, 3), topk=2,
                                                num_draft_tokens=c.k + 1), near(c.target)),
    "ngram": lambda c: (dict(method="ngram", num_speculative_tokens=c.k, prompt_lookup_min=1, prompt_lookup_max=3),
                        None),
    "predicted": lambda c: (dict(method="predicted", num_speculative_tokens=c.k),
                            [edited(p, c.target.config.vocab_size) for p in c.plain]),
    "repeat_last": lambda c: (dict(method="repeat_last", num_speculative_tokens=c.k), None),
    "medusa": lambda c: (dict(method="medusa", num_speculative_tokens=c.k), cached("medusa", c.target, identity_medusa)),
    "medusa-static_tree": lambda c: (dict(method="medusa", tree_choices=binary_tree(c.k)),
                                     cached("medusa", c.target, identity_medusa)),
    "eagle": lambda c: (dict(method="eagle", num_speculative_tokens=c.k),
                        cached("eagle", c.target, informative_eagle("eagle"))),
    "eagle2-dynamic_tree": lambda c: (dict(method="eagle", num_steps=min(c.k, 3), topk=2, num_draft_tokens=c.k + 1),
                                      cached("eagle", c.target, informative_eagle("eagle"))),
    "eagle3": lambda c: (dict(method="eagle3", num_speculative_tokens=c.k),
                         cached("eagle3", c.target, informative_eagle("eagle3"))),
    "mtp": lambda c: (dict(method="mtp", num_speculative_tokens=c.k), cached("mtp", c.target, informative_mtp("mtp"))),
    "mtp_heads": lambda c: (dict(method="mtp_heads", num_speculative_tokens=c.k),
                            cached("mtp_heads", c.target, informative_mtp("mtp_heads"))),
    # A fresh global cache per call (so a request decoded alone sees what it saw in its batch) holding earlier
    # "answers": the plain outputs with edits, as if the same prompts had been asked before.
    "suffix": lambda c: (dict(method="suffix", num_speculative_tokens=c.k,
                              drafter_options=dict(suffix_decoding_max_cached_requests=64)), earlier_answers(c)),    # Lookahead's k is fixed by (W + G)(N - 1): the smallest shape at k = 1, a 2-level window beyond.
    "lookahead": lambda c: (lookahead_fields(*((1, 2, 1) if c.k <= 1 else (2, 3, 2))), None),
    "pard": lambda c: (dict(method="pard", num_speculative_tokens=c.k), cached("pard", c.target, near_pard)),
}


def run(name: str, case: Case, seed: int = 0, **cfg):
    """-> (the config, the generate() result) of factory `name` on `case`; cfg: more SpecConfig fields."""
    kw, drafter = FACTORIES[name](case)
    config = SpecConfig(**kw, **cfg)
    return config, specjax.generate(case.target, case.prompts, config, drafter=drafter, seed=seed)


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
                slow = (k == 1 and (b > 1 or name == "pard")) or (k == 3 and b == 1 and name != "draft_model") \
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

SP = SamplingParams(temperature=0.8, top_k=5, top_p=0.9)
PROMPT = [5, 17, 50, 40, 5, 17]    # ends in a repeat: prompt lookup proposes 50, which the target often samples
N_SAMPLES = 1500
MATES = ragged_prompts(3, seed=3)        # other prompts in the same batch (plain greedy output: baselines[3])
K_SAMPLED = 3


@pytest.fixture(scope="module")
def exact_three(target):
    return exact_joint(target, PROMPT, SP)


@pytest.fixture(scope="module")
def sampled_case(target, baselines) -> Case:
    """N_SAMPLES requests of PROMPT followed by MATES: the chi-square counts the first, and the batch-mates test
    decodes some of each alone."""
    prompt_plain = specjax.generate(target, [PROMPT], SpecConfig(max_new_tokens=BASELINE_MAX_NEW)).tokens
    return Case(target, K_SAMPLED, [PROMPT] * N_SAMPLES + MATES, prompt_plain * N_SAMPLES + baselines[3])


_sampled: dict = {}


def sampled_run(name: str, case: Case, fresh: bool = False):
    """-> (config, result) of factory `name` at SP, 8 new tokens per request (computed once per factory)."""
    if fresh or name not in _sampled:
        out = run(name, case, seed=11, max_new_tokens=8, temperature=SP.temperature, top_k=SP.top_k,
                  top_p=SP.top_p)
        if fresh:
            return out
        _sampled[name] = out
    return _sampled[name]


def sampled_pvalue(res, target, exact) -> float:
    return gof_pvalue(joint_counts(res.tokens[:N_SAMPLES], target.config.vocab_size), exact)


@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n in SAMPLED_FAST else [pytest.mark.slow])
                                  for n in FACTORIES])
def test_sampled_distribution_matches_target(target, exact_three, sampled_case, name):
    """The joint distribution of the first 3 sampled tokens is the target's (by enumeration)."""
    config, res = sampled_run(name, sampled_case)
    assert_both_paths(name, config, res.stats)
    p = sampled_pvalue(res, target, exact_three)
    print(f"{name}: p-value {p:.3g}")
    assert p > 1e-4, p


def with_planted_bug(monkeypatch, module, name: str, bug, decode_fn):
    """decode_fn() with module.name replaced by `bug`; jit caches are cleared before and after, so the compiled
    decode loop is re-traced with the bug and nothing compiled with it survives the test."""
    monkeypatch.setattr(module, name, bug)
    jax.clear_caches()
    try:
        return decode_fn()
    finally:
        monkeypatch.undo()
        jax.clear_caches()


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
    kw, drafter = FACTORIES[name](sampled_case)
    per_request = registry.get(config.method).per_request_params
    for i in [0] + list(range(N_SAMPLES, N_SAMPLES + len(MATES))):
        alone = specjax.generate(target, [sampled_case.prompts[i]], config, seed=11, request_ids=[i],
                                 drafter=drafter[i:i + 1] if per_request else drafter)
        assert alone.tokens[0] == batched.tokens[i], i


# ---- (e) a (2, 4) mesh of virtual devices ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def mesh_result() -> dict:
    from test_sharding import run_worker
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
