"""train/data.py: deterministic split, corpus manifest checks, tokenizer cache, packed batches."""
from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from train import data


@pytest.fixture(scope="module")
def all_files():
    return data.list_stdlib_files()


def test_split_is_deterministic_and_small(all_files):
    tr1, ho1 = data.split_files(all_files)
    tr2, ho2 = data.split_files(list(reversed(all_files)))
    assert {f.rel for f in ho1} == {f.rel for f in ho2}
    assert len(tr1) + len(ho1) == len(all_files)
    assert 0.005 < len(ho1) / len(all_files) < 0.05
    # A file's side depends only on its path, so a subset splits consistently with the whole corpus.
    sub = data.list_stdlib_files(max_files=100)
    assert {f.rel for f in data.split_files(sub)[1]} <= {f.rel for f in ho1}
    assert not any("site-packages" in f.rel for f in all_files)
    assert any(f.rel.startswith("test/") for f in all_files)      # tests are part of the corpus


def test_manifest_mismatch_raises_and_warns(tmp_path, all_files):
    local = data.corpus_manifest(all_files)
    assert data.check_manifest(local, local) == []
    other = dict(local, files_sha256="0" * 64, python_version="2.7.18")
    with pytest.raises(data.CorpusMismatchError, match="files_sha256"):
        data.check_manifest(other, local)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        diffs = data.check_manifest(other, local, strict=False)
    assert len(diffs) == 2 and "corpus mismatch" in str(w[0].message)
    # The checkpoint side: MANIFEST.md carries the manifest in its json block.
    (tmp_path / "MANIFEST.md").write_text("# x\n\nprose\n\n```json\n" + json.dumps({"corpus": other}) + "\n```\n")
    with pytest.raises(data.CorpusMismatchError):
        data.check_checkpoint_corpus(str(tmp_path))


def test_packed_batches_shapes_and_determinism():
    tokens = np.arange(10_000, dtype=np.uint16)
    b = data.PackedBatches(tokens, seq_len=32, batch_size=4, seed=3)
    x = b.batch(7)
    assert x.shape == (4, 33) and x.dtype == np.int32
    assert np.all(np.diff(x, axis=1) == 1)                        # contiguous windows of the stream
    np.testing.assert_array_equal(x, data.PackedBatches(tokens, 32, 4, seed=3).batch(7))   # fresh instance
    assert not np.array_equal(x, b.batch(8))
    assert not np.array_equal(x, data.PackedBatches(tokens, 32, 4, seed=4).batch(7))
    # One epoch visits every window exactly once.
    steps = b.num_windows // 4
    starts = np.concatenate([b.batch(s)[:, 0] for s in range(steps)])
    assert len(set(starts.tolist())) == len(starts)


def test_eval_windows_score_each_token_once():
    tokens = np.arange(1000, dtype=np.uint16)
    seen = []
    for win, w in data.eval_windows(tokens, seq_len=64, batch_size=3):
        assert win.shape == (3, 65) and w.shape == (3, 64)
        seen.extend(win[:, 1:][w > 0].tolist())
    assert seen == list(range(1, 1000))


def test_prepare_corpus_small(tmp_path):
    c = data.prepare_corpus(str(tmp_path), vocab_size=300, max_files=12, verbose=False)
    assert c.vocab_size == 300 and c.tokenizer.token_to_id(data.EOS) == c.eos_id
    assert c.meta["train_tokens"] == len(c.train) and int(c.train[-1]) == c.eos_id
    text = "def f(x):\n    return x + 1  # ü\n"
    ids = c.tokenizer.encode(text).ids
    assert c.tokenizer.decode(ids) == text
    # Byte lengths per token add up to the UTF-8 size, which is what bits-per-byte divides by.
    assert data.token_byte_lengths(c.tokenizer)[ids].sum() == len(text.encode())
    again = data.prepare_corpus(str(tmp_path), vocab_size=300, max_files=12, verbose=False)   # cache hit
    np.testing.assert_array_equal(np.asarray(again.train), np.asarray(c.train))


def test_row_batches_and_token_arrays(tmp_path):
    rows = np.arange(10 * 9, dtype=np.uint16).reshape(10, 9)          # 10 samples of seq_len 8 (+1)
    b = data.RowBatches(rows, batch_size=4, seed=1)
    x = b.batch(3)
    assert x.shape == (4, 9) and x.dtype == np.int32
    np.testing.assert_array_equal(x, data.RowBatches(rows, 4, seed=1).batch(3))   # pure function of (seed, step)
    # Steps 0..4 cover 20 samples = 2 epochs: every row exactly twice.
    seen = np.concatenate([b.batch(s)[:, 0] for s in range(5)]) // 9
    assert sorted(seen.tolist()) == sorted(list(range(10)) * 2)
    assert b.epochs(5) == 2.0
    np.save(tmp_path / "rows.npy", rows)
    np.save(tmp_path / "stream.npy", np.arange(1000, dtype=np.uint16))
    assert isinstance(data.token_array_batches(str(tmp_path / "rows.npy"), 8, 4, 0), data.RowBatches)
    assert isinstance(data.token_array_batches(str(tmp_path / "stream.npy"), 8, 4, 0), data.PackedBatches)
    with pytest.raises(ValueError, match="seq_len"):
        data.token_array_batches(str(tmp_path / "rows.npy"), 16, 4, 0)


def test_length_pool_batches_rows_of_similar_length_and_still_covers_each_epoch():
    """RowBatches(length_pool=P): every row once per epoch (the same rows as random batches), batches of similar
    length (their cut width well below random batches'), still a pure function of (seed, step); rows without
    spans refuse it."""
    rng = np.random.default_rng(0)
    N, B, W = 96, 4, 120
    length = rng.integers(10, W + 1, N).astype(np.int32)
    first = np.minimum(rng.integers(2, 9, N), length - 1).astype(np.int32)
    tokens = rng.integers(1, 50, (N, W)).astype(np.int32)
    plain = data.RowBatches(tokens, B, 7, first, length)
    pooled = data.RowBatches(tokens, B, 7, first, length, length_pool=8)
    steps = N // B
    for epoch in range(2):
        seen = np.concatenate([pooled.indices(epoch * steps + s) for s in range(steps)])
        assert sorted(seen.tolist()) == list(range(N))
    width = lambda b, s: int(np.max(b.batch(s).label_end))
    assert np.mean([width(pooled, s) for s in range(steps)]) < 0.8 * np.mean([width(plain, s) for s in range(steps)])
    again = data.RowBatches(tokens, B, 7, first, length, length_pool=8)
    assert all(np.array_equal(again.indices(s), pooled.indices(s)) for s in (0, 5, steps + 3))
    batch = pooled.batch(3)
    idx = pooled.indices(3)
    cut = data.bucketed_width(length[idx].max(), W)                     # the narrowest multiple of 64 holding them
    assert cut >= length[idx].max() and cut in (data.WIDTH_BUCKET, W)
    np.testing.assert_array_equal(batch.tokens, tokens[idx, :cut])
    np.testing.assert_array_equal(batch.first_label, first[idx])
    widths = {pooled.batch(s).tokens.shape[1] for s in range(steps)}
    assert widths == {data.WIDTH_BUCKET, W}                              # short batches are cut, long ones whole
    with pytest.raises(ValueError, match="only for rows with spans"):
        data.RowBatches(tokens, B, 7, length_pool=8)
    # one program: a bucket as wide as the rows keeps every batch whole (the same rows in the same order)
    whole = data.RowBatches(tokens, B, 7, first, length, length_pool=8, width_bucket=W)
    assert {whole.batch(s).tokens.shape[1] for s in range(steps)} == {W}
    assert all(np.array_equal(whole.indices(s), pooled.indices(s)) for s in range(steps))
    with pytest.raises(ValueError, match="width_bucket 0 must be >= 1"):
        data.RowBatches(tokens, B, 7, first, length, width_bucket=0)
