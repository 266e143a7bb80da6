"""Distill a small draft LM from the frozen target; export checkpoints/stdlib-draft. Or, for a target whose vocabulary
makes an own embedding too large (SmolLM2-135M), a draft made from the target's own first layers (--init_layers).

    nohup nice -n 5 python -m train.draft --time_budget=1200 > runs/draft.log 2>&1 &
    python -m train.draft --target=smollm2-135m --data=sharegpt --init_layers=2 --draft_vocab_size=8192 \
        --ckpt_dir=runs/draft_smollm2_ckpt --out=runs/smollm2-135m-draft

Loss per token (train.losses.draft_model.distill_loss_fn): (1 - ce_weight) * KL(p_target || p_draft) + ce_weight *
CE(next token), the target's logits computed on the fly by the frozen target on the same packed corpus batches.
Forward KL on the full distribution carries more signal per token than the one-hot labels a tiny model would
otherwise fit.
Same tokenizer as the target (read from its checkpoint).

--init_layers=N: a TargetEmbeddingDraft (specjax.drafters.draft_model): copies of the target's first N decoder layers
(architecture flags are the target's) and its final norm, embedding tokens with the TARGET's embedding (read from the
target at decode time, not stored), and an LM head that is the target's own (tied) head or, with
--draft_vocab_size=M, the target's head columns of the M most frequent label tokens of the training rows (EAGLE-3's
draft vocabulary, train.data.draft_vocabulary; d2t stored in the artifact; drafts never propose another token). Its
rows: a chat target's (--data=chat: ShareGPT training first turns answered by the target; --data=sharegpt: those
prompts with ShareGPT's own answers; --num_train, --length_pool, --feature_cache as the EAGLE recipe), or packed
stdlib windows without --data (a target without a chat template). Loss (target_embedding_loss_fn): the same
distillation at label positions only; with a draft vocabulary the teacher is the target's distribution restricted to
it and renormalised, as EAGLE-3's. Held-out metric (draft_agreements, every eval and in the MANIFEST): per position of
an --eval_steps chain the top-1 agreement with the target's argmax (heldout_acc<i>; acc0 bounds the acceptance of
the first draft), the chain agreement and heldout_accept_len, the expected accepted drafts of the chain started at
every label position (on the greedy rows, heldout_accept_len_greedy, exactly what greedy verification accepts).
"""
from __future__ import annotations

import dataclasses
import os
import sys

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters import draft_model
from specjax.drafters.base import target_weight
from specjax.models import load_model
from specjax.models.llama import init_params
from train import data, self_distill, skeleton
from train.losses.common import max_label_span
from train.losses.draft_model import distill_loss_fn, draft_agreements, target_embedding_loss_fn

skeleton.define_llama_flags(hidden=192, layers=1, heads=3, kv_heads=1, intermediate=512)
flags.DEFINE_float("ce_weight", 0.1, "weight of next-token CE mixed with the KL term")
flags.DEFINE_float("temperature", 1.0, "distillation temperature applied to both models' logits")
flags.DEFINE_integer("init_layers", 0, "0: a draft of its own (the architecture flags) trained from scratch; N: the "
                     "target's first N decoder layers and final norm, reading the target's embedding (see the module "
                     "docstring)")
flags.DEFINE_integer("draft_vocab_size", 0, "with --init_layers: 0 drafts through the target's own LM head; M: an own "
                     "head over the M most frequent label tokens of the training rows")
flags.DEFINE_enum("data", None, self_distill.DATA_SOURCES, "with --init_layers, unset: packed stdlib windows (a "
                  "target without a chat template); else the self-distilled " + self_distill.DATA_HELP)
flags.DEFINE_integer("num_train", 2048, "with --data: training rows (train.self_distill)")
flags.DEFINE_integer("eval_steps", 4, "with --init_layers: the held-out metric's chain length")

FROM_TARGET_FLAGS = ("ce_weight", "temperature", "init_layers", "draft_vocab_size", "data", "num_train", "eval_steps")
EVAL_BATCH = 8         # held-out rows per count: its teacher is [rows, R, V] float32 (SmolLM2: ~0.9 GB at R = 576)

NOTES = """\
Default draft model of specjax for {target}: a {m:.2f}M-parameter Llama ({cfg.num_layers} layer(s), hidden
{cfg.hidden_size}, {cfg.num_heads} query / {cfg.num_kv_heads} KV heads, MLP {cfg.intermediate_size}, tied
embeddings) with the target's tokenizer, distilled from the frozen target on this machine's Python standard-library
source: loss per token = {kl_w:g} * KL(p_target || p_draft) + {ce_weight:g} * CE(next token), temperature
{temperature:g}, target logits computed on the fly. Stored as bfloat16.

Why this size: the draft's decode step must cost <= 1/8 of the target's (measured at export in one process,
batch 1, T=1, jit forward with a KV cache, CPU: draft {draft_ms:.3f} ms vs target {target_ms:.3f} ms =
{ratio:.1f}x), and all checkpoints together must stay under 30 MB. At this scale a decode step is mostly the
{cfg.vocab_size}-token LM head and dispatch overhead, so the ratio moves with other people's load on a shared CPU.
"""

FROM_TARGET_NOTES = """\
Draft model for {target} made from the target itself: its first {layers} decoder layer(s) (hidden {H}, {heads}/{kv}
heads, MLP {I}) and final norm, {n_params:,} parameters of its own, embedding tokens with the target's embedding (read
from the target at decode time, not stored here). {vocab}
Distilled on {trained_on}: loss per label position = {kl_w:g} * KL(p_target || p_draft) + {ce_weight:g} * CE(next
token), temperature {temperature:g}{teacher}.
Held-out ({rows} rows: {heldout}), teacher-forced {n}-draft chains from every label position: top-1 agreement with the
target's argmax per position {acc}; chain agreement {chain}; expected accepted drafts {accept:.3f}{accept_g}.
Decode step (batch 1, T=1, jit forward with a KV cache, CPU, at export): draft {draft_ms:.3f} ms vs target
{target_ms:.3f} ms = {ratio:.1f}x. Layout: specjax artifact (draft_model.save; SpecConfig(method="draft_model"),
drafter=<this dir>), stored as bfloat16.
"""


def heldout_windows(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """The held-out stream as whole rows of seq_len + 1 tokens (data.eval_windows' windows, the padded tail
    dropped): the held-out rows of a draft trained on packed windows."""
    return np.concatenate([win[w.all(1)] for win, w in data.eval_windows(tokens, seq_len, 64)])


def build_from_target(run: skeleton.Run) -> skeleton.Parts:
    """--init_layers: a TargetEmbeddingDraft from the target's first layers, on its chat rows or packed windows."""
    F, target = run.flags, run.target
    tcfg = target.config
    given = [f"--{n}" for n in skeleton.LLAMA_FLAGS if F[n].present]
    if given:
        raise ValueError(f"{', '.join(given)} shape a draft trained from scratch; --init_layers copies the target's "
                         "layers, whose shapes are the target's")
    if not 1 <= F.init_layers <= tcfg.num_layers:
        raise ValueError(f"--init_layers={F.init_layers}: the target has {tcfg.num_layers} decoder layers")
    if F.data:
        ds, (first_label, rows, heldout, n_greedy), batches = skeleton.distilled_rows(run)
        batches = skeleton.feature_batches(run, batches)
        trained_on, heldout_desc = self_distill.describe_rows(F.data, ds["meta"], len(batches.rows))
        max_span, meta = max_label_span(rows, first_label), {"self_distillation": ds["meta"]}
    else:
        if target.chat_template is not None:
            raise ValueError(f"{F.target} is a chat model: train its draft on its chat rows (--data=chat or "
                             "--data=sharegpt), not on stdlib windows")
        if F.feature_cache or F.length_pool:
            raise ValueError("--feature_cache and --length_pool are for self-distilled rows (--data)")
        corpus = run.corpus
        # every token of a window after its first is a label; the eval rows are held-out windows of the same width
        first_label, rows, heldout, n_greedy = 1, corpus.train, heldout_windows(corpus.heldout, F.seq_len), 0
        batches, max_span, meta = None, None, {}
        trained_on = f"packed {F.seq_len}-token windows of the stdlib training split (every position a label)"
        heldout_desc = f"{F.seq_len + 1}-token windows of the held-out stdlib files"
    d2t, cov = None, {}
    if F.draft_vocab_size:
        d2t, cov = data.draft_vocabulary(rows, heldout, first_label, tcfg.vocab_size, F.draft_vocab_size)
    # the target's layers as row-major float32 arrays (the frozen target may be held in the CPU kernel's panels)
    draft = draft_model.init_from_target(load_model(F.target, weight_format="float32"), F.init_layers, d2t=d2t)
    cfg, n = draft.config, F.eval_steps
    counts = jax.jit(lambda p, frozen, r: draft_agreements(p, frozen, cfg, tcfg, r, first_label, n, d2t).counts())

    def evaluate(params, max_tokens: int | None = None) -> dict:
        count = lambda p, r: counts(p, target.params, jax.tree.map(jnp.asarray, r))
        tots, idx = self_distill.heldout_counts(count, params, heldout, n_greedy, n, max_tokens, batch=EVAL_BATCH)
        out = self_distill.chain_metrics(tots, n)
        if not F.data:                  # stdlib text is neither the target's greedy nor its sampled output
            out.pop("heldout_accept_len_sampled")
        return {**out, "heldout_rows": int(len(idx))}

    def export(params, out_dir: str, record: dict) -> tuple[dict, str]:
        params = jax.device_get(params)
        n_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))
        # the decode step the drafter runs: its layers over the target's embedding, into its head or the target's
        served = draft_model.forward_params(params, {w: target_weight(target.params, w) for w in
                                                     ("embed", "output_head")})
        head_cfg = dataclasses.replace(cfg, vocab_size=F.draft_vocab_size or tcfg.vocab_size)
        draft_ms, target_ms = skeleton.decode_ms(served, head_cfg), skeleton.decode_ms(target.params, tcfg)
        run.log(f"decode ms/step: draft {draft_ms:.3f}, target {target_ms:.3f} ({target_ms / draft_ms:.1f}x)")
        vocab = (f"Draft vocabulary: its own head over the {F.draft_vocab_size} most frequent label tokens of the "
                 f"training rows (the target's head columns at init; they cover {cov['train']:.1%} of the training "
                 f"rows' label tokens and {cov['heldout']:.1%} of the held-out ones); every other token has "
                 "probability 0." if d2t is not None else "It drafts through the target's own LM head (not stored).")
        notes = FROM_TARGET_NOTES.format(
            target=F.target, layers=cfg.num_layers, H=cfg.hidden_size, heads=cfg.num_heads, kv=cfg.num_kv_heads,
            I=cfg.intermediate_size, n_params=n_params, vocab=vocab, trained_on=trained_on, kl_w=1 - F.ce_weight,
            ce_weight=F.ce_weight, temperature=F.temperature,
            teacher=(", the teacher the target's distribution restricted to the draft vocabulary and renormalised, "
                     "the KL counted where the target's top token is inside it, the CE where the label is"
                     if d2t is not None else ""),
            rows=record.get("heldout_rows"), heldout=heldout_desc, n=n,
            acc=", ".join(f"{record[f'heldout_acc{i}']:.3f}" for i in range(n)),
            chain=", ".join(f"{record[f'heldout_chain{i}']:.3f}" for i in range(n)),
            accept=record["heldout_accept_len"],
            accept_g=(f" ({record['heldout_accept_len_greedy']:.3f} on the greedy rows, exactly what greedy "
                      "verification accepts)" if "heldout_accept_len_greedy" in record else ""),
            draft_ms=draft_ms, target_ms=target_ms, ratio=target_ms / draft_ms)
        draft_model.save(out_dir, draft_model.TargetEmbeddingDraft(
            cfg, params, d2t, os.path.basename(os.path.normpath(out_dir))), target, notes)
        return {**meta, "layer_config": cfg.to_hf(), "init_layers": F.init_layers, "drafter_params": n_params,
                "draft_vocab_size": F.draft_vocab_size or None, "vocab_coverage": cov, "eval_steps": n,
                "distillation": {"loss": "(1-ce_weight)*KL(target||draft) + ce_weight*CE at label positions",
                                 "ce_weight": F.ce_weight, "temperature": F.temperature},
                "decode_ms_per_step_cpu": round(draft_ms, 4), "target_decode_ms_per_step_cpu": round(target_ms, 4),
                "target_over_draft_decode_cost": round(target_ms / draft_ms, 2)}, notes

    loss_fn = target_embedding_loss_fn(cfg, tcfg, F.ce_weight, F.temperature, first_label, d2t=d2t, max_span=max_span)
    rows_shape = batches.rows.shape if batches is not None else f"windows of {F.seq_len}"
    return skeleton.Parts(
        draft.params, loss_fn, evaluate, export, batches=batches, corpus=not F.data,
        summary=f"draft from the target's first {F.init_layers} layer(s), reading its embedding; draft vocabulary "
                + (f"{F.draft_vocab_size} (coverage {cov['train']:.3f} train / {cov['heldout']:.3f} held-out)"
                   if d2t is not None else "the target's head") + f"; rows {rows_shape}")


def build(run: skeleton.Run) -> skeleton.Parts:
    F, target = run.flags, run.target
    for name in ("draft_vocab_size", "data"):
        if getattr(F, name):
            raise ValueError(f"--{name} is for a draft made from the target's layers (--init_layers)")
    cfg = skeleton.llama_config(F, run.corpus, target.config.max_position_embeddings)

    def export(params, out_dir: str, record: dict) -> tuple[dict, str]:
        fields = skeleton.save_lm(params, cfg, out_dir, run.corpus)
        draft_ms, target_ms = skeleton.decode_ms(params, cfg), skeleton.decode_ms(target.params, target.config)
        run.log(f"decode ms/step: draft {draft_ms:.3f}, target {target_ms:.3f} ({target_ms / draft_ms:.1f}x)")
        notes = NOTES.format(target=F.target, cfg=cfg, m=cfg.num_params() / 1e6, kl_w=1 - F.ce_weight,
                             ce_weight=F.ce_weight, temperature=F.temperature, draft_ms=draft_ms,
                             target_ms=target_ms, ratio=target_ms / draft_ms)
        return {**fields, "distillation": {"loss": "(1-ce_weight)*KL(target||draft) + ce_weight*CE",
                                           "ce_weight": F.ce_weight, "temperature": F.temperature},
                "decode_ms_per_step_cpu": round(draft_ms, 4), "target_decode_ms_per_step_cpu": round(target_ms, 4),
                "target_over_draft_decode_cost": round(target_ms / draft_ms, 2)}, notes

    return skeleton.Parts(
        init_params(cfg, jax.random.PRNGKey(F.seed)),
        distill_loss_fn(cfg, target.config, F.ce_weight, F.temperature),
        skeleton.make_evaluator(cfg, run.corpus, F.seq_len), export,
        summary=f"{cfg.num_params() / 1e6:.2f}M params, target {target.config.num_params() / 1e6:.2f}M from "
                f"{F.target}")


RECIPE = skeleton.Recipe(
    "draft", build, run_flags=(*skeleton.LLAMA_FLAGS, "ce_weight", "temperature"),
    frozen_target="checkpoints/stdlib-target",
    # seed 1: a different data order from the target's, so the draft sees other windows first
    defaults=dict(steps=1500, lr=3e-3, seed=1, ckpt_dir="runs/draft_ckpt", out="checkpoints/stdlib-draft"))
# --init_layers picks this one (its own defaults: never the toy draft's checkpoints or export)
FROM_TARGET_RECIPE = skeleton.Recipe(
    "draft_from_target", build_from_target, run_flags=FROM_TARGET_FLAGS, frozen_target="checkpoints/stdlib-target",
    feature_cache=True, length_pool=True,
    curve_metrics=("heldout_accept_len", "heldout_accept_len_greedy", "heldout_acc0"),
    defaults=dict(steps=300, lr=1e-3, batch_size=8, seq_len=255, warmup=20, weight_decay=0.0, eval_every=100,
                  eval_tokens=16384, log_every=10, out="runs/draft_from_target"))

if __name__ == "__main__":
    # --export_only needs --init_layers too: it picks the recipe before the run's flags are restored
    skeleton.main(RECIPE if skeleton.argv_flag(sys.argv[1:], "init_layers", "0") == "0" else FROM_TARGET_RECIPE)
