"""The feature cache (train.features): a drafter loss on cached, column-cut batches equals the loss with the target
run over the full rows (EAGLE-1, EAGLE-3, DFlash, Medusa), batches keep RowBatches' order, and an interrupted or
extended build computes only what is missing."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.drafters import dflash
from train import data, features
from train.losses.dflash import dflash_loss_fn
from train.losses.eagle import eagle_loss_fn
from train.losses.medusa import medusa_loss_fn
from drafter_weights import informative_eagle
from tiny import tiny_model

WIDTH = 150


def _rows(n=10, seed=0):
    rng = np.random.default_rng(seed)
    length = rng.integers(20, WIDTH + 1, n)
    length[0] = 40                                  # the first batches stay narrow (two buckets of 32)
    first = rng.integers(2, 12, n)
    tokens = rng.integers(1, 61, (n, WIDTH)).astype(np.int32)
    tokens[np.arange(WIDTH)[None, :] >= length[:, None]] = 0
    return data.LabeledRows(tokens, first.astype(np.int32), length.astype(np.int32))


def _setup(tmp_path, layers, batch_size=2, chunk_tokens=256):
    target = tiny_model(0)
    rows = _rows()
    batches = data.RowBatches(rows.tokens, batch_size, 0, rows.first_label, rows.label_end)
    store = features.FeatureStore(target, rows, str(tmp_path), chunk_tokens=chunk_tokens, bucket=32, log=lambda m: None)
    return target, batches, features.FeatureBatches(batches, store.ensure(layers), layers), store


def _compare(loss_fn, params, target, batches, cached, steps=3, rtol=1e-5, acc_atol=1e-6):
    key = jax.random.PRNGKey(3)
    loss_fn = jax.jit(loss_fn)          # compiled once per width rather than run op by op
    widths = []
    for step in range(steps):
        full = jax.tree.map(jnp.asarray, batches.batch(step))
        cut = cached.batch(step)
        widths.append(cut.rows.tokens.shape[1])
        assert np.array_equal(cut.rows.tokens, np.asarray(full.tokens)[:, :widths[-1]])
        a, ma = loss_fn(params, full, key, target.params)
        b, mb = loss_fn(params, jax.tree.map(jnp.asarray, cut), key, target.params)
        np.testing.assert_allclose(float(b), float(a), rtol=rtol)
        for name in ma:
            atol = acc_atol if name.startswith("acc") else 1e-6    # an argmax near a tie may flip in bfloat16
            np.testing.assert_allclose(float(mb[name]), float(ma[name]), rtol=rtol, atol=atol, err_msg=name)
    return widths


def test_eagle1_and_medusa_losses_from_the_cache_equal_the_target_forward(tmp_path):
    target, batches, cached, _ = _setup(tmp_path, ())
    w = informative_eagle(target, "eagle")
    widths = _compare(eagle_loss_fn(target.config, w.config, 0, num_steps=2, noise=0.0), w.params, target, batches,
                      cached)
    assert min(widths) < WIDTH and all(x % 32 == 0 or x == WIDTH for x in widths)
    heads = {"w": 0.1 * jax.random.normal(jax.random.PRNGKey(0), (3, 1, 32, 32)), "b": jnp.zeros((3, 1, 32))}
    _compare(medusa_loss_fn(target.config, 0.8, 0), heads, target, batches, cached)


@pytest.mark.slow          # ~45 s; the float32 cache's equality test above stays in make test
def test_eagle3_and_dflash_losses_from_bfloat16_layer_features(tmp_path):
    target = tiny_model(0)
    w3 = informative_eagle(target, "eagle3")
    wd = dflash.dflash_config(target, num_layers=1, block_size=4, target_layers=(0, 1))
    layers = sorted(set(w3.config.target_layers) | set(wd.target_layers))
    _, batches, cached, _ = _setup(tmp_path, layers)
    # the decoder-layer features are stored in bfloat16: the losses agree to its precision, not to float32's
    _compare(eagle_loss_fn(target.config, w3.config, 0, num_steps=3, d2t=w3.d2t), w3.params, target, batches,
             cached, rtol=2e-2, acc_atol=0.05)
    pd = dflash.init_params(jax.random.PRNGKey(1), wd, std=0.3)
    _compare(dflash_loss_fn(target.config, wd, 0, anchors_per_row=4), pd, target, batches, cached, rtol=2e-2,
             acc_atol=0.05)


def test_a_shifted_feature_is_caught(tmp_path):
    """The comparison above can fail: hidden states one position late change the EAGLE-1 loss."""
    target, batches, cached, _ = _setup(tmp_path, ())
    w = informative_eagle(target, "eagle")
    loss_fn = eagle_loss_fn(target.config, w.config, 0, num_steps=1, noise=0.0)
    key = jax.random.PRNGKey(3)
    cut = cached.batch(0)
    late = cut._replace(hidden=np.roll(cut.hidden, 1, axis=1))
    a = float(loss_fn(w.params, jax.tree.map(jnp.asarray, batches.batch(0)), key, target.params)[0])
    b = float(loss_fn(w.params, jax.tree.map(jnp.asarray, late), key, target.params)[0])
    assert abs(a - b) > 1e-3 * abs(a)


def test_build_resumes_and_extends_without_recomputing(tmp_path):
    target, batches, cached, store = _setup(tmp_path, (0,))
    assert len(store.chunks) > 2
    before = np.load(store._path("layer0")).copy()
    # an interrupted build: two chunks never marked done; a new layer asked for
    done = store._done("layer0")
    done[[0, 2]] = False
    store._mark("layer0", done)
    assert store.missing((0, 1)) == ["layer0", "layer1"]
    computed = []
    store2 = features.FeatureStore(target, store.rows, str(tmp_path), chunk_tokens=256, bucket=32,
                                   log=computed.append)
    assert store2.dir == store.dir
    store2.ensure((0, 1))
    assert store2.missing((0, 1)) == []
    assert f"{len(store.chunks)} of {len(store.chunks)} chunks" in computed[0]     # layer1 needs every chunk
    np.testing.assert_array_equal(np.load(store._path("layer0")), before)
    # another target never reuses these features
    other = features.FeatureStore(tiny_model(1), store.rows, str(tmp_path), chunk_tokens=256, bucket=32)
    assert other.dir != store.dir and other.missing(()) == ["hidden", "top"]
    with pytest.raises(ValueError, match="not stored yet"):
        other.gather([0], 32, ())
