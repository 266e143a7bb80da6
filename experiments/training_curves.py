"""Held-out acceptance against training time, per drafter family and recipe, on the same held-out rows.

  python -m experiments.training_curves --shipped=smollm2-135m-eagle3=3.69,smollm2-135m-dflash=1.16 \
      --runs="EAGLE-3 on ShareGPT answers=runs/eagle3_smollm2_long@3.69"

y: 1 + the training eval's expected accepted drafts of its chain over every held-out committed length
(heldout_accept_len: the target's answers to held-out ShareGPT first turns, greedy and sampled rows; the tau of that
chain at T = 0 if every length were a loop step's start, which the loop's walk lowers a little: see
experiments.acceptance_replay). x: training hours on this machine (wall clock, both cores), the starting weights'
own hours included. A shipped drafter is one point (its MANIFEST's final eval, at the hours given for its whole
history, which its MANIFEST's prose records); a run is its periodic evals (ckpt_dir/metrics.jsonl) from the hours
its starting weights had trained (@hours).
"""
from __future__ import annotations

import json
import os

from absl import app, flags

from experiments.tables import pyplot, save_figure, text_table, write_table
from specjax.checkpoints import resolve
from train.data import read_manifest_md

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The entry point's flags (defined only when run as a program, so tests import this module beside others)."""
    flags.DEFINE_list("shipped", [], "name=hours: a shipped drafter and the training hours of its whole history")
    flags.DEFINE_list("runs", [], "label=ckpt_dir[@hours]: a training run's periodic evals, from the hours its starting "
                      "weights had trained")
    flags.DEFINE_string("metric", "heldout_accept_len", "the held-out metric (expected accepted drafts of the eval's "
                        "chain)")
    flags.DEFINE_string("out", "runs/training_curves/curves", "output path stem (.csv/.json/.png)")


def _chain(record: dict) -> list[float]:
    """heldout_chain0, 1, ... of an eval record, as far as it goes."""
    out = []
    while f"heldout_chain{len(out)}" in record:
        out.append(record[f"heldout_chain{len(out)}"])
    return out


def shipped_point(name: str, hours: float, metric: str) -> dict:
    m = read_manifest_md(os.path.join(resolve(name, "drafter"), "MANIFEST.md"))
    return {"label": name, "kind": "shipped", "hours": hours, "step": m.get("steps"), "tau": 1 + m[metric],
            "chain": _chain(m)}


def run_points(label: str, ckpt_dir: str, start_hours: float, metric: str) -> list[dict]:
    out = []
    with open(os.path.join(ckpt_dir, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if metric in rec:
                out.append({"label": label, "kind": "run", "hours": start_hours + rec["elapsed_s"] / 3600,
                             "step": rec["step"], "tau": 1 + rec[metric],
                             "chain": _chain(rec)})
    return out


def main(argv) -> None:
    del argv
    rows = []
    for item in FLAGS.shipped:
        name, hours = item.split("=", 1)
        rows.append(shipped_point(name, float(hours), FLAGS.metric))
    for item in FLAGS.runs:
        label, rest = item.split("=", 1)
        ckpt_dir, _, hours = rest.partition("@")
        rows += run_points(label, ckpt_dir, float(hours or 0), FLAGS.metric)
    print(text_table(["drafter / run", "hours", "step", "tau (eval)", "chain"],
                     [(r["label"], f"{r['hours']:.2f}", r["step"], f"{r['tau']:.3f}",
                       " ".join(f"{c:.3f}" for c in r["chain"])) for r in rows]))
    write_table(rows, FLAGS.out, {"metric": FLAGS.metric})
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for label in dict.fromkeys(r["label"] for r in rows):
        pts = [r for r in rows if r["label"] == label]
        ax.plot([p["hours"] for p in pts], [p["tau"] for p in pts], "o-" if len(pts) > 1 else "s", label=label)
    ax.set_xlabel("training hours on this machine (2 CPU cores)")
    ax.set_ylabel("held-out tau of the eval's chain (T = 0)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, FLAGS.out)


if __name__ == "__main__":
    define_flags()
    app.run(main)
