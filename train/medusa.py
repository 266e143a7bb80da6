"""Train Medusa heads for the shipped target on its own continuations; export checkpoints/stdlib-target-medusa.

    python -m train.medusa                                  # Medusa-1: target frozen, heads only
    python -m train.medusa --medusa2 --init_heads=checkpoints/stdlib-target-medusa \
        --out=checkpoints/stdlib-target-medusa2 --ckpt_dir=runs/medusa2_ckpt --lr=3e-4

Data: self-distillation (train.self_distill: continuations the target generates from stdlib prompts, half greedy,
half at temperature 1), built and cached under data/ on first use. Head i at position t predicts the token at
t + i + 2 (the token after the one the target's own LM head predicts); only target-generated tokens are labels.
Loss: sum_i decay^i CE_i (Medusa's lambda_i = 0.8^i), by default soft cross-entropy against the target's own
(teacher-forced) distribution for that token: for Medusa-2 the trained target's, whose argmax is what verification
accepts once it has moved away from the original target that wrote the rows. Medusa-1 starts every ResBlock at zero and every projection
at the target's LM head (a fresh head predicts what the target predicts). Medusa-2 trains the target jointly,
with KL(original target || trained target) on the same tokens in the objective so the target's distribution holds,
and ships the trained target beside its heads (its held-out bits per byte is in the MANIFEST).
"""
from __future__ import annotations

import os

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters import medusa
from specjax.drafters.base import target_weight
from specjax.models.model import from_panels
from train import data, loop, self_distill, skeleton
from train.losses.common import max_label_span
from train.losses.medusa import medusa_accuracy, medusa_loss_fn

flags.DEFINE_integer("num_heads", 4, "Medusa heads (head i drafts the token i + 1 after the bonus token)")
flags.DEFINE_integer("num_layers", 1, "ResBlocks per head")
flags.DEFINE_enum("layout", "shared", medusa.LAYOUTS, "per_head: one LM head per Medusa head (the paper's); "
                  "shared: every head's hidden state through ONE projection")
flags.DEFINE_float("head_decay", 0.8, "loss weight of head i is head_decay ** i")
flags.DEFINE_bool("medusa2", False, "train the target jointly with the heads (Medusa-2)")
flags.DEFINE_float("kl_weight", 1.0, "Medusa-2: weight of KL(original target || trained target)")
flags.DEFINE_float("heads_weight", 1.0, "Medusa-2: weight of the heads' loss (lambda_0)")
flags.DEFINE_float("target_lr_scale", 0.1, "Medusa-2: the target's learning rate is --lr times this (the heads "
                   "get --lr): a slowly moving target keeps the greedy text the heads were trained to predict")
flags.DEFINE_bool("soft_labels", True, "heads learn the target's own distribution for each token (for Medusa-2 "
                  "the trained target's); false: hard labels, the rows' tokens")
flags.DEFINE_string("init_heads", None, "start from these heads (e.g. Medusa-1's for Medusa-2)")
flags.DEFINE_integer("num_train", 2048, "self-distillation continuations (train.self_distill)")
flags.DEFINE_enum("data", "corpus", self_distill.DATA_SOURCES,
                  self_distill.DATA_HELP + "; the chat sources train Medusa-1 only")

NOTES = """\
Medusa heads for {target} ({variant}): {K} heads x {R} ResBlock(s), layout {layout} ({n_params:,} parameters),
trained on {trained_on}. Head i predicts the token i + 1
after the bonus token; loss sum_i {decay}^i CE_i, {labels}.{medusa2} Stored as bfloat16.

Held-out accuracy ({heldout_prompts}), per head top-1 / top-5 agreement with the target's
own argmax for that token (what greedy verification accepts): {acc}.
"""


def heads_of(params):
    return params["heads"] if "heads" in params else params


def batches_of(rows) -> np.ndarray:
    """The token array of rows (a plain [N, R] array or train.data.LabeledRows)."""
    return rows.tokens if isinstance(rows, data.LabeledRows) else rows


def take(rows, idx):
    return rows.take(idx) if isinstance(rows, data.LabeledRows) else np.asarray(rows[idx], np.int32)


def build(run: skeleton.Run) -> skeleton.Parts:
    F, target = run.flags, run.target
    cfg = target.config
    if F.data != "corpus" and F.medusa2:
        raise ValueError(f"--data={F.data} trains Medusa-1 heads; Medusa-2 evaluates its trained target on the "
                         "stdlib corpus (--data=corpus)")
    ds, (prompt_len, train_rows, heldout, n_greedy), batches = skeleton.distilled_rows(run)
    if F.medusa2 and F.feature_cache:
        raise ValueError("--feature_cache holds a frozen target's features; Medusa-2 trains the target")
    batches = skeleton.feature_batches(run, batches)
    if F.init_heads:
        loaded = medusa.load_heads(F.init_heads, target)
        heads = loaded.params
        if (loaded.num_heads, loaded.num_layers, loaded.layout) != (F.num_heads, F.num_layers, F.layout):
            raise ValueError(f"--init_heads {F.init_heads} has {loaded.num_heads} heads x {loaded.num_layers} "
                             f"layers ({loaded.layout}); the flags ask for {F.num_heads} x {F.num_layers} ({F.layout})")
    else:
        heads = medusa.init_heads(None, F.num_heads, F.num_layers, target_weight(target.params, "lm_head"), F.layout)
    # Medusa-2 trains the target: its row-major arrays (a tied head's panels copy would train apart from the embedding)
    trained_target = jax.tree.map(jnp.asarray, from_panels(target.params, cfg)) if F.medusa2 else None
    params = {"heads": heads, "target": trained_target} if F.medusa2 else heads
    loss_fn = medusa_loss_fn(cfg, F.head_decay, prompt_len, joint=F.medusa2, kl_weight=F.kl_weight,
                             heads_weight=F.heads_weight, soft_labels=F.soft_labels,
                             max_span=max_label_span(train_rows, prompt_len))
    accuracy = jax.jit(lambda p, frozen, rows: medusa_accuracy(
        heads_of(p), p["target"] if F.medusa2 else frozen, cfg, rows, prompt_len, topk=5))
    lm_eval = skeleton.make_evaluator(cfg, run.corpus, 256) if F.medusa2 else None

    def head_accuracy(params, rows) -> np.ndarray:
        hits, total = 0, 0
        # 8 rows at a time: the heads' logits are [rows, width, K, V] (a 49152-token vocabulary over 32 chat rows of
        # 565 tokens is 14 GB)
        for start in range(0, len(batches_of(rows)), 8):
            part = take(rows, np.arange(start, min(start + 8, len(batches_of(rows)))))
            h, n = accuracy(params, target.params, jax.tree.map(jnp.asarray, part))
            hits, total = hits + np.asarray(h), total + np.asarray(n)
        return hits / np.maximum(total, 1)[:, None]                 # [K, topk] cumulative top-k accuracy

    def evaluate(params, max_tokens: int | None = None) -> dict:
        """Held-out per-head top-1 / top-5 accuracy, separately on the greedy continuations (what temperature-0
        decoding verifies) and on the temperature-1 ones (self_distill puts the greedy rows first)."""
        tokens = batches_of(heldout)
        per_split = len(tokens) if max_tokens is None else max(8, max_tokens // tokens.shape[1] // 2)
        out = {}
        for suffix, ix in (("", np.arange(n_greedy)), ("_t1", np.arange(n_greedy, len(tokens)))):
            if len(ix):
                acc = head_accuracy(params, take(heldout, ix[:per_split]))
                # the full curve, for trees built from measured accuracies (the export reads it, whatever
                # --final_eval_tokens; periodic evals log only the scalars)
                out[f"topk_accuracy{suffix}"] = acc.round(4).tolist()
                out.update({f"head{i}_top1{suffix}": float(acc[i, 0]) for i in range(F.num_heads)})
                out.update({f"head{i}_top5{suffix}": float(acc[i, 4]) for i in range(F.num_heads)})
        if lm_eval is not None:        # the jointly trained target beside the original, on the same held-out text
            out.update({f"target_{k}": v for k, v in lm_eval(params["target"], max_tokens).items()})
            if max_tokens is None:
                out.update({f"original_target_{k}": v for k, v in lm_eval(target.params, None).items()})
        return out

    def export(params, out_dir: str, record: dict) -> tuple[dict, str]:
        params = jax.device_get(params)
        heads_dir = out_dir
        fields = {}
        if F.medusa2:                     # the trained target ships beside its heads, which are trained for it
            fields.update(skeleton.save_lm(params["target"], cfg, out_dir, run.corpus))
            heads_dir = os.path.join(out_dir, "medusa_heads")
        acc = "; ".join(f"head {i}: {record[f'head{i}_top1']:.3f} / {record[f'head{i}_top5']:.3f} (greedy), "
                        f"{record[f'head{i}_top1_t1']:.3f} / {record[f'head{i}_top5_t1']:.3f} (T=1)"
                        for i in range(F.num_heads))
        n_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(heads_of(params)))
        m2 = ("" if not F.medusa2 else f" Medusa-2: the target was trained jointly (KL weight {F.kl_weight}, heads "
              f"weight {F.heads_weight}, target learning rate {F.target_lr_scale} x the heads'); this directory "
              f"is that target (HF format) and medusa_heads/ its heads. Its held-out loss: "
              f"{record['target_heldout_bpb']:.4f} bits per byte ({record['target_heldout_loss']:.4f} nats/token) "
              f"against the original target's {record['original_target_heldout_bpb']:.4f} "
              f"({record['original_target_heldout_loss']:.4f}) on the same {record['target_heldout_tokens']:,} "
              f"held-out corpus tokens.")
        trained_on, heldout_prompts = self_distill.describe_rows(F.data, ds["meta"], len(batches.rows))
        notes = NOTES.format(target=F.target, variant="Medusa-2" if F.medusa2 else "Medusa-1", K=F.num_heads,
                             R=F.num_layers, layout=F.layout, n_params=n_params,
                             trained_on=trained_on, heldout_prompts=heldout_prompts,
                             decay=F.head_decay, medusa2=m2, acc=acc,
                             labels="soft, against the target's own distribution for the token (the trained "
                                    "target's for Medusa-2)" if F.soft_labels else "hard, on the rows' tokens")
        medusa.save_heads(heads_dir, medusa.MedusaHeads(F.num_heads, F.num_layers, F.layout, heads_of(params)),
                          target, notes)      # the fingerprint (sizes, vocabulary) is the same for Medusa-2
        fields.update(tree_rank_accuracy=medusa.rank_accuracy(record["topk_accuracy"]),
                      self_distillation=ds["meta"], num_heads=F.num_heads, num_layers=F.num_layers,
                      layout=F.layout, head_params=n_params, medusa2=F.medusa2)
        return fields, notes

    return skeleton.Parts(
        params, loss_fn, evaluate, export, batches=batches, corpus=F.data == "corpus",
        spec_fn=lambda tree, mesh: loop.default_specs(tree, mesh) if not F.medusa2 else
        {"heads": loop.default_specs(tree["heads"], mesh),
         "target": loop.default_specs(tree["target"], mesh)},
        lr_scales={"heads": 1.0, "target": F.target_lr_scale} if F.medusa2 else None,
        summary=f"{'Medusa-2' if F.medusa2 else 'Medusa-1'}: {F.num_heads} heads x {F.num_layers} layers, "
                f"{F.layout}; self-distillation rows {batches.rows.shape}")


RECIPE = skeleton.Recipe(
    "medusa", build, frozen_target="checkpoints/stdlib-target", feature_cache=True, length_pool=True,
    curve_metrics=("head0_top1", "head1_top1", "head2_top1", "head3_top1", "head0_top1_t1"),
    run_flags=("num_heads", "num_layers", "layout", "head_decay", "medusa2", "kl_weight", "heads_weight",
               "target_lr_scale", "soft_labels", "init_heads", "num_train", "data"),
    defaults=dict(steps=300, lr=1e-3, batch_size=8, seq_len=255, warmup=20, weight_decay=0.0, eval_every=100,
                  eval_tokens=32768, ckpt_dir="runs/medusa_ckpt", out="checkpoints/stdlib-target-medusa"))

if __name__ == "__main__":
    skeleton.main(RECIPE)
