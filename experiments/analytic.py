"""The analytic speedup model's tables (specjax.analysis), no measurement: what speculation should give, printed as
aligned tables, written as CSV/JSON and plotted under --out_dir.

  python -m experiments.analytic --out_dir=runs/analytic
  python -m experiments.analytic --context_len=4096 --hardware=H100-SXM,H200,MyGPU=1000:6

  (a) tau    tokens per step vs alpha and k (Leviathan eq. 1)
  (b) speedup_vs_c   walltime speedup vs the draft cost c at one k, with the memory-bound verify cost (1) and a
                     CPU-like one (--cpu_verify_cost: a (k+1)-position target pass is not free there)
  (c) best_k         optimal_k per (alpha, c), with its speedup, for both verify costs
  (d) batch_roofline predicted speedup vs batch size of Llama 3.1 8B (bf16) on datasheet GPUs, and the crossover
                     batch: the first one where speculation loses throughput
  (e) crossover      that crossover batch vs context length (the KV reads per row grow with the context and keep
                     the verify pass memory-bound longer)
"""
from __future__ import annotations

import math
import os
from typing import Sequence

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np
from absl import app, flags

from specjax import analysis
from experiments.tables import pyplot, save_figure, text_table, write_table

# Dense (no sparsity) BF16 tensor-core peak and HBM bandwidth, from NVIDIA's datasheets: "NVIDIA H100 Tensor Core
# GPU" (SXM5: 989 TFLOPS BF16, 3.35 TB/s HBM3) and "NVIDIA H200 Tensor Core GPU" (SXM: 989 TFLOPS BF16, 4.8 TB/s
# HBM3e). The datasheets print 1,979 TFLOPS "with sparsity"; dense is half of that.
HARDWARE = {
    "H100-SXM": dict(peak_flops=989e12, bandwidth=3.35e12),
    "H200": dict(peak_flops=989e12, bandwidth=4.8e12),
}

# meta-llama/Llama-3.1-8B config.json (hidden_size 4096, 32 layers, 8 KV heads of head_dim 128), 8.03e9 params,
# served in bf16.
LLAMA_31_8B = dict(params=8.03e9, layers=32, d_model=4096, kv_heads=8, head_dim=128, bytes_per_value=2)

FLAGS = flags.FLAGS
flags.DEFINE_string("out_dir", "runs/analytic", "directory of the tables (.csv, .json) and plots (.png)")
flags.DEFINE_list("alphas", ["0.5", "0.6", "0.7", "0.8", "0.9"], "acceptance rates of tables (a) and (c)")
flags.DEFINE_integer("max_k", 8, "table (a): k = 1..max_k")
flags.DEFINE_list("draft_costs", ["0", "0.02", "0.05", "0.1", "0.2", "0.5"], "draft costs c of tables (b), (c)")
flags.DEFINE_list("speedup_alphas", ["0.6", "0.8"], "table (b): acceptance rates")
flags.DEFINE_integer("speedup_k", 4, "table (b): drafted tokens per step")
flags.DEFINE_float("cpu_verify_cost", 1.8, "a CPU-like cost of a (k+1)-position target pass in plain-decode steps "
                   "(experiments.speedup measures the real one: its vcost column)")
flags.DEFINE_integer("best_k_max", 16, "table (c): largest k optimal_k tries")
flags.DEFINE_float("roofline_alpha", 0.8, "table (d): acceptance rate")
flags.DEFINE_integer("roofline_k", 4, "table (d): drafted tokens per step (the verify pass covers k + 1)")
flags.DEFINE_float("roofline_c", 0.05, "table (d): draft cost per draft step, relative to a plain step")
flags.DEFINE_integer("context_len", 1024, "table (d): tokens in each row's KV cache")
flags.DEFINE_integer("max_batch", 256, "table (d): batch sizes 1..max_batch")
flags.DEFINE_list("hardware", list(HARDWARE), "tables (d), (e): GPUs, each a name from HARDWARE or "
                  "name=TFLOPS:TB/s (overrides or adds one)")
flags.DEFINE_list("crossover_contexts", ["128", "256", "512", "1024", "2048", "4096"], "table (e): context lengths")


def hardware(entries: Sequence[str]) -> dict[str, dict]:
    """--hardware entries -> {name: {peak_flops, bandwidth}} in FLOP/s and bytes/s."""
    out = {}
    for entry in entries:
        name, _, spec = entry.partition("=")
        if spec:
            tflops, tbps = spec.split(":")
            out[name] = dict(peak_flops=float(tflops) * 1e12, bandwidth=float(tbps) * 1e12)
        elif name in HARDWARE:
            out[name] = HARDWARE[name]
        else:
            raise ValueError(f"unknown GPU {name!r}: one of {sorted(HARDWARE)} or name=TFLOPS:TB/s")
    return out


def target_roofline_inputs(model: dict, context_len: int) -> dict:
    """The model-side arguments of analysis.batch_roofline for a target described by `model` (LLAMA_31_8B's keys):
    weight bytes, KV bytes per cached token (K and V, every layer), FLOPs per new token (matmuls: 2 per parameter;
    attention: QK^T and AV over the context, 2 * 2 * d_model FLOPs per cached token per layer)."""
    kv_bytes = 2 * model["layers"] * model["kv_heads"] * model["head_dim"] * model["bytes_per_value"]
    flops = 2 * model["params"] + 4 * model["layers"] * model["d_model"] * context_len
    return dict(param_bytes=model["params"] * model["bytes_per_value"], kv_bytes_per_token=kv_bytes,
                context_len=context_len, flops_per_token=flops)


def first_batch_below_one(batch_sizes: np.ndarray, speedups: np.ndarray) -> int | None:
    below = np.nonzero(speedups < 1.0)[0]
    return int(batch_sizes[below[0]]) if len(below) else None


def tau_table(alphas: list[float], ks: range) -> list[dict]:
    rows = [dict(alpha=a, k=k, tau=analysis.expected_tokens_per_step(a, k)) for a in alphas for k in ks]
    print("\n(a) tau = expected tokens per step (bonus token included), chain of k drafts, i.i.d. acceptance alpha")
    print(text_table(["alpha"] + [f"k={k}" for k in ks],
                     [[f"{a:g}"] + [f"{r['tau']:.2f}" for r in rows if r["alpha"] == a] for a in alphas]))
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for a in alphas:
        ax.plot(list(ks), [r["tau"] for r in rows if r["alpha"] == a], marker="o", label=f"alpha={a:g}")
    ax.set(xlabel="k (drafted tokens per step)", ylabel="tau (tokens per step)",
           title="Expected tokens per draft-verify step")
    ax.grid(alpha=0.3)
    ax.legend()
    write_table(rows, os.path.join(FLAGS.out_dir, "tau"), meta={"formula": "(1 - alpha^(k+1)) / (1 - alpha)"})
    save_figure(fig, os.path.join(FLAGS.out_dir, "tau"))
    return rows


def speedup_vs_c_table(alphas: list[float], k: int, costs: list[float], verify_costs: list[float]) -> list[dict]:
    rows = [dict(alpha=a, k=k, c=c, verify_cost=v, speedup=analysis.walltime_speedup(a, k, c, v))
            for v in verify_costs for a in alphas for c in costs]
    print(f"\n(b) walltime speedup = tau / (k c + verify_cost) at k={k}, vs the draft cost c (one draft step / one "
          f"plain step); verify_cost 1 = memory-bound ideal, {verify_costs[-1]:g} = CPU-like")
    print(text_table(["alpha", "verify_cost"] + [f"c={c:g}" for c in costs],
                     [[f"{a:g}", f"{v:g}"] + [f"{r['speedup']:.2f}x" for r in rows
                                              if r["alpha"] == a and r["verify_cost"] == v]
                      for v in verify_costs for a in alphas]))
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for v, style in zip(verify_costs, ("-", "--", ":", "-.")):
        for a in alphas:
            ax.plot(costs, [r["speedup"] for r in rows if r["alpha"] == a and r["verify_cost"] == v],
                    style, marker="o", label=f"alpha={a:g}, verify cost {v:g}")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set(xlabel="c (draft step cost / plain step cost)", ylabel="speedup over plain decoding",
           title=f"Walltime speedup at k={k}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    write_table(rows, os.path.join(FLAGS.out_dir, "speedup_vs_c"),
                meta={"formula": "tau(alpha, k) / (k c + verify_cost)"})
    save_figure(fig, os.path.join(FLAGS.out_dir, "speedup_vs_c"))
    return rows


def best_k_table(alphas: list[float], costs: list[float], verify_costs: list[float], k_max: int) -> list[dict]:
    rows = []
    for v in verify_costs:
        for a in alphas:
            for c in costs:
                k, s = analysis.optimal_k(a, c, v, k_max=k_max)
                rows.append(dict(alpha=a, c=c, verify_cost=v, best_k=k, speedup=s))
    for v in verify_costs:
        print(f"\n(c) best k (optimal_k over 0..{k_max}; k=0 = plain decoding wins) and its speedup, verify_cost {v:g}")
        print(text_table(["alpha"] + [f"c={c:g}" for c in costs],
                         [[f"{a:g}"] + [f"k={r['best_k']} {r['speedup']:.2f}x" if r["best_k"] else "plain"
                                        for r in rows if r["alpha"] == a and r["verify_cost"] == v]
                          for a in alphas]))
    write_table(rows, os.path.join(FLAGS.out_dir, "best_k"), meta={"k_max": k_max})
    return rows


def roofline_tables(gpus: dict[str, dict], alpha: float, k: int, c: float, context_len: int, max_batch: int,
                    contexts: list[int]) -> tuple[list[dict], list[dict]]:
    batch_sizes = np.arange(1, max_batch + 1)
    policy = dict(alpha=alpha, k=k, c=c)
    rows, curves, ratios, crossings = [], {}, {}, {}
    for name, gpu in gpus.items():
        inputs = target_roofline_inputs(LLAMA_31_8B, context_len)
        speedups = analysis.batch_roofline(batch_sizes, **inputs, **gpu, **policy)
        t_plain = analysis.roofline_step_time(batch_sizes, 1, **inputs, **gpu)
        t_verify = analysis.roofline_step_time(batch_sizes, k + 1, **inputs, **gpu)
        curves[name], ratios[name] = speedups, t_verify / t_plain
        crossings[name] = (first_batch_below_one(batch_sizes, speedups),
                           analysis.roofline_crossover_batch(**inputs, **gpu, **policy))
        rows += [dict(gpu=name, batch=int(b), speedup=float(s), plain_step_ms=1e3 * float(tp),
                      verify_step_ms=1e3 * float(tv), verify_cost=float(tv / tp), context_len=context_len)
                 for b, s, tp, tv in zip(batch_sizes, speedups, t_plain, t_verify)]

    shown = sorted({int(b) for b in 2 ** np.arange(int(math.log2(max_batch)) + 1)}
                   | {b for b, _ in crossings.values() if b} | {max_batch})
    print(f"\n(d) batch roofline: Llama 3.1 8B bf16 ({LLAMA_31_8B['params'] / 1e9:.2f}e9 params), context "
          f"{context_len}, alpha {alpha:g}, k {k}, c {c:g}; speedup = tau / (k c + t_verify / t_plain), "
          f"t = max(weights + KV reads / bandwidth, FLOPs / peak)")
    print(text_table(["batch"] + [f"{n} speedup" for n in gpus] + [f"{n} verify/plain" for n in gpus],
                     [[b] + [f"{curves[n][b - 1]:.2f}x" for n in gpus]
                      + [f"{ratios[n][b - 1]:.2f}" for n in gpus]
                      for b in shown]))
    r = analysis.expected_tokens_per_step(alpha, k) - k * c       # speculation loses once verify/plain > r
    for name, gpu in gpus.items():
        first, exact = crossings[name]
        where = (f"first batch with speedup < 1: {first}" if first else
                 f"no batch in 1..{max_batch} with speedup < 1")
        if math.isfinite(exact):
            formula = f"formula: speedup < 1 above B* = {exact:.2f}"
        else:
            # Why never: both passes read every row's KV cache, so at any batch the verify pass costs at most
            # this limit of t_verify / t_plain, and it stays below r.
            huge = np.array([1e12])
            inputs = target_roofline_inputs(LLAMA_31_8B, context_len)
            limit = float(analysis.roofline_step_time(huge, k + 1, **inputs, **gpu)[0]
                          / analysis.roofline_step_time(huge, 1, **inputs, **gpu)[0])
            formula = f"formula: never (verify/plain tends to {limit:.2f} < tau - k c = {r:.2f})"
        print(f"{name} ({gpu['peak_flops'] / 1e12:g} TFLOP/s, {gpu['bandwidth'] / 1e12:g} TB/s): {where}; "
              f"{formula}; speedup {curves[name][0]:.2f}x at batch 1, {curves[name][-1]:.2f}x at batch {max_batch}")

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in gpus:
        line, = ax.plot(batch_sizes, curves[name], label=name)
        if crossings[name][0]:
            ax.axvline(crossings[name][0], color=line.get_color(), ls=":", lw=0.8)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="batch size", ylabel="predicted speedup",
           title=f"Llama 3.1 8B roofline, context {context_len}, alpha {alpha:g}, k {k}, c {c:g}")
    ax.grid(alpha=0.3)
    ax.legend()
    meta = dict(model=LLAMA_31_8B, gpus=gpus, **policy, context_len=context_len,
                crossover_batch={n: crossings[n][0] for n in gpus},
                crossover_formula={n: crossings[n][1] for n in gpus})
    write_table(rows, os.path.join(FLAGS.out_dir, "batch_roofline"), meta=meta)
    save_figure(fig, os.path.join(FLAGS.out_dir, "batch_roofline"))

    crossover_rows = []
    for name, gpu in gpus.items():
        for ctx in contexts:
            exact = analysis.roofline_crossover_batch(**target_roofline_inputs(LLAMA_31_8B, ctx), **gpu, **policy)
            crossover_rows.append(dict(gpu=name, context_len=ctx, crossover_formula=exact,
                                       first_batch_below_one=math.floor(exact) + 1 if math.isfinite(exact)
                                       else None))
    print("\n(e) first batch with speedup < 1 vs context length (roofline_crossover_batch; 'never' = the KV reads "
          "keep the verify pass cheap enough at every batch)")
    print(text_table(["gpu"] + [f"ctx={x}" for x in contexts],
                     [[n] + [r["first_batch_below_one"] or "never" for r in crossover_rows if r["gpu"] == n]
                      for n in gpus]))
    write_table(crossover_rows, os.path.join(FLAGS.out_dir, "crossover"), meta=meta)
    return rows, crossover_rows


def main(argv):
    del argv
    alphas = [float(a) for a in FLAGS.alphas]
    costs = [float(c) for c in FLAGS.draft_costs]
    verify_costs = [1.0, FLAGS.cpu_verify_cost]
    tau_table(alphas, range(1, FLAGS.max_k + 1))
    speedup_vs_c_table([float(a) for a in FLAGS.speedup_alphas], FLAGS.speedup_k, costs, verify_costs)
    best_k_table(alphas, costs, verify_costs, FLAGS.best_k_max)
    roofline_tables(hardware(FLAGS.hardware), FLAGS.roofline_alpha, FLAGS.roofline_k, FLAGS.roofline_c,
                    FLAGS.context_len, FLAGS.max_batch, [int(x) for x in FLAGS.crossover_contexts])


if __name__ == "__main__":
    app.run(main)
