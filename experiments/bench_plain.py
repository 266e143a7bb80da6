"""Plain greedy decoding: specjax vs transformers `generate` on the SAME weights, measured in one run.

Prints tokens/s of both, their ratio, the achieved GB/s of weight reads, and the verify-cost curve (cost of one
cached forward over T = 1, 2, 4, 5, 8 positions relative to T = 1) that the speedup formula needs.

  python -m experiments.bench_plain --sizes=30m,110m --new_tokens=128
"""
from __future__ import annotations

import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import app, flags
import numpy as np

import specjax
from specjax import SpecConfig
from experiments import costs

FLAGS = flags.FLAGS
flags.DEFINE_list("sizes", ["30m", "110m"], "model shapes to run")
flags.DEFINE_integer("prompt_len", 32, "prompt tokens")
flags.DEFINE_integer("new_tokens", 128, "generated tokens")
flags.DEFINE_integer("repeats", 3, "timed runs per engine (the fastest is reported)")
flags.DEFINE_integer("threads", 2, "torch intra-op threads (match the cores XLA uses)")

SHAPES = {  # (hidden, layers, intermediate, heads, kv_heads, vocab)
    "30m": (512, 6, 1376, 8, 8, 8192),
    "110m": (768, 12, 2048, 12, 12, 16384),
}


def build_hf(size: str, path: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    h, layers, inter, heads, kv, vocab = SHAPES[size]
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=h, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=2048,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).float().eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


def verify_cost_curve(model, context: int, ts=(1, 2, 4, 5, 8)) -> dict[int, float]:
    """Seconds of one cached forward over T positions at `context` tokens of history."""
    return {T: costs.forward_seconds(model, context, T) for T in ts}


def run_size(size: str) -> dict:
    import torch
    torch.set_num_threads(FLAGS.threads)
    with tempfile.TemporaryDirectory() as d:
        hf = build_hf(size, d)
        model = specjax.load_model(d)
    n_params = model.config.num_params()
    weight_bytes = n_params * 4
    prompt = np.random.default_rng(0).integers(1, model.config.vocab_size, FLAGS.prompt_len).tolist()
    cfg = SpecConfig(max_new_tokens=FLAGS.new_tokens, stop_at_eos=False)

    res = specjax.generate(model, [prompt], cfg)                       # compile
    ours = res.tokens[0]
    t_ours = costs.fastest_seconds(lambda: specjax.generate(model, [prompt], cfg), FLAGS.repeats)

    ids = torch.tensor([prompt])
    def hf_generate():
        with torch.no_grad():
            return hf.generate(ids, max_new_tokens=FLAGS.new_tokens, min_new_tokens=FLAGS.new_tokens,
                               do_sample=False, pad_token_id=0)
    theirs = hf_generate()[0, len(prompt):].tolist()
    t_hf = costs.fastest_seconds(hf_generate, FLAGS.repeats)
    agree = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours))

    curve = verify_cost_curve(model, FLAGS.prompt_len + FLAGS.new_tokens // 2)
    n = FLAGS.new_tokens
    return dict(size=size, params=n_params, ours_tps=n / t_ours, hf_tps=n / t_hf, ratio=t_hf / t_ours,
                ours_gbps=weight_bytes * n / t_ours / 1e9, hf_gbps=weight_bytes * n / t_hf / 1e9,
                agree=agree, curve={T: c / curve[1] for T, c in curve.items()}, t1_ms=curve[1] * 1e3)


def main(argv):
    del argv
    rows = [run_size(s) for s in FLAGS.sizes]
    print(f"\nPlain greedy decoding, batch 1, float32, CPU ({os.cpu_count()} cores), prompt {FLAGS.prompt_len}, "
          f"{FLAGS.new_tokens} new tokens, fastest of {FLAGS.repeats}")
    print(f"{'model':>6} {'params':>8} {'specjax tok/s':>14} {'HF tok/s':>9} {'ratio':>6} {'specjax GB/s':>13} "
          f"{'HF GB/s':>8} {'same tokens':>12}")
    for r in rows:
        print(f"{r['size']:>6} {r['params'] / 1e6:7.1f}M {r['ours_tps']:14.1f} {r['hf_tps']:9.1f} {r['ratio']:5.2f}x "
              f"{r['ours_gbps']:13.2f} {r['hf_gbps']:8.2f} {r['agree']:>5}/{FLAGS.new_tokens}")
    print("\nVerify-cost curve: cached forward over T positions / T = 1 (specjax, XLA path)")
    print(f"{'model':>6} {'T=1 ms':>7} " + " ".join(f"{'T=' + str(t):>6}" for t in rows[0]['curve']))
    for r in rows:
        print(f"{r['size']:>6} {r['t1_ms']:7.2f} " + " ".join(f"{v:6.2f}" for v in r['curve'].values()))


if __name__ == "__main__":
    app.run(main)
