"""EAGLE-3's draft vocabulary size N: coverage vs acceptance vs draft cost, from one trained drafter.

  python -m experiments.eagle_vocab --sizes=256,512,1024 --num_train=6144

Cuts the drafter down to its N most frequent draft tokens (eagle.restrict_draft_vocab: counts over the
self-distillation training rows the recipe used), writes each cut drafter as an artifact under --out_dir, prints
the coverage of the held-out target-generated tokens (greedy rows, where temperature-0 decoding verifies, and all
rows), and prints the experiments.speedup command that measures tau, alpha and c for every N in one run. The cut
drafters are not retrained, so their acceptance is a lower bound for drafters trained at that N.
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import app, flags
import numpy as np

import specjax
from specjax.drafters import eagle
from experiments.tables import write_table
from train import self_distill

flags.DEFINE_string("target", "checkpoints/stdlib-target", "target checkpoint directory")
flags.DEFINE_string("drafter", "stdlib-target-eagle3", "the trained EAGLE-3 drafter (shipped name or directory)")
flags.DEFINE_list("sizes", ["256", "512", "1024"], "draft vocabulary sizes to cut down to")
flags.DEFINE_integer("num_train", 6144, "self-distillation rows the drafter was trained on (token counts)")
flags.DEFINE_string("out_dir", "runs/eagle3_vocab", "where the cut drafters are written (gitignored), and the "
                    "coverage table (coverage.csv, .json)")
FLAGS = flags.FLAGS


def coverage(rows: np.ndarray, first: int, ids: np.ndarray, vocab_size: int) -> float:
    inside = np.zeros(vocab_size, bool)
    inside[ids] = True
    return float(inside[np.asarray(rows[:, first:], np.int64)].mean())


def main(argv):
    del argv
    target = specjax.load_model(FLAGS.target)
    full = eagle.load(FLAGS.drafter, target, "eagle3")
    ds = self_distill.build(FLAGS.target, num_train=FLAGS.num_train)
    first = ds["meta"]["prompt_len"]
    V = target.config.vocab_size
    counts = np.bincount(np.asarray(ds["train"][:, first:], np.int64).ravel(), minlength=V)
    heldout = np.asarray(ds["heldout"])
    greedy = heldout[:int(round(ds["meta"]["greedy_fraction"] * len(heldout)))]
    print(f"{'N':>6} {'held-out coverage (greedy rows)':>32} {'(all rows)':>11}  artifact")
    runs, records = [], []
    for n in sorted({int(s) for s in FLAGS.sizes} | {full.config.draft_vocab_size}, reverse=True):
        w = full if n == full.config.draft_vocab_size else eagle.restrict_draft_vocab(full, counts, n)
        ids = eagle.draft_to_target(w.d2t)
        path = os.path.join(FLAGS.out_dir, f"N{n}")
        if w is not full:
            eagle.save(path, w, target, f"{FLAGS.drafter} cut to its {n} most frequent draft tokens "
                                        f"(experiments.eagle_vocab, counts of {FLAGS.num_train} self-distilled rows)")
        art = FLAGS.drafter if w is full else path
        records.append(dict(draft_vocab=n, coverage_greedy=coverage(greedy, first, ids, V),
                            coverage_all=coverage(heldout, first, ids, V), artifact=art))
        print(f"{n:>6} {records[-1]['coverage_greedy']:>32.4f} {records[-1]['coverage_all']:>11.4f}  {art}")
        runs.append(f"humaneval:eagle3:4:drafter={art}:label=eagle3-N{n}")
    command = "python -m experiments.speedup --runs=" + ",".join(runs)
    write_table(records, os.path.join(FLAGS.out_dir, "coverage"), meta={
        "target": FLAGS.target, "drafter": FLAGS.drafter, "num_train": FLAGS.num_train, "speedup_command": command})
    print(f"\ntau / alpha / c per N (one run): {command}")


if __name__ == "__main__":
    app.run(main)
