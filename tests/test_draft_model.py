"""A draft model made from the target itself (specjax.drafters.draft_model.TargetEmbeddingDraft; train.draft
--init_layers): the init copies the target, the artifact round-trips and is checked against its target, the loss and
the held-out counts read the positions the decode loop drafts, and the recipe runs end to end on the toy target.
(Greedy exactness, the sampled distribution, batch mates and the mesh: the conformance suite's
draft_model-target_embedding factories.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import SpecConfig
from specjax.cache import KVCache
from specjax.drafters import draft_model, registry
from specjax.drafters.draft_model import drafter as draft_model_drafter
from specjax.drafters.base import Context, target_weight
from specjax.drafters.draft_vocab import NEG_LOGIT
from specjax.models import Model
from specjax.models.hf_io import SafetensorsFile
from tiny import ragged_prompts, tiny_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _vocab_map(ids) -> np.ndarray:
    ids = np.asarray(ids)
    return (ids - np.arange(len(ids))).astype(np.int64)


def _drafter(target: Model, draft: draft_model.TargetEmbeddingDraft, k: int = 3):
    """The registry's drafter object and params for `draft`, as generate() builds them."""
    req = registry.BuildRequest(registry.resolve(SpecConfig(method="draft_model", num_speculative_tokens=k)), target,
                                draft, [[1, 2, 3]], 64)
    return draft_model_drafter._build(req)


def artifact_names(path) -> list[str]:
    return list(SafetensorsFile(os.path.join(path, "model.safetensors")).keys())


def _serve_logits(target: Model, draft: draft_model.TargetEmbeddingDraft, tokens: jax.Array) -> jax.Array:
    """The drafter's own forward (what it drafts from at decode time) over tokens [B, T] -> logits [B, T, V]."""
    drafter, params = _drafter(target, draft)
    weights = {n: target_weight(target.params, n, target.config.vocab_size) for n in drafter.target_weights}
    B, T = tokens.shape
    ctx = Context(tokens, jnp.full((B,), T), jnp.full((B,), T), weights)
    cache = KVCache.init(draft.config.num_layers, B, T, draft.config.num_kv_heads, draft.config.head_dim)
    return drafter._forward(params, ctx, tokens, cache).logits


def test_init_with_every_layer_is_the_target(target):
    """init_from_target with all of the target's layers and no draft vocabulary computes the target's logits exactly,
    at decode time (the drafter's forward over the target's embedding and head) and in training (the loss's
    forward); decoding with it, every draft is accepted. A planted bug (the layers copied in the wrong order) is
    caught by the same comparison."""
    from train.losses.common import DraftHead
    from train.losses.draft_model import draft_hidden
    cfg = target.config
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 9)), jnp.int32)
    want = target.logits(tokens)
    draft = draft_model.init_from_target(target, cfg.num_layers)
    assert set(draft.params) == {"layers", "final_norm"} and draft.d2t is None
    np.testing.assert_array_equal(_serve_logits(target, draft, tokens), want)
    head = DraftHead.of(cfg.vocab_size, True)
    trained = head.logits(draft.params, target.params, draft_hidden(draft.params, cfg, head, tokens, target.params))
    np.testing.assert_array_equal(trained, want)
    res = specjax.generate(target, ragged_prompts(3, seed=3), SpecConfig(method="draft_model", num_speculative_tokens=3,
                                                                          max_new_tokens=12), drafter=draft)
    assert res.stats["rejected"] == 0 and res.stats["accepted"] > 0, res.stats
    swapped = draft_model.init_from_target(target, cfg.num_layers, from_layers=tuple(range(cfg.num_layers))[::-1])
    assert not np.allclose(_serve_logits(target, swapped, tokens), want, atol=1e-3)


def test_draft_vocabulary_head_is_the_target_head_restricted(target):
    """With a draft vocabulary the head is the target's LM-head columns of those tokens: a full-depth copy's drafted
    logits are the target's there and -1e30 (probability 0) everywhere else."""
    V = target.config.vocab_size
    ids = np.arange(0, V, 3)
    draft = draft_model.init_from_target(target, target.config.num_layers, d2t=_vocab_map(ids))
    assert draft.params["lm_head"].shape == (target.config.hidden_size, len(ids))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, V, (2, 7)), jnp.int32)
    got, want = _serve_logits(target, draft, tokens), target.logits(tokens)
    np.testing.assert_allclose(got[..., ids], want[..., ids], atol=1e-5)
    outside = np.setdiff1d(np.arange(V), ids)
    assert np.all(np.asarray(got[..., outside]) == NEG_LOGIT)


@pytest.mark.parametrize("draft_vocab", [False, True])
def test_saved_artifact_loads_and_decodes_exactly(target, baselines, tmp_path, draft_vocab):
    """The target's first layer reading its embedding, through its own head or a draft vocabulary's, saved as an
    artifact (bfloat16: no embedding, a 31-token head and d2t) and loaded by path: the loaded draft is the saved one
    (d2t exactly), and greedy output is plain greedy output with drafts both accepted and rejected."""
    V = target.config.vocab_size
    d2t = _vocab_map(np.arange(0, V, 2)) if draft_vocab else None
    draft = draft_model.init_from_target(target, 1, d2t=d2t)
    draft_model.save(tmp_path, draft, target, "# test draft\n")
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["specjax_drafter"] == "draft_model"
    loaded = draft_model_drafter._load(target, str(tmp_path))
    assert isinstance(loaded, draft_model.TargetEmbeddingDraft) and loaded.config == draft.config
    assert sorted(artifact_names(tmp_path)) == sorted(["final_norm", "layers.0.attn_norm", "layers.0.mlp_norm",
                                                       "layers.0.w_down", "layers.0.w_gate", "layers.0.w_up",
                                                       "layers.0.wk", "layers.0.wo", "layers.0.wq", "layers.0.wv"]
                                                      + (["d2t", "lm_head"] if draft_vocab else []))
    bf16 = lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)
    np.testing.assert_array_equal(loaded.params["layers"][0]["wq"], bf16(draft.params["layers"][0]["wq"]))
    assert (loaded.d2t is None) == (d2t is None) and (d2t is None or np.array_equal(loaded.d2t, d2t))
    res = specjax.generate(target, ragged_prompts(3, seed=3), SpecConfig(method="draft_model", num_speculative_tokens=4,
                                                                          max_new_tokens=24), drafter=str(tmp_path))
    assert res.tokens == baselines[3]
    assert res.stats["accepted"] > 0 and res.stats["rejected"] > 0, res.stats


@pytest.mark.parametrize("kind, match", [
    ("another target by path", "trained for another target.*vocab_size"),
    ("another target's width", r"embeds with its target's embedding table of 61 tokens x 32; the target 'tiny' has "
                               r"61 x 48"),
    ("another target's vocabulary", r"table of 61 tokens x 32; the target 'tiny' has 50 x 32"),
    ("tree wider than the draft vocabulary", "top-40 draft tokens per node but the draft's vocabulary has only 31"),
    ("from_layers out of range", r"from_layers \[7\] out of range: the target has 2"),
])
def test_bad_input_is_refused(target, tmp_path, kind, match):
    V = target.config.vocab_size
    draft = draft_model.init_from_target(target, 1, d2t=_vocab_map(np.arange(0, V, 2)))
    config = SpecConfig(method="draft_model", num_speculative_tokens=3, max_new_tokens=4)
    with pytest.raises(ValueError, match=match):
        if kind == "from_layers out of range":
            draft_model.init_from_target(target, 1, from_layers=(7,))
        if kind == "another target by path":
            draft_model.save(tmp_path, draft, target, "# test\n", dtype="float32")
            specjax.generate(tiny_model(0, vocab=50), [[1, 2, 3]], config, drafter=str(tmp_path))
        where = {"another target's width": tiny_model(0, hidden=48),
                 "another target's vocabulary": tiny_model(0, vocab=50)}.get(kind, target)
        if kind == "tree wider than the draft vocabulary":
            config = SpecConfig(method="draft_model", num_steps=2, topk=40, num_draft_tokens=5, max_new_tokens=4)
        specjax.generate(where, [[1, 2, 3]], config, drafter=draft)


def _rows(target, first_label: int = 3):
    from train.data import LabeledRows
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, target.config.vocab_size, (2, 14)), jnp.int32)
    return LabeledRows(tokens, jnp.asarray([first_label, 6], jnp.int32), jnp.asarray([14, 11], jnp.int32))


@pytest.mark.parametrize("draft_vocab", [False, True])
def test_loss_is_zero_for_the_target_itself(target, monkeypatch, draft_vocab):
    """A full-depth copy of the target is its own teacher: with the target's head, and with a draft vocabulary (the
    teacher restricted to it and renormalised is exactly the copy's distribution over it), the KL is 0 and the copy
    agrees wherever it can. The same loss over the label window only (max_span), and from cached features, equals it. A
    planted bug (the teacher read one position late) makes the same KL large."""
    from train.data import FeatureRows
    from train.losses.common import TargetFeatures, frozen_target_features, max_label_span
    from train.losses.draft_model import target_embedding_loss_fn
    cfg, V = target.config, target.config.vocab_size
    d2t = _vocab_map(np.arange(0, V, 2)) if draft_vocab else None
    draft = draft_model.init_from_target(target, cfg.num_layers, d2t=d2t)
    rows = _rows(target)
    loss = lambda ce_weight, batch, **kw: jax.jit(target_embedding_loss_fn(draft.config, cfg, ce_weight, 1.0, 0,
                                                                           d2t=d2t, **kw))(draft.params, batch, None,
                                                                                           target.params)
    _, m = loss(0.0, rows)
    # it agrees wherever it can: everywhere, or where the target's top token is in the draft vocabulary
    assert abs(float(m["kl"])) < 1e-5 and float(m["top1_agree"]) == float(m.get("in_vocab", 1.0)), m
    assert not draft_vocab or float(m["in_vocab"]) < 1.0
    mixed = float(loss(0.5, rows)[0])
    np.testing.assert_allclose(float(loss(0.5, rows, max_span=max_label_span(rows))[0]), mixed, rtol=1e-6)
    tf = frozen_target_features(target.params, cfg, rows.tokens)
    cached = FeatureRows(rows, tf.hidden, jnp.argmax(tf.logits, -1).astype(jnp.int32), {})
    np.testing.assert_allclose(float(loss(0.5, cached)[0]), mixed, rtol=1e-5)
    teacher = TargetFeatures.teacher_logits
    monkeypatch.setattr(TargetFeatures, "teacher_logits", lambda self, lm_head, at=None, ids=None: teacher(
        self, lm_head, at=jnp.minimum(at + 1, self.hidden.shape[1] - 1), ids=ids))
    assert float(loss(0.0, rows)[1]["kl"]) > 1e-2


def test_held_out_counts_of_the_target_itself_on_its_greedy_rows(target):
    """draft_agreements on rows the target decoded greedily: a full-depth copy drafts what greedy verification
    accepts, so every chain of every length is all hits (accept length = the chain's length); with a draft vocabulary
    missing the target's tokens, exactly the positions whose target token it lacks are misses, and a chain ends
    there."""
    from train.losses.draft_model import draft_agreements
    cfg, V, n = target.config, target.config.vocab_size, 3
    prompts = np.random.default_rng(2).integers(1, V, (4, 5)).tolist()
    res = specjax.generate(target, prompts, SpecConfig(max_new_tokens=12, stop_at_eos=False))
    rows = jnp.asarray(np.concatenate([np.asarray(prompts), np.asarray(res.tokens)], 1), jnp.int32)
    full = draft_model.init_from_target(target, cfg.num_layers)
    hits, labels, chain_hits, chains = draft_agreements(full.params, target.params, full.config, cfg, rows, 5,
                                                        n).counts()
    assert int(chains) > 0 and np.all(np.asarray(chain_hits) == int(chains)) and np.all(hits == labels)
    ids = np.setdiff1d(np.arange(V), np.unique(np.asarray(res.tokens))[:3])     # lacks 3 of the generated tokens
    part = draft_model.init_from_target(target, cfg.num_layers, d2t=_vocab_map(ids))
    agree = draft_agreements(part.params, target.params, part.config, cfg, rows, 5, n, part.d2t)
    R = rows.shape[1]
    first, valid = np.asarray(agree.agree[:, 0, :R]), np.asarray(agree.valid[:, 0, :R])   # draft 1 of token L
    assert valid.sum() == 4 * (R - 5)
    np.testing.assert_array_equal(first[valid], np.isin(np.asarray(rows), ids)[valid])
    _, _, chain_hits, chains = agree.counts()
    assert int(chain_hits[0]) < int(chains) and np.all(np.diff(np.asarray(chain_hits)) <= 0)


def test_recipe_smoke_on_the_toy_target(tmp_path):
    """python -m train.draft --init_layers=1 --draft_vocab_size=512 on the toy target (60 stdlib files, 3 steps):
    it trains, evaluates the held-out chains, exports an artifact of one layer, a final norm, a 512-token head and
    d2t (no embedding), and decoding with that artifact is exact."""
    out, env = tmp_path / "out", dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "train.draft", "--init_layers=1", "--draft_vocab_size=512", "--max_files=60",
           "--seq_len=64", "--batch_size=4", "--steps=3", "--warmup=1", "--log_every=1", "--eval_every=3",
           "--eval_tokens=1024", "--final_eval_tokens=1024", f"--data_dir={tmp_path}/data",
           f"--ckpt_dir={tmp_path}/ckpt", f"--out={out}"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    from specjax.drafters.artifacts import read_manifest_record
    record = read_manifest_record(str(out))
    assert record["steps"] == 3 and record["draft_vocab_size"] == 512 and 0 < record["heldout_acc0"] <= 1
    assert record["training_curve"] and "heldout_accept_len" in record["training_curve"][-1]
    names = artifact_names(out)
    assert "d2t" in names and "lm_head" in names and not any(n.startswith("embed") for n in names), names
    toy = specjax.load_model("stdlib-target")
    prompts = ["def fibonacci(n):", "import os\n"]
    plain = specjax.generate(toy, prompts, SpecConfig(max_new_tokens=16))
    spec = specjax.generate(toy, prompts, SpecConfig(method="draft_model", num_speculative_tokens=3, max_new_tokens=16),
                            drafter=str(out))
    assert spec.tokens == plain.tokens
