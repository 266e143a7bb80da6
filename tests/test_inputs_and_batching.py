"""Bad input gets a clear error naming the problem; ragged batches decode exactly as one-at-a-time."""
import pytest

import specjax
from specjax import SpecConfig
from conftest import ragged_prompts, tiny_model


def test_ragged_batch_equals_one_at_a_time(target):
    prompts = ragged_prompts(6, seed=4)
    cfg = SpecConfig(max_new_tokens=20)
    batched = specjax.generate(target, prompts, cfg).tokens
    alone = [specjax.generate(target, [p], cfg).tokens[0] for p in prompts]
    assert batched == alone


@pytest.mark.parametrize("kwargs,match", [
    (dict(method="draft_model", num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(method="ngram", num_speculative_tokens=65), r"\[1, 64\]"),
    (dict(method="ngram"), "num_speculative_tokens"),
    (dict(method="medusa-ish", num_speculative_tokens=2), "unknown speculative method"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.01), "top_p"),
    (dict(top_k=-3), "top_k"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(method="ngram", num_speculative_tokens=2, prompt_lookup_min=4, prompt_lookup_max=2), "prompt_lookup"),
])
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SpecConfig(**kwargs)


def test_vocabulary_mismatch(target):
    other = tiny_model(5, vocab=target.config.vocab_size + 3)
    with pytest.raises(ValueError, match="vocabulary mismatch"):
        specjax.generate(target, [[1, 2]], SpecConfig(method="draft_model", num_speculative_tokens=2), drafter=other)


def test_empty_prompt(target):
    with pytest.raises(ValueError, match="empty"):
        specjax.generate(target, [[1, 2], []], SpecConfig())


def test_out_of_vocab_token(target):
    with pytest.raises(ValueError, match="outside"):
        specjax.generate(target, [[1, target.config.vocab_size]], SpecConfig())


def test_prompt_longer_than_cache(target):
    with pytest.raises(ValueError, match="prompt too long for the cache"):
        specjax.generate(target, [list(range(1, 40))], SpecConfig(max_new_tokens=8, max_cache_len=32))
    # k beyond the cache headroom is the same check: k + 1 verify slots must fit.
    with pytest.raises(ValueError, match="prompt too long for the cache"):
        specjax.generate(target, [[1, 2, 3]], SpecConfig(method="ngram", num_speculative_tokens=30,
                                                         max_new_tokens=8, max_cache_len=32))


def test_single_prompt_not_in_a_list(target):
    with pytest.raises(TypeError, match="one entry per request"):
        specjax.generate(target, [1, 2, 3], SpecConfig())


def test_predicted_needs_one_prediction_per_prompt(target):
    with pytest.raises(ValueError, match="one prediction per prompt"):
        specjax.generate(target, [[1, 2], [3]], SpecConfig(method="predicted", num_speculative_tokens=2),
                         drafter=[[1, 2]])


def test_unknown_shipped_model():
    with pytest.raises(FileNotFoundError, match="no shipped model"):
        specjax.load_model("no-such-model")
