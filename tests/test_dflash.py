"""The DFlash block drafter: its context keys/values follow the committed tokens exactly (init, then commits of
accepted paths, equal a direct computation from one full target forward), its artifact round-trips, and bad input
is refused (exactness over k and batches is the conformance suite's: factory dflash)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import SpecConfig
from specjax.drafters import dflash
from specjax.drafters.base import Context, target_weight
from specjax.models.llama import forward
from specjax.cache import KVCache
from specjax.sampling import SamplingParams
from train.losses.common import causal_forward
from tiny import tiny_model


def _weights(target, block_size=5, target_layers=(0, 1), draft_vocab=None):
    """Random DFlash weights; draft_vocab: target ids of a draft vocabulary (its own head) or None."""
    cfg = dflash.dflash_config(target, num_layers=2, block_size=block_size, target_layers=target_layers,
                               draft_vocab_size=None if draft_vocab is None else len(draft_vocab))
    d2t = None if draft_vocab is None else (np.sort(draft_vocab) - np.arange(len(draft_vocab))).astype(np.int64)
    return dflash.DFlashWeights(cfg, dflash.init_params(jax.random.PRNGKey(1), cfg, std=0.3), "random", d2t)


def test_context_cache_follows_the_committed_tokens():
    target = tiny_model(0)
    w = _weights(target)
    cfg, k = w.config, 3
    rng = np.random.default_rng(0)
    seq = jnp.asarray(rng.integers(1, 61, (2, 20)), jnp.int32)
    P = 6
    drafter = dflash.DFlashDrafter(k, cfg, 32)
    tw = {"embed": target.params["embed"], "lm_head": target_weight(target.params, "lm_head")}
    cache = KVCache.init(target.config.num_layers, 2, 32, target.config.num_kv_heads, target.config.head_dim)
    prefill = forward(target.params, target.config, seq[:, :P], cache, hidden_layers=cfg.target_layers)
    state = drafter.init(w.params, Context(seq, jnp.full((2,), P + 1), jnp.full((2,), P), tw), prefill,
                         SamplingParams())
    # one verify pass over positions P .. P + k; row 0 accepts 2 drafts, row 1 none
    tcache = prefill.cache.replace(lengths=jnp.full((2,), P, jnp.int32))
    verify = forward(target.params, target.config, seq[:, P:P + k + 1], tcache, hidden_layers=cfg.target_layers)
    n = jnp.array([2, 0])
    new_len = P + 1 + n + 1
    state = drafter.commit(w.params, state, Context(seq, new_len, jnp.full((2,), P), tw), n, verify, None)
    assert state.lengths.tolist() == (new_len - 1).tolist()
    full = causal_forward(target.params, target.config, seq, hidden_layers=cfg.target_layers)
    feats = dflash.context_features(w.params, cfg, full.layer_hidden)
    positions = jnp.broadcast_to(jnp.arange(20), (2, 20))
    for l, lp in enumerate(w.params["layers"]):
        k_ref, v_ref = dflash.context_kv(lp, cfg, feats, positions)        # [B, T, Hkv, D]
        for b in range(2):
            m = int(state.lengths[b])
            np.testing.assert_allclose(np.asarray(state.keys(l)[b, :, :m]), np.asarray(k_ref[b, :m]).swapaxes(0, 1),
                                       rtol=2e-4, atol=2e-5)
            np.testing.assert_allclose(np.asarray(state.v[l][b, :, :m]), np.asarray(v_ref[b, :m]).swapaxes(0, 1),
                                       rtol=2e-4, atol=2e-5)
    # the proposal reads exactly those entries: the same drafts from a cache rebuilt from the full forward
    ctx = Context(seq, new_len, jnp.full((2,), P), tw)
    drafts, _ = drafter.propose(w.params, state, ctx, jax.random.split(jax.random.PRNGKey(0), 2), SamplingParams())
    rebuilt = KVCache.init(cfg.num_layers, 2, 32, cfg.num_kv_heads, cfg.head_dim, keys_transposed=False)
    rebuilt = drafter._write(w.params, rebuilt, tuple(h[:, :20] for h in full.layer_hidden), jnp.zeros(2, jnp.int32))
    again, _ = drafter.propose(w.params, rebuilt.replace(lengths=state.lengths), ctx,
                               jax.random.split(jax.random.PRNGKey(0), 2), SamplingParams())
    assert drafts.tokens.tolist() == again.tokens.tolist()


@pytest.mark.parametrize("draft_vocab", [None, np.arange(1, 60, 3)])
def test_artifact_round_trip_and_bad_input(tmp_path, draft_vocab):
    target = tiny_model(0)
    w = _weights(target, draft_vocab=draft_vocab)
    dflash.save(str(tmp_path / "d"), w, target, "# test drafter\n", dtype="float32")
    loaded = dflash.load(str(tmp_path / "d"), target)
    assert loaded.config == w.config
    for a, b in zip(jax.tree_util.tree_leaves(loaded.params), jax.tree_util.tree_leaves(w.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if draft_vocab is not None:
        assert loaded.d2t.dtype == np.int64 and loaded.d2t.tolist() == w.d2t.tolist()
        drafts = _drafts(target, loaded, [[1, 2, 3, 4, 5], [9, 8, 7]])
        assert set(np.unique(drafts)) <= set(draft_vocab.tolist())     # every draft is a draft-vocabulary token
    prompts = [[1, 2, 3, 4, 5]]
    plain = specjax.generate(target, prompts, SpecConfig(max_new_tokens=10)).tokens
    cfg = SpecConfig(method="dflash", num_speculative_tokens=4, max_new_tokens=10)
    assert specjax.generate(target, prompts, cfg, drafter=str(tmp_path / "d")).tokens == plain
    with pytest.raises(ValueError, match="k=5 drafts more positions than the DFlash drafter 'random' fills"):
        specjax.generate(target, prompts, SpecConfig(method="dflash", num_speculative_tokens=5), drafter=w)
    with pytest.raises(ValueError, match=r"reads target layers \[0, 7\]; the target has 2 decoder layers"):
        specjax.generate(target, prompts, cfg, drafter=_weights(target, target_layers=(0, 7)))
    with pytest.raises(ValueError, match="trained for another target"):
        specjax.generate(tiny_model(0, layers=3), prompts, cfg, drafter=str(tmp_path / "d"))
    with pytest.raises(TypeError, match="method='dflash' needs drafter="):
        specjax.generate(target, prompts, cfg)
    truncated = dataclasses.replace(w, params={k: v for k, v in w.params.items() if k != "fc"})
    dflash.save(str(tmp_path / "truncated"), truncated, target, "# no fc\n", dtype="float32")
    with pytest.raises(ValueError, match=r"tensors do not match its config.json; missing \['fc'\]"):
        dflash.load(str(tmp_path / "truncated"), target)
    if draft_vocab is not None:
        with pytest.raises(ValueError, match="draft_vocab_size is 20 and d2t is None: a draft vocabulary needs its d2t"):
            dflash.DFlashWeights(w.config, w.params, "no-map")
        bad = dataclasses.replace(w, d2t=w.d2t + 10)                           # the last ids leave the vocabulary
        dflash.save(str(tmp_path / "bad"), bad, target, "# bad map\n", dtype="float32")
        with pytest.raises(ValueError, match=f"the d2t map does not fit the target vocabulary of {target.config.vocab_size}"):
            dflash.load(str(tmp_path / "bad"), target)
        with pytest.raises(ValueError, match="draft_vocab_size must be in"):
            dataclasses.replace(w.config, draft_vocab_size=target.config.vocab_size + 1)


def _drafts(target, w, prompts, k=4):
    """The drafts of one propose() after each prompt (greedy) -> int array [B, k]."""
    cfg = w.config
    B, P = len(prompts), max(map(len, prompts))
    seq = jnp.asarray([p + [0] * (P - len(p)) for p in prompts], jnp.int32)
    lengths = jnp.asarray([len(p) for p in prompts], jnp.int32)
    params = dict(w.params)
    if cfg.draft_vocab_size is not None:
        params["vocab_map"] = jnp.asarray(np.arange(len(w.d2t)) + w.d2t, jnp.int32)
    drafter = dflash.DFlashDrafter(k, cfg, 32)
    tw = {"embed": target.params["embed"], "lm_head": target_weight(target.params, "lm_head")}
    full = causal_forward(target.params, target.config, seq, hidden_layers=cfg.target_layers)
    cache = KVCache.init(cfg.num_layers, B, 32, cfg.num_kv_heads, cfg.head_dim, keys_transposed=False)
    cache = drafter._write(params, cache, full.layer_hidden, jnp.zeros(B, jnp.int32)).replace(lengths=lengths - 1)
    ctx = Context(seq, lengths, lengths, tw)
    draft, _ = drafter.propose(params, cache, ctx, jax.random.split(jax.random.PRNGKey(0), B), SamplingParams())
    return np.asarray(draft.tokens)


@pytest.mark.parametrize("draft_vocab", [pytest.param(None, marks=pytest.mark.slow),      # ~40 s: the slow tier
                                         np.arange(0, 61, 2)])
def test_training_blocks_are_what_the_drafter_proposes(draft_vocab):
    """The loss's block at anchor a (train.losses.dflash) has exactly the distributions propose() draws from after
    the committed tokens 0..a, so training optimises what drafting uses; and the loss trains (it falls). With a
    draft vocabulary: the same over its tokens, probability 0 elsewhere."""
    from train.losses.common import frozen_target_features, labeled
    from train.losses.dflash import _blocks, dflash_accuracy, dflash_loss_fn
    import optax
    from specjax.drafters.draft_vocab import full_vocab_logits
    target = tiny_model(0)
    w = _weights(target, draft_vocab=draft_vocab)
    cfg, k = w.config, 4
    ids = None if draft_vocab is None else jnp.asarray(draft_vocab, jnp.int32)
    params = w.params if ids is None else dict(w.params, vocab_map=ids)
    seq = jnp.asarray(np.random.default_rng(1).integers(1, 61, (2, 16)), jnp.int32)
    rows = labeled(seq, 1)
    tf = frozen_target_features(target.params, target.config, seq, cfg.target_layers)
    anchors = jnp.array([[7], [11]], jnp.int32)
    logits, _, _, _, _ = _blocks(w.params, cfg, rows, target.params, tf, anchors, k, ids)
    if ids is not None:
        logits = full_vocab_logits(logits, ids, cfg.vocab_size)
    drafter = dflash.DFlashDrafter(k, cfg, 32)
    tw = {"embed": target.params["embed"], "lm_head": target_weight(target.params, "lm_head")}
    cache = KVCache.init(cfg.num_layers, 2, 32, cfg.num_kv_heads, cfg.head_dim, keys_transposed=False)
    cache = drafter._write(params, cache, tf.layers, jnp.zeros(2, jnp.int32)).replace(lengths=anchors[:, 0])
    ctx = Context(seq, anchors[:, 0] + 1, jnp.ones(2, jnp.int32), tw)
    sp = SamplingParams(temperature=1.0)
    draft, _ = drafter.propose(params, cache, ctx, jax.random.split(jax.random.PRNGKey(0), 2), sp)
    np.testing.assert_allclose(np.asarray(draft.probs), np.asarray(jax.nn.softmax(logits[:, 0], -1)),
                               rtol=1e-4, atol=1e-6)
    if ids is not None:
        assert float(jnp.max(draft.probs[..., 1::2])) == 0.0                 # odd tokens are outside the vocabulary
    loss_fn = dflash_loss_fn(target.config, cfg, 1, anchors_per_row=4, d2t=w.d2t)
    opt = optax.adam(3e-3)
    params, state = w.params, opt.init(w.params)
    step = jax.jit(lambda p, s, r: (lambda lg: (lg[0], *opt.update(lg[1], s, p)))(
        jax.value_and_grad(lambda p: loss_fn(p, seq, r, target.params)[0])(p)))
    losses = []
    for i in range(30):
        loss, updates, state = step(params, state, jax.random.PRNGKey(i % 3))
        params = optax.apply_updates(params, updates)
        losses.append(float(loss))
    assert losses[-1] < 0.7 * losses[0]
    hits, counts, chain_hits, chains = dflash_accuracy(params, target.params, target.config, cfg, seq, 1, 3, d2t=w.d2t)
    assert counts.tolist()[0] > 0 and int(chains) > 0 and int(chain_hits[2]) <= int(chain_hits[0])


def test_published_layout_loads_to_the_same_drafter(tmp_path):
    from layouts import write_dflash_layout
    target = tiny_model(0)
    w = _weights(target)
    mask_id = 60
    w = dflash.DFlashWeights(w.config, dict(w.params, mask_embed=target.params["embed"][mask_id]), "random")
    write_dflash_layout(str(tmp_path / "pub"), w, mask_id)
    loaded = dflash.load_published(str(tmp_path / "pub"), target)
    assert loaded.config == w.config
    for a, b in zip(jax.tree_util.tree_leaves(loaded.params), jax.tree_util.tree_leaves(w.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    cfg = SpecConfig(method="dflash", num_speculative_tokens=3, max_new_tokens=12)
    ours = specjax.generate(target, prompts, cfg, drafter=w)
    theirs = specjax.generate(target, prompts, cfg, drafter=str(tmp_path / "pub"))
    assert ours.tokens == theirs.tokens and ours.stats["accept_hist"] == theirs.stats["accept_hist"]
    write_dflash_layout(str(tmp_path / "bad"), w, 99)              # a mask token the target does not have
    with pytest.raises(ValueError, match="embeds mask token 99, outside the target's vocabulary of 61"):
        specjax.generate(target, prompts, cfg, drafter=str(tmp_path / "bad"))


def test_trees_come_from_the_block_top_tokens():
    """DDTree's idea: the static tree's depth-d node of rank r holds block position d's r-th token (whatever its
    parent); the dynamic tree's nodes are paths of block top tokens ranked by summed log-probability, its first
    child the block's greedy draft; a tree deeper than the block is refused (exactness: conformance factories
    dflash-static_tree, dflash-dynamic_tree)."""
    from specjax.trees import TreeSpec
    target = tiny_model(0)
    w = _weights(target, block_size=5)
    cfg, B, P = w.config, 2, 7
    seq = jnp.asarray(np.random.default_rng(4).integers(1, 61, (B, P)), jnp.int32)
    lengths = jnp.full((B,), P, jnp.int32)
    tw = {"embed": target.params["embed"], "lm_head": target_weight(target.params, "lm_head")}
    full = causal_forward(target.params, target.config, seq, hidden_layers=cfg.target_layers)
    chain = dflash.DFlashDrafter(3, cfg, 32)                # a block as long as the trees are deep
    cache = KVCache.init(cfg.num_layers, B, 32, cfg.num_kv_heads, cfg.head_dim, keys_transposed=False)
    cache = chain._write(w.params, cache, full.layer_hidden, jnp.zeros(B, jnp.int32)).replace(lengths=lengths - 1)
    ctx = Context(seq, lengths, lengths, tw)
    logits = np.asarray(chain.block_logits(w.params, cache, ctx))                   # [B, 3, V]
    order = np.argsort(-logits, axis=-1, kind="stable")
    keys = jax.random.split(jax.random.PRNGKey(0), B)

    spec = TreeSpec.from_choices([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    static = dflash.DFlashDrafter(6, cfg, 32, tree=spec)
    draft, _ = static.propose(w.params, cache, ctx, keys, SamplingParams())
    tokens = np.asarray(draft.tree.tokens)
    assert (tokens[:, 0] == np.asarray(seq[:, -1])).all()                            # the root: the anchor
    for node in range(1, spec.num_nodes):
        d, r = int(spec.depths[node]), int(spec.ranks[node])
        assert (tokens[:, node] == order[:, d - 1, r]).all(), node

    dynamic = dflash.DFlashDrafter(5, cfg, 32, num_steps=3, topk=2)
    draft, _ = dynamic.propose(w.params, cache, ctx, keys, SamplingParams())
    tree = draft.tree
    parents, tokens = np.asarray(tree.parents), np.asarray(tree.tokens)
    greedy = chain.propose(w.params, cache, ctx, keys, SamplingParams())[0].tokens
    for b in range(B):
        child = [n for n in range(1, 6) if parents[b, n] == 0]
        assert tokens[b, child[0]] == int(greedy[b, 0])                           # the best root child first
        for n in range(1, 6):                     # every node is one of its block position's top-2 tokens
            d, up = 0, n
            while up != 0:
                up, d = int(parents[b, up]), d + 1
            assert tokens[b, n] in order[b, d - 1, :2], (b, n)
    too_deep = SpecConfig(method="dflash", tree_choices=[(0,) * d for d in range(1, 6)])     # 5 deep, block 5
    with pytest.raises(ValueError, match="a tree 5 deep more positions than the DFlash drafter 'random' fills"):
        specjax.generate(target, [[1, 2, 3, 4, 5]], too_deep, drafter=w)
    with pytest.raises(ValueError, match="top-62 tokens of a block position"):
        specjax.generate(target, [[1, 2, 3, 4, 5]], SpecConfig(method="dflash", num_steps=2, topk=62,
                                                                num_draft_tokens=5), drafter=w)


def test_init_drafter_continues_a_saved_drafter_and_refuses_another(tmp_path):
    """train.dflash --init_drafter: a saved drafter comes back as float32 params equal to what was saved (bfloat16
    values) with its own draft vocabulary, also where it stored its norm epsilon as a float32 image; one whose
    config is not what the flags ask for is refused by name.
    In a subprocess: importing a recipe defines its absl flags, which another recipe's import would repeat."""
    import textwrap
    from workers import run_snippet
    target = tiny_model(0)
    w = _weights(target, draft_vocab=np.arange(0, 61, 2))
    # saved with its norm epsilon as a float32 image (as a drafter for a GGUF target once stored it): the same config
    f32_image = dataclasses.replace(w.config, rms_norm_eps=float(np.float32(w.config.rms_norm_eps)))
    assert f32_image.rms_norm_eps != w.config.rms_norm_eps
    dflash.save(str(tmp_path / "d"), dataclasses.replace(w, config=f32_image), target, "# test drafter\n")  # bf16
    np.savez(tmp_path / "want.npz", d2t=w.d2t, **{f"p{i}": np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)
                                                 for i, x in enumerate(jax.tree_util.tree_leaves(w.params))})
    script = textwrap.dedent(f"""
        import dataclasses, jax, numpy as np, pytest
        from specjax.drafters import dflash
        from train.dflash import saved_drafter
        from tiny import tiny_model
        target = tiny_model(0)
        want = np.load({str(tmp_path / 'want.npz')!r})
        cfg = dflash.dflash_config(target, num_layers=2, block_size=5, target_layers=(0, 1), draft_vocab_size=31)
        got, d2t = saved_drafter({str(tmp_path / 'd')!r}, target, cfg)
        assert np.array_equal(d2t, want["d2t"])
        for i, x in enumerate(jax.tree_util.tree_leaves(got)):
            assert x.dtype == np.float32 and np.array_equal(np.asarray(x), want[f"p{{i}}"]), i
        with pytest.raises(ValueError, match="the flags ask for"):
            saved_drafter({str(tmp_path / 'd')!r}, target, dataclasses.replace(cfg, block_size=8))
        print("ok")
    """)
    run_snippet(script)
