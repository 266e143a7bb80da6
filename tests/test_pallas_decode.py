"""End to end: speculative decoding through the Pallas verify kernel (interpret mode on CPU) gives the same tokens
as the XLA path, which gives the same tokens as plain greedy decoding."""
import dataclasses

import pytest

import specjax
from specjax import SpecConfig
from tiny import perturbed, ragged_prompts


# The TPU kernel's interpret mode is the slower one (~20 s): test-slow; its kernel tests against the reference stay
# in make test (test_verify_attention).
@pytest.mark.parametrize("implementation", ["pallas", pytest.param("pallas_tpu", marks=pytest.mark.slow)])
def test_pallas_greedy_speculative_equals_xla(target, implementation):
    prompts = ragged_prompts(2, seed=2)
    draft = perturbed(target, 0.08)
    base = SpecConfig(method="draft_model", num_speculative_tokens=3, max_new_tokens=10)
    xla = specjax.generate(target, prompts, base, drafter=draft)
    pallas = specjax.generate(target, prompts, dataclasses.replace(base, implementation=implementation),
                              drafter=draft)
    plain = specjax.generate(target, prompts, SpecConfig(max_new_tokens=10))
    assert pallas.tokens == xla.tokens == plain.tokens
    assert xla.stats["accepted"] > 0 and xla.stats["rejected"] > 0
