"""The frozen target's features over a self-distillation set, computed once and read back by the drafter recipes.

A feature drafter's loss needs the target's forward over every training row: the outputs of a few decoder layers
(EAGLE-3, DFlash), the final normed hidden state (EAGLE-1, Medusa: it is also what the target's LM head reads, so
the teacher's logits are one matmul away) and the target's argmax token. On a real target that forward costs
several times the drafter's own step, every epoch. With a FeatureStore it runs once per (target, rows, layer): the
arrays land in data/features/<key>/ as flat per-token memory maps (only each row's real tokens, no padding), and
FeatureBatches hands the loss the same rows in the same order as train.data.RowBatches with the features attached
(train.losses.common.target_features reads them instead of running the target).

Storage: decoder-layer outputs in bfloat16 (the drafter's inputs; an engine serving the drafter in bfloat16 feeds it
no better), the final hidden state in float32 (the teacher distribution softmax(hidden @ lm_head) keeps the target's
precision), the argmax token as int32 from the target's own float32 logits. One file per layer, so drafters with
different feature layers share what they have in common. Building is resumable: rows are processed in chunks of
similar length, and each chunk is marked done only after its arrays are flushed.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from train.data import WIDTH_BUCKET, FeatureRows, LabeledRows, RowBatches, bucketed_width

DEFAULT_DIR = os.path.join("data", "features")
VERSION = 1


def row_lengths(rows: LabeledRows) -> np.ndarray:
    """The positions of each row whose features a loss can read: through its last label (label_end is past the
    row for plain fixed-layout rows, whose last position predicts the token after the row)."""
    return np.minimum(np.asarray(rows.label_end, np.int64), rows.tokens.shape[1])


def params_digest(params) -> str:
    """sha256 of every weight (leaves in pytree order): features are only reused for the very same target."""
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        h.update(jax.tree_util.keystr(path).encode())
        h.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
    return h.hexdigest()


def rows_digest(rows: LabeledRows) -> str:
    h = hashlib.sha256()
    for a in rows:
        h.update(np.ascontiguousarray(np.asarray(a, np.int64)).tobytes())
    return h.hexdigest()


class FeatureStore:
    """Per-token target features of a fixed set of rows under data_dir/<key>/ (key: the target's weights and the
    rows). Build or extend with ensure(); read with gather()."""

    def __init__(self, target, rows: LabeledRows, data_dir: str = DEFAULT_DIR, chunk_tokens: int = 16384,
                 bucket: int = WIDTH_BUCKET, log=print):
        self.target, self.rows, self.bucket, self.log = target, rows, bucket, log
        self.lengths = row_lengths(rows)
        if np.any(self.lengths < 1):
            raise ValueError("FeatureStore: every row needs at least one position")
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)])
        self.hidden_size = target.config.hidden_size
        key = hashlib.sha256(json.dumps({"v": VERSION, "params": params_digest(target.params),
                                         "rows": rows_digest(rows), "chunk_tokens": chunk_tokens,
                                         "bucket": bucket}).encode()).hexdigest()[:16]
        self.dir = os.path.join(data_dir, key)
        os.makedirs(self.dir, exist_ok=True)
        self.chunks = self._chunks(chunk_tokens)
        self._maps: dict[str, np.ndarray] = {}

    def _chunks(self, chunk_tokens: int) -> list[np.ndarray]:
        """Row indices in chunks of similar length (rows sorted by length), each padded to one bucketed width:
        about chunk_tokens padded tokens per target forward."""
        order = np.argsort(self.lengths, kind="stable")
        chunks, cur = [], []
        for i in order:
            width = self.width(max([self.lengths[j] for j in cur] + [self.lengths[i]]))
            if cur and width * (len(cur) + 1) > chunk_tokens:
                chunks.append(np.array(cur))
                cur = []
            cur.append(int(i))
        if cur:
            chunks.append(np.array(cur))
        return chunks

    def width(self, length: int) -> int:
        """The bucketed width that holds `length` positions (at most the rows' own width)."""
        return bucketed_width(length, self.rows.tokens.shape[1], self.bucket)

    def _path(self, name: str) -> str:
        return os.path.join(self.dir, f"{name}.npy")

    def _open(self, name: str, dtype, width: int | None, mode: str) -> np.ndarray:
        shape = (int(self.offsets[-1]),) + ((width,) if width else ())
        if mode == "w+" and not os.path.exists(self._path(name)):
            return np.lib.format.open_memmap(self._path(name), mode="w+", dtype=dtype, shape=shape)
        return np.load(self._path(name), mmap_mode=mode)

    def _done(self, name: str) -> np.ndarray:
        path = os.path.join(self.dir, f"{name}.done.npy")
        return np.load(path) if os.path.exists(path) else np.zeros(len(self.chunks), bool)

    def _mark(self, name: str, done: np.ndarray) -> None:
        path = os.path.join(self.dir, f"{name}.done.npy")
        np.save(path + ".tmp.npy", done)
        os.replace(path + ".tmp.npy", path)

    @staticmethod
    def _names(layers: Sequence[int]) -> list[str]:
        return ["hidden", "top"] + [f"layer{int(l)}" for l in layers]

    def missing(self, layers: Sequence[int]) -> list[str]:
        return [n for n in self._names(layers) if not self._done(n).all()]

    def ensure(self, layers: Sequence[int]) -> "FeatureStore":
        """Compute whatever of (final hidden, argmax, the given decoder layers) is not stored yet: one target forward
        per chunk still missing any of them; an interrupted build resumes at the first unfinished chunk."""
        from train.losses.common import frozen_target_features
        cfg = self.target.config
        layers = tuple(sorted({int(l) % cfg.num_layers for l in layers}))
        names = self.missing(layers)
        if not names:
            return self
        want = tuple(int(n[5:]) for n in names if n.startswith("layer"))
        H = self.hidden_size
        maps = {n: self._open(n, np.int32 if n == "top" else (np.float32 if n == "hidden" else np.uint16),
                              None if n == "top" else H, "r+" if os.path.exists(self._path(n)) else "w+")
                for n in names}
        done = {n: self._done(n) for n in names}
        fwd = jax.jit(lambda p, t: frozen_target_features(p, cfg, t, want))
        todo = [c for c in range(len(self.chunks)) if not all(done[n][c] for n in names)]
        self.log(f"[features] {self.dir}: {', '.join(names)} for {len(self.rows.tokens)} rows "
                 f"({int(self.offsets[-1]):,} positions), {len(todo)} of {len(self.chunks)} chunks to compute")
        t0, made = time.time(), 0
        for c in todo:
            idx = self.chunks[c]
            width = self.width(int(self.lengths[idx].max()))
            tf = fwd(self.target.params, jnp.asarray(np.asarray(self.rows.tokens[idx][:, :width], np.int32)))
            arrays = {"hidden": np.asarray(tf.hidden, np.float32), "top": np.asarray(jnp.argmax(tf.logits, -1),
                                                                                      np.int32)}
            for l, a in zip(want, tf.layers):
                arrays[f"layer{l}"] = np.asarray(a, ml_dtypes.bfloat16).view(np.uint16)
            for n in names:
                for r, i in enumerate(idx):
                    lo, n_pos = self.offsets[i], self.lengths[i]
                    maps[n][lo:lo + n_pos] = arrays[n][r, :n_pos]
            for n in names:
                maps[n].flush()
                done[n][c] = True
                self._mark(n, done[n])
            made += int(self.lengths[idx].sum())
            if c == todo[-1] or (todo.index(c) + 1) % 10 == 0:
                self.log(f"[features] {todo.index(c) + 1}/{len(todo)} chunks, {made / (time.time() - t0):.0f} "
                         "positions/s")
        self._maps = {}
        return self

    def gather(self, idx: Sequence[int], width: int, layers: Sequence[int]) -> tuple[np.ndarray, np.ndarray, dict]:
        """(hidden [b, width, H] float32, top [b, width] int32, {layer: [b, width, H] float32}) of rows idx; positions
        past a row's length are zeros."""
        L = self.target.config.num_layers
        names = self._names(layers)
        if self.missing(layers):
            raise ValueError(f"features {self.missing(layers)} are not stored yet in {self.dir}: call ensure()")
        for n in names:
            if n not in self._maps:
                self._maps[n] = np.load(self._path(n), mmap_mode="r")
        b, H = len(idx), self.hidden_size
        hidden = np.zeros((b, width, H), np.float32)
        top = np.zeros((b, width), np.int32)
        lay = {int(l): np.zeros((b, width, H), np.uint16) for l in layers}
        for r, i in enumerate(idx):
            lo, n_pos = self.offsets[i], min(self.lengths[i], width)
            hidden[r, :n_pos] = self._maps["hidden"][lo:lo + n_pos]
            top[r, :n_pos] = self._maps["top"][lo:lo + n_pos]
            for l in layers:
                lay[int(l)][r, :n_pos] = self._maps[f"layer{int(l) % L}"][lo:lo + n_pos]
        return hidden, top, {l: a.view(ml_dtypes.bfloat16).astype(np.float32) for l, a in lay.items()}


class FeatureBatches:
    """train.data.RowBatches' batches (same rows, same order for a seed) as FeatureRows: each batch cut to the
    narrowest multiple of `bucket` columns that holds its rows (a few compiled shapes instead of the widest row's
    padding everywhere: causal features make the cut exact)."""

    def __init__(self, batches: RowBatches, store: FeatureStore, layers: Sequence[int]):
        if len(store.rows.tokens) != len(batches.rows):
            raise ValueError(f"FeatureBatches: the store has {len(store.rows.tokens)} rows, the batches "
                             f"{len(batches.rows)}")
        self.batches, self.store, self.layers = batches, store, tuple(layers)
        self.batch_size = batches.batch_size

    @property
    def rows(self) -> np.ndarray:
        return self.batches.rows

    def batch(self, step: int) -> FeatureRows:
        idx = self.batches.indices(step)
        width = self.store.width(int(self.store.lengths[idx].max()))
        spans = self.store.rows
        rows = LabeledRows(np.asarray(self.batches.rows[idx][:, :width], np.int32), spans.first_label[idx],
                           spans.label_end[idx])
        hidden, top, layers = self.store.gather(idx, width, self.layers)
        return FeatureRows(rows, hidden, top, layers)

    def epochs(self, steps: int) -> float:
        return self.batches.epochs(steps)


def cached_batches(target, batches: RowBatches, layers: Sequence[int], data_dir: str = DEFAULT_DIR,
                   log=print) -> FeatureBatches:
    """A recipe's RowBatches with the target's features (final hidden, argmax and `layers`) computed once."""
    if batches.spans is None:
        R = batches.rows.shape[1]
        rows = LabeledRows(batches.rows, np.zeros(len(batches.rows), np.int32),
                           np.full(len(batches.rows), R + 1, np.int32))
    else:
        rows = LabeledRows(batches.rows, *batches.spans)
    store = FeatureStore(target, rows, data_dir, log=log).ensure(layers)
    return FeatureBatches(batches, store, layers)


def main(argv) -> None:
    """Precompute the features several drafter recipes will read (one target pass for the union of their layers):

        python -m train.features --target=smollm2-135m --data=chat --num_train=2048 --layers=1,8,14,20,26,27
    """
    del argv
    from absl import flags
    from specjax.models import load_model
    from train import self_distill
    F = flags.FLAGS
    _, _, batches = self_distill.recipe_data(F.target, F.data, F.num_train, 1, 0)
    cached_batches(load_model(F.target), batches, [int(x) for x in F.layers], F.features_dir)


if __name__ == "__main__":
    from absl import app, flags
    from train.self_distill import DATA_SOURCES
    flags.DEFINE_string("target", "smollm2-135m", "target model (name, HF directory or .gguf file)")
    flags.DEFINE_enum("data", "chat", DATA_SOURCES, "self-distillation rows (train.self_distill.recipe_data)")
    flags.DEFINE_integer("num_train", 2048, "training rows (as the recipes' --num_train)")
    flags.DEFINE_list("layers", [], "decoder layers whose outputs to store (the final hidden state and the argmax "
                      "token are always stored)")
    flags.DEFINE_string("features_dir", DEFAULT_DIR, "where the features go")
    app.run(main)
