"""The weight formats a model's params may hold in place of a float32 matrix, and what a product with each means.

A linear layer computes x [..., K] @ w. specjax.ops.linear takes w as a float32 array [K, N] (transposed=True: w
[N, K], read as w.T, e.g. a tied LM head's embedding [V, H]) or as one of these formats; each format defines its
product (`product`: the definition every backend of the linear op matches), and a backend registers for the
formats it computes (cpu_kernels: the small-M CPU kernel over each of them). Each format is a pytree (a NamedTuple
of arrays), so it travels through jit like the array it stands for.

  PanelMatrix      w [K, N] float32 rearranged: each half of w's rows by panels of 16 columns (load_model's layout
                   on a CPU; the same values and the same product as the row-major w)
  Q4_1Matrix       w [K, N] as llama.cpp's Q4_1 blocks (0.75 bytes per weight); the product is the float32 product
                   over the dequantized w
  Q8_0Matrix       w [N, K] (read transposed) as llama.cpp's Q8_0 blocks (1.125 bytes per weight); likewise
  Q4_1Int8Matrix   Q4_1 blocks packed for llama.cpp's own arithmetic: x's rows quantized to 8 bits per block of 32,
                   integer dot products, one float scaling per block: NOT the float32 product (lossy against it,
                   like llama.cpp itself; load_model(weight_format="gguf_int8") opts in)
  Q8_0Int8Matrix   the same for Q8_0 rows (read transposed)
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["PanelMatrix", "Q4_1Int8Matrix", "Q4_1Matrix", "Q8_0Int8Matrix", "Q8_0Matrix",
           "check_orientation", "dequantize_q4_1", "dequantize_q8_0", "q4_1_int8_reference", "q8_0_int8_reference",
           "quantize_rows_q8", "unpack_panels", "unpack_q4_1_int8", "unpack_q8_0_int8"]


def check_orientation(w, transposed: bool) -> None:
    """A clear error where a product reads a format the other way round from how it is stored (its class's
    READ_TRANSPOSED: stored [N, K] and read transposed, a tied LM head's embedding; else w [K, N])."""
    stored_transposed = type(w).READ_TRANSPOSED
    if bool(transposed) != stored_transposed:
        stored = "[N, K], read transposed" if stored_transposed else "[K, N]"
        hint = " (linear(x, w, transposed=True))" if stored_transposed else "; transposed products take a float32 w"
        raise ValueError(f"a {type(w).__name__} is w {stored}{hint}; got transposed={transposed}")


def _stored_bytes(blocks) -> int:
    """The bytes a format's arrays occupy (what a product reads)."""
    return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in blocks)


def _flat(product):
    """A product over x [M, K] -> one over x [..., K]."""
    def over_rows(x, *arrays):
        lead = x.shape[:-1]
        return product(x.reshape(-1, x.shape[-1]), *arrays).reshape(*lead, -1)
    return over_rows


def _float32(blocks) -> jnp.dtype:
    """What a format stands for: a float32 matrix."""
    return jnp.dtype(jnp.float32)


class PanelMatrix(NamedTuple):
    """w [K, N] float32 with its values rearranged for the CPU kernel: each half of w's rows, [0, K / 2) and [K / 2, K),
    by panels of 16 columns, a panel's rows consecutive. The same values and the same sums as the row-major w
    (bit-identical products), but each core streams one contiguous block, where the row-major w puts a strip's
    rows a page apart. A pytree: it travels through jit like the array it stands for, and specjax.ops.linear
    takes it in place of w; XLA's dot reads it back row-major first."""
    panels: jax.Array       # float32 [2, N / 16, K / 2, 16]

    @property
    def shape(self) -> tuple[int, int]:
        return 2 * self.panels.shape[2], 16 * self.panels.shape[1]

    @property
    def dtype(self) -> jnp.dtype:
        return self.panels.dtype

    nbytes = property(_stored_bytes)
    READ_TRANSPOSED = False
    check_product = check_orientation

    def dequantize(self) -> jax.Array:
        """The row-major w [K, N] (the name quantized blocks share: what the product stands for)."""
        return unpack_panels(self.panels)

    def product(self, x: jax.Array, transposed: bool = False) -> jax.Array:
        """x [..., K] @ w: the row-major w's product."""
        self.check_product(transposed)
        return x @ self.dequantize()

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


class Q4_1Matrix(NamedTuple):
    """w [K, N] float32 stored as llama.cpp's Q4_1 blocks along K (32 rows of one column per block):
    w[k, n] = scale[k // 32, n] * q[k, n] + minimum[k // 32, n], q in 0..15. A pytree: it travels through jit like
    the array it stands for, and specjax.ops.linear takes it in place of w."""
    nibbles: jax.Array      # uint8 [K, N / 2]: byte (k, 16 g + j) = q[k, 32 g + j] | q[k, 32 g + 16 + j] << 4
    scale: jax.Array        # float32 [K / 32, N]
    minimum: jax.Array      # float32 [K / 32, N]

    BLOCK = 32

    @property
    def shape(self) -> tuple[int, int]:
        return self.nibbles.shape[0], 2 * self.nibbles.shape[1]

    dtype = property(_float32)
    nbytes = property(_stored_bytes)
    READ_TRANSPOSED = False
    check_product = check_orientation

    def dequantize(self) -> jax.Array:
        """The float32 w [K, N] these blocks hold."""
        return dequantize_q4_1(self.nibbles, self.scale, self.minimum)

    def product(self, x: jax.Array, transposed: bool = False) -> jax.Array:
        """x [..., K] @ w: the float32 product over the dequantized w."""
        self.check_product(transposed)
        return x @ self.dequantize()

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
    w[n, k] = scale[n, k // 32] * values[n, k]. A pytree; specjax.ops.linear(x, w, transposed=True) takes it."""
    values: jax.Array       # int8 [N, K]
    scale: jax.Array        # float32 [N, K / 32]

    BLOCK = 32

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)

    dtype = property(_float32)
    nbytes = property(_stored_bytes)
    READ_TRANSPOSED = True
    check_product = check_orientation

    def dequantize(self) -> jax.Array:
        """The float32 w [N, K] these blocks hold."""
        return dequantize_q8_0(self.values, self.scale)

    def product(self, x: jax.Array, transposed: bool = True) -> jax.Array:
        """x [..., K] @ w.T: the float32 product over the dequantized w."""
        self.check_product(transposed)
        return x @ self.dequantize().T


class Q4_1Int8Matrix(NamedTuple):
    """The blocks of a Q4_1Matrix packed for integer dot products against 8-bit activations (llama.cpp's Q4_1 x Q8_1
    arithmetic, `product`): not the float32 product over the dequantized w. A pytree."""
    packed: jax.Array       # uint8 [N / 16, K / 8, 64]: by 16-column panels (unpack_q4_1_int8)
    scale: jax.Array        # float32 [K / 32, N]
    minimum: jax.Array      # float32 [K / 32, N]

    @property
    def shape(self) -> tuple[int, int]:
        return 8 * self.packed.shape[1], 16 * self.packed.shape[0]

    dtype = property(_float32)
    nbytes = property(_stored_bytes)
    READ_TRANSPOSED = False
    check_product = check_orientation

    def product(self, x: jax.Array, transposed: bool = False) -> jax.Array:
        """x [..., K] @ w in llama.cpp's Q4_1 x Q8_1 arithmetic (q4_1_int8_reference)."""
        self.check_product(transposed)
        _float32_activations(self, x)
        return _flat(q4_1_int8_reference)(x, *self)

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


class Q8_0Int8Matrix(NamedTuple):
    """The rows of a Q8_0Matrix (w [N, K], read transposed) packed for integer dot products against 8-bit
    activations (llama.cpp's Q8_0 x Q8_0 arithmetic, `product`). A pytree."""
    packed: jax.Array       # uint8 [N / 16, K / 4, 64]: by 16-row panels, q + 128 (unpack_q8_0_int8)
    scale: jax.Array        # float32 [K / 32, N]

    @property
    def shape(self) -> tuple[int, int]:
        return 16 * self.packed.shape[0], 4 * self.packed.shape[1]

    dtype = property(_float32)
    nbytes = property(_stored_bytes)
    READ_TRANSPOSED = True
    check_product = check_orientation

    def product(self, x: jax.Array, transposed: bool = True) -> jax.Array:
        """x [..., K] @ w.T in llama.cpp's Q8_0 x Q8_0 arithmetic (q8_0_int8_reference)."""
        self.check_product(transposed)
        _float32_activations(self, x)
        return _flat(q8_0_int8_reference)(x, *self)

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




def _float32_activations(w, x) -> None:
    if x.dtype != jnp.float32:
        raise ValueError(f"a {type(w).__name__} takes float32 x, got {x.dtype}")


def unpack_panels(panels: jax.Array) -> jax.Array:
    """A PanelMatrix's panels [2, N / 16, K / 2, 16] -> the row-major float32 w [K, N] they hold."""
    _, P, half, width = panels.shape
    return panels.transpose(0, 2, 1, 3).reshape(2 * half, P * width)


def dequantize_q4_1(nibbles: jax.Array, scale: jax.Array, minimum: jax.Array) -> jax.Array:
    """Q4_1 blocks (Q4_1Matrix's arrays) -> float32 w [K, N]: scale * q + minimum, q in 0..15; byte
    (k, 16 g + j) of nibbles holds q[k, 32 g + j] low and q[k, 32 g + 16 + j] high. scale * q is exact in float32,
    so this is gguf's own dequantization bit for bit."""
    K, half = nibbles.shape
    b = nibbles.reshape(K, half // 16, 16)
    q = jnp.concatenate([b & 15, b >> 4], axis=-1).reshape(K, 2 * half).astype(jnp.float32)     # [K, N]
    rows = lambda a: jnp.repeat(a, K // a.shape[0], axis=0)                                       # [K, N]
    return rows(scale) * q + rows(minimum)


def dequantize_q8_0(values: jax.Array, scale: jax.Array) -> jax.Array:
    """Q8_0 rows (Q8_0Matrix's arrays) -> float32 w [N, K] = scale * q, exact in float32: gguf's
    own dequantization bit for bit."""
    N, K = values.shape
    return jnp.repeat(scale, K // scale.shape[1], axis=1) * values.astype(jnp.float32)


def quantize_rows_q8(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [M, K] float32 -> its rows in 8-bit blocks of 32 (llama.cpp's Q8_1 activations): q int32 [M, K / 32, 32]
    in -127..127, d [M, K / 32] = max |x| / 127, s [M, K / 32] = d * sum q; x ~ d * q. Ties round to even."""
    M, K = x.shape
    xb = x.reshape(M, K // 32, 32)
    d = jnp.max(jnp.abs(xb), axis=-1) / 127.0
    inverse = jnp.where(d != 0, 1.0 / jnp.where(d != 0, d, 1.0), 0.0)
    q = jnp.round(xb * inverse[..., None]).astype(jnp.int32)
    return q, d, d * jnp.sum(q, axis=-1).astype(jnp.float32)


def unpack_q4_1_int8(packed: jax.Array) -> jax.Array:
    """Q4_1Int8Matrix's packed [N / 16, K / 8, 64] -> q [K, N] int32 in 0..15: byte 4 n + j of octet o of panel p
    holds q[8 o + j, 16 p + n] low and q[8 o + 4 + j, 16 p + n] high."""
    P, O, _ = packed.shape
    b = packed.reshape(P, O, 16, 4).astype(jnp.int32)                       # [p, o, n, j]
    q = jnp.stack([b & 15, b >> 4], axis=2)                                  # [p, o, half, n, j]
    return q.transpose(1, 2, 4, 0, 3).reshape(8 * O, 16 * P)


def q4_1_int8_reference(x: jax.Array, packed: jax.Array, scale: jax.Array, minimum: jax.Array) -> jax.Array:
    """x [M, K] @ Q4_1 blocks in llama.cpp's arithmetic (Q4_1Int8Matrix's product): x's rows quantized to 8 bits
    per block of 32, exact integer dot products per block, y = sum over blocks of (scale * d) * I + minimum * s."""
    M, K = x.shape
    q = unpack_q4_1_int8(packed).reshape(K // 32, 32, -1)                   # [B, 32, N]
    xq, d, s = quantize_rows_q8(x)                                           # [M, B, 32], [M, B], [M, B]
    dots = jnp.einsum("mbk,bkn->mbn", xq, q, preferred_element_type=jnp.int32).astype(jnp.float32)
    terms = (scale[None] * d[..., None]) * dots + minimum[None] * s[..., None]      # [M, B, N]
    return jnp.sum(terms, axis=1)


def unpack_q8_0_int8(packed: jax.Array) -> jax.Array:
    """Q8_0Int8Matrix's packed [N / 16, K / 4, 64] -> q [N, K] int32 in -128..127: byte 4 n + j of quad r of panel p
    holds q[16 p + n, 4 r + j] + 128."""
    P, R, _ = packed.shape
    b = packed.reshape(P, R, 16, 4).astype(jnp.int32) - 128                  # [p, r, n, j]
    return b.transpose(0, 2, 1, 3).reshape(16 * P, 4 * R)


def q8_0_int8_reference(x: jax.Array, packed: jax.Array, scale: jax.Array) -> jax.Array:
    """x [M, K] @ w.T for Q8_0 rows w [N, K] in llama.cpp's arithmetic (Q8_0Int8Matrix's product): x's rows
    quantized to 8 bits per block of 32, exact integer dot products, y = sum over blocks of (scale * d) * I."""
    M, K = x.shape
    q = unpack_q8_0_int8(packed).reshape(-1, K // 32, 32)                   # [N, B, 32]
    xq, d, _ = quantize_rows_q8(x)                                           # [M, B, 32], [M, B]
    dots = jnp.einsum("mbk,nbk->mbn", xq, q, preferred_element_type=jnp.int32).astype(jnp.float32)
    return jnp.sum((scale[None] * d[..., None]) * dots, axis=1)
