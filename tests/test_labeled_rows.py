"""Rows with per-row label spans (train.data.LabeledRows: chat rows, each labelled on its own answer) in the
drafter losses: a fixed-layout span is the old scalar first_label, and tokens outside a span change nothing."""
import jax
import jax.numpy as jnp
import numpy as np

from train import data, self_distill
from train.losses.common import label_mask, labeled
from train.losses.eagle import eagle_accuracy, eagle_loss_fn
from drafter_weights import informative_eagle
from tiny import tiny_model


def _rows(seed=0, n=4, width=20, vocab=61):
    return np.random.default_rng(seed).integers(1, vocab, (n, width)).astype(np.int32)


def test_label_mask_and_tokens():
    rows = data.LabeledRows(_rows(), np.array([3, 5, 0, 19]), np.array([10, 20, 4, 21]))
    mask = np.asarray(label_mask(jax.tree.map(jnp.asarray, rows), jnp.arange(20)))
    assert mask.sum(1).tolist() == [7, 15, 4, 1]
    assert np.array_equal(data.label_tokens(rows), rows.tokens[mask])
    plain = labeled(jnp.asarray(rows.tokens), 6)
    assert plain.first_label.tolist() == [6] * 4 and plain.label_end.tolist() == [21] * 4


def test_eagle3_loss_spans():
    target = tiny_model(0)
    w = informative_eagle(target, "eagle3")
    loss_fn = eagle_loss_fn(target.config, w.config, 6, num_steps=3, d2t=w.d2t)
    tokens = jnp.asarray(_rows())
    key = jax.random.PRNGKey(0)
    fixed = loss_fn(w.params, tokens, key, target.params)[0]
    spans = data.LabeledRows(tokens, jnp.full((4,), 6, jnp.int32), jnp.full((4,), 21, jnp.int32))
    assert float(loss_fn(w.params, spans, key, target.params)[0]) == float(fixed)
    # rows that end early: what follows each row's end (padding) does not reach the loss
    short = spans._replace(label_end=jnp.array([12, 15, 18, 21], jnp.int32))
    cols = jnp.arange(20)[None, :]
    noisy = short._replace(tokens=jnp.where(cols >= short.label_end[:, None], (tokens * 7) % 61, tokens))
    a, b = (float(loss_fn(w.params, r, key, target.params)[0]) for r in (short, noisy))
    assert a == b and a != float(fixed)
    hits = eagle_accuracy(w.params, target.params, target.config, w.config, short, 0, 3, w.d2t)
    hits_noisy = eagle_accuracy(w.params, target.params, target.config, w.config, noisy, 0, 3, w.d2t)
    assert all(np.array_equal(x, y) for x, y in zip(hits, hits_noisy))
    # step 0's labels: indices 2..20 inside [6, end): 6 + 9 + 12 + 15
    assert int(hits[1][0]) == 42


def test_chat_recipe_rows_put_greedy_held_out_rows_first():
    part = lambda greedy: {"tokens": _rows(n=4).astype(np.uint16), "prompt_len": np.array([2, 3, 4, 5], np.int32),
                           "length": np.array([9, 10, 11, 12], np.int32), "greedy": np.array(greedy)}
    ds = {"train": part([True, False, True, False]), "heldout": part([False, True, False, True])}
    rr = self_distill.chat_recipe_rows(ds)
    assert rr.n_greedy == 2 and rr.heldout.first_label.tolist() == [3, 5, 2, 4]
    assert rr.rows.first_label.tolist() == [2, 3, 4, 5]
    batches = data.RowBatches(rr.rows.tokens, 2, 0, rr.rows.first_label, rr.rows.label_end)
    b = batches.batch(0)
    assert isinstance(b, data.LabeledRows) and b.tokens.shape == (2, 20)
