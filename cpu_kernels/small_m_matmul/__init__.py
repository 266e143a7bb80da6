"""Small-M matmul on CPU: y [M, N] = x [M, K] @ w for the few rows of a decode step or a verify pass.

The CPU backend of specjax.ops.linear (registered as "cpu_kernel"): the kernel where it applies (CPU, float32,
min_rows() <= M <= MAX_ROWS, fewer rows for w [N, K], the shapes it tiles), the op's definition (XLA's dot)
elsewhere. The kernel itself: `small_m_matmul(x, w, transposed=False, *, parts=None)` and one function per weight
format of specjax.models.weights.

Why: at 2-9 rows XLA:CPU hands a matmul to a general GEMM (YNNPACK) that reads the weights several times over,
so a verify pass of k + 1 positions cost far more than a one-position step although both read the same weight
bytes. The kernel streams each weight element from memory once and uses it for all M rows; for a few rows of
w [K, N] each core streams a contiguous half of w's rows (one core alone reads memory at about half the rate of
two, and strided reads lose the hardware prefetchers), the two halves' sums added at the end.

Exactness: every output element is the same sequence of float32 operations whatever M, the thread split and the
number of cores (w [K, N]: fused multiply-add chains over w's two halves of rows, then their sum), so a row is
bit-identical whichever rows share its call (a tree's node in a 9-node verify and in a 5-node one; XLA's
dot gives no such promise between its paths). Against XLA's dot the results differ by float32 rounding only.

  x  [M, K] float32;  w [K, N] float32 (transposed: w [N, K], read as w.T; a tied LM head's embed [V, H])
  nn needs N % 16 == 0, nt needs K % 16 == 0 (the others fall back to XLA).
Gradients: the op definition's (specjax.ops.backends.reference_gradient). SPECJAX_LINEAR_BACKEND=xla
(specjax.settings) turns the kernel off.

Rearranged weights: `PanelMatrix` holds w [K, N] float32 in 16-column panels, each half of its rows one contiguous
block (load_model's default on a CPU): the same values and bit-identical products, but each core streams its half
in order where a row-major w puts a strip's consecutive rows a page apart (beyond the hardware prefetchers).

Quantized weights: `Q4_1Matrix` holds w [K, N] as llama.cpp's Q4_1 blocks (0.75 bytes per weight instead of 4),
`Q8_0Matrix` w [N, K] (transposed products: a tied LM head) as Q8_0 blocks (1.125 bytes); the op takes either in
place of w. The kernel dequantizes in cache or registers and sums with the float32 code, so the product is
bit-identical to the float32 kernel's over the dequantized w (scale * q is exact in float32); where the kernel does
not apply, w is dequantized in XLA and XLA's dot takes it.

`Q4_1Int8Matrix` and `Q8_0Int8Matrix` hold the same blocks for another product: llama.cpp's own arithmetic (x's
rows quantized to 8 bits per block of 32, exact integer dot products, one float scaling per block), a quarter of
the float32 work per weight, NOT the float32 product (lossy against it, like llama.cpp itself); their rows are
bit-identical whatever M.
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels import build
from specjax.models.weights import PanelMatrix, Q4_1Int8Matrix, Q4_1Matrix, Q8_0Int8Matrix, Q8_0Matrix
from specjax.ops import Backend, linear_reference, register_backend

__all__ = ["MAX_ROWS", "MAX_ROWS_TRANSPOSED", "XLA_GEMM_MAX_ROWS", "applies", "cores", "min_rows", "small_m_matmul",
           "small_m_matmul_panels", "small_m_matmul_q4_1", "small_m_matmul_q4_1_int8", "small_m_matmul_q8_0",
           "small_m_matmul_q8_0_int8"]

# Measured on a 2-core AVX-512 CPU over weights streamed from memory: the kernel was as fast as XLA's GEMM or faster
# up to MAX_ROWS rows (nn); nt's blocks hold fewer rows, and XLA's GEMM was the faster path for 17-64 of them. Above
# XLA_GEMM_MAX_ROWS rows XLA's GEMM ran 2-3x slower per row than at 64 (jaxlib 0.10), so both take the kernel there.
MAX_ROWS = 192
MAX_ROWS_TRANSPOSED = 16
XLA_GEMM_MAX_ROWS = 64
LANES = 16             # the kernel's column (nn) or K (nt) granule
# A PanelMatrix product of MAX_ROWS < M <= this many rows runs through the kernel MAX_ROWS rows at a time; more rows
# take XLA's dot over the row-major values (a 2-core AVX2 CPU, the toy target's forward at 2048 rows: the chunks
# were 10-15% slower than XLA's GEMM; at a few hundred rows XLA's copy out of the panels dominated).
PANELS_CHUNKED_MAX_ROWS = 1024


def min_rows() -> int:
    """The fewest rows the kernel takes: 1 with two or more cores, else 2. One row: the kernel beat XLA's
    matrix-vector path on two cores (both targets' decode step) but lost to it on one (Eigen's single-thread GEMV
    streamed the weights faster)."""
    return 1 if cores() > 1 else 2


def applies(x_shape, w_shape, dtype, transposed: bool = False, quantized: bool = False) -> str | None:
    """Why the kernel cannot take this product (None: it can). Static: shapes and dtypes only. quantized: w is
    in blocks (Q4_1Matrix, Q8_0Matrix), which the kernel takes at any row count up to MAX_ROWS (XLA's GEMM, faster
    over float32 w [N, K] at 17-64 rows, would need the weights dequantized first)."""
    if jnp.dtype(dtype) != jnp.float32:
        return f"dtype {jnp.dtype(dtype)} (the kernel is float32)"
    M = int(np.prod(x_shape[:-1]))
    if (transposed and not quantized
            and not (min_rows() <= M <= MAX_ROWS_TRANSPOSED or XLA_GEMM_MAX_ROWS < M <= MAX_ROWS)):
        return (f"{M} rows (the kernel takes {min_rows()}..{MAX_ROWS_TRANSPOSED} or {XLA_GEMM_MAX_ROWS + 1}.."
                f"{MAX_ROWS} for w [N, K] here)")
    if (quantized or not transposed) and not min_rows() <= M <= MAX_ROWS:
        return f"{M} rows (the kernel takes {min_rows()}..{MAX_ROWS} here)"
    K, N = (w_shape[1], w_shape[0]) if transposed else w_shape
    if (K if transposed else N) % LANES:
        return f"{'K' if transposed else 'N'} = {K if transposed else N} not a multiple of {LANES}"
    return None


def small_m_matmul(x: jax.Array, w: jax.Array, transposed: bool = False, *, parts: int | None = None) -> jax.Array:
    """The kernel itself (CPU only): x [M, K] @ w -> [M, N]. parts: the threads the work is spread over (default:
    the machine's cores: the calling thread and XLA's intra-op pool; w [N, K]: as many column ranges, w [K, N]: two
    halves of w's rows times parts // 2 column ranges). The result does not depend on it."""
    target = _built()
    if x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"small_m_matmul takes x [M, K] and w 2-D, got {x.shape} and {w.shape}")
    K, N = (w.shape[1], w.shape[0]) if transposed else w.shape
    if x.shape[1] != K:
        raise ValueError(f"x has K = {x.shape[1]}, w has K = {K} ({'[N, K]' if transposed else '[K, N]'})")
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], N), jnp.float32), vmap_method="sequential")
    return call(x, w, transposed=transposed, parts=np.int64(parts or cores()))


def small_m_matmul_panels(x: jax.Array, w: PanelMatrix, *, parts: int | None = None) -> jax.Array:
    """The kernel over a PanelMatrix (CPU only): x [M, K] @ w -> [M, N], bit-identical to small_m_matmul(x,
    w.dequantize()) for every M, parts and core count."""
    return _block_product("small_m_matmul_panels", build.PANELS_TARGET, x, w, parts)


def small_m_matmul_q4_1_int8(x: jax.Array, w: Q4_1Int8Matrix, *, parts: int | None = None) -> jax.Array:
    """x [M, K] @ w in llama.cpp's Q4_1 x Q8_1 arithmetic (CPU only; any M): specjax.models.weights.q4_1_int8_reference up to the float
    rounding of its last sum; every row bit-identical whatever M, parts and core count."""
    return _block_product("small_m_matmul_q4_1_int8", build.Q4_1_INT8_TARGET, x, w, parts)


def small_m_matmul_q8_0_int8(x: jax.Array, w: Q8_0Int8Matrix, *, parts: int | None = None) -> jax.Array:
    """x [M, K] @ w.T in llama.cpp's Q8_0 x Q8_0 arithmetic (CPU only; any M): specjax.models.weights.q8_0_int8_reference up to the float
    rounding of its last sum; every row bit-identical whatever M, parts and core count."""
    return _block_product("small_m_matmul_q8_0_int8", build.Q8_0_INT8_TARGET, x, w, parts)


def small_m_matmul_q8_0(x: jax.Array, w: Q8_0Matrix, *, parts: int | None = None) -> jax.Array:
    """The kernel over Q8_0 rows (CPU only): x [M, K] @ w.T -> [M, N], bit-identical to small_m_matmul(x,
    w.dequantize(), transposed=True)."""
    return _block_product("small_m_matmul_q8_0", build.Q8_0_TARGET, x, w, parts)


def small_m_matmul_q4_1(x: jax.Array, w: Q4_1Matrix, *, parts: int | None = None) -> jax.Array:
    """The kernel over Q4_1 blocks (CPU only): x [M, K] @ w -> [M, N], bit-identical to small_m_matmul(x,
    w.dequantize()) for every M, parts and core count."""
    return _block_product("small_m_matmul_q4_1", build.Q4_1_TARGET, x, w, parts)


def _block_product(name: str, target: str, x: jax.Array, w, parts: int | None) -> jax.Array:
    """The kernel `target` over quantized blocks w (a NamedTuple of arrays, the FFI call's operands in order):
    x [M, K] float32 -> [M, N]; w [N, K] for the transposed kinds (Q8_0)."""
    _built()
    transposed = isinstance(w, (Q8_0Matrix, Q8_0Int8Matrix))
    N, K = w.shape if transposed else w.shape[::-1]
    if x.ndim != 2 or x.shape[1] != K:
        raise ValueError(f"{name} takes x [M, {K}] for w {[N, K] if transposed else [K, N]}, got x {x.shape}")
    if x.dtype != jnp.float32:
        raise ValueError(f"{name} takes float32 x, got {x.dtype}")
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], N), jnp.float32), vmap_method="sequential")
    return call(x, *w, parts=np.int64(parts or cores()))


def _built() -> str:
    """The float32 kernel's FFI target (the quantized ones register with it); a clear error where none was built."""
    return build.require()


def cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


_BLOCKS = {Q4_1Matrix: small_m_matmul_q4_1, Q8_0Matrix: small_m_matmul_q8_0, PanelMatrix: small_m_matmul_panels,
           Q4_1Int8Matrix: small_m_matmul_q4_1_int8, Q8_0Int8Matrix: small_m_matmul_q8_0_int8}


def _product(x: jax.Array, w, transposed: bool) -> jax.Array:
    """The kernel over x [M, K] for w's format."""
    product = _BLOCKS.get(type(w))
    return small_m_matmul(x, w, transposed) if product is None else product(x, w)


def _takes(x: jax.Array, w, *, transposed: bool) -> bool:
    """The products the kernel takes: float32 rows within its row counts and tiles (applies), a PanelMatrix product
    of up to PANELS_CHUNKED_MAX_ROWS rows (a prefill: MAX_ROWS rows at a time), and every product of the blocks
    packed for 8-bit activations (their own arithmetic at any row count)."""
    if isinstance(w, (Q4_1Int8Matrix, Q8_0Int8Matrix)):
        return x.dtype == jnp.float32
    rows = int(np.prod(x.shape[:-1]))
    if isinstance(w, PanelMatrix) and MAX_ROWS < rows <= PANELS_CHUNKED_MAX_ROWS:
        return x.dtype == w.dtype and applies((MAX_ROWS, x.shape[-1]), w.shape, x.dtype) is None
    quantized = isinstance(w, (Q4_1Matrix, Q8_0Matrix))
    return x.dtype == w.dtype and applies(x.shape, w.shape, x.dtype, transposed, quantized) is None


def _linear(x: jax.Array, w, *, transposed: bool) -> jax.Array:
    """specjax.ops.linear on the kernel: x [..., K] @ w -> [..., N]."""
    lead, K = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, K)
    rows = flat.shape[0]
    if isinstance(w, PanelMatrix) and rows > MAX_ROWS:
        # A prefill: MAX_ROWS rows at a time through the kernel (each row as it would be alone), rather than XLA's
        # dot over the row-major values, which copies every matrix out of its panels on every call. Past
        # PANELS_CHUNKED_MAX_ROWS (a training batch) XLA's GEMM is faster per row and the copy is amortized.
        pieces = [flat[i:i + MAX_ROWS] for i in range(0, rows, MAX_ROWS)]
        out = jnp.concatenate([_product(p, w, False) if applies(p.shape, w.shape, p.dtype) is None
                               else linear_reference(p, w) for p in pieces], axis=0)
        return out.reshape(*lead, -1)
    return _product(flat, w, transposed).reshape(*lead, -1)


register_backend("linear", Backend("cpu_kernel", _linear, platforms=("cpu",), takes=_takes, available=build.available))
