"""Sampling: the transform, the chain speculative-sampling rule, and end-to-end distribution tests that can fail."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as scistats

import specjax
from specjax import SamplingParams, SpecConfig
from specjax import verify
from specjax.sampling import probabilities
from conftest import tiny_model


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


# ---- end to end: the joint distribution of the first three generated tokens -----------------------------------

V = 8
SP = dict(temperature=0.8, top_k=6, top_p=0.9)
PROMPT = [1, 2, 3]
N = 40_000


@pytest.fixture(scope="module")
def models():
    return tiny_model(3, vocab=V, hidden=16, layers=2, heads=2, kv_heads=1, std=0.6), \
        tiny_model(4, vocab=V, hidden=16, layers=1, heads=2, kv_heads=1, std=0.6)


def exact_joint(model) -> np.ndarray:
    """P(t1, t2, t3 | prompt) [V, V, V] by enumeration, through the same sampling transform."""
    sp = SamplingParams(**SP)
    seqs = np.array([PROMPT + [a, b] for a, b in itertools.product(range(V), repeat=2)], np.int32)
    probs = np.asarray(probabilities(model.logits(seqs), sp))               # [V*V, 5, V]
    p1 = probs[0, len(PROMPT) - 1]                                            # [V]
    p2 = probs[::V, len(PROMPT)]                                              # [t1, V]
    p3 = probs[:, len(PROMPT) + 1].reshape(V, V, V)                         # [t1, t2, V]
    return p1[:, None, None] * p2[:, :, None] * p3


def sample_joint(model, config, drafter=None, seed=0) -> np.ndarray:
    res = specjax.generate(model, [PROMPT] * N, config, drafter=drafter, seed=seed)
    t = np.array(res.tokens)
    return np.bincount(t[:, 0] * V * V + t[:, 1] * V + t[:, 2], minlength=V ** 3)


def gof_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit; cells with expected count < 5 are pooled into one."""
    expected = probs.ravel() * counts.sum()
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return scistats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue


@pytest.mark.parametrize("method,k", [("none", None), ("draft_model", 2), ("ngram", 2)])
def test_sampled_distribution_matches_target(models, method, k):
    target, draft = models
    exact = exact_joint(target)
    cfg = SpecConfig(method=method, num_speculative_tokens=k, max_new_tokens=3,
                     prompt_lookup_min=1 if method == "ngram" else None, **SP)
    counts = sample_joint(target, cfg, drafter=draft if method == "draft_model" else None, seed=11)
    assert gof_pvalue(counts, exact) > 1e-3


def test_planted_bug_is_caught(models, monkeypatch):
    """Resampling from p instead of norm(max(0, p - q)) after a rejection biases the output toward the drafter:
    the same test must fail."""
    target, draft = models
    exact = exact_joint(target)
    jax.clear_caches()
    monkeypatch.setattr(verify, "residual_distribution", lambda p, q: p)
    try:
        cfg = SpecConfig(method="draft_model", num_speculative_tokens=2, max_new_tokens=3, **SP)
        counts = sample_joint(target, cfg, drafter=draft, seed=11)
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    assert gof_pvalue(counts, exact) < 1e-6


def test_batch_mates_do_not_change_a_request(target):
    """A request's sampled output depends only on (seed, request_id), not on what else is in the batch."""
    from conftest import ragged_prompts, perturbed
    prompts = ragged_prompts(5, seed=9)
    for cfg, d in [(SpecConfig(temperature=0.9, top_p=0.95, max_new_tokens=16), None),
                   (SpecConfig(method="draft_model", num_speculative_tokens=3, temperature=0.9, max_new_tokens=16),
                    perturbed(target, 0.05))]:
        batched = specjax.generate(target, prompts, cfg, drafter=d, seed=5).tokens
        alone = [specjax.generate(target, [p], cfg, drafter=d, seed=5, request_ids=[i]).tokens[0]
                 for i, p in enumerate(prompts)]
        assert batched == alone
