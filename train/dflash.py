"""Train a DFlash-style block drafter (specjax.drafters.dflash) for a target on its own answers.

    python -m train.dflash                                        # the toy target, corpus rows
    python -m train.dflash --target=smollm2-135m --data=chat --feature_cache --block_size=8 --draft_layers=2 \
        --draft_vocab_size=8192 --ckpt_dir=runs/dflash_smollm2 --out=checkpoints/smollm2-135m-dflash

Data: the self-distillation rows the EAGLE and Medusa recipes train on (train.self_distill; --data=chat for a chat
target: ShareGPT training first turns answered by the target). Loss (train.losses.dflash): --anchors_per_row blocks
per row at random committed positions, each filled in one forward from the target's features before its anchor;
block position i trained toward the target's own distribution for its token, weighted --position_decay^(i-1).
Init: N(0, 0.02) layers and fc, the mask embedding the mean of the target's token embeddings, the final norm the
target's (the drafter reads through the target's embedding and LM head, stored nowhere here). --draft_vocab_size=N
gives it its own LM head over the N most frequent target-generated tokens of the training rows (EAGLE-3's draft
vocabulary; initialized from the target's head columns, trained): its largest matmul N/V as wide.
Held-out metric (dflash_accuracy): blocks anchored every 4th position of held-out rows, per block position the top-1
agreement with the target's argmax, the chain agreement and heldout_accept_len = the expected accepted drafts of a
block of --eval_steps drafts (on the greedy rows exactly what greedy verification accepts from that anchor).
"""
from __future__ import annotations

import os

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters import dflash
from specjax.drafters.base import target_weight
from specjax.drafters.draft_vocab import draft_to_target
from train import data, self_distill, skeleton
from train.losses.dflash import dflash_accuracy, dflash_loss_fn

flags.DEFINE_integer("block_size", 8, "the block: the anchor and block_size - 1 drafts (the largest k it serves)")
flags.DEFINE_integer("draft_layers", 1, "decoder layers of the drafter")
flags.DEFINE_list("target_layers", None, "target layers whose outputs are the context features (default "
                  "dflash.default_target_layers)")
flags.DEFINE_integer("anchors_per_row", 8, "blocks trained per row and step")
flags.DEFINE_float("position_decay", 0.8, "loss weight of block position i is position_decay ** (i - 1)")
flags.DEFINE_integer("draft_vocab_size", 0, "0: draft over the target's whole vocabulary through its LM head; N: an "
                     "own head over the N most frequent target-generated tokens of the training rows")
flags.DEFINE_integer("eval_steps", 4, "held-out metric: drafts per block scored")
flags.DEFINE_integer("num_train", 2048, "self-distillation rows (train.self_distill)")
flags.DEFINE_enum("data", "corpus", self_distill.DATA_SOURCES, self_distill.DATA_HELP)

NOTES = """\
DFlash-style block drafter for {target}: {layers} decoder layer(s) (hidden {H}, {heads}/{kv} heads, MLP {I};
{n_params:,} parameters) filling a block of {bs} positions (the anchor and {k} drafts) in one forward, context =
target layers {tl} fused. Trained on {rows} self-distillation rows ({data}), {anchors} blocks per row per step,
position i weighted {decay}^(i-1).
{vocab}
Held-out ({eval_rows} rows, blocks anchored every 4th position): top-1 agreement per block position {acc}; chain
agreement {chain}; expected accepted drafts of a {n}-draft block {accept:.3f} ({accept_g:.3f} on the greedy rows).
Layout: specjax artifact (dflash.save; load with specjax.generate(..., SpecConfig(method="dflash"),
drafter=<this dir>)), stored as bfloat16.
"""


def saved_drafter(path: str, target, cfg: dflash.DFlashConfig) -> tuple[dict, np.ndarray | None]:
    """--init_drafter: (float32 params, draft vocabulary d2t) of a saved DFlash drafter of the config the flags
    ask for (its draft vocabulary kept: its LM head's columns are those tokens)."""
    weights = dflash.load(path, target)
    if weights.config != cfg:
        raise ValueError(f"--init_drafter {path} is {weights.config}; the flags ask for {cfg}")
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), weights.params), weights.d2t


def build(run: skeleton.Run) -> skeleton.Parts:
    F, target = run.flags, run.target
    tcfg = target.config
    ds, (prompt_len, rows, heldout, n_greedy), batches = skeleton.distilled_rows(run)
    layers = None if not F.target_layers else [int(x) for x in F.target_layers]
    cfg = dflash.dflash_config(target, num_layers=F.draft_layers, block_size=F.block_size, target_layers=layers,
                               draft_vocab_size=F.draft_vocab_size or None)
    bad = [l for l in cfg.target_layers if not 0 <= l < tcfg.num_layers]
    if bad:
        raise ValueError(f"--target_layers {bad} out of range: the target has {tcfg.num_layers} decoder layers")
    batches = skeleton.feature_batches(run, batches, cfg.target_layers)
    d2t, cov = None, {}
    if F.init_drafter:
        params, d2t = saved_drafter(F.init_drafter, target, cfg)
        if d2t is not None:
            cov = data.vocabulary_coverage(d2t, rows, heldout, prompt_len, tcfg.vocab_size)
    else:
        params = dflash.init_params(jax.random.PRNGKey(F.seed), cfg)
        params["mask_embed"] = jnp.mean(jnp.asarray(target.params["embed"], jnp.float32), 0)
        params["final_norm"] = jnp.asarray(target.params["final_norm"], jnp.float32)
        if F.draft_vocab_size:
            d2t, cov = data.draft_vocabulary(rows, heldout, prompt_len, tcfg.vocab_size, F.draft_vocab_size)
            params["lm_head"] = jnp.asarray(target_weight(target.params, "lm_head"), jnp.float32)[
                :, draft_to_target(d2t)]
    n = F.eval_steps
    if n > F.block_size - 1:
        raise ValueError(f"--eval_steps={n} scores more drafts than a block of {F.block_size} holds")
    accuracy = jax.jit(lambda p, frozen, r: dflash_accuracy(p, frozen, tcfg, cfg, r, prompt_len, n, d2t=d2t))

    def evaluate(params, max_tokens: int | None = None) -> dict:
        count = lambda p, r: accuracy(p, target.params, jax.tree.map(jnp.asarray, r))
        return self_distill.chain_eval(count, params, heldout, n_greedy, n, max_tokens)

    vocab_source = ("those of the drafter this run continued" if F.init_drafter else
                    "the most frequent label tokens of the training rows")

    def export(params, out_dir: str, record: dict) -> tuple[dict, str]:
        params = jax.device_get(params)
        n_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))
        notes = NOTES.format(
            target=F.target, layers=cfg.num_layers, H=cfg.hidden_size, heads=cfg.num_heads, kv=cfg.num_kv_heads,
            I=cfg.intermediate_size, n_params=n_params, bs=cfg.block_size, k=cfg.block_size - 1,
            tl=list(cfg.target_layers), rows=len(batches.rows), data=F.data, anchors=F.anchors_per_row,
            vocab=(f"Draft vocabulary: {cfg.draft_vocab_size} tokens, {vocab_source} (coverage of label tokens: "
                   f"train {cov['train']:.3f}, held-out {cov['heldout']:.3f})."
                   if d2t is not None else "Drafts over the target's whole vocabulary through its LM head.")
                  + (f"\nContinued from the drafter saved at {F.init_drafter} (--init_drafter: its weights and draft "
                     "vocabulary; a fresh optimizer and schedule)." if F.init_drafter else ""),
            decay=F.position_decay, eval_rows=record.get("heldout_rows"), n=n,
            acc=", ".join(f"{record[f'heldout_acc{i}']:.3f}" for i in range(n)),
            chain=", ".join(f"{record[f'heldout_chain{i}']:.3f}" for i in range(n)),
            accept=record["heldout_accept_len"], accept_g=record.get("heldout_accept_len_greedy", float("nan")))
        dflash.save(out_dir, dflash.DFlashWeights(cfg, params, os.path.basename(os.path.normpath(out_dir)), d2t),
                    target, notes)
        return dict(self_distillation=ds["meta"], dflash_config=cfg.to_dict(), drafter_params=n_params,
                    anchors_per_row=F.anchors_per_row, position_decay=F.position_decay, vocab_coverage=cov), notes

    return skeleton.Parts(
        params, dflash_loss_fn(tcfg, cfg, prompt_len, anchors_per_row=F.anchors_per_row,
                               position_decay=F.position_decay, d2t=d2t),
        evaluate, export, batches=batches, corpus=F.data == "corpus",
        summary=f"DFlash: {cfg.num_layers} layer(s), block {cfg.block_size}, target layers {list(cfg.target_layers)}; "
                f"self-distillation rows {batches.rows.shape}")


RECIPE = skeleton.Recipe(
    "dflash", build, frozen_target="checkpoints/stdlib-target", feature_cache=True, length_pool=True, init_drafter="",
    run_flags=("block_size", "draft_layers", "target_layers", "anchors_per_row", "position_decay", "num_train",
               "data", "draft_vocab_size"),
    curve_metrics=("heldout_accept_len", "heldout_accept_len_greedy", "heldout_acc0"),
    defaults=dict(steps=300, lr=1e-3, batch_size=8, seq_len=255, warmup=30, weight_decay=0.0, eval_every=100,
                  eval_tokens=16384, log_every=10, ckpt_dir="runs/dflash_ckpt", out="checkpoints/stdlib-target-dflash"))

if __name__ == "__main__":
    skeleton.main(RECIPE)
