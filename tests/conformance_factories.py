"""The conformance suite's drafter configurations (tests/test_conformance.py runs every check on each; the policy
tests and the mesh workers reuse them): one FACTORIES line per drafter configuration.

Adding a drafter = its file + one FACTORIES line: a factory gets a Case (the target, k, the prompts and the
target's plain greedy continuations of them, which is what a user's prediction would be) and returns the
SpecConfig fields and the `drafter=` argument. Each factory's drafter must get some drafts accepted and some
rejected on the test target, so that acceptance and rollback both run (the suite asserts it)."""
from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax
import numpy as np

import specjax
from specjax import SamplingParams, SpecConfig
from specjax.drafters import dflash, draft_model, medusa, pard
from specjax.drafters.base import target_weight
from specjax.drafters.suffix import SuffixCache
from specjax.models import Model
from _stats import gof_pvalue, joint_counts
from drafter_weights import informative_eagle, informative_mtp
from tiny import perturbed, ragged_prompts
import _repeat_last_drafter  # noqa: F401  (registers method "repeat_last", a drafter written as a user would)


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


def earlier_answers(c: Case) -> SuffixCache:
    distinct = list(dict.fromkeys(tuple(p) for p in c.plain))
    return SuffixCache(edited(list(p), c.target.config.vocab_size) for p in distinct)


def lookahead_fields(window: int, ngram: int, guesses: int) -> dict:
    return dict(method="lookahead", num_speculative_tokens=(window + guesses) * (ngram - 1),
                drafter_options=dict(window_size=window, ngram_size=ngram, guess_set_size=guesses))


_heads: dict = {}


def cached(kind: str, target: Model, build: Callable[[Model], object]):
    """One drafter artifact per (kind, target), built on first use."""
    if (kind, id(target)) not in _heads:
        _heads[(kind, id(target))] = (target, build(target))
    return _heads[(kind, id(target))][1]


def identity_medusa(target: Model, layout: str = "shared") -> medusa.MedusaHeads:
    """Medusa heads as initialised for training (ResBlocks at zero, the target's LM head as the projection):
    every head proposes the target's own next-token guess, right whenever the text repeats."""
    return medusa.MedusaHeads(4, 1, layout, medusa.init_heads(None, 4, 1, target_weight(target.params, "lm_head"),
                                                               layout), "identity")


def _most_common(c: "Case") -> int:
    """The token the target's plain outputs use most."""
    return max(set(t for row in c.plain for t in row), key=lambda t: sum(row.count(t) for row in c.plain))


def guessing_dflash(c: "Case") -> dflash.DFlashWeights:
    """An untrained DFlash drafter whose every draft leans to the token the target's plain outputs use most (its
    mask embedding is that token's LM-head column; small random layers around it): some drafts accepted, most
    not."""
    target = c.target
    cfg = dflash.dflash_config(target, num_layers=2, block_size=8, target_layers=(0, 1))
    params = dflash.init_params(jax.random.PRNGKey(3), cfg, std=0.002)
    params["mask_embed"] = 10 * target_weight(target.params, "lm_head")[:, _most_common(c)]  # dominant over layers
    return dflash.DFlashWeights(cfg, params, "guessing-dflash")


def guessing_dflash_vocab(c: "Case") -> dflash.DFlashWeights:
    """guessing_dflash with a draft vocabulary: its own head over the even target tokens and the common one (the
    target's LM-head columns), so drafts go through the scatter to the target's vocabulary and the target's plain
    outputs often fall outside what it can draft."""
    w = guessing_dflash(c)
    V = c.target.config.vocab_size
    ids = np.union1d(np.arange(0, V, 2), [_most_common(c)])
    cfg = dataclasses.replace(w.config, draft_vocab_size=len(ids))
    params = dict(w.params, lm_head=target_weight(c.target.params, "lm_head")[:, ids])
    return dflash.DFlashWeights(cfg, params, "guessing-dflash-vocab", (ids - np.arange(len(ids))).astype(np.int64))


def near_pard(target: Model) -> pard.PardModel:
    """A PARD draft: near(target) with 7 mean-embedding mask rows appended, so draft 1 is (nearly) the target's own
    guess and the mask drafts are an untrained model's guesses: some accepted, many rejected."""
    params, cfg = pard.add_mask_rows(near(target).params, target.config, 7)
    return pard.PardModel(Model(cfg, params, None, "near-pard"), tuple(range(target.config.vocab_size,
                                                                               cfg.vocab_size)))


def pard_target_embedding(c: "Case") -> pard.TargetEmbeddingPard:
    """A PARD draft reading the target's embedding: the target's first layer and final norm, 7 mean-embedding masks
    and its own head over the even target tokens and the common one (the target's head columns): draft 1 is a
    one-layer guess at the target's, the masks an untrained model's, and many of the target's tokens fall outside
    what it can draft."""
    V = c.target.config.vocab_size
    ids = np.union1d(np.arange(0, V, 2), [_most_common(c)])
    return pard.init_target_embedding(c.target, 1, 7, d2t=(ids - np.arange(len(ids))).astype(np.int64))


def draft_from_target(c: "Case", draft_vocab: bool = True) -> draft_model.TargetEmbeddingDraft:
    """A draft model made from the target as train.draft --init_layers makes one: the target's first layer and final
    norm, reading the target's embedding, and its own head over the even target tokens and the common one (the
    target's head columns; draft_vocab=False: the target's own head). A one-layer guess at the target: some drafts
    accepted, many rejected, and with the draft vocabulary many of the target's tokens outside what it can draft."""
    V = c.target.config.vocab_size
    ids = np.union1d(np.arange(0, V, 2), [_most_common(c)])
    d2t = (ids - np.arange(len(ids))).astype(np.int64) if draft_vocab else None
    return draft_model.init_from_target(c.target, 1, d2t=d2t)


def parallel_eagle(target: Model):
    return cached("p_eagle", target, lambda t: informative_eagle(t, "eagle3", parallel_drafting=True))


FACTORIES = {
    "none": lambda c: (dict(), None),
    "draft_model": lambda c: (dict(method="draft_model", num_speculative_tokens=c.k), near(c.target)),
    "draft_model-static_tree": lambda c: (dict(method="draft_model", tree_choices=binary_tree(c.k)),
                                          near(c.target)),
    "draft_model-dynamic_tree": lambda c: (dict(method="draft_model", num_steps=min(c.k, 3), topk=2,
                                                num_draft_tokens=c.k + 1), near(c.target)),
    "draft_model-target_embedding": lambda c: (dict(method="draft_model", num_speculative_tokens=c.k),
                                               draft_from_target(c)),
    "draft_model-target_embedding-static_tree": lambda c: (dict(method="draft_model", tree_choices=binary_tree(c.k)),
                                                           draft_from_target(c)),
    "draft_model-target_embedding-dynamic_tree": lambda c: (dict(method="draft_model", num_steps=min(c.k, 3), topk=2,
                                                                 num_draft_tokens=c.k + 1),
                                                            draft_from_target(c, draft_vocab=False)),
    "ngram": lambda c: (dict(method="ngram", num_speculative_tokens=c.k, prompt_lookup_min=1, prompt_lookup_max=3),
                        None),
    "predicted": lambda c: (dict(method="predicted", num_speculative_tokens=c.k),
                            [edited(p, c.target.config.vocab_size) for p in c.plain]),
    "repeat_last": lambda c: (dict(method="repeat_last", num_speculative_tokens=c.k), None),
    "medusa": lambda c: (dict(method="medusa", num_speculative_tokens=c.k), cached("medusa", c.target, identity_medusa)),
    "medusa-static_tree": lambda c: (dict(method="medusa", tree_choices=binary_tree(c.k)),
                                     cached("medusa", c.target, identity_medusa)),
    "medusa-dynamic_tree": lambda c: (dict(method="medusa", num_steps=min(c.k, 3), topk=2, num_draft_tokens=c.k + 1),
                                      cached("medusa", c.target, identity_medusa)),
    "medusa-target_head": lambda c: (dict(method="medusa", num_speculative_tokens=c.k),
                                     cached("medusa-target_head", c.target,
                                            lambda t: identity_medusa(t, "target_head"))),
    "eagle": lambda c: (dict(method="eagle", num_speculative_tokens=c.k),
                        cached("eagle", c.target, lambda t: informative_eagle(t, "eagle"))),
    "eagle2-dynamic_tree": lambda c: (dict(method="eagle", num_steps=min(c.k, 3), topk=2, num_draft_tokens=c.k + 1),
                                      cached("eagle", c.target, lambda t: informative_eagle(t, "eagle"))),
    "eagle3": lambda c: (dict(method="eagle3", num_speculative_tokens=c.k),
                         cached("eagle3", c.target, lambda t: informative_eagle(t, "eagle3"))),
    "eagle3.1": lambda c: (dict(method="eagle3", num_speculative_tokens=c.k),
                           cached("eagle3.1", c.target, lambda t: informative_eagle(t, "eagle3", fc_norm=True,
                                                                                    norm_output=True))),
    "p_eagle": lambda c: (dict(method="eagle3", num_speculative_tokens=c.k), parallel_eagle(c.target)),
    "p_eagle-static_tree": lambda c: (dict(method="eagle3", tree_choices=binary_tree(c.k)), parallel_eagle(c.target)),
    "p_eagle-dynamic_tree": lambda c: (dict(method="eagle3", num_steps=min(c.k, 3), topk=2,
                                            num_draft_tokens=c.k + 1), parallel_eagle(c.target)),
    "mtp": lambda c: (dict(method="mtp", num_speculative_tokens=c.k),
                      cached("mtp", c.target, lambda t: informative_mtp(t, "mtp", 3))),
    "mtp_heads": lambda c: (dict(method="mtp_heads", num_speculative_tokens=c.k),
                            cached("mtp_heads", c.target, lambda t: informative_mtp(t, "mtp_heads", 3))),
    # A fresh global cache per call (so a request decoded alone sees what it saw in its batch) holding earlier
    # "answers": the plain outputs with edits, as if the same prompts had been asked before.
    "suffix": lambda c: (dict(method="suffix", num_speculative_tokens=c.k,
                              drafter_options=dict(suffix_decoding_max_cached_requests=64)), earlier_answers(c)),
    # Lookahead's k is fixed by (W + G)(N - 1): the smallest shape at k = 1, a 2-level window beyond.
    "lookahead": lambda c: (lookahead_fields(*((1, 2, 1) if c.k <= 1 else (2, 3, 2))), None),
    "pard": lambda c: (dict(method="pard", num_speculative_tokens=c.k), cached("pard", c.target, near_pard)),
    "pard-target_embedding": lambda c: (dict(method="pard", num_speculative_tokens=c.k), pard_target_embedding(c)),
    # The test target has 2 layers: the draft pass runs layer 0 alone.
    "dflash": lambda c: (dict(method="dflash", num_speculative_tokens=c.k), guessing_dflash(c)),
    "dflash-draft_vocab": lambda c: (dict(method="dflash", num_speculative_tokens=c.k), guessing_dflash_vocab(c)),
    "dflash-static_tree": lambda c: (dict(method="dflash", tree_choices=binary_tree(c.k)), guessing_dflash(c)),
    "dflash-dynamic_tree": lambda c: (dict(method="dflash", num_steps=min(c.k, 3), topk=2, num_draft_tokens=c.k + 1),
                                      guessing_dflash_vocab(c)),
    "layer_skip": lambda c: (dict(method="layer_skip", num_speculative_tokens=c.k,
                                  drafter_options=dict(skip_layers=[1])), None),
    "layer_skip-dynamic_tree": lambda c: (dict(method="layer_skip", num_steps=min(c.k, 3), topk=2,
                                               num_draft_tokens=c.k + 1, drafter_options=dict(skip_layers=[1])),
                                          None),
}


def run(name: str, case: Case, seed: int = 0, **cfg):
    """-> (the config, the generate() result) of factory `name` on `case`; cfg: more SpecConfig fields."""
    kw, drafter = FACTORIES[name](case)
    config = SpecConfig(**kw, **cfg)
    return config, specjax.generate(case.target, case.prompts, config, drafter=drafter, seed=seed)


# ---- the sampled batch (conftest.py's sampled_case and exact_three fixtures) -----------------------------------

SP = SamplingParams(temperature=0.8, top_k=5, top_p=0.9)
PROMPT = [5, 17, 50, 40, 5, 17]    # ends in a repeat: prompt lookup proposes 50, which the target often samples
N_SAMPLES = 1500
MATES = ragged_prompts(3, seed=3)        # other prompts in the same batch (plain greedy output: baselines[3])
K_SAMPLED = 3


def sampled_pvalue(res, target: Model, exact) -> float:
    """The chi-square p-value of the first 3 tokens of the batch's N_SAMPLES requests of PROMPT against `exact`."""
    return gof_pvalue(joint_counts(res.tokens[:N_SAMPLES], target.config.vocab_size), exact)


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
