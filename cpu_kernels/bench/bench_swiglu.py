"""Benchmark the SwiGLU CPU kernel against XLA's fused silu * up (swiglu_reference), each alone in a compiled loop.

Per row count it prints microseconds per call of the kernel and of XLA, each less the loop's own cost (the same loop
with a plain slice in place of SwiGLU), at SmolLM2-135M's width (I = 1536) by default:

  python -m cpu_kernels.bench.bench_swiglu
  python -m cpu_kernels.bench.bench_swiglu --rows 1,9,72 --width 1536
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from cpu_kernels.bench import looped_us
from cpu_kernels.swiglu import swiglu_cpu
from specjax.ops import swiglu_reference


def per_call_us(op, x: jax.Array, width: int, calls: int, reps: int) -> float:
    """op inside a loop whose every step feeds its result back into half of its input (nothing is hoisted)."""
    def step(i, x):
        return x.at[:, :width].set(lax.optimization_barrier(op(x)) * 1.0001)   # op not fused into the update

    return looped_us(step, x, calls, reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,5,9,72", help="row counts (B x T)")
    ap.add_argument("--width", type=int, default=1536, help="I: the gate's (and up's) width")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    print(f"{'rows':>5} {'kernel us':>10} {'xla us':>8} {'xla / kernel':>13}")
    for rows in (int(r) for r in args.rows.split(",")):
        x = jnp.asarray(np.random.default_rng(0).standard_normal((rows, 2 * args.width)), jnp.float32)
        loop = per_call_us(lambda x: x[:, args.width:], x, args.width, args.calls, args.reps)
        kernel = per_call_us(swiglu_cpu, x, args.width, args.calls, args.reps) - loop
        xla = per_call_us(swiglu_reference, x, args.width, args.calls, args.reps) - loop
        print(f"{rows:5d} {kernel:10.2f} {xla:8.2f} {xla / kernel:13.2f}", flush=True)


if __name__ == "__main__":
    main()
