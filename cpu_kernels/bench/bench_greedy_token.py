"""Benchmark the greedy-token CPU kernel against XLA's two reductions (greedy_token_reference), each alone in a
compiled loop.

Per row count it prints microseconds per call of the kernel and of XLA, each less the loop's own cost (the same loop
reading one logit in place of the greedy token), at SmolLM2-135M's vocabulary (V = 49152) by default: a decode
step's one row, a verify pass's k + 1 and batch 8's 8 (k + 1).

  python -m cpu_kernels.bench.bench_greedy_token
  python -m cpu_kernels.bench.bench_greedy_token --rows 1,5,40 --vocab 49152
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from cpu_kernels.bench import looped_us
from cpu_kernels.greedy_token import greedy_token_cpu
from specjax.ops import greedy_token_reference


def per_call_us(op, x: jax.Array, calls: int, reps: int) -> float:
    """op inside a loop whose every step writes its result into the logits it reads next (nothing is hoisted)."""
    def step(i, x):
        token = lax.optimization_barrier(op(x))                                # [rows]
        return x.at[:, 0].set(token.astype(x.dtype))

    return looped_us(step, x, calls, reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,5,9,40", help="row counts (B x T)")
    ap.add_argument("--vocab", type=int, default=49152, help="V: the logits per row")
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    print(f"{'rows':>5} {'kernel us':>10} {'xla us':>8} {'xla / kernel':>13}")
    for rows in (int(r) for r in args.rows.split(",")):
        x = jnp.asarray(np.random.default_rng(0).standard_normal((rows, args.vocab)), jnp.float32)
        loop = per_call_us(lambda x: x[:, 1].astype(jnp.int32), x, args.calls, args.reps)
        kernel = per_call_us(greedy_token_cpu, x, args.calls, args.reps) - loop
        xla = per_call_us(greedy_token_reference, x, args.calls, args.reps) - loop
        print(f"{rows:5d} {kernel:10.2f} {xla:8.2f} {xla / kernel:13.2f}", flush=True)


if __name__ == "__main__":
    main()
