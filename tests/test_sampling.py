"""Sampling: the transform and the chain speculative-sampling rule (end-to-end distribution tests for every drafter:
tests/test_conformance.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import SamplingParams, SpecConfig
from specjax import verify
from specjax.sampling import SAMPLE_BLOCK, greedy_token, probabilities, sample
from cpu_kernels import build as cpu_build
from cpu_kernels.greedy_token import greedy_token_cpu
from specjax.ops import greedy_token_reference

from tests._stats import gof_pvalue


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


def _frequencies(sampler, probs, draws: int) -> np.ndarray:
    keys = jax.random.split(jax.random.key(0), draws)
    tokens = np.asarray(jax.jit(jax.vmap(lambda key: sampler(key, jnp.asarray(probs, jnp.float32))))(keys))
    return np.bincount(tokens, minlength=len(probs))


def test_sample_draws_each_index_with_its_probability():
    """The two-level inverse CDF against a row of 2.5 blocks (the last one padded) with zeros (the first and last
    index among them), tiny entries and most mass in a few: a chi-square test that fails a sampler off by one
    index (planted), and no zero entry ever drawn."""
    rng = np.random.default_rng(0)
    V = 2 * SAMPLE_BLOCK + SAMPLE_BLOCK // 2
    p = rng.dirichlet(np.full(V, 0.3))
    p[::7] = 0.0
    p[-1] = 0.0
    p /= p.sum()
    counts = _frequencies(sample, p, 200_000)
    assert counts[p == 0].sum() == 0
    assert gof_pvalue(counts, p) > 1e-3

    def shifted(key, probs):                       # planted: every draw one index on (the last wraps to 0)
        return (sample(key, probs) + 1) % probs.shape[-1]

    assert gof_pvalue(_frequencies(shifted, p, 200_000), p) < 1e-6
    # rows of any leading shape, unnormalized rows, and one-hot rows at block edges
    assert sample(jax.random.key(1), jnp.ones((2, 3, V))).shape == (2, 3)
    edges = jnp.array([0, SAMPLE_BLOCK - 1, SAMPLE_BLOCK, V - 1])
    onehot = 3.0 * jax.nn.one_hot(edges, V)
    assert jax.vmap(sample)(jax.random.split(jax.random.key(2), 4), onehot).tolist() == edges.tolist()


@pytest.mark.parametrize("implementation", ["library", "kernel", "reference"])
def test_greedy_token_is_argmax(implementation):
    """The greedy token (the library's, the CPU kernel alone, the reference's two reductions) against np.argmax:
    ties (first index), NaN (the first NaN, also after the largest logit of a long row, which XLA:CPU's max can
    skip), infinities, all -inf rows, signed zeros, rows whose width the kernel's vectors do not divide, any
    leading axes, a real vocabulary's width, under jit and vmap."""
    fn = {"library": greedy_token, "kernel": greedy_token_cpu, "reference": greedy_token_reference}[implementation]
    if implementation == "kernel" and cpu_build.load() is None:
        pytest.skip("the CPU kernels cannot be built here")
    rng = np.random.default_rng(0)
    cases = [rng.integers(-3, 3, size=shape).astype(np.float32) for shape in [(3, 7), (2, 4, 50), (5,), (2, 130)]]
    cases.append(np.array([[1, np.nan, 3, np.nan], [-np.inf] * 4, [np.inf, 1, np.inf, 0], [2, 2, 2, 2]], np.float32))
    cases.append(np.array([[0.0, -0.0, 0.0] * 30, [-0.0, 0.0] * 45], np.float32))
    long = rng.standard_normal((3, 49153)).astype(np.float32)
    long[0, [5, 40000]] = np.nan                      # a NaN well after the first, the largest between them
    long[0, 17] = 99.0
    long[1, [49152, 64]] = 50.0                       # a tie, the later in the tail the vectors leave
    long[2, :] = -np.inf
    cases += [long, rng.standard_normal((2, 3, 49152)).astype(np.float32)]
    for x in cases:
        got = jax.jit(fn)(jnp.asarray(x))
        assert got.dtype == jnp.int32 and got.shape == x.shape[:-1]
        np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
    batched = rng.standard_normal((4, 2, 300)).astype(np.float32)
    np.testing.assert_array_equal(jax.vmap(fn)(jnp.asarray(batched)), np.argmax(batched, axis=-1))
    if implementation == "kernel":
        with pytest.raises(ValueError, match="float32"):
            fn(jnp.zeros((2, 8), jnp.bfloat16))
        with pytest.raises(ValueError, match="V >= 1"):
            fn(jnp.zeros((2, 0), jnp.float32))


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
