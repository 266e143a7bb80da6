"""Train a multi-token target from scratch (Gloeckle et al. 2024) and export checkpoints/stdlib-target-mtp4.

    python -m train.mtp_heads --num_predict=4 --steps=500 --time_budget=2400

The model: a shared trunk (--layers - 1 decoder layers), then n = --num_predict output heads of one decoder layer
each over the trunk's output, every head through the shared (tied) unembedding; head i predicts the token i places
ahead. Head 1 is the last decoder layer of an ordinary Llama (exported in HF format: any Llama reader loads the
next-token model), heads 2..n are a specjax "mtp_heads" artifact in its `mtp_heads/` directory: the model's own
drafter (SpecConfig(method="mtp_heads"), k <= n - 1; head 1 verifies). Loss: the sum of the heads' next-i-token
cross-entropies on the stdlib corpus, same data order and schedule flags as train.target. The paper's
memory-efficient sequential head backward is not needed at this size.
"""
from __future__ import annotations

import os

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters import mtp
from specjax.models import load_model
from specjax.models.llama import init_params
from train import data, skeleton
from train.losses.mtp_heads import multi_token_accuracy, multi_token_lm_loss_fn

skeleton.define_llama_flags(hidden=192, layers=2, heads=3, kv_heads=1, intermediate=512)
flags.DEFINE_integer("num_predict", 4, "n: output heads (head 1 = next token, head i = the token i ahead)")
flags.DEFINE_integer("head_intermediate", 384, "MLP width of heads 2..n (head 1 is the last decoder layer: "
                     "--intermediate)")
flags.DEFINE_integer("max_len", 2048, "max_position_embeddings recorded in config.json")
flags.DEFINE_string("compare_to", "checkpoints/stdlib-target", "a plain next-token model whose MANIFEST's held-out "
                    "bits/byte the MANIFEST quotes beside head 1's ('' for none)")

NOTES = """\
Multi-token target (Gloeckle et al. 2024, n = {n}): a {m:.2f}M-parameter model trained from scratch to predict the
next {n} tokens at every position: a shared trunk of {trunk} decoder layer(s) (hidden {H}, {heads} query / {kv} KV
heads, MLP {I}), then {n} output heads of one decoder layer each (head 1: MLP {I}, exported as the last layer of an
ordinary {L}-layer Llama, {base:.2f}M parameters; heads 2..{n}: MLP {HI}, in mtp_heads/, {extra:.2f}M parameters),
all through the tied {V}-token unembedding. Loss: the sum over heads of head i's cross-entropy on token t + i, on
this machine's Python standard-library source (float32 on CPU, stored as bfloat16).

Use: the HF directory is the target; SpecConfig(method="mtp_heads", num_speculative_tokens=k <= {d}) drafts k
tokens from heads 2..k+1 (drafter=<this directory>), head 1 verifies (self-speculation, exact like any drafter).

Held-out (head 1, i.e. the next-token model): {bpb:.4f} bits per UTF-8 byte{compare}.
Extra heads on held-out text, top-1 accuracy against the text's token / agreement with head 1's argmax at that
position (what greedy self-speculation accepts when the earlier drafts were right): {acc}.
Size: the size budget of checkpoints/ (40 MB for every shipped model) sets this model's width: a 256-wide trunk
with four 256-wide heads would not fit beside the other shipped models.
"""

HEADS_NOTES = """\
Heads 2..{n} of the multi-token target in the parent directory (specjax artifact, kind "mtp_heads"): one decoder
layer each over the output of target decoder layer {trunk} (the trunk), own final norm, the target's tied
unembedding. Trained jointly with the target from scratch; see ../MANIFEST.md for the command and metrics.
"""


def build(run: skeleton.Run) -> skeleton.Parts:
    F = run.flags
    if F.num_predict < 2:
        raise ValueError(f"--num_predict={F.num_predict}: a multi-token model predicts at least 2 tokens")
    if F.layers < 2:
        raise ValueError(f"--layers={F.layers}: the trunk needs at least one layer below head 1")
    cfg = skeleton.llama_config(F, run.corpus, F.max_len)
    hcfg = mtp.MTPConfig("mtp_heads", mtp.layer_config(cfg, F.head_intermediate), F.num_predict - 1,
                         trunk_layer=cfg.num_layers - 2)
    k1, k2 = jax.random.split(jax.random.PRNGKey(F.seed))
    params = {"lm": init_params(cfg, k1), "heads": mtp.init_params(k2, hcfg)["heads"]}
    lm_eval = skeleton.make_evaluator(cfg, run.corpus, F.seq_len)
    accuracy = jax.jit(lambda p, w, wt: multi_token_accuracy(p, cfg, hcfg, w, wt))

    def evaluate(params, max_tokens: int | None = None) -> dict:
        out = lm_eval(params["lm"], max_tokens)
        tot = np.zeros((3, hcfg.depth))
        for win, w in data.eval_windows(run.corpus.heldout, F.seq_len, 16, max_tokens):
            tot += np.asarray(jnp.stack(accuracy(params, win, w)), np.float64)
        for d in range(hcfg.depth):
            out[f"heldout_head{d + 2}_acc"] = float(tot[0, d] / max(tot[2, d], 1))
            out[f"heldout_head{d + 2}_agree"] = float(tot[1, d] / max(tot[2, d], 1))
        return out

    def count(tree) -> int:
        return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(tree))

    def export(params, out_dir: str, record: dict) -> tuple[dict, str]:
        params = jax.device_get(params)
        fields = skeleton.save_lm(params["lm"], cfg, out_dir, run.corpus)
        target = load_model(out_dir)
        mtp.save(os.path.join(out_dir, mtp.HEADS_DIR), mtp.MTPWeights(hcfg, {"heads": params["heads"]}), target,
                 HEADS_NOTES.format(n=F.num_predict, trunk=hcfg.trunk_layer))
        base, extra = count(params["lm"]), count(params["heads"])
        plain, compare = {}, ""
        if F.compare_to:
            rec = data.read_manifest_md(F.compare_to)
            mc = rec["model_config"]
            plain = {"compare_to": F.compare_to, "compare_to_heldout_bpb": rec["heldout_bpb"]}
            compare = (f"; the plain next-token model {F.compare_to} ({mc['num_hidden_layers']} layers, hidden "
                       f"{mc['hidden_size']}, {rec['num_params'] / 1e6:.1f}M parameters, {rec['steps']} steps of "
                       f"{rec['batch_size']} x {rec['seq_len']} tokens) reaches {rec['heldout_bpb']:.4f} on the same "
                       "held-out files")
        acc = "; ".join(f"head {d + 2}: {record[f'heldout_head{d + 2}_acc']:.3f} / "
                        f"{record[f'heldout_head{d + 2}_agree']:.3f}" for d in range(hcfg.depth))
        notes = NOTES.format(n=F.num_predict, m=(base + extra) / 1e6, trunk=cfg.num_layers - 1, H=cfg.hidden_size,
                             heads=cfg.num_heads, kv=cfg.num_kv_heads, I=cfg.intermediate_size, L=cfg.num_layers,
                             base=base / 1e6, HI=F.head_intermediate, extra=extra / 1e6, V=cfg.vocab_size,
                             d=hcfg.depth, bpb=record["heldout_bpb"], acc=acc, compare=compare)
        return {**fields, "heads_config": hcfg.to_dict(), "heads_params": extra, "num_predict": F.num_predict,
                **plain}, notes

    return skeleton.Parts(params, multi_token_lm_loss_fn(cfg, hcfg), evaluate, export,
                          summary=f"{count(params['lm']) / 1e6:.2f}M (next-token model) + {count(params['heads']) / 1e6:.2f}M "
                                  f"({hcfg.depth} extra heads)")


RECIPE = skeleton.Recipe(
    "mtp_heads", build, run_flags=(*skeleton.LLAMA_FLAGS, "num_predict", "head_intermediate", "max_len"),
    curve_metrics=("heldout_bpb", "heldout_head2_agree"),
    defaults=dict(steps=500, lr=2e-3, warmup=60, seed=0, vocab_size=4096,
                  tokenizer="checkpoints/stdlib-target/tokenizer.json", ckpt_dir="runs/mtp_heads_ckpt",
                  out="checkpoints/stdlib-target-mtp4"))

if __name__ == "__main__":
    skeleton.main(RECIPE)
