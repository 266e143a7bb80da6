"""Benchmark the small-M CPU matmul kernel against XLA's dot, with the weights streamed from memory as in a forward.

For each weight shape, --layers distinct matrices (together larger than the caches) are multiplied one after the
other in one jit, each product feeding the next input, so every call reads its weights from memory; per M it prints
the time per matrix, the weight bandwidth reached, and the cost relative to M = 1, for the kernel and for XLA.

  python -m cpu_kernels.bench.bench_small_m_matmul                                   # SmolLM2-135M's shapes
  python -m cpu_kernels.bench.bench_small_m_matmul --rows 1,5,9,40 --shapes nn:576x1536 --parts 1
  python -m cpu_kernels.bench.bench_small_m_matmul --shapes q4_1:576x1536,q4_1:1536x576   # Q4_1 blocks
  python -m cpu_kernels.bench.bench_small_m_matmul --shapes q4_1_int8:576x1536       # llama.cpp's arithmetic
  python -m cpu_kernels.bench.bench_small_m_matmul --shapes q8_0:49152x576           # a Q8_0 tied LM head
  python -m cpu_kernels.bench.bench_small_m_matmul --shapes panels:576x576            # w in 16-column panels

For q4_1 shapes the first columns are the kernel over Q4_1 blocks and the last the float32 kernel over the same
dequantized weights (q8_0, w [N, K] read transposed: the kernel over Q8_0 blocks, then the float32 kernel over the
same weights dequantized); for q4_1_int8 the first are the same blocks with 8-bit activations and integer dot products
(small_m_matmul_q4_1_int8) and the last the exact Q4_1 kernel (GB/s: float32 bytes the product stands for, per
second; each streams --megabytes of its own storage).
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import numpy as np

from cpu_kernels.bench import fastest
from cpu_kernels.small_m_matmul import (small_m_matmul, small_m_matmul_panels, small_m_matmul_q4_1,
                                       small_m_matmul_q4_1_int8, small_m_matmul_q8_0)
from specjax.models.weights import PanelMatrix, Q4_1Int8Matrix, Q4_1Matrix, Q8_0Matrix
from specjax.ops import linear_reference


def chained(product, rows: int, K: int):
    """One jit over all the matrices: the next input depends on the last product (nothing is hoisted)."""
    def run(x, ws):
        for w in ws:
            y = product(x, w)
            x = x + 1e-9 * jnp.sum(y, axis=1, keepdims=True)        # [rows, K]
        return x
    return jax.jit(run)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="nn:576x1536,nn:1536x576,nt:49152x576",
                    help="form:AxB: nn w [K, N] = AxB; nt w [N, K] = AxB (a tied LM head); q4_1 w [K, N] as Q4_1; "
                         "q4_1_int8 the same blocks times 8-bit activations")
    ap.add_argument("--rows", default="1,2,3,5,9,17,40", help="M values")
    ap.add_argument("--megabytes", type=float, default=400, help="weight bytes streamed per call, in MB")
    ap.add_argument("--parts", type=int, default=None, help="the kernel's thread split (default: the cores)")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    print(f"{'shape':>16} {'M':>3} {'kernel ms':>9} {'GB/s':>6} {'vs M=1':>6} {'xla ms':>8} {'GB/s':>6} {'vs M=1':>6}"
          "   (q4_1, q8_0, panels: the second is the float32 kernel over row-major w; q4_1_int8: the exact Q4_1 "
          "kernel)")
    for spec in a.shapes.split(","):
        form, dims = spec.split(":")
        A, B = (int(d) for d in dims.split("x"))
        transposed, quantized = form in ("nt", "q8_0"), form in ("q4_1", "q4_1_int8")
        K = B if transposed else A
        stored_bytes = {"q4_1": 0.75, "q4_1_int8": 0.75, "q8_0": 1.125}.get(form, 4)     # per weight
        layers = max(1, int(a.megabytes * 1e6 // (A * B * stored_bytes)))
        if form == "q8_0":
            rng = np.random.default_rng(0)
            ws = [Q8_0Matrix(jnp.asarray(rng.integers(-127, 128, (A, B), dtype=np.int8)),
                             jnp.asarray(rng.standard_normal((A, B // 32)).astype(np.float32) * 1e-2))
                  for _ in range(layers)]
            dense = [w.dequantize() for w in ws[:max(1, int(a.megabytes * 1e6 // (A * B * 4)))]]
            candidates = (("exact", lambda x, w: small_m_matmul_q8_0(x, w, parts=a.parts), ws),
                          ("kernel", lambda x, w: small_m_matmul(x, w, True, parts=a.parts), dense))
        elif quantized:
            rng = np.random.default_rng(0)
            blocks = [Q4_1Matrix.from_blocks(rng.integers(0, 16, (A, B), dtype=np.uint8),
                                             rng.standard_normal((A // 32, B)).astype(np.float32) * 1e-2,
                                             rng.standard_normal((A // 32, B)).astype(np.float32) * 1e-2)
                      for _ in range(layers)]
            ws = [Q4_1Matrix(*map(jnp.asarray, b)) for b in blocks]
            exact = ("exact", lambda x, w: small_m_matmul_q4_1(x, w, parts=a.parts), ws)
            if form == "q4_1_int8":
                packed = [Q4_1Int8Matrix(*map(jnp.asarray, Q4_1Int8Matrix.from_q4_1(b))) for b in blocks]
                candidates = (("int8", lambda x, w: small_m_matmul_q4_1_int8(x, w, parts=a.parts), packed), exact)
            else:
                dense = [w.dequantize() for w in ws[:max(1, int(a.megabytes * 1e6 // (A * B * 4)))]]
                candidates = (exact, ("xla", lambda x, w: small_m_matmul(x, w, parts=a.parts), dense))
        elif form == "panels":
            ws = [jax.random.normal(jax.random.PRNGKey(i), (A, B), jnp.float32) for i in range(layers)]
            panels = [PanelMatrix(jnp.asarray(PanelMatrix.from_dense(w).panels)) for w in ws]
            candidates = (("panels", lambda x, w: small_m_matmul_panels(x, w, parts=a.parts), panels),
                          ("kernel", lambda x, w: small_m_matmul(x, w, parts=a.parts), ws))
        else:
            ws = [jax.random.normal(jax.random.PRNGKey(i), (A, B), jnp.float32) for i in range(layers)]
            candidates = (("kernel", lambda x, w: small_m_matmul(x, w, transposed, parts=a.parts), ws),
                          ("xla", lambda x, w: linear_reference(x, w, transposed), ws))
        first = {}
        for M in (int(m) for m in a.rows.split(",")):
            x = jax.random.normal(jax.random.PRNGKey(M), (M, K), jnp.float32)
            cells = []
            for name, product, mats in candidates:
                s = fastest(chained(product, M, K), x, mats, reps=a.reps) / len(mats)
                first.setdefault(name, s)
                cells += [s * 1e3, A * B * 4 / s / 1e9, s / first[name]]
            print(f"{spec:>16} {M:>3} {cells[0]:9.3f} {cells[1]:6.1f} {cells[2]:6.2f} {cells[3]:8.3f} {cells[4]:6.1f} "
                  f"{cells[5]:6.2f}", flush=True)


if __name__ == "__main__":
    main()
