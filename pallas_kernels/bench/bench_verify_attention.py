"""Benchmark the fused verify-attention kernel against the XLA path.

Sweeps batch x context x T x {chain, tree} at Llama-3-8B attention shapes (Hq 32, Hkv 8, D 128, bf16) and prints,
per config: median time per call, achieved bandwidth (bytes of K+V in the valid lengths / time), the cost relative
to T=1 (same batch, context, mode), the XLA path's time, the speedup over it, and the max |kernel - xla| error.

  python -m pallas_kernels.bench.bench_verify_attention                      # full sweep (GPU/TPU)
  python -m pallas_kernels.bench.bench_verify_attention --batch 8 --context 4096 --T 1,4,16
  JAX_PLATFORMS=cpu python -m pallas_kernels.bench.bench_verify_attention --smoke   # tiny, interpret mode

Timing: each measurement runs `--inner` dependent calls unrolled in one jit (the output of one call is the next
call's q, so nothing is hoisted or overlapped), repeated `--reps` times; the median over reps divided by `--inner`
is reported. Every row's cache is full (lengths = context), the T new entries included.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.verify_attention import validate_tree_mask, verify_attention


def _ints(s: str) -> list[int]:
    out = []
    for x in s.split(","):
        x = x.strip().lower()
        if x:
            out.append(int(float(x[:-1]) * 1024) if x.endswith("k") else int(x))
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=_ints, default=[1, 8, 32])
    p.add_argument("--context", type=_ints, default=[1024, 4096, 16384], help="cache length per row (1k style ok)")
    p.add_argument("--T", type=_ints, default=[1, 2, 4, 5, 8, 16, 32, 64], help="new positions per row")
    p.add_argument("--modes", default="chain,tree", help="chain, tree or both (tree: binary tree, parent (i-1)//2)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--impl", default="pallas", help="pallas | pallas_gpu | pallas_tpu")
    p.add_argument("--block-kv", type=int, default=None)
    p.add_argument("--num-splits", type=int, default=None)
    p.add_argument("--block-m", type=int, default=None)
    p.add_argument("--num-warps", type=int, default=None)
    p.add_argument("--num-stages", type=int, default=None)
    p.add_argument("--inner", type=int, default=10, help="dependent calls per timed jit")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--no-xla", action="store_true", help="skip the XLA baseline (and the error check)")
    p.add_argument("--xla-max-bytes", type=float, default=24e9,
                   help="skip the XLA baseline when its float32 score tensor would exceed this many bytes")
    p.add_argument("--interpret", action="store_true", help="run the kernel in interpret mode (CPU)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny config in interpret mode: batch 2, context 64, T 1,4, Hq 4, Hkv 2, D 64, float32")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    a = p.parse_args(argv)
    if a.smoke:
        a.batch, a.context, a.T = [2], [64], [1, 4]
        a.heads, a.kv_heads, a.head_dim, a.dtype = 4, 2, 64, "float32"
        a.inner, a.reps, a.interpret = 2, 2, True
    return a


def tree_mask(T: int):
    m = np.zeros((T, T), bool)
    for i in range(T):
        j = i
        while j >= 0:
            m[i, j] = True
            j = (j - 1) // 2 if j > 0 else -1
    return m


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.smoke and "JAX_PLATFORMS" not in os.environ:
        jax.config.update("jax_platforms", "cpu")       # before the first computation starts a backend
    dtype = jnp.dtype(a.dtype)
    Hq, Hkv, D = a.heads, a.kv_heads, a.head_dim
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    tunables = dict(block_kv=a.block_kv, num_splits=a.num_splits, block_m=a.block_m, num_warps=a.num_warps,
                    num_stages=a.num_stages)
    if a.interpret:
        tunables["interpret"] = True
    print(f"# devices: {jax.devices()}  jax {jax.__version__}  impl={a.impl} dtype={dtype.name} "
          f"Hq={Hq} Hkv={Hkv} D={D} tunables={ {k: v for k, v in tunables.items() if v is not None} }", flush=True)

    def timed(fn, *args):
        out = jax.block_until_ready(fn(*args))                     # compile + warm up
        times = []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - t0)
        return statistics.median(times) / a.inner, out

    def make_fn(impl, mask, extra):
        def chain(q, k, v, lengths):
            def body(_, q):
                return verify_attention(q, k, v, lengths, mask, implementation=impl, **extra)
            return lax.fori_loop(0, a.inner, body, q, unroll=True)
        return jax.jit(chain)

    header = (f"{'mode':5} {'B':>3} {'ctx':>6} {'T':>3} {'kernel_us':>10} {'GB/s':>8} {'vs_T1':>6} "
              f"{'xla_us':>10} {'speedup':>8} {'max_err':>9}")
    print(header, flush=True)
    rows, t1 = [], {}
    for B in a.batch:
        for ctx in a.context:
            key = jax.random.PRNGKey(B * 100003 + ctx)
            kk, kv, kq = jax.random.split(key, 3)
            try:
                k = jax.random.normal(kk, (B, Hkv, ctx, D), dtype)
                v = jax.random.normal(kv, (B, Hkv, ctx, D), dtype)
            except Exception as e:                                 # noqa: BLE001 (e.g. out of memory)
                print(f"# skip B={B} ctx={ctx}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            lengths = jnp.full((B,), ctx, jnp.int32)
            kv_bytes = 2 * B * ctx * Hkv * D * dtype.itemsize
            for mode in modes:
                for T in a.T:
                    if T > ctx:
                        continue
                    mask = None
                    if mode == "tree":
                        m = tree_mask(T)
                        validate_tree_mask(m)
                        mask = jnp.asarray(m)
                    q = jax.random.normal(jax.random.fold_in(kq, T), (B, T, Hq, D), dtype)
                    row = dict(mode=mode, B=B, context=ctx, T=T)
                    try:
                        t_k, out_k = timed(make_fn(a.impl, mask, tunables), q, k, v, lengths)
                    except Exception as e:                         # noqa: BLE001
                        print(f"# {mode} B={B} ctx={ctx} T={T}: kernel failed: {type(e).__name__}: "
                              f"{str(e)[:300]}", flush=True)
                        continue
                    row.update(kernel_s=t_k, gbps=kv_bytes / t_k / 1e9)
                    if T == 1:
                        t1[(mode, B, ctx)] = t_k
                    base = t1.get((mode, B, ctx)) or t1.get(("chain", B, ctx))
                    row["vs_T1"] = t_k / base if base else None
                    score_bytes = 4 * B * Hq * T * ctx
                    if not a.no_xla and score_bytes <= a.xla_max_bytes:
                        try:
                            t_x, out_x = timed(make_fn("xla", mask, {}), q, k, v, lengths)
                            row.update(xla_s=t_x, speedup=t_x / t_k,
                                       max_err=float(jnp.max(jnp.abs(out_k.astype(jnp.float32)
                                                                     - out_x.astype(jnp.float32)))))
                        except Exception as e:                     # noqa: BLE001
                            print(f"# xla failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    rows.append(row)
                    fmt = lambda x, f: (f % x) if x is not None else "-"
                    print(f"{mode:5} {B:>3} {ctx:>6} {T:>3} {t_k * 1e6:>10.1f} {row['gbps']:>8.1f} "
                          f"{fmt(row.get('vs_T1'), '%6.2f'):>6} {fmt(row.get('xla_s') and row['xla_s'] * 1e6, '%10.1f'):>10} "
                          f"{fmt(row.get('speedup'), '%8.2f'):>8} {fmt(row.get('max_err'), '%9.2e'):>9}", flush=True)
            del k, v
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(args={k: v for k, v in vars(a).items()}, rows=rows), f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
