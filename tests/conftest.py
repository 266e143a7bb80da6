import gc
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import pytest

from specjax.models import Model
from specjax.models.config import ModelConfig
from specjax.models.llama import init_params


def tiny_model(seed: int = 0, vocab: int = 61, hidden: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2,
               std: float = 0.3, name: str = "tiny", **cfg_kw) -> Model:
    """A random Llama-family model with spread-out logits (std well above the usual 0.02) so greedy argmaxes
    are not near-ties and exact-equality tests are meaningful."""
    cfg = ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_layers=layers,
                      num_heads=heads, num_kv_heads=kv_heads, head_dim=hidden // heads, eos_token_id=None,
                      max_position_embeddings=4096, **cfg_kw)
    return Model(cfg, init_params(cfg, jax.random.PRNGKey(seed), std=std), None, name)


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


def perturbed(model: Model, scale: float, seed: int = 7, name: str = "perturbed") -> Model:
    """Same architecture, weights plus noise: a drafter that agrees with the target often but not always."""
    leaves, treedef = jax.tree_util.tree_flatten(model.params)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    noisy = [x + scale * jax.random.normal(k_, x.shape, x.dtype) for x, k_ in zip(leaves, keys)]
    return Model(model.config, jax.tree_util.tree_unflatten(treedef, noisy), model.tokenizer, name)


def ragged_prompts(batch: int, vocab: int = 61, seed: int = 0) -> list[list[int]]:
    """Prompts of different lengths with repeated spans, so prompt lookup finds matches."""
    import numpy as np
    rng = np.random.default_rng(seed)
    out = []
    for b in range(batch):
        span = rng.integers(1, vocab, size=int(rng.integers(2, 6))).tolist()
        out.append((span * 4)[: int(rng.integers(3, 22))])
    return out


BASELINE_MAX_NEW = 24


@pytest.fixture(scope="session")
def near_draft(target):
    """The target with noise: accepts some drafts and rejects others (both paths exercised)."""
    return perturbed(target, 0.08)


@pytest.fixture(scope="session")
def baselines(target):
    """Plain greedy output of ragged_prompts(b, seed=b) for b in 1, 3, 8 (BASELINE_MAX_NEW tokens)."""
    import specjax
    from specjax import SpecConfig
    return {b: specjax.generate(target, ragged_prompts(b, seed=b), SpecConfig(max_new_tokens=BASELINE_MAX_NEW)).tokens
            for b in (1, 3, 8)}
