"""PARD (specjax.drafters.pard and its training loss): greedy identity, the draft cache under partial acceptance,
the drafts against a plain forward over [context + masks], bad artifacts, and the multi-stream training mask."""
from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import SamplingParams, SpecConfig
from specjax.models import Model
from specjax.cache import KVCache
from specjax.drafters import pard
from specjax.drafters.pard import drafter as pard_drafter
from specjax.drafters.base import Context
from specjax.models.llama import forward, full_logits
from tiny import perturbed, ragged_prompts, tiny_model

M = 4                      # mask tokens of the test drafts


def word_tokenizer(words):
    from tokenizers import Tokenizer, models
    return Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))


def pard_of(model: Model, num_masks: int = M, tokenizer=None) -> pard.PardModel:
    """model's weights with num_masks mean-embedding rows appended: draft 1 is the model's own guess."""
    params, cfg = pard.add_mask_rows(model.params, model.config, num_masks)
    ids = tuple(range(model.config.vocab_size, cfg.vocab_size))
    return pard.PardModel(Model(cfg, params, tokenizer, "tiny-pard"), ids)


@pytest.fixture(scope="module")
def saved(target, tmp_path_factory):
    """A PARD draft of the (noised) target written as an artifact with tokenizers: (target with a tokenizer,
    directory)."""
    tok = word_tokenizer([f"w{i}" for i in range(target.config.vocab_size)])
    draft_tok, ids = pard.mask_tokenizer(tok, M)
    p = pard_of(perturbed(target, 0.05), M)
    path = tmp_path_factory.mktemp("pard")
    pard.save(path, p.model.params, p.model.config, ids, draft_tok, "# test draft\n", dtype="float32")
    return Model(target.config, target.params, tok, "tiny"), str(path)


def test_greedy_equals_plain_from_a_saved_artifact(saved, baselines):
    target, path = saved
    prompts = ragged_prompts(3, seed=3)
    res = specjax.generate(target, prompts, SpecConfig(method="pard", num_speculative_tokens=4, max_new_tokens=24),
                           drafter=path)
    assert res.tokens == baselines[3]
    assert res.stats["accepted"] > 0 and res.stats["rejected"] > 0, res.stats


def test_cache_holds_committed_tokens_and_drafts_match_a_plain_forward(target):
    """Drive the drafter through steps with partial acceptance (0..k drafts + 1 token, per row): after every
    proposal its cache equals a fresh prefill of the committed tokens at every valid entry, and its draft
    distributions equal a cache-free causal forward over [committed tokens, mask_1 .. mask_{k-1}]."""
    k = 3
    p = pard_of(perturbed(target, 0.05))
    cfg, params = p.model.config, p.model.params
    drafter = pard.PardDrafter(k, cfg, target.config.vocab_size, p.mask_token_ids[:k - 1], 64)
    sp = SamplingParams(temperature=1.0)
    rng = np.random.default_rng(0)
    prompts = [[5], [3, 9, 14, 20, 7, 7, 30]]       # row 0 starts shorter than the k + 1 block
    B, L = len(prompts), 64
    tokens = np.zeros((B, L), np.int32)
    length = np.array([len(q) + 1 for q in prompts], np.int32)
    for b, q in enumerate(prompts):
        tokens[b, :len(q) + 1] = q + [int(rng.integers(61))]
    prompt_len = jnp.asarray([len(q) for q in prompts], jnp.int32)
    ctx = Context(jnp.asarray(tokens), jnp.asarray(length), prompt_len)
    state = drafter.init(params, ctx, SimpleNamespace(hidden=jnp.zeros((B, 8, 1))), sp)   # an 8-wide prompt block
    propose = jax.jit(drafter.propose, static_argnums=4)
    # References at one fixed width each (one compile): causal, so what follows the real tokens changes nothing.
    prefill = jax.jit(lambda row: forward(params, cfg, row, KVCache.init(cfg.num_layers, 1, L, cfg.num_kv_heads,
                                                                          cfg.head_dim)).cache)
    plain_logits = jax.jit(lambda row: full_logits(params, cfg, row))
    for step in range(6):
        ctx = Context(jnp.asarray(tokens), jnp.asarray(length), prompt_len)
        keys = jax.random.split(jax.random.PRNGKey(step), B)
        draft, state = propose(params, state, ctx, keys, sp)
        np.testing.assert_array_equal(state.lengths, length)
        for b in range(B):
            n = int(length[b])
            fresh = prefill(jnp.asarray(tokens[b:b + 1]))
            keys = lambda cache: np.stack([cache.keys(i) for i in range(len(cache.k))])     # [L, B, Hkv, S, D]
            np.testing.assert_allclose(keys(state)[:, b, :, :n], keys(fresh)[:, 0, :, :n], atol=1e-5)
            np.testing.assert_allclose(np.stack(state.v)[:, b, :, :n], np.stack(fresh.v)[:, 0, :, :n], atol=1e-5)
            seq = np.zeros((1, L), np.int32)
            seq[0, :n + k - 1] = np.concatenate([tokens[b, :n], p.mask_token_ids[:k - 1]])
            ref = jax.nn.softmax(plain_logits(jnp.asarray(seq))[0, n - 1:n + k - 1, :61], -1)     # [k, V]
            np.testing.assert_allclose(draft.probs[b], ref, atol=1e-5)
        # Commit 0..k drafts plus one more token per row (some steps accept everything, some nothing).
        for b in range(B):
            acc = int(rng.integers(0, k + 1))
            new = list(np.asarray(draft.tokens[b, :acc])) + [int(rng.integers(61))]
            tokens[b, length[b]:length[b] + len(new)] = new
            length[b] += len(new)


@pytest.fixture(scope="module")
def tok_target(target):
    return Model(target.config, target.params, word_tokenizer([f"w{i}" for i in range(61)]), "tiny")


def _bad(kind: str, target: Model, tmp_path):
    """A saved PARD artifact broken in one way -> (directory or PardModel, k)."""
    tok = target.tokenizer
    draft_tok, ids = pard.mask_tokenizer(tok, M)
    p = pard_of(target)
    params, cfg = p.model.params, p.model.config
    if kind == "no masks in config":
        from specjax.models.hf_io import save_pretrained
        save_pretrained(params, cfg, tmp_path, tokenizer=draft_tok)
        return str(tmp_path), 3
    if kind == "masks not in tokenizer":
        from tokenizers import Tokenizer
        plain = Tokenizer.from_str(tok.to_str())
        plain.add_tokens([pard.MASK_TOKEN.format(j) for j in range(M)])          # ordinary, not special
        pard.save(tmp_path, params, cfg, ids, plain)
        return str(tmp_path), 3
    if kind == "k too large":
        pard.save(tmp_path, params, cfg, ids, draft_tok)
        return str(tmp_path), M + 2
    if kind == "another tokenizer":
        other, _ = pard.mask_tokenizer(word_tokenizer([f"w{i}" for i in reversed(range(61))]), M)
        pard.save(tmp_path, params, cfg, ids, other)
        return str(tmp_path), 3
    if kind == "vocab size":
        small, scfg = pard.add_mask_rows(tiny_model(0, vocab=50).params, tiny_model(0, vocab=50).config, M)
        return pard.PardModel(Model(scfg, small, None, "small"), tuple(range(50, 50 + M))), 3
    raise AssertionError(kind)


@pytest.mark.parametrize("kind, match", [
    ("no masks in config", "not a PARD draft.*pard_mask_token_ids"),
    ("masks not in tokenizer", "not special tokens"),
    ("k too large", "trained with 4 mask tokens.*num_speculative_tokens=6"),
    ("another tokenizer", "different tokenizers"),
    ("vocab size", "vocabulary mismatch.*vocab_size 54.*61 plus its 4 mask tokens = 65"),
])
def test_bad_artifacts_are_refused(tok_target, tmp_path, kind, match):
    drafter, k = _bad(kind, tok_target, tmp_path)
    with pytest.raises(ValueError, match=match):
        specjax.generate(tok_target, [[1, 2, 3]], SpecConfig(method="pard", num_speculative_tokens=k,
                                                             max_new_tokens=4), drafter=drafter)


def test_multi_stream_training_logits_equal_each_cut_point_run_alone():
    """One forward over stream 0 and the mask streams (the training mask) gives, for draft j + 1 of context end c,
    what a plain causal forward over the literal sequence [x_0 .. x_c, mask_1 .. mask_j] gives at its last
    position -- for every context end, and for a subset of them (the drop-token form training uses)."""
    from train.losses.pard import pard_loss_fn, pard_stream_logits
    k, T, V = 4, 9, 61
    model = tiny_model(3, vocab=V)
    params, cfg = pard.add_mask_rows(model.params, model.config, k - 1,
                                     rows=0.3 * jax.random.normal(jax.random.PRNGKey(1), (k - 1, 32)))
    ids = tuple(range(V, V + k - 1))
    rows = np.random.default_rng(0).integers(0, V, (2, T + 1)).astype(np.int32)
    streams = jax.jit(lambda x, ends: pard_stream_logits(params, cfg, x, ids, k, V, ends))
    real, masks = streams(jnp.asarray(rows[:, :-1]), jnp.arange(T))
    plain_logits = jax.jit(lambda seq: full_logits(params, cfg, seq))      # one width: causal, the tail is unread
    ref = np.zeros((2, k, T, V), np.float32)
    for c in range(T):
        for j in range(k):
            seq = np.zeros((2, T + k), np.int32)
            seq[:, :c + j + 1] = np.concatenate([rows[:, :c + 1], np.broadcast_to(np.asarray(ids[:j], np.int32),
                                                                                  (2, j))], 1)
            ref[:, j, c] = plain_logits(jnp.asarray(seq))[:, c + j, :V]
    np.testing.assert_allclose(real, ref[:, 0], atol=2e-4)
    np.testing.assert_allclose(masks, ref[:, 1:], atol=2e-4)
    ends = jnp.asarray([1, 4, 8])
    real_s, masks_s = jax.jit(lambda x: pard_stream_logits(params, cfg, x, ids, k, V, ends))(
        jnp.asarray(rows[:, :-1]))
    np.testing.assert_allclose(real_s, ref[:, 0], atol=2e-4)
    np.testing.assert_allclose(masks_s, ref[:, 1:][:, :, np.asarray(ends)], atol=2e-4)
    # Against a target equal to the draft's own stream 0: draft 1's KL is 0 (agreement 1), the masks' is not.
    target_params = dict(params, embed=params["embed"][:V], lm_head=params["lm_head"][:, :V])
    loss_fn = pard_loss_fn(cfg, model.config, ids, k, ce_weight=0.0, num_ends=4)
    _, m = jax.jit(loss_fn)(params, jnp.asarray(rows), jax.random.PRNGKey(0), target_params)
    assert abs(float(m["loss0"])) < 1e-5 and float(m["acc0"]) == 1.0
    assert all(float(m[f"loss{j}"]) > 1e-3 for j in range(1, k))


# ---- a PARD draft reading the target's embedding (pard.TargetEmbeddingPard) -------------------------------------

def _vocab_map(ids) -> np.ndarray:
    ids = np.asarray(ids)
    return (ids - np.arange(len(ids))).astype(np.int64)


@pytest.mark.parametrize("draft_vocab", [False, True])
def test_target_embedding_draft_saved_loaded_and_exact(target, baselines, tmp_path, draft_vocab):
    """A draft of the target's first layer reading its embedding, through the target's own head or a draft
    vocabulary's, saved as an artifact and loaded by path: greedy output is plain greedy output, with drafts both
    accepted and rejected; the loaded draft is the saved one (its d2t exactly)."""
    V = target.config.vocab_size
    d2t = _vocab_map(np.arange(0, V, 2)) if draft_vocab else None
    draft = pard.init_target_embedding(target, 1, M, d2t=d2t)
    assert "embed" not in draft.params and draft.mask_token_ids == tuple(range(V, V + M))
    pard.save_target_embedding(tmp_path, draft, target, "# test draft\n", dtype="float32")
    loaded = pard_drafter._load(target, str(tmp_path))
    assert isinstance(loaded, pard.TargetEmbeddingPard) and loaded.config == draft.config
    np.testing.assert_array_equal(loaded.params["layers"][0]["wq"], draft.params["layers"][0]["wq"])
    assert (loaded.d2t is None) == (d2t is None) and (d2t is None or np.array_equal(loaded.d2t, d2t))
    prompts = ragged_prompts(3, seed=3)
    res = specjax.generate(target, prompts, SpecConfig(method="pard", num_speculative_tokens=4, max_new_tokens=24),
                           drafter=str(tmp_path))
    assert res.tokens == baselines[3]
    assert res.stats["accepted"] > 0 and res.stats["rejected"] > 0, res.stats


def test_target_embedding_loss_is_zero_for_the_target_itself_and_reads_cached_features(target):
    """A draft made of ALL the target's layers (its embedding, its head) is the target at stream 0: draft 1's KL
    is 0 and it always agrees; the mask streams are not. The same loss from cached features (FeatureRows: the
    target's final hidden state and argmax) equals the one that runs the frozen target."""
    from train.data import FeatureRows, LabeledRows
    from train.losses.common import frozen_target_features
    from train.losses.pard import pard_loss_fn
    k, cfg = 3, target.config
    draft = pard.init_target_embedding(target, cfg.num_layers, k - 1)
    rows = LabeledRows(jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 12)), jnp.int32),
                       jnp.asarray([3, 5], jnp.int32), jnp.asarray([12, 10], jnp.int32))
    loss_fn = jax.jit(pard_loss_fn(draft.config, cfg, draft.mask_token_ids, k, ce_weight=0.0, num_ends=4,
                                   target_embedding=True))
    loss, m = loss_fn(draft.params, rows, jax.random.PRNGKey(0), target.params)
    assert abs(float(m["loss0"])) < 1e-5 and float(m["acc0"]) == 1.0
    assert all(float(m[f"loss{j}"]) > 1e-3 for j in range(1, k))
    tf = frozen_target_features(target.params, cfg, rows.tokens)
    cached = FeatureRows(rows, tf.hidden, jnp.argmax(tf.logits, -1).astype(jnp.int32), {})
    loss_c, m_c = loss_fn(draft.params, cached, jax.random.PRNGKey(0), target.params)
    np.testing.assert_allclose(float(loss_c), float(loss), rtol=1e-5, atol=1e-6)
    # a planted bug: the mask streams scored against the wrong token (one position late) must change the loss
    shifted = LabeledRows(jnp.roll(rows.tokens, -1, axis=1), rows.first_label, rows.label_end)
    assert abs(float(loss_fn(draft.params, shifted, jax.random.PRNGKey(0), target.params)[0]) - float(loss)) > 1e-3


def test_target_embedding_stream_hidden_equals_a_forward_over_each_context_and_masks(target):
    """pard_stream_hidden with the target's embedding: draft j + 1 of context end c is the draft's forward over
    the literal [x_0 .. x_c, mask_1 .. mask_j] (per-row context ends)."""
    from train.losses.pard import DraftHead, pard_stream_hidden
    k, T, cfg = 3, 8, target.config
    draft = pard.init_target_embedding(target, 1, k - 1)
    draft.params["mask_embed"] = 0.3 * jax.random.normal(jax.random.PRNGKey(2), draft.params["mask_embed"].shape)
    head = DraftHead.of(cfg.vocab_size, True)
    rows = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, T)).astype(np.int32)
    ends = jnp.asarray([[1, 4, 6], [0, 2, 7]])
    real, masks = jax.jit(lambda x, e: pard_stream_hidden(draft.params, draft.config, x, draft.mask_token_ids, k, e,
                                                          head, target.params))(jnp.asarray(rows), ends)
    embed, W = target.params["embed"], T + k

    @jax.jit
    def plain_hidden(seq):             # one width: causal, the tail past the sequence is unread
        cache = KVCache.init(1, 1, W, cfg.num_kv_heads, cfg.head_dim)
        x = pard.embed_tokens(draft.params["mask_embed"], embed, seq)
        return forward(dict(draft.params, embed=embed), draft.config, seq, cache, input_embeds=x).hidden[0]

    for b in range(2):
        for i, c in enumerate(np.asarray(ends[b])):
            for j in range(k):
                seq = np.zeros((1, W), np.int32)
                seq[0, :c + j + 1] = list(rows[b, :c + 1]) + list(draft.mask_token_ids[:j])
                got = real[b, c] if j == 0 else masks[b, j - 1, i]
                np.testing.assert_allclose(got, plain_hidden(jnp.asarray(seq))[c + j], atol=2e-5)


@pytest.mark.parametrize("kind, match", [
    ("k too large", "trained with 2 mask tokens.*num_speculative_tokens=5"),
    ("another target", "vocab_size"),
    ("from_layers out of range", r"from_layers \[7\] out of range: the target has 2"),
    ("wrong tensor shape", "mask_embed.*expected"),
])
def test_target_embedding_bad_input_is_refused(target, tmp_path, kind, match):
    with pytest.raises(ValueError, match=match):
        if kind == "from_layers out of range":
            pard.init_target_embedding(target, 1, 2, from_layers=(7,))
        draft = pard.init_target_embedding(target, 1, 2)
        k, where = 3, target
        if kind == "k too large":
            k = 5
        if kind == "another target":
            where = tiny_model(0, vocab=50)
        pard.save_target_embedding(tmp_path, draft, target, "# test\n", dtype="float32")
        if kind == "wrong tensor shape":
            import json
            with open(tmp_path / "config.json") as f:
                meta = json.load(f)
            meta["config"]["num_masks"] = 3
            with open(tmp_path / "config.json", "w") as f:
                json.dump(meta, f)
        specjax.generate(where, [[1, 2, 3]], SpecConfig(method="pard", num_speculative_tokens=k, max_new_tokens=4),
                         drafter=str(tmp_path))
