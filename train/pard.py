"""Fine-tune the default draft model into a PARD parallel drafter; export checkpoints/stdlib-draft-pard. Or, for a
target with no small sibling, train a PARD draft that reads the target's embedding (--draft_layers).

    python -m train.pard --time_budget=540                 # ckpt runs/pard_ckpt
    python -m train.pard --data=selfdistill --ckpt_dir=runs/pard_sd_ckpt --out=
    python -m train.pard --target=smollm2-135m --data=chat --feature_cache --draft_layers=2 --draft_vocab_size=8192 \
        --num_masks=5 --mask_ends=64 --eval_stride=4 --ckpt_dir=runs/pard_smollm2 --out=runs/smollm2-135m-pard

The draft (--init, default checkpoints/stdlib-draft) gets --num_masks mask tokens appended to its vocabulary
(embedding rows initialised to its mean embedding, special tokens "<|pard_mask_j|>" in its tokenizer) and learns
to fill k = num_masks + 1 positions in one forward (specjax.drafters.pard). Training runs all k draft positions of
a batch in ONE forward (train.losses.pard.pard_stream_logits: the real tokens, then masks 1..k-1 after each of
--mask_ends context ends drawn per step, an attention mask giving each query exactly what it sees at inference);
loss per draft position = (1 - ce_weight) * KL(p_target || p_draft) + ce_weight * CE, the teacher being the frozen
target's distribution for the same token (the default draft's distillation loss), positions weighted equally.

--draft_layers=N: a TargetEmbeddingPard (specjax.drafters.pard): N decoder layers of the target's shapes, copies of
the target's layers --from_target_layers (default its first N), the target's final norm, one embedding row per mask
(the mean embedding), the target's embedding for real tokens, and the target's LM head or (--draft_vocab_size) an
own head over the most frequent target-generated tokens, initialized from the target's head columns. Its rows are
the other feature recipes' (--data=chat: ShareGPT training first turns answered by the target; --feature_cache: the
target's final hidden state and argmax computed once), and its teacher is the target's distribution from them.

Data (--data): "chat" / "sharegpt" (train.self_distill.recipe_data), "selfdistill", the target's own continuations (train.self_distill, labels = target-generated
tokens only), or "corpus" (default), packed stdlib windows (the skeleton's default batches): at equal steps the two
tied on the greedy held-out metric and corpus was slightly ahead on the mask drafts (numbers in the shipped
artifact's MANIFEST). Held-out metric either way, on the self-distilled held-out rows: per draft position the
top-1 agreement with the frozen target's greedy token, and the expected accepted length of a k-token (and a
4-token) parallel draft; on the greedy rows those chains are exactly what greedy verification accepts from each
position (averaged over every position, which overstates a loop step: see self_distill.chain_metrics).
"""
from __future__ import annotations

import dataclasses

from absl import flags
import jax
import jax.numpy as jnp

import os

import numpy as np

from specjax.drafters import pard
from specjax.drafters.draft_model import check_same_vocabulary
from specjax.models import load_model
from specjax.models.config import ModelConfig
from specjax.models.llama import init_params
from train import data, self_distill, skeleton
from train.losses.pard import pard_accuracy, pard_loss_fn

flags.DEFINE_string("init", "checkpoints/stdlib-draft", "draft model to start from (HF directory, target's vocab)")
flags.DEFINE_integer("num_masks", 7, "mask tokens appended (drafts up to num_masks + 1 tokens per step)")
flags.DEFINE_float("ce_weight", 0.1, "weight of next-token CE mixed with the KL term")
flags.DEFINE_enum("data", "corpus", ["selfdistill", "corpus", "chat", "sharegpt"],
                  "training data (see the module docstring)")
flags.DEFINE_integer("mask_ends", 64, "context ends per row that get mask streams each step (drawn at random; "
                     "0 = every position): the masks' share of the forward is mask_ends / seq_len of the dense form")
flags.DEFINE_integer("add_layers", 0, "decoder layers appended to --init before fine-tuning, each starting as the "
                     "identity (random attention/MLP inputs, zero output projections), so step 0 is --init's model")
flags.DEFINE_integer("num_train", 6144, "self-distillation continuations (train.self_distill; the cached set)")
flags.DEFINE_integer("draft_layers", 0, "0: fine-tune --init (a draft with its own vocabulary); N: a draft of N "
                     "decoder layers reading the target's embedding (see the module docstring)")
flags.DEFINE_list("from_target_layers", None, "with --draft_layers: the target layers its layers start as (default "
                  "the first draft_layers; 'random': normal(0, 0.02) layers)")
flags.DEFINE_integer("draft_vocab_size", 0, "with --draft_layers: 0 projects through the target's LM head; N: an own "
                     "head over the N most frequent target-generated tokens of the training rows")
flags.DEFINE_integer("eval_stride", 1, "held-out metric: context ends every eval_stride positions of each row's "
                     "labels")

RUN_FLAGS = ("init", "add_layers", "num_masks", "ce_weight", "data", "mask_ends", "num_train", "draft_layers",
             "from_target_layers", "draft_vocab_size", "eval_stride")

TARGET_EMBEDDING_NOTES = """\
PARD parallel drafter for {target} reading the target's token embedding: {layers} decoder layer(s) of the target's
shapes (hidden {H}, {heads}/{kv} heads, MLP {I}; {n_params:,} parameters of its own), initialized from {init};
{num_masks} mask embedding rows (mask j is token id {V} + j; each the mean embedding at init). {vocab}
It fills up to {k} positions in ONE forward (SpecConfig(method="pard", num_speculative_tokens<= {k}), drafter=<this
dir>): the uncached committed tokens plus k - 1 masks.
Objective: all {k} draft positions of a batch in one forward: draft 1 at every position, the masks after
{mask_ends} context ends per row drawn at random each step; per draft position (1 - {ce_weight:g}) *
KL(p_target || p_draft) + {ce_weight:g} * CE, the teacher the frozen target's distribution for that token.
Data: {data_desc}.
Held-out ({rows} rows, context ends every {stride} position(s) of each answer): top-1 agreement per draft position
{acc}; chain agreement {chain}; expected accepted drafts of a {k}-draft parallel draft {accept:.3f} ({accept_g:.3f}
on the greedy rows). Layout: specjax artifact (pard.save_target_embedding), stored as bfloat16.
"""

NOTES = """\
PARD parallel drafter for {target}: {init} ({m:.2f}M parameters, {cfg.num_layers} layer(s), hidden
{cfg.hidden_size}) fine-tuned to fill up to {k} positions in ONE forward: its vocabulary is the target's
{V} tokens plus {num_masks} special mask tokens ({first_mask}..{last_mask}, "<|pard_mask_0|>".., listed in
config.json as pard_mask_token_ids; embedding rows initialised to the mean embedding). Use with
SpecConfig(method="pard", num_speculative_tokens<= {k}): one draft forward over the uncached committed tokens
plus k - 1 masks; drafts are cut to the target's vocabulary. HF Llama layout, bfloat16.

Objective: all {k} draft positions of a batch in one forward: the real tokens (draft 1 at every position) and, for
{mask_ends} context ends per row drawn at random each step, masks 1..{num_masks} after each (an attention mask gives
every query exactly what it sees at inference); per draft position (1 - {ce_weight:g}) * KL(p_target || p_draft)
+ {ce_weight:g} * CE against the frozen target's distribution for that token, positions weighted equally.
Data: {data_desc}.

Held-out ({rows} self-distilled continuations from held-out stdlib prompts, {greedy_rows} of them greedy),
top-1 agreement with the target's greedy token per stream (draft 1..{k}): {acc}. Expected accepted drafts of a
parallel draft (greedy rows, where it is exactly what greedy verification accepts from each position; averaged
over every position, which overstates a decode loop's step): {accept_g:.3f} at k = {k},
{accept_g4:.3f} at k = 4 (all rows: {accept:.3f} / {accept4:.3f}). Chain agreement (drafts 1..i all agree,
greedy rows): {chain}.
"""


def add_identity_layers(params: dict, cfg: ModelConfig, n: int, seed: int) -> tuple[dict, ModelConfig]:
    """Append n decoder layers that start as the identity on the residual stream: random input projections (so
    their gradients are not zero), zero wo and w_down (so the model's function is unchanged at step 0)."""
    if n == 0:
        return params, cfg
    deeper = dataclasses.replace(cfg, num_layers=cfg.num_layers + n)
    fresh = init_params(deeper, jax.random.PRNGKey(seed))["layers"][cfg.num_layers:]
    new = [dict(lp, wo=jnp.zeros_like(lp["wo"]), w_down=jnp.zeros_like(lp["w_down"])) for lp in fresh]
    return dict(params, layers=list(params["layers"]) + new), deeper


def heldout_evaluate(accuracy, target, heldout, n_greedy: int, k: int):
    """The recipe's held-out report: per draft position the top-1 agreement with the target's greedy token, and
    the expected accepted length of a k-token (and a 4-token) parallel draft, over all rows and per part."""
    def evaluate(params, max_tokens: int | None = None) -> dict:
        count = lambda p, r: accuracy(p, target.params, jax.tree.map(jnp.asarray, r))
        tots, idx = self_distill.heldout_counts(count, params, heldout, n_greedy, k, max_tokens, min_rows=16,
                                                batch=16)
        out = self_distill.chain_metrics(tots, k)       # agreement, chains, accept_len over all rows and per part
        chain, chains = (sum(t[j] for t in tots.values()) for j in (2, 3))
        out["heldout_accept_len_k4"] = float(chain[:4].sum() / max(chains, 1))
        for name, t in tots.items():
            out[f"heldout_accept_len_k4_{name}"] = float(t[2][:4].sum() / max(t[3], 1))
            if name == "greedy":
                out.update({f"heldout_chain{j}_greedy": float(t[2][j] / max(t[3], 1)) for j in range(k)})
        out["heldout_rows"] = int(len(idx))
        out["heldout_rows_greedy"] = int((idx < n_greedy).sum())
        return out

    return evaluate


def build_target_embedding(run: skeleton.Run) -> skeleton.Parts:
    """--draft_layers: a TargetEmbeddingPard on the feature recipes' rows."""
    F, target = run.flags, run.target
    tcfg = target.config
    if F.data not in self_distill.DATA_SOURCES:
        raise ValueError(f"--draft_layers trains on self-distilled rows: --data must be one of "
                         f"{self_distill.DATA_SOURCES}, got {F.data!r}")
    if F.add_layers:
        raise ValueError("--add_layers appends layers to --init's draft; with --draft_layers give the layer count "
                         "there")
    ds, (prompt_len, rows, heldout, n_greedy), batches = skeleton.distilled_rows(run)
    batches = skeleton.feature_batches(run, batches)
    named = F.from_target_layers or []
    from_layers = () if named == ["random"] else None if not named else tuple(int(x) for x in named)
    d2t, cov = None, {}
    if F.draft_vocab_size:
        d2t, cov = data.draft_vocabulary(rows, heldout, prompt_len, tcfg.vocab_size, F.draft_vocab_size)
    # the target's layers as row-major float32 arrays (the frozen target may be held in the CPU kernel's panels)
    source = target if from_layers == () else load_model(F.target, weight_format="float32")
    draft = pard.init_target_embedding(source, F.draft_layers, F.num_masks, from_layers=from_layers, d2t=d2t,
                                       seed=F.seed)
    del source
    cfg, k, mask_ids = draft.config, F.num_masks + 1, draft.mask_token_ids
    accuracy = jax.jit(lambda p, frozen, r: pard_accuracy(p, frozen, cfg, tcfg, r, mask_ids, k, prompt_len,
                                                          stride=F.eval_stride, target_embedding=True, d2t=d2t))
    evaluate = heldout_evaluate(accuracy, target, heldout, n_greedy, k)
    init = ("random layers" if from_layers == () else
            f"the target's layers {list(from_layers) if from_layers else list(range(F.draft_layers))}")
    data_desc, _ = self_distill.describe_rows(F.data, ds["meta"], len(batches.rows))

    def export(params, out_dir: str, record: dict) -> tuple[dict, str]:
        params = jax.device_get(params)
        n_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))
        vocab = (f"Draft vocabulary: its own head over the {F.draft_vocab_size} most "
                 f"frequent label tokens of the training rows (coverage of label tokens: train {cov['train']:.3f}, "
                 f"held-out {cov['heldout']:.3f})." if d2t is not None else "Drafts through the target's LM head.")
        notes = TARGET_EMBEDDING_NOTES.format(
            target=F.target, layers=cfg.num_layers, H=cfg.hidden_size, heads=cfg.num_heads, kv=cfg.num_kv_heads,
            I=cfg.intermediate_size, n_params=n_params, init=init, num_masks=F.num_masks, V=tcfg.vocab_size,
            vocab=vocab, k=k, mask_ends=F.mask_ends or "all", ce_weight=F.ce_weight, data_desc=data_desc,
            rows=record.get("heldout_rows"), stride=F.eval_stride,
            acc=", ".join(f"{record[f'heldout_acc{j}']:.3f}" for j in range(k)),
            chain=", ".join(f"{record[f'heldout_chain{j}']:.3f}" for j in range(k)),
            accept=record["heldout_accept_len"], accept_g=record.get("heldout_accept_len_greedy", float("nan")))
        pard.save_target_embedding(out_dir, pard.TargetEmbeddingPard(
            cfg, params, os.path.basename(os.path.normpath(out_dir)), d2t), target, notes)
        return dict(self_distillation=ds["meta"], layer_config=cfg.to_hf(), drafter_params=n_params,
                    num_masks=F.num_masks, max_k=k, mask_ends=F.mask_ends, vocab_coverage=cov,
                    loss={"per_stream": "(1-ce_weight)*KL(target||draft) + ce_weight*CE", "ce_weight": F.ce_weight,
                          "stream_weights": "equal"}), notes

    return skeleton.Parts(
        draft.params, pard_loss_fn(cfg, tcfg, mask_ids, k, F.ce_weight, prompt_len, F.mask_ends or None,
                                   target_embedding=True, d2t=d2t),
        evaluate, export, batches=batches, corpus=F.data == "corpus",
        summary=f"PARD reading the target's embedding: {F.draft_layers} layer(s) from {init}, {F.num_masks} masks "
                f"(k <= {k}), draft vocabulary {F.draft_vocab_size or 'the target head'}; rows {batches.rows.shape}")


def build(run: skeleton.Run) -> skeleton.Parts:
    if run.flags.draft_layers:
        return build_target_embedding(run)
    F, target = run.flags, run.target
    tcfg = target.config
    if F.data in ("chat", "sharegpt"):
        raise ValueError(f"--data={F.data} trains a draft reading the target's embedding: pass --draft_layers")
    for name in ("draft_vocab_size", "from_target_layers", "feature_cache", "length_pool"):
        if getattr(F, name):
            raise ValueError(f"--{name} is for a draft reading the target's embedding (--draft_layers)")
    draft = load_model(F.init, weight_format="float32")     # trainable row-major arrays, not the CPU panels
    check_same_vocabulary(target, draft)
    tokenizer, mask_ids = pard.mask_tokenizer(draft.tokenizer, F.num_masks)
    params, cfg = pard.add_mask_rows(*add_identity_layers(draft.params, draft.config, F.add_layers, F.seed),
                                     F.num_masks)
    k = F.num_masks + 1
    ds = self_distill.build(F.target, num_train=F.num_train, log=run.log)
    prompt_len, _, heldout, n_greedy = self_distill.recipe_rows(ds)
    if F.data == "selfdistill":
        batches, first_label = data.RowBatches(ds["train"], F.batch_size, F.seed), prompt_len
        data_desc = (f"{len(ds['train'])} continuations the target generated itself (train.self_distill, half "
                     f"greedy, half temperature 1, from stdlib training-split prompts; labels = the "
                     f"{ds['train'].shape[1] - prompt_len} generated tokens per row)")
    else:
        batches, first_label = None, 1
        data_desc = f"packed {F.seq_len}-token windows of the stdlib training split, every position a label"
    accuracy = jax.jit(lambda p, frozen, r: pard_accuracy(p, frozen, cfg, tcfg, r, mask_ids, k, prompt_len,
                                                          stride=F.eval_stride))
    evaluate = heldout_evaluate(accuracy, target, heldout, n_greedy, k)
    def export(params, out_dir: str, record: dict) -> tuple[dict, str]:
        pard.save(out_dir, params, cfg, mask_ids, tokenizer)
        fields = {
            "model_config": cfg.to_hf(), "num_params": cfg.num_params(), "storage_dtype": "bfloat16",
            "pard_mask_token_ids": list(mask_ids), "num_masks": F.num_masks, "max_k": k, "init": F.init,
            "add_layers": F.add_layers, "data": F.data, "first_label": first_label, "self_distillation": ds["meta"],
            "loss": {"per_stream": "(1-ce_weight)*KL(target||draft) + ce_weight*CE", "ce_weight": F.ce_weight,
                     "stream_weights": "equal"}, "mask_ends": F.mask_ends}
        notes = NOTES.format(
            target=F.target, m=cfg.num_params() / 1e6, cfg=cfg, k=k, V=tcfg.vocab_size,
            init=F.init + (f" + {F.add_layers} appended identity-initialised layer(s)" if F.add_layers else ""),
            num_masks=F.num_masks, first_mask=mask_ids[0], last_mask=mask_ids[-1], ce_weight=F.ce_weight,
            mask_ends=F.mask_ends or "all",
            data_desc=data_desc, rows=record["heldout_rows"], greedy_rows=record["heldout_rows_greedy"],
            acc=", ".join(f"{record[f'heldout_acc{j}']:.3f}" for j in range(k)),
            accept_g=record["heldout_accept_len_greedy"], accept_g4=record["heldout_accept_len_k4_greedy"],
            accept=record["heldout_accept_len"], accept4=record["heldout_accept_len_k4"],
            chain=", ".join(f"{record[f'heldout_chain{j}_greedy']:.3f}" for j in range(k)))
        return fields, notes

    return skeleton.Parts(
        params, pard_loss_fn(cfg, tcfg, mask_ids, k, F.ce_weight, first_label, F.mask_ends or None), evaluate,
        export, batches=batches,
        summary=f"PARD from {F.init}: {cfg.num_params() / 1e6:.2f}M params, {F.num_masks} masks (k <= {k}), "
                f"data {F.data}" + (f" {ds['train'].shape}" if F.data == "selfdistill" else ""))


RECIPE = skeleton.Recipe(
    "pard", build, run_flags=RUN_FLAGS, frozen_target="checkpoints/stdlib-target", feature_cache=True,
    length_pool=True,
    curve_metrics=("heldout_accept_len", "heldout_accept_len_greedy", "heldout_accept_len_k4_greedy", "heldout_acc0",
                   "heldout_acc1"),
    defaults=dict(steps=300, lr=1e-3, batch_size=8, seq_len=255, warmup=20, weight_decay=0.0, eval_every=100,
                  eval_tokens=16384, log_every=10, ckpt_dir="runs/pard_ckpt", out="checkpoints/stdlib-draft-pard"))

if __name__ == "__main__":
    skeleton.main(RECIPE)
