"""Tiny random models and ragged prompts: shared by the tests, the fixtures in conftest.py and the subprocess
workers (tests/_*_worker.py), which cannot import conftest's fixtures."""
import jax
import numpy as np

from specjax.models import Model
from specjax.models.config import ModelConfig
from specjax.models.llama import init_params

BASELINE_MAX_NEW = 24         # new tokens of the `baselines` fixture's plain greedy outputs


def tiny_model(seed: int = 0, vocab: int = 61, hidden: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2,
               std: float = 0.3, name: str = "tiny", **cfg_kw) -> Model:
    """A random Llama-family model with spread-out logits (std well above the usual 0.02) so greedy argmaxes
    are not near-ties and exact-equality tests are meaningful."""
    cfg = ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_layers=layers,
                      num_heads=heads, num_kv_heads=kv_heads, head_dim=hidden // heads, eos_token_id=None,
                      max_position_embeddings=4096, **cfg_kw)
    return Model(cfg, init_params(cfg, jax.random.PRNGKey(seed), std=std), None, name)


def perturbed(model: Model, scale: float, seed: int = 7, name: str = "perturbed") -> Model:
    """Same architecture, weights plus noise: a drafter that agrees with the target often but not always."""
    leaves, treedef = jax.tree_util.tree_flatten(model.params)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    noisy = [x + scale * jax.random.normal(k_, x.shape, x.dtype) for x, k_ in zip(leaves, keys)]
    return Model(model.config, jax.tree_util.tree_unflatten(treedef, noisy), model.tokenizer, name)


def ragged_prompts(batch: int, vocab: int = 61, seed: int = 0) -> list[list[int]]:
    """Prompts of different lengths with repeated spans, so prompt lookup finds matches."""
    rng = np.random.default_rng(seed)
    out = []
    for b in range(batch):
        span = rng.integers(1, vocab, size=int(rng.integers(2, 6))).tolist()
        out.append((span * 4)[: int(rng.integers(3, 22))])
    return out
