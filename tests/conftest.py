import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import pytest

from specjax.api import Model
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


@pytest.fixture(scope="session")
def target():
    return tiny_model(0)


@pytest.fixture(scope="session")
def draft():
    return tiny_model(1, hidden=16, layers=1, heads=2, kv_heads=1, name="tiny-draft")
