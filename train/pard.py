"""Fine-tune the default draft model into a PARD parallel drafter; export checkpoints/stdlib-draft-pard.

    python -m train.pard --time_budget=540                 # ckpt runs/pard_ckpt
    python -m train.pard --data=selfdistill --ckpt_dir=runs/pard_sd_ckpt --out=

The draft (--init, default checkpoints/stdlib-draft) gets --num_masks mask tokens appended to its vocabulary
(embedding rows initialised to its mean embedding, special tokens "<|pard_mask_j|>" in its tokenizer) and learns
to fill k = num_masks + 1 positions in one forward (specjax.drafters.pard). Training runs all k draft positions of
a batch in ONE forward (train.losses.pard.pard_stream_logits: the real tokens, then masks 1..k-1 after each of
--mask_ends context ends drawn per step, an attention mask giving each query exactly what it sees at inference);
loss per draft position = (1 - ce_weight) * KL(p_target || p_draft) + ce_weight * CE, the teacher being the frozen
target's distribution for the same token (the default draft's distillation loss), positions weighted equally.

Data (--data): "selfdistill", the target's own continuations (train.self_distill, labels = target-generated
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
flags.DEFINE_enum("data", "corpus", ["selfdistill", "corpus"], "training data (see the module docstring)")
flags.DEFINE_integer("mask_ends", 64, "context ends per row that get mask streams each step (drawn at random; "
                     "0 = every position): the masks' share of the forward is mask_ends / seq_len of the dense form")
flags.DEFINE_integer("add_layers", 0, "decoder layers appended to --init before fine-tuning, each starting as the "
                     "identity (random attention/MLP inputs, zero output projections), so step 0 is --init's model")
flags.DEFINE_integer("num_train", 6144, "self-distillation continuations (train.self_distill; the cached set)")

RUN_FLAGS = ("init", "add_layers", "num_masks", "ce_weight", "data", "mask_ends", "num_train")

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


def build(run: skeleton.Run) -> skeleton.Parts:
    F, target = run.flags, run.target
    tcfg = target.config
    draft = load_model(F.init)
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
    accuracy = jax.jit(lambda p, frozen, r: pard_accuracy(p, frozen, cfg, tcfg, r, mask_ids, k, prompt_len))

    def evaluate(params, max_tokens: int | None = None) -> dict:
        tots, idx = self_distill.heldout_counts(lambda p, r: accuracy(p, target.params, jnp.asarray(r)), params,
                                                heldout, n_greedy, k, max_tokens, min_rows=16, batch=16)
        hits, labels, chain, chains = (sum(t[j] for t in tots.values()) for j in range(4))
        out = {f"heldout_acc{j}": float(hits[j] / max(labels[j], 1)) for j in range(k)}
        out["heldout_accept_len"] = float(chain.sum() / max(chains, 1))
        out["heldout_accept_len_k4"] = float(chain[:4].sum() / max(chains, 1))
        for name, t in tots.items():
            out[f"heldout_accept_len_{name}"] = float(t[2].sum() / max(t[3], 1))
            out[f"heldout_accept_len_k4_{name}"] = float(t[2][:4].sum() / max(t[3], 1))
            if name == "greedy":
                out.update({f"heldout_chain{j}_greedy": float(t[2][j] / max(t[3], 1)) for j in range(k)})
        out["heldout_rows"] = int(len(idx))
        out["heldout_rows_greedy"] = int((idx < n_greedy).sum())
        return out

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
    "pard", build, run_flags=RUN_FLAGS, frozen_target="checkpoints/stdlib-target",
    curve_metrics=("heldout_accept_len_greedy", "heldout_accept_len_k4_greedy", "heldout_acc1"),
    defaults=dict(steps=300, lr=1e-3, batch_size=8, seq_len=255, warmup=20, weight_decay=0.0, eval_every=100,
                  eval_tokens=16384, log_every=10, ckpt_dir="runs/pard_ckpt", out="checkpoints/stdlib-draft-pard"))

if __name__ == "__main__":
    skeleton.main(RECIPE)
