"""Training corpus: the running interpreter's standard-library source, a byte-level BPE tokenizer, packed batches.

Every machine has this corpus, so the shipped checkpoints are reproducible without downloads. Its exact content
depends on the Python build, hence the manifest (version, file list hash) that checkpoints record and that
`check_manifest` compares against before anyone trusts a held-out number.

Layout of the token cache (under data/, never committed): data/<key>/{train,heldout}.bin (uint16 memmaps, files
joined with <|endoftext|>), tokenizer.json and meta.json. The key hashes the corpus manifest, the tokenizer
settings and the file limit, so a different Python or a different vocab never reuses a stale cache.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import sys
import sysconfig
import warnings
from typing import Iterator, NamedTuple

import numpy as np

from specjax.drafters.draft_vocab import t2d_from_d2t, vocab_map_from_counts

EOS = "<|endoftext|>"
SPECIAL_TOKENS = (EOS,)
HELDOUT_FRACTION = 0.02
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DATA_DIR = os.path.join(REPO_ROOT, "data")


class CorpusMismatchError(ValueError):
    """The local stdlib corpus is not the one a checkpoint was trained/evaluated on."""


@dataclasses.dataclass(frozen=True)
class SourceFile:
    rel: str      # path relative to the stdlib root, '/'-separated (the split key)
    path: str
    size: int     # bytes on disk


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def list_stdlib_files(max_files: int | None = None, root: str | None = None) -> list[SourceFile]:
    """All .py files under the stdlib (tests included, site-packages excluded), sorted by relative path.
    max_files keeps an evenly spaced subset (for tests), still sorted and still deterministic."""
    root = root or stdlib_root()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        for name in filenames:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                if os.path.islink(path) or not os.path.isfile(path):
                    continue
                rel = os.path.relpath(path, root).replace(os.sep, "/")
                out.append(SourceFile(rel, path, os.path.getsize(path)))
    out.sort(key=lambda f: f.rel)
    if max_files is not None and max_files < len(out):
        stride = len(out) / max_files
        out = [out[int(i * stride)] for i in range(max_files)]
    return out


def is_heldout(rel: str, fraction: float = HELDOUT_FRACTION) -> bool:
    """Split by file, from a hash of the relative path: stable across machines, Python versions and file limits."""
    h = int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "big")
    return h / 2.0 ** 64 < fraction


def split_files(files: list[SourceFile], fraction: float = HELDOUT_FRACTION):
    train = [f for f in files if not is_heldout(f.rel, fraction)]
    held = [f for f in files if is_heldout(f.rel, fraction)]
    return train, held


def corpus_manifest(files: list[SourceFile]) -> dict:
    listing = "".join(f"{f.rel}\t{f.size}\n" for f in files)
    return {
        "python_version": sys.version.split()[0],
        "python_implementation": sys.implementation.name,
        "file_count": len(files),
        "total_bytes": sum(f.size for f in files),
        "files_sha256": hashlib.sha256(listing.encode()).hexdigest(),
        "heldout_fraction": HELDOUT_FRACTION,
    }


def check_manifest(expected: dict, actual: dict | None = None, strict: bool = True) -> list[str]:
    """Compare a checkpoint's recorded corpus manifest with the local one. A different file list means
    held-out numbers are not comparable (and held-out files may have been trained on): raise when strict,
    warn otherwise. Returns the list of differences."""
    actual = actual if actual is not None else corpus_manifest(list_stdlib_files())
    keys = ("python_version", "file_count", "total_bytes", "files_sha256")
    diffs = [f"{k}: checkpoint={expected.get(k)!r} local={actual.get(k)!r}"
             for k in keys if expected.get(k) != actual.get(k)]
    if diffs:
        msg = ("corpus mismatch: this machine's stdlib is not the corpus the checkpoint was trained on, so "
               "held-out metrics are not comparable:\n  " + "\n  ".join(diffs))
        if strict:
            raise CorpusMismatchError(msg)
        warnings.warn(msg, stacklevel=2)
    return diffs


_JSON_BLOCK = re.compile(r"```json\n(.*?)\n```", re.S)


def read_manifest_md(path: str) -> dict:
    """The machine-readable part of a checkpoint's MANIFEST.md: its first ```json block."""
    if os.path.isdir(path):
        path = os.path.join(path, "MANIFEST.md")
    with open(path) as f:
        m = _JSON_BLOCK.search(f.read())
    if not m:
        raise ValueError(f"{path} has no ```json block")
    return json.loads(m.group(1))


def check_checkpoint_corpus(ckpt_dir: str, strict: bool = True) -> list[str]:
    return check_manifest(read_manifest_md(ckpt_dir)["corpus"], strict=strict)


def read_text(f: SourceFile) -> str:
    # A few test files are deliberately not UTF-8; replacement keeps them (bytes are counted after decoding).
    with open(f.path, "rb") as fh:
        return fh.read().decode("utf-8", errors="replace")


# ---------------------------------------------------------------- tokenizer

def train_tokenizer(files: list[SourceFile], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((read_text(f) for f in files), trainer=trainer, length=len(files))
    return tok


def token_byte_lengths(tok) -> np.ndarray:
    """UTF-8 bytes each token id stands for (0 for specials). ByteLevel maps one byte to one character, so a
    token's byte count is its string length; this turns any set of scored tokens into exact bits per byte."""
    vocab = tok.get_vocab()
    out = np.zeros(tok.get_vocab_size(), np.int64)
    for s, i in vocab.items():
        out[i] = 0 if s in SPECIAL_TOKENS else len(s)
    return out


# ---------------------------------------------------------------- token cache

@dataclasses.dataclass
class Corpus:
    train: np.ndarray          # uint16 memmap, files joined by EOS
    heldout: np.ndarray
    tokenizer: object          # tokenizers.Tokenizer
    tokenizer_path: str
    manifest: dict             # corpus manifest of ALL files (train + held-out)
    meta: dict                 # counts: files, bytes, tokens per split
    eos_id: int

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()


def _encode_to(path: str, files: list[SourceFile], tok, eos_id: int, chunk: int = 64) -> tuple[int, int]:
    n_tok = n_bytes = 0
    with open(path + ".tmp", "wb") as out:
        for i in range(0, len(files), chunk):
            texts = [read_text(f) for f in files[i:i + chunk]]
            n_bytes += sum(len(t.encode()) for t in texts)
            for enc in tok.encode_batch(texts):
                ids = np.asarray(enc.ids + [eos_id], np.uint16)
                out.write(ids.tobytes())
                n_tok += len(ids)
    os.replace(path + ".tmp", path)
    return n_tok, n_bytes


def prepare_corpus(data_dir: str = DEFAULT_DATA_DIR, vocab_size: int = 4096, max_files: int | None = None,
                   tokenizer_path: str | None = None, verbose: bool = True) -> Corpus:
    """Build (or reuse) the tokenized corpus. tokenizer_path: reuse an existing tokenizer (a draft model must
    share its target's) instead of training one on the training split."""
    from tokenizers import Tokenizer
    files = list_stdlib_files(max_files)
    manifest = corpus_manifest(files)
    train_files, held_files = split_files(files)
    if tokenizer_path:
        with open(tokenizer_path, "rb") as f:
            tok_id = "file-" + hashlib.sha256(f.read()).hexdigest()[:16]
    else:
        tok_id = f"bpe{vocab_size}"
    key = hashlib.sha256(f"{manifest['files_sha256']}|{manifest['python_version']}|{tok_id}|{max_files}|v1"
                         .encode()).hexdigest()[:16]
    cache = os.path.join(data_dir, key)
    meta_path = os.path.join(cache, "meta.json")
    if not os.path.exists(meta_path):
        os.makedirs(cache, exist_ok=True)
        if tokenizer_path:
            tok = Tokenizer.from_file(tokenizer_path)
        else:
            if verbose:
                print(f"[data] training BPE tokenizer (vocab {vocab_size}) on {len(train_files)} files", flush=True)
            tok = train_tokenizer(train_files, vocab_size)
        tok.save(os.path.join(cache, "tokenizer.json"))
        eos_id = tok.token_to_id(EOS)
        if tok.get_vocab_size() > 65535:
            raise ValueError("uint16 token cache needs vocab_size <= 65535")
        if verbose:
            print(f"[data] tokenizing {len(files)} files into {cache}", flush=True)
        tr_tok, tr_bytes = _encode_to(os.path.join(cache, "train.bin"), train_files, tok, eos_id)
        ho_tok, ho_bytes = _encode_to(os.path.join(cache, "heldout.bin"), held_files, tok, eos_id)
        meta = {"manifest": manifest, "tokenizer": tok_id, "eos_id": eos_id,
                "train_files": len(train_files), "train_tokens": tr_tok, "train_bytes": tr_bytes,
                "heldout_files": len(held_files), "heldout_tokens": ho_tok, "heldout_bytes": ho_bytes,
                "heldout_list": [f.rel for f in held_files]}
        with open(meta_path + ".tmp", "w") as f:
            json.dump(meta, f, indent=1)
        os.replace(meta_path + ".tmp", meta_path)   # meta.json last: its presence marks a complete cache
    with open(meta_path) as f:
        meta = json.load(f)
    tok_file = os.path.join(cache, "tokenizer.json")
    tok = Tokenizer.from_file(tok_file)

    def load(name: str) -> np.ndarray:
        path = os.path.join(cache, name)       # a small --max_files subset may have no held-out file at all
        return np.memmap(path, dtype=np.uint16, mode="r") if os.path.getsize(path) else np.zeros(0, np.uint16)
    return Corpus(load("train.bin"), load("heldout.bin"), tok, tok_file, manifest, meta, meta["eos_id"])


# ---------------------------------------------------------------- batches

class PackedBatches:
    """Fixed-length windows of seq_len + 1 tokens cut from the joined token stream (inputs = w[:-1],
    targets = w[1:]). Sample k of the whole run (k = step * batch + row) is window perm_e[k mod N] of epoch
    e = k div N, with perm_e and a per-epoch offset drawn from (seed, e): any step's batch is a pure function
    of (seed, step), so a resumed run sees exactly the batches the uninterrupted run would have."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int):
        if len(tokens) < 2 * (seq_len + 1):
            raise ValueError(f"corpus too small: {len(tokens)} tokens for seq_len {seq_len}")
        self.tokens, self.seq_len, self.batch_size, self.seed = tokens, seq_len, batch_size, seed
        self.num_windows = (len(tokens) - 1 - seq_len) // seq_len   # leave room for a per-epoch offset
        self._epoch_cache: dict[int, tuple[np.ndarray, int]] = {}

    def _epoch(self, e: int) -> tuple[np.ndarray, int]:
        if e not in self._epoch_cache:
            rng = np.random.default_rng([self.seed, e])
            self._epoch_cache = {e: (rng.permutation(self.num_windows), int(rng.integers(self.seq_len)))}
        return self._epoch_cache[e]

    def batch(self, step: int):
        """int32 [batch, seq_len + 1]: windows of the token stream."""
        L = self.seq_len
        out = np.empty((self.batch_size, L + 1), np.int32)
        for r in range(self.batch_size):
            k = step * self.batch_size + r
            perm, offset = self._epoch(k // self.num_windows)
            start = offset + int(perm[k % self.num_windows]) * L
            out[r] = self.tokens[start:start + L + 1]
        return out

    def epochs(self, steps: int) -> float:
        return steps * self.batch_size / self.num_windows


class LabeledRows(NamedTuple):
    """Self-distilled rows with their label spans: token p of a row is a label (target-generated, trained on) when
    first_label <= p < label_end. Rows of one fixed layout (a corpus prompt of the same length in every row, the
    target's continuation after it) are plain [B, R] arrays and get their recipe's first_label and label_end R + 1
    (labeled(): the prediction past the row's end is still the target's); chat rows carry their own prompt length
    and length (the answer through its end-of-turn token; padding after it)."""
    tokens: np.ndarray         # [B, R] int32
    first_label: np.ndarray    # [B] int32
    label_end: np.ndarray      # [B] int32

    def take(self, idx) -> "LabeledRows":
        """The rows at idx (numpy or jax arrays alike)."""
        return LabeledRows(self.tokens[idx], self.first_label[idx], self.label_end[idx])


class FeatureRows(NamedTuple):
    """A batch of rows with the frozen target's features over them (train.features.FeatureBatches), which a
    drafter loss reads instead of running the target (train.losses.common.target_features)."""
    rows: LabeledRows                  # tokens [B, W] and label spans
    hidden: np.ndarray                 # [B, W, H] float32 final normed hidden state (zeros past each row's length)
    top: np.ndarray                    # [B, W] int32 the target's argmax token at each position
    layers: dict                       # decoder layer -> [B, W, H] float32 (its output)


def label_tokens(rows, first_label: int = 0) -> np.ndarray:
    """Every label token of rows (LabeledRows: inside each row's span; a plain [N, R] array: columns first_label
    on; a 1-D token stream, packed windows' source: its tokens from first_label on), flat."""
    if isinstance(rows, LabeledRows):
        tokens = np.asarray(rows.tokens)
        cols = np.arange(tokens.shape[1])[None, :]
        keep = (cols >= np.asarray(rows.first_label)[:, None]) & (cols < np.asarray(rows.label_end)[:, None])
        return tokens[keep]
    if np.ndim(rows) == 1:
        return np.asarray(rows[first_label:])
    return np.asarray(rows[:, first_label:]).ravel()


def draft_vocabulary(rows, heldout, first_label: int, vocab_size: int, size: int) -> tuple[np.ndarray, dict]:
    """A draft vocabulary of the `size` most frequent label tokens of rows (the target's own text; EAGLE-3's
    construction) -> (d2t int64 [size], coverage: the share of label tokens inside it, {"train": , "heldout": }).
    EAGLE-3 and DFlash recipes share it."""
    counts = np.bincount(label_tokens(rows, first_label).astype(np.int64), minlength=vocab_size)
    d2t = vocab_map_from_counts(counts, size)
    return d2t, vocabulary_coverage(d2t, rows, heldout, first_label, vocab_size)


def vocabulary_coverage(d2t: np.ndarray, rows, heldout, first_label: int, vocab_size: int) -> dict:
    """The share of the label tokens of rows and of heldout that a draft vocabulary d2t holds: {"train": , "heldout": }."""
    inside = t2d_from_d2t(d2t, vocab_size)
    share = lambda r: float(inside[label_tokens(r, first_label).astype(np.int64)].mean())
    return {"train": share(rows), "heldout": share(heldout)}


WIDTH_BUCKET = 64     # batches of chat rows are cut to a multiple of this many columns: a few compiled shapes


def batch_tokens(batch, first_label: int = 0) -> tuple[int, int]:
    """(positions, label tokens) of a training batch: a plain [B, R] row or window array (the labels from
    first_label on, and the prediction past the row, as train.losses.common.labeled reads such rows; a packed
    corpus window's every position after the first), LabeledRows (labels inside each row's span), or
    FeatureRows."""
    if isinstance(batch, FeatureRows):
        batch = batch.rows
    if isinstance(batch, LabeledRows):
        tokens = np.asarray(batch.tokens)
        end = np.minimum(np.asarray(batch.label_end), tokens.shape[1])
        return int(tokens.size), int(np.maximum(end - np.asarray(batch.first_label), 0).sum())
    B, R = np.shape(batch)
    return B * R, B * (R - 1 if first_label == 0 else R + 1 - first_label)


def bucketed_width(length: int, width: int, bucket: int = WIDTH_BUCKET) -> int:
    """The narrowest multiple of `bucket` columns that holds `length` positions, at most the rows' own `width`."""
    return int(min(-(-int(length) // bucket) * bucket, width))


class RowBatches:
    """Batches of whole rows of a [N, seq_len + 1] token array (e.g. a cached self-distillation set: the target's
    own generations, one sample per row). Sample k of the run (k = step * batch + row) is row perm_e[k mod N] of
    epoch e = k div N, perm_e drawn from (seed, e): like PackedBatches, a pure function of (seed, step).

    length_pool P > 0 (rows with spans): perm_e is regrouped by length, P batches at a time: each run of P * batch
    rows of the random permutation is sorted by row length (label_end), cut into batches, and those batches
    shuffled, so a batch's rows are of similar length (a batch is cut to its longest row: chat rows of 50 to 570
    tokens otherwise fill ~60% of a random batch) and every row is still seen once per epoch. A batch of rows with
    spans is cut to the bucketed width of its longest row (bucketed_width, width_bucket columns), pooled or not: a
    wider bucket compiles fewer training programs (one, at the rows' own width or more) for more padded positions."""

    def __init__(self, rows: np.ndarray, batch_size: int, seed: int, first_label: np.ndarray | None = None,
                 label_end: np.ndarray | None = None, length_pool: int = 0, width_bucket: int = WIDTH_BUCKET):
        """first_label, label_end [N]: each row's label span (chat rows, train.losses.common.LabeledRows); batches
        are then LabeledRows, otherwise plain token arrays."""
        if rows.ndim != 2 or len(rows) < batch_size:
            raise ValueError(f"need a [N >= {batch_size}, seq_len + 1] token array, got shape {rows.shape}")
        if (first_label is None) != (label_end is None):
            raise ValueError("RowBatches: give both first_label and label_end, or neither")
        if length_pool < 0 or (length_pool and label_end is None):
            raise ValueError(f"RowBatches: length_pool {length_pool} must be >= 0, and > 0 only for rows with spans "
                             "(rows of one layout all have the same length)")
        if width_bucket < 1:
            raise ValueError(f"RowBatches: width_bucket {width_bucket} must be >= 1")
        self.rows, self.batch_size, self.seed, self.length_pool = rows, batch_size, seed, length_pool
        self.width_bucket = width_bucket
        self.spans = None if first_label is None else (np.asarray(first_label, np.int32),
                                                       np.asarray(label_end, np.int32))
        self.seq_len = rows.shape[1] - 1
        self._perm: dict[int, np.ndarray] = {}

    def indices(self, step: int) -> np.ndarray:
        """The row indices of batch `step`."""
        n = len(self.rows)
        idx = []
        for k in range(step * self.batch_size, (step + 1) * self.batch_size):
            e = k // n
            if e not in self._perm:
                self._perm = {e: self._epoch_order(e)}
            idx.append(int(self._perm[e][k % n]))
        return np.asarray(idx)

    def _epoch_order(self, e: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, e])
        perm = rng.permutation(len(self.rows))
        if not self.length_pool:
            return perm
        B, pool = self.batch_size, self.length_pool * self.batch_size
        out = []
        for start in range(0, len(perm), pool):
            part = perm[start:start + pool]
            part = part[np.argsort(self.spans[1][part], kind="stable")]
            chunks = [part[i:i + B] for i in range(0, len(part), B)]
            out.extend(chunks[j] for j in rng.permutation(len(chunks)))
        return np.concatenate(out)

    def batch(self, step: int):
        """int32 [batch, seq_len + 1]; rows with spans: LabeledRows of them cut to the batch's bucketed width."""
        idx = self.indices(step)
        if self.spans is None:
            return np.asarray(self.rows[idx], np.int32)
        width = bucketed_width(self.spans[1][idx].max(), self.rows.shape[1], self.width_bucket)
        return LabeledRows(np.asarray(self.rows[idx, :width], np.int32), self.spans[0][idx], self.spans[1][idx])

    def epochs(self, steps: int) -> float:
        return steps * self.batch_size / len(self.rows)


def token_array_batches(path: str, seq_len: int, batch_size: int, seed: int) -> PackedBatches | RowBatches:
    """Batches from a .npy token array (memory-mapped): a 1-D stream is cut into packed windows, a 2-D
    [N, seq_len + 1] array is used row by row."""
    tokens = np.load(path, mmap_mode="r")
    if tokens.ndim == 1:
        return PackedBatches(tokens, seq_len, batch_size, seed)
    if tokens.ndim == 2 and tokens.shape[1] == seq_len + 1:
        return RowBatches(tokens, batch_size, seed)
    raise ValueError(f"{path}: expected a 1-D token stream or [N, seq_len + 1 = {seq_len + 1}] rows, got shape "
                     f"{tokens.shape}")


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def eval_windows(tokens: np.ndarray, seq_len: int, batch_size: int,
                 max_tokens: int | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Sequential non-overlapping windows covering the stream once (every token after the first is scored
    exactly once); yields (windows int32 [B, L + 1], weights float32 [B, L]) with the tail padded at weight 0."""
    n = len(tokens) if max_tokens is None else min(len(tokens), max_tokens + 1)
    starts = list(range(0, n - 1, seq_len))
    for i in range(0, len(starts), batch_size):
        win = np.zeros((batch_size, seq_len + 1), np.int32)
        w = np.zeros((batch_size, seq_len), np.float32)
        for r, s in enumerate(starts[i:i + batch_size]):
            chunk = np.asarray(tokens[s:min(s + seq_len + 1, n)], np.int32)
            win[r, :len(chunk)] = chunk
            w[r, :len(chunk) - 1] = 1.0
        yield win, w


def bits_per_byte(total_nats: float, total_bytes: int) -> float:
    return total_nats / math.log(2) / max(total_bytes, 1)
