import gc
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import pytest

import specjax
from specjax import SpecConfig
from _stats import exact_joint
from conformance_factories import K_SAMPLED, MATES, N_SAMPLES, PROMPT, SP, Case
from tiny import BASELINE_MAX_NEW, perturbed, ragged_prompts, tiny_model

MAX_MEMORY_MAPS = 30_000      # half the kernel's default vm.max_map_count (65530)


def _memory_maps() -> int:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:              # not Linux: no such limit to watch
        return 0


@pytest.fixture(autouse=True)
def _free_compiled_programs():
    """Drop every compiled program once the process holds MAX_MEMORY_MAPS memory maps. XLA's CPU backend maps
    each executable's code into memory (a decode loop: ~500 maps); one pytest process compiling a few hundred
    decode loops reached the kernel's limit (vm.max_map_count) and died with a segmentation fault inside the
    next compile. Clearing only past the threshold keeps the programs that neighbouring tests share."""
    yield
    if _memory_maps() > MAX_MEMORY_MAPS:
        jax.clear_caches()
        gc.collect()


@pytest.fixture(scope="session")
def target():
    return tiny_model(0)


@pytest.fixture(scope="session")
def draft():
    return tiny_model(1, hidden=16, layers=1, heads=2, kv_heads=1, name="tiny-draft")


@pytest.fixture(scope="session")
def near_draft(target):
    """The target with noise: accepts some drafts and rejects others (both paths exercised)."""
    return perturbed(target, 0.08)


@pytest.fixture(scope="session")
def baselines(target):
    """Plain greedy output of ragged_prompts(b, seed=b) for b in 1, 3, 8 (BASELINE_MAX_NEW tokens)."""
    return {b: specjax.generate(target, ragged_prompts(b, seed=b), SpecConfig(max_new_tokens=BASELINE_MAX_NEW)).tokens
            for b in (1, 3, 8)}


@pytest.fixture(scope="session")
def exact_three(target):
    """The target's exact joint distribution of its first 3 sampled tokens after PROMPT at SP (by enumeration)."""
    return exact_joint(target, PROMPT, SP)


@pytest.fixture(scope="session")
def sampled_case(target, baselines) -> Case:
    """The conformance suite's sampled batch: N_SAMPLES requests of PROMPT followed by MATES (the chi-square counts
    the first, the batch-mates test decodes some of each alone)."""
    prompt_plain = specjax.generate(target, [PROMPT], SpecConfig(max_new_tokens=BASELINE_MAX_NEW)).tokens
    return Case(target, K_SAMPLED, [PROMPT] * N_SAMPLES + MATES, prompt_plain * N_SAMPLES + baselines[3])
