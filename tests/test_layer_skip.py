"""Layer-skip self-speculation: the skip set's validation, its artifact, and that the drafter runs on the target's
own arrays (exactness over k, batches and trees is the conformance suite's: factories layer_skip*)."""
import pytest

import specjax
from specjax import SpecConfig
from specjax.drafters import layer_skip, registry
from specjax.drafters.artifacts import save_artifact
from tiny import tiny_model


def _generate(target, prompts, drafter=None, **opts):
    cfg = SpecConfig(method="layer_skip", num_speculative_tokens=3, max_new_tokens=8, **opts)
    return specjax.generate(target, prompts, cfg, drafter=drafter)


def test_default_rule_skips_a_middle_fifth():
    assert layer_skip.default_skip_layers(30) == (12, 13, 14, 15, 16, 17)
    assert layer_skip.default_skip_layers(4) == (1,)
    assert layer_skip.default_skip_layers(2) == ()


def test_drafts_with_the_kept_layers_over_the_targets_cache():
    """Skipping nothing, the draft pass is the target itself: every draft is accepted (greedy)."""
    target = tiny_model(0, layers=3)
    out = _generate(target, [[1, 2, 3, 4], [5, 6]], drafter_options=dict(skip_layers=[]))
    plain = specjax.generate(target, [[1, 2, 3, 4], [5, 6]], SpecConfig(max_new_tokens=8))
    assert out.tokens == plain.tokens
    assert out.stats["alpha"] == 1.0


def test_dynamic_tree_must_fit_the_verify_slots():
    with pytest.raises(ValueError, match="feeds 6 nodes after the root, more than the 4 slots"):
        specjax.generate(tiny_model(0, layers=3), [[1, 2, 3]],
                         SpecConfig(method="layer_skip", num_steps=4, topk=2, num_draft_tokens=4, max_new_tokens=4))


@pytest.mark.parametrize("skip, match", [([4], r"\[4\] out of range: the target has 4 decoder layers"),
                                         ([-1], "out of range"),
                                         ([1, 1], "names a layer twice"),
                                         ([0, 1, 2, 3], "skips all 4 decoder layers")])
def test_bad_skip_sets_are_refused(skip, match):
    with pytest.raises(ValueError, match=match):
        _generate(tiny_model(0, layers=4), [[1, 2, 3]], drafter_options=dict(skip_layers=skip))


def test_skip_option_must_be_a_list_of_ints():
    with pytest.raises(ValueError, match="skip_layers"):
        registry.resolve(SpecConfig(method="layer_skip", num_speculative_tokens=2,
                                    drafter_options=dict(skip_layers="1,2")))


def test_artifact_round_trip_and_another_target(tmp_path):
    target = tiny_model(0, layers=4)
    save_artifact(tmp_path, "layer_skip", {"skip_layers": [1, 2]}, {}, target, "# test skip set\n")
    loaded = layer_skip._load(target, str(tmp_path))
    assert loaded.skip_layers == (1, 2)
    out = _generate(target, [[1, 2, 3, 4]], drafter=str(tmp_path))
    plain = specjax.generate(target, [[1, 2, 3, 4]], SpecConfig(max_new_tokens=8))
    assert out.tokens == plain.tokens
    with pytest.raises(ValueError, match="trained for another target.*num_layers: trained for 4"):
        _generate(tiny_model(0, layers=3), [[1, 2, 3]], drafter=str(tmp_path))
    with pytest.raises(ValueError, match="not both"):
        _generate(target, [[1, 2, 3]], drafter=str(tmp_path), drafter_options=dict(skip_layers=[1]))
