"""Greedy exactness beyond the conformance suite (tests/test_conformance.py runs greedy == plain greedy, EOS per row,
sampling and meshes for every drafter): the target drafting for itself accepts every draft."""
import specjax
from specjax import SpecConfig
from conftest import BASELINE_MAX_NEW, ragged_prompts

MAX_NEW = BASELINE_MAX_NEW


def test_self_draft_accepts_everything(target, baselines):
    prompts = ragged_prompts(3, seed=3)
    res = specjax.generate(target, prompts, SpecConfig(method="draft_model", num_speculative_tokens=4,
                                                       max_new_tokens=MAX_NEW), drafter=target)
    assert res.tokens == baselines[3]
    assert res.stats["alpha"] == 1.0
