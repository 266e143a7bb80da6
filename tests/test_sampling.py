"""Sampling: the transform and the chain speculative-sampling rule (end-to-end distribution tests for every drafter:
tests/test_conformance.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import SamplingParams, SpecConfig
from specjax import verify
from specjax.sampling import probabilities


def test_transform_greedy_topk_topp():
    logits = jnp.log(jnp.array([[0.1, 0.4, 0.2, 0.3]]))
    assert probabilities(logits, SamplingParams(0.0)).tolist() == [[0, 1, 0, 0]]
    p = probabilities(logits, SamplingParams(1.0, top_k=2))
    np.testing.assert_allclose(p, [[0, 4 / 7, 0, 3 / 7]], atol=1e-6)
    # top-p keeps the smallest set whose mass reaches top_p: 0.4 + 0.3 = 0.7 >= 0.6
    p = probabilities(logits, SamplingParams(1.0, top_p=0.6))
    np.testing.assert_allclose(p, [[0, 4 / 7, 0, 3 / 7]], atol=1e-6)
    p = probabilities(logits, SamplingParams(0.5))
    np.testing.assert_allclose(p, jax.nn.softmax(logits / 0.5), atol=1e-6)


@pytest.mark.parametrize("bad", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1),
                                 dict(temperature=float("nan"))])
def test_invalid_sampling_params(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)
    with pytest.raises(ValueError):
        SpecConfig(**bad)


def test_seed_three_token_example():
    """p=[0.5,0.2,0.3], q=[0.3,0.5,0.2]: output frequencies are p and acceptance is sum(min(p, q)) = 0.70."""
    n = 1_000_000
    p = jnp.array([0.5, 0.2, 0.3])
    q = jnp.array([0.3, 0.5, 0.2])
    key_d, key_v = jax.random.split(jax.random.PRNGKey(0))
    drafts = jax.random.categorical(key_d, jnp.log(q), shape=(n, 1)).astype(jnp.int32)
    keys = jax.random.split(key_v, n)
    target = jnp.broadcast_to(p, (n, 2, 3))
    acc, nxt = jax.jit(verify.chain_sampled)(keys, drafts, jnp.broadcast_to(q, (n, 1, 3)), target)
    first = np.where(np.asarray(acc) == 1, np.asarray(drafts[:, 0]), np.asarray(nxt))
    freq = np.bincount(first, minlength=3) / n
    np.testing.assert_allclose(freq, [0.5, 0.2, 0.3], atol=0.002)        # ~4 sigma at n = 1e6
    assert abs(np.mean(acc) - 0.70) < 0.002


# End to end (the joint distribution of the first three generated tokens against the exact one, with a planted
# bug that must fail it; batch mates) for every drafter: tests/test_conformance.py.
