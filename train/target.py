"""Train the default target LM (Llama family, float32) on the stdlib corpus; export checkpoints/stdlib-target.

    nohup nice -n 5 python -m train.target --time_budget=3300 > runs/target.log 2>&1 &
    python -m train.target --export_only        # export the newest training checkpoint

Training state (orbax) lives in --ckpt_dir; rerunning the same command resumes from it with the same data order.
"""
from __future__ import annotations

from absl import flags
import jax

from specjax.models.llama import init_params
from train import skeleton
from train.losses.lm import lm_loss_fn

skeleton.define_llama_flags(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=768)
flags.DEFINE_integer("max_len", 2048, "max_position_embeddings recorded in config.json")

NOTES = """\
Default target model of specjax: a {m:.1f}M-parameter Llama ({cfg.num_layers} layers, hidden {cfg.hidden_size},
{cfg.num_heads} query / {cfg.num_kv_heads} KV heads, MLP {cfg.intermediate_size}, tied embeddings, BPE vocab
{cfg.vocab_size}) trained from scratch with next-token cross-entropy on this machine's Python standard-library
source (float32 on CPU, stored as bfloat16).

Why this size: (1) all shipped checkpoints must fit in 30 MB together (this one is ~{mb:.1f} MB); (2) its decode
step (batch 1, T=1, jit forward with a KV cache, CPU) must cost >= 8x the draft model's: measured here
{decode_ms:.2f} ms/step at export; (3) it has to train in about an hour on 2 shared CPU cores, where every larger
candidate sees fewer tokens: this one averaged {tok_per_s:.1f}k tokens/s over the run.
"""


def build(run: skeleton.Run) -> skeleton.Parts:
    F = run.flags
    cfg = skeleton.llama_config(F, run.corpus, F.max_len)

    def export(params, out_dir: str, record: dict) -> tuple[dict, str]:
        fields = skeleton.save_lm(params, cfg, out_dir, run.corpus)
        ms = skeleton.decode_ms(params, cfg)
        notes = NOTES.format(cfg=cfg, m=cfg.num_params() / 1e6, mb=cfg.num_params() * 2 / 1e6, decode_ms=ms,
                             tok_per_s=record["tokens_seen"] / record["train_wall_s"] / 1e3)
        return {**fields, "decode_ms_per_step_cpu": round(ms, 4)}, notes

    return skeleton.Parts(init_params(cfg, jax.random.PRNGKey(F.seed)), lm_loss_fn(cfg),
                          skeleton.make_evaluator(cfg, run.corpus, F.seq_len), export,
                          summary=f"{cfg.num_params() / 1e6:.2f}M params")


RECIPE = skeleton.Recipe(
    "target", build, run_flags=(*skeleton.LLAMA_FLAGS, "max_len"),
    defaults=dict(steps=800, lr=2e-3, seed=0, vocab_size=4096, ckpt_dir="runs/target_ckpt",
                  out="checkpoints/stdlib-target"))

if __name__ == "__main__":
    skeleton.main(RECIPE)
