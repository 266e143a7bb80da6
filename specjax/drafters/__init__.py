"""Drafters: one module or package per drafter family, each registering its methods with specjax.drafters.registry
(found on the registry's first lookup: adding a drafter is adding its module or package here).

One shape per drafter. A drafter with a trained artifact of its own (its own config and tensors: eagle, mtp, dflash,
pard, medusa, draft_model) is a package of one module per job:
  config.py      the config dataclass and its constructors (one shaped for a target, fresh params, the loaded
                 weights' type);
  model.py       the pure-function maths that the drafter and the training losses (train/losses/) share;
  drafter.py     the drafter object, its protocol methods (specjax.drafters.base.Drafter) and its registration;
  checkpoint.py  saving and loading the specjax artifact (specjax.drafters.artifacts), and published layouts;
  __init__.py    what the drafter is (its docstring), and the package's public names re-exported, so callers write
                 `from specjax.drafters import dflash; dflash.load(...)` whatever module holds the name.
A package may add a module for a job of its own (eagle's vocab.py: EAGLE-3's draft vocabulary).
A drafter without an artifact of its own (ngram, suffix, lookahead, predicted, layer_skip) is a single module. Shared
pieces sit beside them: base (the Drafter protocol and drafting helpers), registry, artifacts (the artifact directory
format), draft_vocab (draft vocabulary maps).
"""
from specjax.drafters.base import Context, Draft, Drafter, NullDrafter, Verified
from specjax.drafters.registry import BuildRequest, DrafterSpec, Option, register

__all__ = ["BuildRequest", "Context", "Draft", "Drafter", "DrafterSpec", "NullDrafter", "Option", "Verified",
           "register"]
