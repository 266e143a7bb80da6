"""Small-M matmul on CPU: y [M, N] = x [M, K] @ w for the few rows of a decode step or a verify pass.

Public entry: `small_m_matmul(x, w, transposed=False, *, parts=None)`; `matmul(x, w, transposed=False)` is what the
models call: the kernel where it applies (CPU, float32, min_rows() <= M <= MAX_ROWS, fewer rows for w [N, K], the
shapes it tiles), XLA's dot elsewhere.

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
Gradients: the backward pass is XLA's (the kernel is for inference; a custom VJP makes it safe under jax.grad).
SPECJAX_SMALL_M_MATMUL=0 turns the kernel off (every call takes XLA's dot).

Rearranged weights: `PanelMatrix` holds w [K, N] float32 in 16-column panels, each half of its rows one contiguous
block (load_model's default on a CPU): the same values and bit-identical products, but each core streams its half
in order where a row-major w puts a strip's consecutive rows a page apart (beyond the hardware prefetchers).

Quantized weights: `Q4_1Matrix` holds w [K, N] as llama.cpp's Q4_1 blocks (0.75 bytes per weight instead of 4),
`Q8_0Matrix` w [N, K] (transposed products: a tied LM head) as Q8_0 blocks (1.125 bytes); `matmul` takes either in
place of w. The kernel dequantizes in cache or registers and sums with the float32 code, so the product is
bit-identical to the float32 kernel's over the dequantized w (scale * q is exact in float32); where the kernel does
not apply, w is dequantized in XLA and XLA's dot takes it.

`Q4_1Int8Matrix` and `Q8_0Int8Matrix` hold the same blocks for another product: llama.cpp's own arithmetic (x's
rows quantized to 8 bits per block of 32, exact integer dot products, one float scaling per block), a quarter of
the float32 work per weight, NOT the float32 product (lossy against it, like llama.cpp itself); their rows are
bit-identical whatever M.
"""
from __future__ import annotations

import functools
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels import build
from cpu_kernels.small_m_matmul.reference import (dequantize_q4_1, dequantize_q8_0, q4_1_int8_reference,
                                                  q8_0_int8_reference, small_m_matmul_reference, unpack_panels)

__all__ = ["MAX_ROWS", "MAX_ROWS_TRANSPOSED", "PanelMatrix", "Q4_1Int8Matrix", "Q4_1Matrix", "Q8_0Int8Matrix",
           "Q8_0Matrix", "XLA_GEMM_MAX_ROWS", "applies", "cores", "matmul", "min_rows", "small_m_matmul",
           "small_m_matmul_panels", "small_m_matmul_q4_1", "small_m_matmul_q4_1_int8", "small_m_matmul_q8_0",
           "small_m_matmul_q8_0_int8", "small_m_matmul_reference"]

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
    if _turned_off():
        return "turned off by SPECJAX_SMALL_M_MATMUL=0"
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


def _float32(blocks) -> jnp.dtype:
    """What quantized blocks stand for: a float32 matrix."""
    return jnp.dtype(jnp.float32)


def _stored_bytes(blocks) -> int:
    """The bytes quantized blocks occupy (what a product reads)."""
    return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in blocks)


class PanelMatrix(NamedTuple):
    """w [K, N] float32 with its values rearranged for the kernel: each half of w's rows, [0, K / 2) and [K / 2, K),
    by panels of 16 columns, a panel's rows consecutive. The same values and the same sums as the row-major w
    (bit-identical products), but each core streams one contiguous block, where the row-major w puts a strip's
    rows a page apart. A pytree: it travels through jit like the array it stands for, and `matmul` takes it in
    place of w; XLA's dot (no kernel, or more rows than it takes) reads it back row-major first."""
    panels: jax.Array       # float32 [2, N / 16, K / 2, 16]

    @property
    def shape(self) -> tuple[int, int]:
        return 2 * self.panels.shape[2], 16 * self.panels.shape[1]

    @property
    def dtype(self) -> jnp.dtype:
        return self.panels.dtype

    nbytes = property(_stored_bytes)

    def dequantize(self) -> jax.Array:
        """The row-major w [K, N] (the name quantized blocks share: what the product stands for)."""
        return unpack_panels(self.panels)

    @classmethod
    def from_dense(cls, w) -> "PanelMatrix":
        """Row-major w [K, N] (K even, N % 16 == 0) -> its panels (numpy arrays: a load-time transform)."""
        w = np.asarray(w)
        if w.ndim != 2 or w.dtype != np.float32:
            raise ValueError(f"a PanelMatrix holds a 2-D float32 w, got {w.dtype} {list(w.shape)}")
        K, N = w.shape
        if K % 2 or N % 16:
            raise ValueError(f"a PanelMatrix needs K even and N % 16 == 0, got [{K}, {N}]")
        return cls(np.ascontiguousarray(_panels_of(w)))

    @classmethod
    def from_dense_traced(cls, w: jax.Array) -> "PanelMatrix":
        """from_dense in jnp (inside a trace: a gradient with respect to w, laid out as w is)."""
        return cls(_panels_of(w))

    @classmethod
    def concatenate(cls, parts: "list[PanelMatrix]") -> "PanelMatrix":
        """[w_1 | w_2 | ...] along N: one product in place of several over the same x, each column computed exactly
        as in its own matrix's product."""
        if len({p.shape[0] for p in parts}) != 1:
            raise ValueError(f"matrices concatenated along N need one K, got {[p.shape for p in parts]}")
        return cls(np.concatenate([np.asarray(p.panels) for p in parts], axis=1))


def _panels_of(w):
    """w [K, N] (numpy or jax) -> [2, N / 16, K / 2, 16]: PanelMatrix's arrangement (unpack_panels undoes it)."""
    K, N = w.shape
    return w.reshape(2, K // 2, N // 16, 16).transpose(0, 2, 1, 3)


def small_m_matmul_panels(x: jax.Array, w: PanelMatrix, *, parts: int | None = None) -> jax.Array:
    """The kernel over a PanelMatrix (CPU only): x [M, K] @ w -> [M, N], bit-identical to small_m_matmul(x,
    w.dequantize()) for every M, parts and core count."""
    return _block_product("small_m_matmul_panels", build.PANELS_TARGET, x, w, parts)


class Q4_1Matrix(NamedTuple):
    """w [K, N] float32 stored as llama.cpp's Q4_1 blocks along K (32 rows of one column per block):
    w[k, n] = scale[k // 32, n] * q[k, n] + minimum[k // 32, n], q in 0..15. A pytree: it travels through jit like
    the array it stands for, and `matmul` takes it in place of w."""
    nibbles: jax.Array      # uint8 [K, N / 2]: byte (k, 16 g + j) = q[k, 32 g + j] | q[k, 32 g + 16 + j] << 4
    scale: jax.Array        # float32 [K / 32, N]
    minimum: jax.Array      # float32 [K / 32, N]

    BLOCK = 32

    @property
    def shape(self) -> tuple[int, int]:
        return self.nibbles.shape[0], 2 * self.nibbles.shape[1]

    dtype = property(_float32)
    nbytes = property(_stored_bytes)

    def dequantize(self) -> jax.Array:
        """The float32 w [K, N] these blocks hold."""
        return dequantize_q4_1(self.nibbles, self.scale, self.minimum)

    @classmethod
    def concatenate(cls, parts: "list[Q4_1Matrix]") -> "Q4_1Matrix":
        """[w_1 | w_2 | ...] along N (numpy arrays): one product in place of several over the same x, each
        column computed exactly as in its own matrix's product."""
        if len({p.shape[0] for p in parts}) != 1:
            raise ValueError(f"Q4_1 matrices concatenated along N need one K, got {[p.shape for p in parts]}")
        return cls(*(np.concatenate([np.asarray(p[i]) for p in parts], axis=1) for i in range(3)))

    @classmethod
    def from_blocks(cls, q: np.ndarray, scale: np.ndarray, minimum: np.ndarray) -> "Q4_1Matrix":
        """q uint8 [K, N] in 0..15, scale / minimum float32 [K / 32, N] -> the packed matrix (numpy arrays)."""
        q = np.asarray(q)
        K, N = q.shape
        if K % cls.BLOCK or N % 32:
            raise ValueError(f"a Q4_1 matrix needs K % {cls.BLOCK} == 0 and N % 32 == 0, got [{K}, {N}]")
        if np.shape(scale) != (K // cls.BLOCK, N) or np.shape(minimum) != (K // cls.BLOCK, N):
            raise ValueError(f"scale and minimum must be [{K // cls.BLOCK}, {N}] for q [{K}, {N}], got "
                             f"{list(np.shape(scale))} and {list(np.shape(minimum))}")
        if q.dtype != np.uint8 or q.max(initial=0) > 15:
            raise ValueError("q must be uint8 values in 0..15")
        g = q.reshape(K, N // 32, 2, 16)
        nibbles = (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(K, N // 2)
        return cls(np.ascontiguousarray(nibbles), np.ascontiguousarray(scale, np.float32),
                   np.ascontiguousarray(minimum, np.float32))


class Q8_0Matrix(NamedTuple):
    """w [N, K] float32 (read transposed: a tied LM head's embed [V, H]) stored as llama.cpp's Q8_0 blocks along K:
    w[n, k] = scale[n, k // 32] * values[n, k]. A pytree; `matmul(x, w, transposed=True)` takes it."""
    values: jax.Array       # int8 [N, K]
    scale: jax.Array        # float32 [N, K / 32]

    BLOCK = 32

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)

    dtype = property(_float32)
    nbytes = property(_stored_bytes)

    def dequantize(self) -> jax.Array:
        """The float32 w [N, K] these blocks hold."""
        return dequantize_q8_0(self.values, self.scale)


class Q4_1Int8Matrix(NamedTuple):
    """The blocks of a Q4_1Matrix packed for integer dot products against 8-bit activations (llama.cpp's Q4_1 x Q8_1
    arithmetic, `small_m_matmul_q4_1_int8`): not the float32 product over the dequantized w. A pytree."""
    packed: jax.Array       # uint8 [N / 16, K / 8, 64]: by 16-column panels (reference.unpack_q4_1_int8)
    scale: jax.Array        # float32 [K / 32, N]
    minimum: jax.Array      # float32 [K / 32, N]

    @property
    def shape(self) -> tuple[int, int]:
        return 8 * self.packed.shape[1], 16 * self.packed.shape[0]

    dtype = property(_float32)
    nbytes = property(_stored_bytes)

    @classmethod
    def from_q4_1(cls, w: Q4_1Matrix) -> "Q4_1Int8Matrix":
        """The same blocks repacked (numpy arrays)."""
        nibbles = np.asarray(w.nibbles)
        K, N = w.shape
        b = nibbles.reshape(K, N // 32, 16)
        q = np.concatenate([b & 15, b >> 4], axis=-1).reshape(K // 8, 2, 4, N // 16, 16)   # [o, half, j, p, n]
        q = q.transpose(3, 0, 1, 4, 2)                                                        # [p, o, half, n, j]
        packed = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(N // 16, K // 8, 64)
        return cls(np.ascontiguousarray(packed), np.asarray(w.scale), np.asarray(w.minimum))


def small_m_matmul_q4_1_int8(x: jax.Array, w: Q4_1Int8Matrix, *, parts: int | None = None) -> jax.Array:
    """x [M, K] @ w in llama.cpp's Q4_1 x Q8_1 arithmetic (CPU only; any M): q4_1_int8_reference up to the float
    rounding of its last sum; every row bit-identical whatever M, parts and core count."""
    return _block_product("small_m_matmul_q4_1_int8", build.Q4_1_INT8_TARGET, x, w, parts)


class Q8_0Int8Matrix(NamedTuple):
    """The rows of a Q8_0Matrix (w [N, K], read transposed) packed for integer dot products against 8-bit
    activations (llama.cpp's Q8_0 x Q8_0 arithmetic, `small_m_matmul_q8_0_int8`). A pytree."""
    packed: jax.Array       # uint8 [N / 16, K / 4, 64]: by 16-row panels, q + 128 (reference.unpack_q8_0_int8)
    scale: jax.Array        # float32 [K / 32, N]

    @property
    def shape(self) -> tuple[int, int]:
        return 16 * self.packed.shape[0], 4 * self.packed.shape[1]

    dtype = property(_float32)
    nbytes = property(_stored_bytes)

    @classmethod
    def from_q8_0(cls, w: Q8_0Matrix) -> "Q8_0Int8Matrix":
        """The same blocks repacked (numpy arrays); N must be a multiple of 16."""
        values = np.asarray(w.values)
        N, K = values.shape
        if N % 16:
            raise ValueError(f"a Q8_0Int8Matrix needs N % 16 == 0, got [{N}, {K}]")
        u = (values.astype(np.int16) + 128).astype(np.uint8).reshape(N // 16, 16, K // 4, 4)   # [p, n, r, j]
        packed = u.transpose(0, 2, 1, 3).reshape(N // 16, K // 4, 64)
        return cls(np.ascontiguousarray(packed), np.ascontiguousarray(np.asarray(w.scale).T))


def small_m_matmul_q8_0_int8(x: jax.Array, w: Q8_0Int8Matrix, *, parts: int | None = None) -> jax.Array:
    """x [M, K] @ w.T in llama.cpp's Q8_0 x Q8_0 arithmetic (CPU only; any M): q8_0_int8_reference up to the float
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


def _turned_off() -> bool:
    """SPECJAX_SMALL_M_MATMUL=0: every product takes XLA's dot (quantized blocks: their jnp reference)."""
    return build.turned_off("SPECJAX_SMALL_M_MATMUL")


def cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _differentiable_kernel(x, w, transposed):
    return small_m_matmul(x, w, transposed)


def _kernel_forward(x, w, transposed):
    return small_m_matmul(x, w, transposed), (x, w)


def _kernel_backward(transposed, residuals, g):
    x, w = residuals
    return (g @ w, g.T @ x) if transposed else (g @ w.T, x.T @ g)


_differentiable_kernel.defvjp(_kernel_forward, _kernel_backward)


@jax.custom_vjp
def _differentiable_panels(x, w):
    return small_m_matmul_panels(x, w)


def _panels_forward(x, w):
    return small_m_matmul_panels(x, w), (x, w)


def _panels_backward(residuals, g):
    x, w = residuals
    dense = w.dequantize()
    return g @ dense.T, PanelMatrix.from_dense_traced(x.T @ g)


_differentiable_panels.defvjp(_panels_forward, _panels_backward)


def matmul(x: jax.Array, w: jax.Array | PanelMatrix | Q4_1Matrix | Q4_1Int8Matrix | Q8_0Matrix | Q8_0Int8Matrix,
           transposed: bool = False) -> jax.Array:
    """x [..., K] @ w [K, N] (transposed: w [N, K]) -> [..., N]: the kernel on CPU where `applies`, else XLA's dot.
    With an accelerator as the default backend nothing is built and XLA's dot is traced; a CPU program lowered
    for another platform lowers XLA's dot there (lax.platform_dependent). w may be a Q4_1Matrix (nn) or a Q8_0Matrix
    (transposed); XLA's dot takes them dequantized. A Q4_1Int8Matrix (nn) or Q8_0Int8Matrix (transposed) is its
    own product at every row count (the kernel, else its reference)."""
    if isinstance(w, Q4_1Matrix) and transposed:
        raise ValueError("a Q4_1Matrix is w [K, N]; transposed products take a float32 w")
    if isinstance(w, PanelMatrix) and transposed:
        raise ValueError("a PanelMatrix is w [K, N]; transposed products take a float32 w")
    if isinstance(w, Q8_0Matrix) and not transposed:
        raise ValueError("a Q8_0Matrix is w [N, K], read transposed (matmul(x, w, transposed=True))")
    if isinstance(w, (Q4_1Int8Matrix, Q8_0Int8Matrix)):
        return _int8_product(x, w, transposed)
    rows = int(np.prod(x.shape[:-1]))
    if isinstance(w, PanelMatrix) and MAX_ROWS < rows <= PANELS_CHUNKED_MAX_ROWS and applies(
            (MAX_ROWS, x.shape[-1]), w.shape, x.dtype) is None and x.dtype == w.dtype:
        # A prefill: MAX_ROWS rows at a time through the kernel (each row as it would be alone), rather than XLA's
        # dot over the row-major values, which copies every matrix out of its panels on every call. Past
        # PANELS_CHUNKED_MAX_ROWS (a training batch) XLA's GEMM is faster per row and the copy is amortized.
        flat = x.reshape(rows, x.shape[-1])
        pieces = [matmul(flat[i:i + MAX_ROWS], w) for i in range(0, rows, MAX_ROWS)]
        return jnp.concatenate(pieces, axis=0).reshape(*x.shape[:-1], -1)
    quantized = isinstance(w, (Q4_1Matrix, Q8_0Matrix))
    rearranged = quantized or isinstance(w, PanelMatrix)
    reference = lambda x, w: small_m_matmul_reference(x, w.dequantize() if rearranged else w, transposed)
    usable = x.dtype == w.dtype and applies(x.shape, w.shape, x.dtype, transposed, quantized) is None
    product = {Q4_1Matrix: small_m_matmul_q4_1, Q8_0Matrix: small_m_matmul_q8_0,
               PanelMatrix: _differentiable_panels}.get(
        type(w), lambda x, w: _differentiable_kernel(x, w, transposed))
    lead = x.shape[:-1]
    kernel = lambda x, w: product(x.reshape(-1, x.shape[-1]), w).reshape(*lead, -1)
    return build.kernel_or_reference(kernel, reference, x, w, usable=usable)


def _int8_product(x: jax.Array, w: Q4_1Int8Matrix | Q8_0Int8Matrix, transposed: bool) -> jax.Array:
    """matmul for blocks times 8-bit activations: the kernel at any row count where it is built, else the jnp
    reference (the same arithmetic up to float rounding)."""
    if transposed != isinstance(w, Q8_0Int8Matrix):
        kind = "[N, K], read transposed" if isinstance(w, Q8_0Int8Matrix) else "[K, N]"
        raise ValueError(f"a {type(w).__name__} is w {kind}; got transposed={transposed}")
    if x.dtype != jnp.float32:
        raise ValueError(f"a {type(w).__name__} takes float32 x, got {x.dtype}")
    kernel, same_arithmetic = ((small_m_matmul_q8_0_int8, q8_0_int8_reference) if transposed
                               else (small_m_matmul_q4_1_int8, q4_1_int8_reference))
    lead = x.shape[:-1]
    flat = lambda product: lambda x, w: product(x.reshape(-1, x.shape[-1]), w).reshape(*lead, -1)
    reference = flat(lambda x, w: same_arithmetic(x, *w))
    return build.kernel_or_reference(flat(kernel), reference, x, w, usable=not _turned_off())
