"""Multi-token drafters (specjax.drafters.mtp): DeepSeek-style MTP modules ("mtp") and Gloeckle-style multi-token
heads ("mtp_heads"). Greedy identity, sampled exactness, batches and the mesh run in the conformance suite; here:
the drafts are what the training-time forward computes on the drafted prefix (before and after a commit), reuse
beyond the trained depth, artifacts, bad input."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import SamplingParams, SpecConfig
from specjax.models import Model
from specjax.cache import KVCache
from specjax.drafters import mtp
from specjax.drafters.base import Context, target_weight
from specjax.models.llama import ForwardOut, forward
from drafter_weights import MTP_TRUNK, informative_mtp
from tiny import ragged_prompts, tiny_model


def spread(target: Model, kind: str, depth: int) -> mtp.MTPWeights:
    """Random weights with spread-out logits (no near-ties): for comparing argmaxes of two computations."""
    return informative_mtp(target, kind, depth, noise=0.3, seed=3)


def _target_out(target: Model, ids: jax.Array, kind: str) -> ForwardOut:
    """The target's teacher-forced forward over ids [1, T] (hidden and the trunk layer's output)."""
    cfg = target.config
    cache = KVCache.init(cfg.num_layers, 1, ids.shape[1], cfg.num_kv_heads, cfg.head_dim)
    return forward(target.params, cfg, ids, cache, hidden_layers=(MTP_TRUNK,) if kind == "mtp_heads" else ())


def _reference_probs(target: Model, w: mtp.MTPWeights, seq: list, start: int, k: int) -> np.ndarray:
    """The distributions [k, V] of drafts 1..k of a chain started at entry `start` (= committed length - 2), from
    the training forward over the whole sequence seq (committed tokens + the drafts): mtp module j at entry
    start + j - 1, heads: head j + 1 at start."""
    ids = jnp.asarray([seq], jnp.int32)
    out = _target_out(target, ids, w.config.kind)
    tw = {n: target_weight(target.params, n) for n in ("embed", "lm_head")}
    if w.config.kind == "mtp":
        _, logits = mtp.mtp_forward_sequence(w.params, w.config, ids[:, 1:], out.hidden[:, :-1], tw)
        rows = [logits[j - 1, 0, start + j - 1] for j in range(1, k + 1)]
    else:
        _, logits = mtp.heads_forward_sequence(w.params, w.config, out.layer_hidden[0], tw["lm_head"])
        rows = [logits[j - 1, 0, start] for j in range(1, k + 1)]
    return np.asarray(jax.nn.softmax(jnp.stack(rows), -1))


# ~40-55 s each (the training forward over every drafted prefix): CI runs them in test-slow, make test's budget
@pytest.mark.slow
@pytest.mark.parametrize("kind, depth", [("mtp", 3), ("mtp_heads", 3)])
def test_drafts_are_the_training_forward_on_the_drafted_prefix(target, kind, depth):
    """init -> propose, then a commit of a partly accepted chain -> propose again: every draft's distribution
    (temperature 1) equals what the teacher-forced training forward computes on the committed tokens plus the
    earlier drafts (an off-by-one in the cache entries, RoPE positions, the chain's hidden inputs or the token
    pairing changes the numbers)."""
    w, k, buf = spread(target, kind, depth), depth, 64
    drafter = mtp.MTPDrafter(k, w.config, buf)
    tw = {n: target_weight(target.params, n) for n in drafter.target_weights}
    sp = SamplingParams(temperature=1.0)
    prompt = ragged_prompts(1, seed=5)[0] + [7, 8, 9]
    P = len(prompt)
    out = _target_out(target, jnp.asarray([prompt], jnp.int32), kind)
    seq = prompt + [int(jnp.argmax(out.logits[0, -1]))]                 # the bonus token of the prefill
    tokens = jnp.zeros((1, buf), jnp.int32).at[0, :len(seq)].set(jnp.asarray(seq))
    ctx = Context(tokens, jnp.asarray([len(seq)]), jnp.asarray([P]), tw)
    state = drafter.init(w.params, ctx, out, sp)
    draft, state = drafter.propose(w.params, state, ctx, jax.random.split(jax.random.PRNGKey(0), 1), sp)
    drafts = [int(t) for t in draft.tokens[0]]
    np.testing.assert_allclose(draft.probs[0], _reference_probs(target, w, seq + drafts[:-1], len(seq) - 2, k),
                               atol=1e-5)

    # Verification accepted the first draft and sent a bonus token of its own: commit, then draft again.
    L = len(seq)
    verified = seq[-1:] + drafts                                         # the verify block: positions L-1 .. L-1+k
    full = _target_out(target, jnp.asarray([seq + drafts], jnp.int32), kind)
    block = ForwardOut(full.logits[:, L - 1:], full.hidden[:, L - 1:],
                       tuple(h[:, L - 1:] for h in full.layer_hidden), None)
    seq = seq + drafts[:1] + [(drafts[1] + 1) % target.config.vocab_size]
    tokens = jnp.zeros((1, buf), jnp.int32).at[0, :len(seq)].set(jnp.asarray(seq))
    ctx = Context(tokens, jnp.asarray([len(seq)]), jnp.asarray([P]), tw)
    assert len(verified) == k + 1
    state = drafter.commit(w.params, state, ctx, jnp.asarray([1]), block, None)
    assert int(state.cache.lengths[0]) == len(seq) - 1
    draft, _ = drafter.propose(w.params, state, ctx, jax.random.split(jax.random.PRNGKey(1), 1), sp)
    drafts = [int(t) for t in draft.tokens[0]]
    np.testing.assert_allclose(draft.probs[0], _reference_probs(target, w, seq + drafts[:-1], len(seq) - 2, k),
                               atol=1e-5)


@pytest.mark.parametrize("batch", [pytest.param(1, marks=pytest.mark.slow), 3])   # make test budget
def test_mtp_beyond_its_depth_reuses_the_last_module(target, baselines, batch):
    """k = 4 drafts from 2 modules (module 2 runs again for drafts 3 and 4): still exactly plain greedy."""
    w = informative_mtp(target, "mtp", 2)
    config = SpecConfig(method="mtp", num_speculative_tokens=4, max_new_tokens=24,
                        drafter_options={"reuse_last_module": True})
    res = specjax.generate(target, ragged_prompts(batch, seed=batch), config, drafter=w)
    assert res.tokens == baselines[batch]


def test_artifacts_round_trip_and_the_heads_load_from_their_target_directory(tmp_path, target):
    w = spread(target, "mtp_heads", 2)
    mtp.save(tmp_path / "heads", w, target, "# test\n", dtype="float32")
    back = mtp.load(tmp_path / "heads", target, "mtp_heads")
    assert back.config == w.config
    for a, b in zip(jax.tree_util.tree_leaves(w.params), jax.tree_util.tree_leaves(back.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    (tmp_path / "tgt").mkdir()
    mtp.save(tmp_path / "tgt" / mtp.HEADS_DIR, w, target, "# test\n")
    assert mtp.load(tmp_path / "tgt", target, "mtp_heads").config == w.config
    m = informative_mtp(target, "mtp", 2)
    mtp.save(tmp_path / "modules", m, target, "# test\n", dtype="float32")
    assert mtp.load(tmp_path / "modules", target, "mtp").config == m.config


def test_bad_input_is_named(tmp_path, target):
    prompts = [[1, 2, 3]]
    modules, heads = informative_mtp(target, "mtp", 2), informative_mtp(target, "mtp_heads", 3)
    with pytest.raises(ValueError, match="2 MTP modules.*reuse_last_module"):
        specjax.generate(target, prompts, SpecConfig(method="mtp", num_speculative_tokens=3), drafter=modules)
    with pytest.raises(ValueError, match="3 extra heads"):
        specjax.generate(target, prompts, SpecConfig(method="mtp_heads", num_speculative_tokens=4), drafter=heads)
    with pytest.raises(ValueError, match="use method='mtp_heads'"):
        specjax.generate(target, prompts, SpecConfig(method="mtp", num_speculative_tokens=2), drafter=heads)
    with pytest.raises(TypeError, match="method='mtp' needs drafter="):
        specjax.generate(target, prompts, SpecConfig(method="mtp", num_speculative_tokens=2), drafter=None)
    mtp.save(tmp_path / "m", modules, target, "# test\n")
    other = tiny_model(0, hidden=48, heads=4, kv_heads=2, name="wider")
    with pytest.raises(ValueError, match="trained for another target"):
        mtp.load(tmp_path / "m", other, "mtp")
    with pytest.raises(ValueError, match="holds a 'mtp' drafter, not a 'mtp_heads'"):
        mtp.load(tmp_path / "m", target, "mtp_heads")
    with pytest.raises(ValueError, match="depth"):
        mtp.MTPConfig("mtp", mtp.layer_config(target.config), 0)
