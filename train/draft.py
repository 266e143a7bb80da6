"""Distill a small draft LM from the frozen target; export checkpoints/stdlib-draft.

    nohup nice -n 5 python -m train.draft --time_budget=1200 > runs/draft.log 2>&1 &

Loss per token (train.losses.draft_model.distill_loss_fn): (1 - ce_weight) * KL(p_target || p_draft) + ce_weight *
CE(next token), the target's logits computed on the fly by the frozen target on the same packed corpus batches.
Forward KL on the full distribution carries more signal per token than the one-hot labels a tiny model would
otherwise fit.
Same tokenizer as the target (read from its checkpoint).
"""
from __future__ import annotations

from absl import flags
import jax

from specjax.models.llama import init_params
from train import skeleton
from train.losses.draft_model import distill_loss_fn

skeleton.define_llama_flags(hidden=192, layers=1, heads=3, kv_heads=1, intermediate=512)
flags.DEFINE_float("ce_weight", 0.1, "weight of next-token CE mixed with the KL term")
flags.DEFINE_float("temperature", 1.0, "distillation temperature applied to both models' logits")

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


def build(run: skeleton.Run) -> skeleton.Parts:
    F, target = run.flags, run.target
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

if __name__ == "__main__":
    skeleton.main(RECIPE)
