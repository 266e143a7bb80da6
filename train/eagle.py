"""Train an EAGLE-1 or EAGLE-3 drafter for the shipped target on its own continuations.

    python -m train.eagle --kind=eagle      # -> checkpoints/stdlib-target-eagle  (ckpt runs/eagle_ckpt)
    python -m train.eagle --kind=eagle3     # -> checkpoints/stdlib-target-eagle3 (ckpt runs/eagle3_ckpt)

Data: self-distillation rows (train.self_distill: 64 corpus prompt tokens + 192 tokens the target generated, half
greedy, half at temperature 1); only target-generated tokens are labels. The frozen target runs over every batch
(its features are recomputed every step; --feature_cache computes them once for the training rows, train.features:
worth it on a real target, whose forward costs several drafter steps).

EAGLE-1 (specjax.drafters.eagle kind "eagle"): fc(concat(embed(x_{t+1}), f_t)) + one decoder layer regressing the
target's final normed hidden state f_{t+1}, drafting through the target's LM head. Loss
(train.losses.eagle.eagle_loss_fn): reg_weight * SmoothL1(feature) + ce_weight * soft CE against the target's
next-token distribution (the reference trainer's v_w = 1.0, p_w = 0.1), input features + U(-noise, noise) (the
paper's augmentation, noise 0.1), teacher-forced (--ttt_steps=1). Init: fc = identity on the feature half
(+ N(0, 0.02)), the layer N(0, 0.02): a fresh drafter passes f_t through, i.e. proposes what the target predicted
one position earlier.

EAGLE-3 (kind "eagle3"): fc fuses three target layers (--target_layers, default eagle.default_target_layers), a
reduced draft vocabulary of --draft_vocab_size tokens (the most frequent target-generated tokens of the training
rows, eagle.vocab_map_from_counts), training-time test over --ttt_steps=7 steps weighted 0.8^i, soft CE against the
target's distribution restricted to the draft vocabulary, masked where the target's top token is outside it; no
feature regression, no noise. Init (--warm_start): final norm = the target's, lm_head = the target's LM head
columns of the draft vocabulary, and (--fc_identity, the default) fc = identity on the highest fused layer.

Held-out metric (eagle_accuracy, every eval and in the MANIFEST): the drafter unrolled --eval_steps steps on
its own features over held-out continuations; per step the top-1 agreement with the target's argmax
(heldout_acc<i>), the chain agreement (steps 0..i all agree, heldout_chain<i>) and heldout_accept_len = the sum of
the chain agreements (expected accepted drafts of an eval_steps-token chain started at each position; on the greedy
rows, heldout_accept_len_greedy, each chain is exactly what greedy verification accepts from there).
"""
from __future__ import annotations

import dataclasses
import os
import sys

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters import eagle
from specjax.drafters.base import target_weight
from train import data, self_distill, skeleton
from train.losses.common import max_label_span
from train.losses.eagle import eagle_accuracy, eagle_loss_fn

flags.DEFINE_enum("kind", "eagle", eagle.KINDS, "eagle: EAGLE-1/2 drafter; eagle3: EAGLE-3 drafter "
                  "(the default --out / --ckpt_dir follow the kind)")
flags.DEFINE_integer("draft_vocab_size", 2048, "EAGLE-3: draft vocabulary size N (most frequent target-generated "
                     "training tokens)")
flags.DEFINE_list("target_layers", None, "EAGLE-3: target decoder layers whose outputs are fused, low to high "
                  "(default eagle.default_target_layers)")
flags.DEFINE_integer("ttt_steps", None, "training-time-test steps (default: 1 = teacher forcing for eagle, 7 for "
                     "eagle3)")
flags.DEFINE_float("step_decay", 0.8, "loss weight of TTT step i is step_decay ** i")
flags.DEFINE_float("noise", None, "uniform noise U(-noise, noise) on the input features (default 0.1 for eagle, "
                   "0 for eagle3)")
flags.DEFINE_float("reg_weight", 1.0, "EAGLE-1: weight of the feature regression (smooth L1)")
flags.DEFINE_float("ce_weight", 0.1, "EAGLE-1: weight of the token cross-entropy (EAGLE-3's CE has weight 1)")
flags.DEFINE_integer("draft_hidden", None, "drafter hidden size (default: the target's; EAGLE-1 must match it)")
flags.DEFINE_integer("draft_intermediate", None, "drafter MLP size (default: the target's)")
flags.DEFINE_integer("draft_heads", None, "drafter query heads (default: the target's)")
flags.DEFINE_integer("draft_kv_heads", None, "drafter key/value heads (default: the target's)")
flags.DEFINE_bool("warm_start", True, "init from the target (EAGLE-3: the target's final norm and LM head columns; "
                  "both kinds: fc as the identity unless --nofc_identity)")
flags.DEFINE_bool("fc_norm", False, "EAGLE-3.1: an RMSNorm of its own on each fused target feature before fc")
flags.DEFINE_bool("norm_output", False, "EAGLE-3.1: feed the post-norm layer output to lm_head and to the next "
                  "draft step (EAGLE-3 feeds back the pre-norm state)")
flags.DEFINE_bool("fc_identity", True, "--warm_start: also start fc as the identity on the feature half (EAGLE-1) or "
                  "on the top fused layer (EAGLE-3), so a fresh drafter proposes what the target predicted one "
                  "position earlier; --nofc_identity starts fc at N(0, 0.02) (the EAGLE-3 reference's init)")
flags.DEFINE_bool("parallel_drafting", False, "P-EAGLE: drafts 2..k from one forward over learned mask inputs "
                  "(trained as the training-time test with those inputs at steps > 0; --ttt_steps = the depths)")
flags.DEFINE_integer("eval_steps", 4, "held-out metric: steps the drafter is unrolled for")
flags.DEFINE_integer("num_train", 2048, "self-distillation continuations (train.self_distill)")
flags.DEFINE_enum("data", "corpus", self_distill.DATA_SOURCES, self_distill.DATA_HELP)
flags.DEFINE_bool("export_published", False, "also write the weights in the published EAGLE layout under "
                  "<out>/published (a second copy: off by default to keep checkpoints/ small)")

RUN_FLAGS = ("kind", "draft_vocab_size", "target_layers", "ttt_steps", "step_decay", "noise", "reg_weight",
             "ce_weight", "draft_hidden", "draft_intermediate", "draft_heads", "draft_kv_heads", "warm_start",
             "fc_identity", "fc_norm", "norm_output", "parallel_drafting", "num_train", "data")
DEFAULT_TTT = {"eagle": 1, "eagle3": 7}
DEFAULT_NOISE = {"eagle": 0.1, "eagle3": 0.0}
DEFAULT_STEPS = {"eagle": 450, "eagle3": 200}   # ~10-12 CPU minutes at batch 8 (EAGLE-3 with --ttt_steps=3)

NOTES = """\
{variant} drafter for {target}: one decoder layer (hidden {H}, {heads}/{kv_heads} heads, MLP {I}; {n_params:,}
trainable parameters{own}), trained on {trained_on}.
{loss}
{vocab}
Held-out ({eval_rows} {heldout_prompts}), drafter unrolled {n} steps on its own features,
top-1 agreement with the target's argmax per step: {acc}; chain agreement (steps 0..i all agree): {chain};
expected accepted drafts of a {n}-token chain started at every label position: {accept:.3f} over all rows,
{accept_g:.3f} on the greedy rows (where each chain is exactly what greedy verification would accept from that
position).
Layout: specjax artifact (eagle.save; load with specjax.generate(..., SpecConfig(method="{kind}"),
drafter=<this dir>)), stored as bfloat16. {published_note}
"""


def drafter_config(F, target) -> eagle.EagleConfig:
    layers = None if not F.target_layers else tuple(int(x) for x in F.target_layers)
    kw = dict(hidden_size=F.draft_hidden, intermediate_size=F.draft_intermediate, num_heads=F.draft_heads,
              num_kv_heads=F.draft_kv_heads, fc_norm=F.fc_norm, norm_output=F.norm_output,
              parallel_drafting=F.parallel_drafting)
    if F.kind == "eagle":
        if layers is not None:
            raise ValueError("--target_layers is an EAGLE-3 setting (EAGLE-1 reads the final hidden state)")
        return eagle.eagle_config(target, "eagle", **kw)
    return eagle.eagle_config(target, "eagle3", target_layers=layers, draft_vocab_size=F.draft_vocab_size, **kw)


def init_drafter(F, target, cfg: eagle.EagleConfig, d2t) -> dict:
    """N(0, 0.02) params (eagle.init_params); with --warm_start the EAGLE-3 drafter gets the target's own final norm
    and LM head columns, and (--fc_identity) the EAGLE-1 fc passes the feature through, the EAGLE-3 fc the highest
    fused layer."""
    tc = target.config
    H = cfg.hidden_size
    own_embed = H != tc.hidden_size                         # EAGLE-3 narrower than the target: its own embedding
    params = eagle.init_params(jax.random.PRNGKey(F.seed), cfg, embed=own_embed)
    if not F.warm_start:
        return params
    if own_embed:
        raise ValueError(f"--warm_start copies the target's {tc.hidden_size}-wide weights; the drafter is {H} wide "
                         "(pass --nowarm_start)")
    if cfg.kind == "eagle":
        if F.fc_identity:
            params["fc_w"] = params["fc_w"].at[H:].add(jnp.eye(H, dtype=params["fc_w"].dtype))
    else:
        top = cfg.target_layers.index(max(cfg.target_layers))
        if F.fc_identity:
            params["fc_w"] = params["fc_w"].at[top * tc.hidden_size:(top + 1) * tc.hidden_size].add(jnp.eye(H))
        params["final_norm"] = jnp.asarray(target.params["final_norm"], jnp.float32)
        params["lm_head"] = jnp.asarray(target_weight(target.params, "lm_head"), jnp.float32)[
            :, eagle.draft_to_target(d2t)]
    return params


def saved_drafter(path: str, target, cfg: eagle.EagleConfig, seed: int = 0) -> tuple[dict, np.ndarray | None]:
    """--init_drafter: (float32 params, draft vocabulary d2t) of a saved drafter of the config these flags ask for,
    or of the EAGLE-3 drafter a P-EAGLE config extends (its mask inputs then start at N(0, 0.02), from seed).
    Continuing keeps the drafter's own draft vocabulary (its lm_head rows are those tokens), even where the rows
    now given would rank their tokens otherwise; the MANIFEST reports its coverage of these rows."""
    weights = eagle.load(path, target, cfg.kind)
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), weights.params)
    extends = (cfg.parallel_drafting and not weights.config.parallel_drafting
               and dataclasses.replace(weights.config, parallel_drafting=True) == cfg)
    if weights.config != cfg and not extends:
        raise ValueError(f"--init_drafter {path} is {weights.config}; the flags ask for {cfg}")
    if extends:
        fresh = eagle.init_params(jax.random.PRNGKey(seed), cfg)
        params.update(mask_embed=fresh["mask_embed"], mask_hidden=fresh["mask_hidden"])
    return params, weights.d2t


def variant_name(cfg: eagle.EagleConfig) -> str:
    if cfg.kind == "eagle":
        return "EAGLE-1"
    if cfg.parallel_drafting:
        return "P-EAGLE" + (" (EAGLE-3.1 options)" if cfg.fc_norm or cfg.norm_output else "")
    opts = [n for n in ("fc_norm", "norm_output") if getattr(cfg, n)]
    return "EAGLE-3.1" if len(opts) == 2 else "EAGLE-3" + (f" (+{opts[0]})" if opts else "")


def build(run: skeleton.Run) -> skeleton.Parts:
    F, target = run.flags, run.target
    tcfg = target.config
    ds, (prompt_len, rows, heldout, n_greedy), batches = skeleton.distilled_rows(run)
    ttt = F.ttt_steps or DEFAULT_TTT[F.kind]
    noise = DEFAULT_NOISE[F.kind] if F.noise is None else F.noise
    cfg = drafter_config(F, target)
    is3 = cfg.kind == "eagle3"
    d2t, cov = None, {}
    if F.init_drafter:
        params, d2t = saved_drafter(F.init_drafter, target, cfg, F.seed)
        if is3:
            cov = data.vocabulary_coverage(d2t, rows, heldout, prompt_len, tcfg.vocab_size)
    else:
        if is3:
            d2t, cov = data.draft_vocabulary(rows, heldout, prompt_len, tcfg.vocab_size, cfg.draft_vocab_size)
        params = init_drafter(F, target, cfg, d2t)
    batches = skeleton.feature_batches(run, batches, cfg.target_layers if is3 else ())
    loss_fn = eagle_loss_fn(tcfg, cfg, prompt_len, num_steps=ttt, step_decay=F.step_decay,
                            reg_weight=F.reg_weight, ce_weight=F.ce_weight, noise=noise, d2t=d2t,
                            max_span=max_label_span(rows, prompt_len))
    accuracy = jax.jit(lambda p, frozen, r: eagle_accuracy(p, frozen, tcfg, cfg, r, prompt_len,
                                                                  F.eval_steps, d2t))
    n = F.eval_steps

    def evaluate(params, max_tokens: int | None = None) -> dict:
        count = lambda p, r: accuracy(p, target.params, jax.tree.map(jnp.asarray, r))
        return self_distill.chain_eval(count, params, heldout, n_greedy, n, max_tokens)

    def export(params, out_dir: str, record: dict) -> tuple[dict, str]:
        params = jax.device_get(params)
        weights = eagle.EagleWeights(cfg, params, d2t, os.path.basename(os.path.normpath(out_dir)))
        n_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))
        c = cfg.layer
        if is3:
            if F.target_layers:
                layers_why = "--target_layers"
            elif cfg.target_layers == eagle.reference_target_layers(tcfg.num_layers):
                layers_why = "the EAGLE-3 reference's rule (1, L//2 - 1, L - 4)"
            else:
                layers_why = (f"eagle.default_target_layers({tcfg.num_layers}): the reference's (1, L//2 - 1, L - 4) "
                              f"is not increasing for L = {tcfg.num_layers}, so low, middle and high layers below "
                              "the top one")
            loss = (f"Loss: EAGLE-3 training-time test over {ttt} steps"
                    + (" (steps > 0 read the learned mask embedding and shared hidden state: P-EAGLE's parallel "
                       "depths, exactly its one-forward proposal)" if cfg.parallel_drafting else "")
                    + f", step i weighted {F.step_decay}^i, soft "
                    "cross-entropy against the target's distribution restricted to the draft vocabulary "
                    "(renormalised), masked where the target's top token is outside it; no feature regression"
                    + (f"; input noise U(-{noise}, {noise})." if noise else "."))
            vocab = (f"Features: the outputs of target decoder layers {list(cfg.target_layers)} of "
                     f"{tcfg.num_layers} (chosen by {layers_why}). "
                     + (f"Draft vocabulary: that of the drafter this run continued ({F.init_drafter}), "
                        f"{cfg.draft_vocab_size} of {tcfg.vocab_size} tokens; it covers" if F.init_drafter else
                        f"Draft vocabulary: the {cfg.draft_vocab_size} most frequent label tokens of the "
                        f"training rows (of {tcfg.vocab_size}); they cover")
                     + f" {cov['train']:.1%} of the training rows' label "
                     f"tokens and {cov['heldout']:.1%} of the held-out ones.")
        else:
            loss = (f"Loss: {F.reg_weight} x smooth-L1 regression of the target's next final normed hidden state + "
                    f"{F.ce_weight} x soft cross-entropy against the target's next-token distribution (drafter "
                    f"logits through the target's LM head), input features + U(-{noise}, {noise}) noise"
                    + (", teacher-forced." if ttt == 1 else f", training-time test over {ttt} steps weighted "
                                                            f"{F.step_decay}^i."))
            vocab = "Vocabulary: the target's (its embedding and LM head, not stored here)."
        n = F.eval_steps
        layout = ("EAGLE-3 (fc / midlayer / norm / lm_head / d2t / t2d, eagle_aux_hidden_state_layer_ids)" if is3
                  else "EAGLE-1 (fc / layers.0)")
        published_note = (f"published/ holds the same weights in the {layout} layout (eagle.export_published) for "
                          "engines that load those." if F.export_published else
                          f"eagle.export_published writes them in the {layout} layout for engines that load those.")
        trained_on, heldout_prompts = self_distill.describe_rows(F.data, ds["meta"], len(batches.rows))
        notes = NOTES.format(
            variant=variant_name(cfg), target=F.target, H=c.hidden_size, heads=c.num_heads,
            kv_heads=c.num_kv_heads, I=c.intermediate_size, n_params=n_params,
            own="" if "embed" not in params else ", own embedding", loss=loss, vocab=vocab,
            eval_rows=record.get("heldout_rows"), n=n,
            acc=", ".join(f"{record[f'heldout_acc{i}']:.3f}" for i in range(n)),
            chain=", ".join(f"{record[f'heldout_chain{i}']:.3f}" for i in range(n)), accept=record["heldout_accept_len"],
            accept_g=record.get("heldout_accept_len_greedy", float("nan")),
            kind=cfg.kind, published_note=published_note,
            trained_on=trained_on, heldout_prompts=heldout_prompts)
        eagle.save(out_dir, weights, target, notes)
        if F.export_published:
            eagle.export_published(os.path.join(out_dir, "published"), weights, dtype="bfloat16")
        fields = dict(self_distillation=ds["meta"], drafter_config=cfg.to_dict(), drafter_params=n_params,
                      ttt_steps=ttt, step_decay=F.step_decay, noise=noise, warm_start=F.warm_start,
                      fc_identity=F.fc_identity, eval_steps=n,
                      published_dir="published" if F.export_published else None)
        if is3:
            fields.update(draft_vocab_size=cfg.draft_vocab_size, vocab_coverage=cov,
                          target_layers=list(cfg.target_layers), target_layers_reason=layers_why)
        else:
            fields.update(reg_weight=F.reg_weight, ce_weight=F.ce_weight)
        return fields, notes

    return skeleton.Parts(
        params, loss_fn, evaluate, export, batches=batches, corpus=F.data == "corpus",
        summary=f"{variant_name(cfg)}: hidden {cfg.hidden_size}, TTT {ttt} step(s), noise {noise}"
                + (f", layers {list(cfg.target_layers)}, draft vocab {cfg.draft_vocab_size} (coverage "
                   f"{cov['train']:.3f} train / {cov['heldout']:.3f} held-out)" if is3 else "")
                + f"; self-distillation rows {batches.rows.shape}")


def recipe(kind: str) -> skeleton.Recipe:
    return skeleton.Recipe(
        kind, build, frozen_target="checkpoints/stdlib-target", run_flags=RUN_FLAGS, feature_cache=True,
        length_pool=True, init_drafter="an EAGLE-3 drafter may start a --parallel_drafting one: fresh mask inputs "
                                       "are added",
        curve_metrics=("heldout_accept_len", "heldout_accept_len_greedy", "heldout_accept_len_sampled"),
        defaults=dict(steps=DEFAULT_STEPS[kind], lr=1e-3, batch_size=8, seq_len=255, warmup=30, weight_decay=0.0, eval_every=100,
                      eval_tokens=16384, log_every=10, ckpt_dir=f"runs/{kind}_ckpt",
                      out=f"checkpoints/stdlib-target-{kind}"))


RECIPES = {k: recipe(k) for k in eagle.KINDS}
RECIPE = RECIPES["eagle"]

if __name__ == "__main__":
    kind = skeleton.argv_flag(sys.argv[1:], "kind", "eagle")
    if kind not in RECIPES:
        raise SystemExit(f"--kind must be one of {eagle.KINDS}, got {kind!r}")
    skeleton.main(RECIPES[kind])
