"""Train DeepSeek-style MTP modules for the shipped (frozen) target; export checkpoints/stdlib-target-mtp.

    python -m train.mtp --depth=2 --steps=400 --time_budget=1500

D modules (specjax.drafters.mtp, kind "mtp"): module d reads proj([RMSNorm(h^{d-1}); RMSNorm(embed(next token))]),
h^0 = the target's final normed hidden state, through one decoder layer, its own final norm and the target's LM
head; module d drafts token d + 1 ahead of the bonus token through the causal chain of modules 1..d. Data: the
self-distillation rows the Medusa and EAGLE recipes train on (train.self_distill); labels: the target's own
distribution for each token (soft cross-entropy, train.losses.mtp.mtp_loss_fn), depth d weighted --depth_decay ** d.
Held-out metric (mtp_accuracy): per-module top-1 agreement with the target's argmax, the chain agreement
(modules 1..d all agree) and the expected accepted length of a D-token chain.
"""
from __future__ import annotations

import os

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters import mtp
from train import data, self_distill, skeleton
from train.losses.mtp import mtp_accuracy, mtp_loss_fn

flags.DEFINE_integer("depth", 2, "D: MTP modules (module d drafts token d + 1 after the bonus token)")
flags.DEFINE_integer("module_intermediate", 256, "MLP width of each module's decoder layer")
flags.DEFINE_float("depth_decay", 1.0, "loss weight of module d is depth_decay ** d")
flags.DEFINE_integer("num_train", 6144, "self-distillation continuations (train.self_distill)")

NOTES = """\
DeepSeek-V3-style multi-token prediction modules for {target}: D = {D} modules chained as the paper (module d reads
RMSNorm(h^(d-1)) and RMSNorm(embedding of the token d places ahead), projected 2H -> H, one decoder layer (hidden
{H}, {heads}/{kv} heads, MLP {I}), its own final norm, the target's LM head and embedding; {n_params:,} trainable
parameters), trained on the frozen target's own continuations ({rows} rows of train.self_distill: half greedy, half
temperature 1): soft cross-entropy against the target's distribution for each drafted token, depth d weighted
{decay:g}^d.

Held-out ({eval_rows} continuations from held-out stdlib prompts), teacher-forced chains: top-1 agreement with the
target's argmax per module: {acc}; chain agreement (modules 1..d all agree): {chain}; conditional acceptance of
module d given modules before it agreed: {cond}; expected accepted drafts of a {D}-token chain: {accept:.3f} over all
rows, {accept_g:.3f} on the greedy rows (exactly what greedy verification accepts there).
Use: SpecConfig(method="mtp", num_speculative_tokens=k <= {D}) with drafter=<this dir>; k > {D} with
drafter_options={{"reuse_last_module": True}} runs module {D} again on its own output (vLLM's way). Stored as
bfloat16 (specjax artifact, kind "mtp").
"""


def build(run: skeleton.Run) -> skeleton.Parts:
    F, target = run.flags, run.target
    tcfg = target.config
    ds = self_distill.build(F.target, num_train=F.num_train, log=run.log)
    prompt_len, rows, heldout, n_greedy = self_distill.recipe_rows(ds)
    cfg = mtp.MTPConfig("mtp", mtp.layer_config(tcfg, F.module_intermediate), F.depth)
    params = mtp.init_params(jax.random.PRNGKey(F.seed), cfg, target.params)
    D = F.depth
    accuracy = jax.jit(lambda p, frozen, r: mtp_accuracy(p, frozen, tcfg, cfg, r, prompt_len))

    def evaluate(params, max_tokens: int | None = None) -> dict:
        count = lambda p, r: accuracy(p, target.params, jnp.asarray(r))
        return self_distill.chain_eval(count, params, heldout, n_greedy, D, max_tokens)

    def export(params, out_dir: str, record: dict) -> tuple[dict, str]:
        params = jax.device_get(params)
        n_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))
        chain = [record[f"heldout_chain{d}"] for d in range(D)]
        cond = [chain[0]] + [chain[d] / max(chain[d - 1], 1e-9) for d in range(1, D)]
        c = cfg.layer
        notes = NOTES.format(target=F.target, D=D, H=c.hidden_size, heads=c.num_heads, kv=c.num_kv_heads,
                             I=c.intermediate_size, n_params=n_params, rows=len(rows), decay=F.depth_decay,
                             eval_rows=record.get("heldout_rows"),
                             acc=", ".join(f"{record[f'heldout_acc{d}']:.3f}" for d in range(D)),
                             chain=", ".join(f"{x:.3f}" for x in chain), cond=", ".join(f"{x:.3f}" for x in cond),
                             accept=record["heldout_accept_len"],
                             accept_g=record.get("heldout_accept_len_greedy", float("nan")))
        mtp.save(out_dir, mtp.MTPWeights(cfg, params, os.path.basename(os.path.normpath(out_dir))), target, notes)
        return dict(self_distillation=ds["meta"], mtp_config=cfg.to_dict(), drafter_params=n_params,
                    depth_decay=F.depth_decay, heldout_conditional_acceptance=cond), notes

    return skeleton.Parts(params, mtp_loss_fn(tcfg, cfg, prompt_len, F.depth_decay), evaluate, export,
                          batches=data.RowBatches(rows, F.batch_size, F.seed),
                          summary=f"MTP: {D} modules, MLP {F.module_intermediate}; self-distillation rows {rows.shape}")


RECIPE = skeleton.Recipe(
    "mtp", build, frozen_target="checkpoints/stdlib-target",
    run_flags=("depth", "module_intermediate", "depth_decay", "num_train"),
    curve_metrics=("heldout_accept_len", "heldout_accept_len_greedy", "heldout_acc0"),
    defaults=dict(steps=400, lr=1e-3, batch_size=8, seq_len=255, warmup=30, weight_decay=0.0, eval_every=100,
                  eval_tokens=16384, log_every=10, ckpt_dir="runs/mtp_ckpt", out="checkpoints/stdlib-target-mtp"))

if __name__ == "__main__":
    skeleton.main(RECIPE)
