"""EAGLE training losses (train.losses.eagle.eagle_loss_fn / eagle_accuracy) on a tiny target's own generated text: both
kinds learn under train.loop, the EAGLE-3 loss masks labels whose target top token is outside the draft vocabulary,
and the step alignment is the one specjax.drafters.eagle documents (step i at index t <-> target position t + i + 1).
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import SpecConfig
from specjax.drafters import eagle
from specjax.drafters.base import target_weight
from train import data, loop
from train.losses.common import frozen_target_features
from train.losses.eagle import eagle_accuracy, eagle_loss_fn
from tiny import tiny_model

PROMPT = 8
LAYERS3 = (0, 1, 1)            # the 2-layer tiny target (EAGLE-3 needs three feature layers)


@pytest.fixture(scope="module")
def tiny():
    # std 1.0: peaked next-token distributions (entropy ~0.8 nats), so a drafter has something to learn in 20 steps
    return tiny_model(0, std=1.0)


@pytest.fixture(scope="module")
def rows(tiny):
    """[32, 32] rows: 8 random prompt tokens + 24 tokens the target generated greedily."""
    prompts = np.random.default_rng(0).integers(1, tiny.config.vocab_size, (32, PROMPT)).tolist()
    res = specjax.generate(tiny, prompts, SpecConfig(max_new_tokens=24, stop_at_eos=False))
    return np.concatenate([np.asarray(prompts), np.asarray(res.tokens)], 1).astype(np.int32)


def config_for(tiny, kind, vocab=40):
    if kind == "eagle":
        return eagle.eagle_config(tiny, "eagle"), None
    d2t = eagle.vocab_map_from_counts(np.arange(tiny.config.vocab_size)[::-1], vocab)
    return eagle.eagle_config(tiny, "eagle3", target_layers=LAYERS3, draft_vocab_size=vocab), d2t


@pytest.mark.parametrize("kind,steps,ratio", [("eagle", 1, 0.9), ("eagle3", 2, 0.95)])
def test_loss_decreases_under_train_loop(tiny, rows, kind, steps, ratio):
    """20 steps of train.loop (EAGLE-1 teacher-forced with input noise; EAGLE-3 with a 2-step training-time test):
    the mean loss of the last 3 steps is well below that of the first 3 (deterministic on CPU: measured 0.82 and
    0.90 of it)."""
    cfg, d2t = config_for(tiny, kind)
    if kind == "eagle3":          # the draft vocabulary from the generated tokens' counts, as train.eagle builds it
        counts = np.bincount(rows[:, PROMPT:].ravel(), minlength=tiny.config.vocab_size)
        d2t = eagle.vocab_map_from_counts(counts, cfg.draft_vocab_size)
    params = eagle.init_params(jax.random.PRNGKey(0), cfg)
    loss_fn = eagle_loss_fn(tiny.config, cfg, PROMPT, num_steps=steps, noise=0.1 if kind == "eagle" else 0.0,
                                   d2t=d2t)
    tcfg = loop.TrainConfig(steps=20, lr=3e-2, warmup_steps=2, weight_decay=0.0, log_every=100)
    res = loop.train(params, loss_fn, data.RowBatches(rows, 8, 0).batch, tcfg, frozen=tiny.params,
                     log=lambda _: None)
    first, last = np.mean(res.losses[:3]), np.mean(res.losses[-3:])
    assert np.all(np.isfinite(res.losses))
    assert last < ratio * first, (kind, res.losses)
    if kind == "eagle":           # the held-out metric's counts (one kind: each jit costs seconds on this CPU)
        acc = jax.jit(lambda p, tp, r: eagle_accuracy(p, tp, tiny.config, cfg, r, PROMPT, 3, d2t))
        hits, labels, chain, chains = (np.asarray(x) for x in acc(res.params, tiny.params, jnp.asarray(rows)))
        R = rows.shape[1]
        assert labels.tolist() == [len(rows) * (R + 1 - PROMPT)] * 3          # labels t + i + 2 >= PROMPT
        assert chains == len(rows) * (R - 3 - (PROMPT - 2))                   # starts whose 3 steps fit the row
        assert np.all(np.diff(chain) <= 0) and np.all(chain <= hits[0]) and np.all(hits <= labels)
        assert hits[0] > 0.2 * labels[0]                                      # it learned something


def manual_eagle3_loss(params, cfg, tiny, rows, d2t, steps, decay=0.8):
    """The documented alignment, spelled out: step i at index t <-> target logits at position t + i + 1."""
    @jax.jit
    def forward(params, rows):
        tf = frozen_target_features(tiny.params, tiny.config, rows, cfg.target_layers)
        _, logits = eagle.ttt_forward(params, cfg, rows[:, 1:], tuple(f[:, :-1] for f in tf.layers), steps,
                                      {"embed": target_weight(tiny.params, "embed")})
        return tf, logits
    tf, logits = forward(params, rows)
    ids = eagle.draft_to_target(d2t)
    inside = eagle.t2d_from_d2t(d2t, tiny.config.vocab_size)
    T = rows.shape[1] - 1
    total, total_unmasked = 0.0, 0.0
    for i in range(steps):
        z = np.asarray(tf.logits)[:, i + 1:]
        lg = np.asarray(logits[i])[:, :T - i]
        p = np.asarray(jax.nn.softmax(z[..., ids]))
        ce = -np.sum(p * np.asarray(jax.nn.log_softmax(lg)), -1)
        gen = np.broadcast_to(np.arange(T - i) + i + 2 >= PROMPT, ce.shape)
        mask = gen & inside[z.argmax(-1)]
        total += decay ** i * ce[mask].mean()
        total_unmasked += decay ** i * ce[gen].mean()
    return total, total_unmasked, mask[gen].mean()


def test_eagle3_loss_masks_tokens_outside_the_draft_vocab(tiny, rows):
    rows = jnp.asarray(rows[:8])
    tf = frozen_target_features(tiny.params, tiny.config, rows)
    top = np.asarray(tf.logits.argmax(-1))[:, PROMPT - 1:]           # the target's top tokens at label positions
    vals, counts = np.unique(top, return_counts=True)
    dropped = vals[np.argsort(-counts)[:2]]                          # the two most frequent top tokens: left out
    keep = np.setdiff1d(np.arange(tiny.config.vocab_size), dropped)
    d2t = (keep - np.arange(len(keep))).astype(np.int64)
    cfg = eagle.eagle_config(tiny, "eagle3", target_layers=LAYERS3, draft_vocab_size=len(keep))
    params = eagle.init_params(jax.random.PRNGKey(1), cfg, std=0.3)
    fn = jax.jit(eagle_loss_fn(tiny.config, cfg, PROMPT, num_steps=2, noise=0.0, d2t=d2t))
    loss, metrics = fn(params, rows, jax.random.PRNGKey(0), tiny.params)
    want, unmasked, share = manual_eagle3_loss(params, cfg, tiny, rows, d2t, 2)
    assert 0.0 < share < 0.95                                        # some labels are masked, not all
    np.testing.assert_allclose(float(loss), want, rtol=1e-4)
    assert abs(want - unmasked) > 1e-3                               # the mask changes the loss
    np.testing.assert_allclose(float(metrics["in_vocab1"]), share, rtol=1e-5)

    # Uniform draft logits: CE log(N) at every kept label, so the per-step masked means are log(N) exactly.
    flat = dict(params, lm_head=jnp.zeros_like(params["lm_head"]))
    loss0, _ = fn(flat, rows, jax.random.PRNGKey(0), tiny.params)
    np.testing.assert_allclose(float(loss0), (1 + 0.8) * np.log(len(keep)), rtol=1e-5)


def test_eagle1_loss_terms_and_noise(tiny, rows):
    """EAGLE-1: reg + 0.1 CE (the reference's weights); the input noise is drawn from rng."""
    rows = jnp.asarray(rows[:8])
    cfg, _ = config_for(tiny, "eagle")
    params = eagle.init_params(jax.random.PRNGKey(2), cfg)
    noisy = jax.jit(eagle_loss_fn(tiny.config, cfg, PROMPT, noise=0.1))
    l1, m = noisy(params, rows, jax.random.PRNGKey(0), tiny.params)
    np.testing.assert_allclose(float(l1), float(m["reg0"] + 0.1 * m["ce0"]), rtol=1e-6)
    assert float(noisy(params, rows, jax.random.PRNGKey(1), tiny.params)[0]) != float(l1)
    assert float(noisy(params, rows, jax.random.PRNGKey(0), tiny.params)[0]) == float(l1)


def test_init_drafter_continues_from_a_saved_drafter_and_refuses_another(tiny, tmp_path):
    """train.eagle --init_drafter: a saved EAGLE-3 drafter comes back as float32 params equal to what was saved
    (bfloat16 values) with its own draft vocabulary, one whose config is not what the flags ask for is refused by
    name (an EAGLE-3 drafter may start a P-EAGLE one: its mask inputs are added), and one that stored its norm
    epsilon as a float32 image (9.999999747e-06 for 1e-05) is the same config.
    In a subprocess: importing a recipe defines its absl flags, which another recipe's import would repeat."""
    import textwrap
    from workers import run_snippet
    cfg, d2t = config_for(tiny, "eagle3")
    params = eagle.init_params(jax.random.PRNGKey(1), cfg)
    f32_image = dataclasses.replace(cfg, layer=dataclasses.replace(
        cfg.layer, rms_norm_eps=float(np.float32(cfg.layer.rms_norm_eps))))
    assert f32_image.layer.rms_norm_eps != cfg.layer.rms_norm_eps
    eagle.save(str(tmp_path / "d"), eagle.EagleWeights(f32_image, params, d2t, "d"), tiny, "test drafter")
    np.save(tmp_path / "d2t.npy", d2t)
    np.savez(tmp_path / "want.npz", **{f"p{i}": np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)
                                      for i, x in enumerate(jax.tree_util.tree_leaves(params))})
    script = textwrap.dedent(f"""
        import dataclasses, jax, numpy as np
        from specjax.drafters import eagle
        from train.eagle import saved_drafter
        from tiny import tiny_model
        tiny = tiny_model(0, std=1.0)
        d2t = np.load({str(tmp_path / 'd2t.npy')!r})
        cfg = eagle.eagle_config(tiny, "eagle3", target_layers={LAYERS3}, draft_vocab_size=len(d2t))
        got, got_d2t = saved_drafter({str(tmp_path / 'd')!r}, tiny, cfg)
        assert np.array_equal(got_d2t, d2t)
        want = np.load({str(tmp_path / 'want.npz')!r})
        leaves = jax.tree_util.tree_leaves(got)
        assert all(x.dtype == np.float32 for x in leaves)
        assert all(np.array_equal(np.asarray(x), want[f"p{{i}}"]) for i, x in enumerate(leaves))
        grown, _ = saved_drafter({str(tmp_path / 'd')!r}, tiny, dataclasses.replace(cfg, parallel_drafting=True))
        assert set(grown) == set(got) | {{"mask_embed", "mask_hidden"}}, sorted(grown)
        assert np.array_equal(np.asarray(grown["lm_head"]), np.asarray(got["lm_head"]))
        try:
            saved_drafter({str(tmp_path / 'd')!r}, tiny, dataclasses.replace(cfg, norm_output=True))
        except ValueError as e:
            assert "the flags ask for" in str(e), e
        else:
            raise AssertionError("accepted another config")
        print("ok")
    """)
    run_snippet(script)


def test_mixed_precision_trains_float32_master_weights_on_bfloat16_arithmetic(tiny, rows):
    """TrainConfig(compute_dtype="bfloat16"), what --compute_dtype=bfloat16 sets: the loss sees bfloat16 params and a
    bfloat16 frozen target, the params, gradients and optimizer state stay float32, the first step's loss is the
    float32 one up to bfloat16 rounding, and the loss still falls."""
    cfg, _ = config_for(tiny, "eagle3")
    counts = np.bincount(rows[:, PROMPT:].ravel(), minlength=tiny.config.vocab_size)
    d2t = eagle.vocab_map_from_counts(counts, cfg.draft_vocab_size)
    params = eagle.init_params(jax.random.PRNGKey(0), cfg)
    inner = eagle_loss_fn(tiny.config, cfg, PROMPT, num_steps=2, d2t=d2t)
    seen = set()

    def loss_fn(p, batch, rng, frozen):
        seen.update(str(x.dtype) for x in jax.tree.leaves((p, frozen)) if jnp.issubdtype(x.dtype, jnp.floating))
        return inner(p, batch, rng, frozen)
    runs = {}
    for dtype in (None, "bfloat16"):
        seen.clear()
        tcfg = loop.TrainConfig(steps=20, lr=3e-2, warmup_steps=2, weight_decay=0.0, log_every=100,
                                compute_dtype=dtype)
        runs[dtype] = loop.train(params, loss_fn, data.RowBatches(rows, 8, 0).batch, tcfg, frozen=tiny.params,
                                 log=lambda _: None)
        assert seen == ({"float32"} if dtype is None else {"bfloat16"}), (dtype, seen)
    mixed, full = runs["bfloat16"], runs[None]
    assert {str(x.dtype) for x in jax.tree.leaves(mixed.params)} == {"float32"}
    assert abs(mixed.losses[0] - full.losses[0]) < 0.02 * full.losses[0], (mixed.losses[0], full.losses[0])
    assert mixed.losses[0] != full.losses[0]                      # it did run in bfloat16
    assert np.mean(mixed.losses[-3:]) < 0.95 * np.mean(mixed.losses[:3]), mixed.losses
