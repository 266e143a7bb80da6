"""Benchmarks of the CPU kernels against XLA (python -m cpu_kernels.bench.<name>), and their shared timing."""
from __future__ import annotations

import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")     # before jax reads it: the benchmarks are of CPU kernels

import jax
from jax import lax


def fastest(fn, *args, reps: int) -> float:
    """The fastest of `reps` timed calls of fn(*args) in seconds, after one untimed call (it compiles)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return min(times)


def looped_us(step, x: jax.Array, calls: int, reps: int) -> float:
    """Microseconds per step of a compiled loop x = step(i, x), `calls` steps long, the fastest of `reps` runs: a
    step that feeds what it computes into its next input keeps XLA from hoisting it out of the loop."""
    run = jax.jit(lambda x: lax.fori_loop(0, calls, step, x))
    return fastest(run, x, reps=reps) / calls * 1e6
