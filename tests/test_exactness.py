"""Greedy speculative output == plain greedy output, token for token, for every drafter, k and batch size."""
import pytest

import specjax
from specjax import SpecConfig
from conftest import BASELINE_MAX_NEW, ragged_prompts

MAX_NEW = BASELINE_MAX_NEW


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("method", ["draft_model", "ngram", "predicted"])
def test_greedy_equals_plain(target, near_draft, baselines, method, k, batch):
    prompts = ragged_prompts(batch, seed=batch)
    base = baselines[batch]
    kw = {}
    if method == "draft_model":
        drafter = near_draft
    elif method == "predicted":
        # A prediction that is right for a while and then wrong (edits), per row.
        drafter = [b[:MAX_NEW // 2] + [(t + 1) % 61 for t in b[MAX_NEW // 2:]] for b in base]
    else:
        drafter = None
        kw = dict(prompt_lookup_min=1, prompt_lookup_max=3)
    res = specjax.generate(target, prompts, SpecConfig(method=method, num_speculative_tokens=k,
                                                       max_new_tokens=MAX_NEW, **kw), drafter=drafter)
    assert res.tokens == base
    assert res.stats["accepted"] > 0, "the drafter never got a token accepted: the test would not exercise acceptance"
    if method != "predicted":
        assert res.stats["rejected"] > 0, "no rejection happened: the test would not exercise rollback"


def test_self_draft_accepts_everything(target):
    prompts = ragged_prompts(3, seed=3)
    base = specjax.generate(target, prompts, SpecConfig(max_new_tokens=MAX_NEW)).tokens
    res = specjax.generate(target, prompts, SpecConfig(method="draft_model", num_speculative_tokens=4,
                                                       max_new_tokens=MAX_NEW), drafter=target)
    assert res.tokens == base
    assert res.stats["alpha"] == 1.0


def test_eos_stops_each_row(target):
    prompts = ragged_prompts(3, seed=3)
    base = specjax.generate(target, prompts, SpecConfig(max_new_tokens=MAX_NEW)).tokens
    eos = base[1][5]
    from specjax.api import Model
    import dataclasses
    t_eos = Model(dataclasses.replace(target.config, eos_token_id=eos), target.params, None, "eos")
    for cfg, d in [(SpecConfig(max_new_tokens=MAX_NEW), None),
                   (SpecConfig(method="draft_model", num_speculative_tokens=4, max_new_tokens=MAX_NEW), target)]:
        out = specjax.generate(t_eos, prompts, cfg, drafter=d).tokens
        for b, o in zip(base, out):
            expect = b[: b.index(eos) + 1] if eos in b else b
            assert o == expect
