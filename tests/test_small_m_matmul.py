"""The small-M CPU matmul kernel (cpu_kernels.small_m_matmul) against its reference, and its promises: each row
independent of M and of the thread split and of concurrent calls, the dispatch's fallbacks, gradients, vmap, errors."""
import concurrent.futures
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels import build
from cpu_kernels.small_m_matmul import (MAX_ROWS, MAX_ROWS_TRANSPOSED, XLA_GEMM_MAX_ROWS, applies, small_m_matmul,
                                        small_m_matmul_panels, small_m_matmul_q4_1, small_m_matmul_q4_1_int8,
                                        small_m_matmul_q8_0, small_m_matmul_q8_0_int8)
from specjax import settings
from specjax.models.weights import (PanelMatrix, Q4_1Int8Matrix, Q4_1Matrix, Q8_0Int8Matrix, Q8_0Matrix,
                                    q4_1_int8_reference, q8_0_int8_reference, quantize_rows_q8, unpack_q4_1_int8,
                                    unpack_q8_0_int8)
from specjax.ops import linear, linear_reference

pytestmark = pytest.mark.skipif(build.load() is None, reason="no C++ compiler: the kernel cannot be built here")

# (K, N): N a multiple of 16 but not of 64 (a short last strip), of 64; K not a multiple of 16 for nn.
NN_SHAPES = [(40, 80), (64, 192), (23, 48)]
NT_SHAPES = [(48, 37), (64, 130), (32, 70)]        # nt: (K, N) with K % 16 == 0, any N (the 4-column blocks' remainder)
ROWS = [1, 2, 3, 5, 6, 7, 9, 13, 24, 25, 31, 64, 72, 129]


def _inputs(M, K, N, transposed, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((M, K), dtype=np.float32)
    w = rng.standard_normal((N, K) if transposed else (K, N), dtype=np.float32)
    return jnp.asarray(x), jnp.asarray(w)


@pytest.mark.parametrize("transposed,shapes", [(False, NN_SHAPES), (True, NT_SHAPES)])
def test_kernel_matches_float64(transposed, shapes):
    for K, N in shapes:
        for M in ROWS:
            x, w = _inputs(M, K, N, transposed)
            want = np.asarray(x, np.float64) @ (np.asarray(w, np.float64).T if transposed else np.asarray(w, np.float64))
            got = np.asarray(jax.jit(lambda x, w: small_m_matmul(x, w, transposed))(x, w))
            scale = np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64).T if transposed else np.asarray(w, np.float64))
            assert got.shape == want.shape
            assert (np.abs(got - want) <= 1e-5 * scale + 1e-6).all(), (transposed, K, N, M)


@pytest.mark.parametrize("transposed,K,N", [(False, 40, 80), (False, 23, 1536), (False, 1, 48), (True, 64, 130)])
def test_rows_independent_of_m_and_split(transposed, K, N):
    """Row m of an M-row product is bit-identical to that row alone and to any thread split: a row does not depend
    on which rows share its call (nn: few rows are summed row-major, more in column strips, and an N this wide
    takes the strips at fewer rows: the paths must agree bit for bit)."""
    x, w = _inputs(max(ROWS), K, N, transposed, seed=1)
    alone = np.stack([np.asarray(small_m_matmul(x[m:m + 1], w, transposed))[0] for m in range(max(ROWS))])
    for M in ROWS:
        for parts in (1, 2, 3):
            got = np.asarray(small_m_matmul(x[:M], w, transposed, parts=parts))
            np.testing.assert_array_equal(got, alone[:M], err_msg=f"M={M} parts={parts}")


def test_concurrent_calls_give_the_serial_results():
    """Calls from several threads at once, and independent products in one jit (which XLA may run concurrently),
    share the intra-op pool: every result equals the same product computed alone on one thread."""
    K, N = 576, 1536
    cases = [_inputs(M, K, N, False, seed=10 + M) for M in (1, 3, 5, 9, 64, 72)]
    serial = [np.asarray(small_m_matmul(x, w, parts=1)) for x, w in cases]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            got = list(pool.map(lambda c: np.asarray(small_m_matmul(*c)), cases * 2))
            for g, want in zip(got, serial * 2):
                np.testing.assert_array_equal(g, want)
    together = jax.jit(lambda *xs: [small_m_matmul(xs[2 * i], xs[2 * i + 1]) for i in range(len(cases))])
    for g, want in zip(together(*[a for c in cases for a in c]), serial):
        np.testing.assert_array_equal(np.asarray(g), want)


def test_a_planted_difference_is_seen():
    """The identity check can fail: the same rows through XLA's dot (another summation order) differ in bits."""
    x, w = _inputs(9, 576, 80, False, seed=2)
    assert not np.array_equal(np.asarray(small_m_matmul(x, w)), np.asarray(linear_reference(x, w) * (1 + 2e-7)))
    assert not np.array_equal(np.asarray(small_m_matmul(x, w)), np.asarray(small_m_matmul(x, w * 1.0000001)))


def test_dispatch_falls_back_where_the_kernel_does_not_apply(monkeypatch):
    assert applies((5, 64), (64, 80), jnp.float32) is None
    assert "bfloat16" in applies((5, 64), (64, 80), jnp.bfloat16)
    assert f"..{MAX_ROWS}" in applies((MAX_ROWS + 1, 64), (64, 80), jnp.float32)
    assert f"..{MAX_ROWS}" in applies((0, 64), (64, 80), jnp.float32)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)    # one core: one row is XLA's
    assert f"2..{MAX_ROWS}" in applies((1, 64), (64, 80), jnp.float32)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert applies((1, 64), (64, 80), jnp.float32) is None
    assert f"..{MAX_ROWS_TRANSPOSED}" in applies((MAX_ROWS_TRANSPOSED + 1, 64), (80, 64), jnp.float32, True)
    assert f"..{MAX_ROWS_TRANSPOSED} or {XLA_GEMM_MAX_ROWS + 1}" in applies((XLA_GEMM_MAX_ROWS, 64), (80, 64),
                                                                           jnp.float32, True)
    assert applies((XLA_GEMM_MAX_ROWS + 1, 64), (80, 64), jnp.float32, True) is None     # XLA's GEMM slows above
    assert f"..{MAX_ROWS} for w [N, K]" in applies((MAX_ROWS + 1, 64), (80, 64), jnp.float32, True)
    assert "multiple of 16" in applies((5, 64), (64, 72), jnp.float32)
    assert "multiple of 16" in applies((5, 72), (80, 72), jnp.float32, transposed=True)


def test_the_xla_choice_turns_the_kernel_off():
    x, w = _inputs(5, 64, 80, False)
    with settings.use_backends(linear="xla"):
        assert build.TARGET not in _lowered_text(linear, x, w)
    assert build.TARGET in _lowered_text(linear, x, w)


def _lowered_text(fn, *args):
    return jax.jit(fn).lower(*args).as_text()


def test_matmul_uses_the_kernel_only_where_it_applies():
    x, w = _inputs(5, 64, 80, False)
    assert build.TARGET in _lowered_text(linear, x.reshape(1, 5, 64), w)
    big, _ = _inputs(MAX_ROWS + 1, 64, 80, False)
    assert build.TARGET not in _lowered_text(linear, big, w)
    assert build.TARGET not in _lowered_text(linear, x.astype(jnp.bfloat16), w.astype(jnp.bfloat16))
    # [..., K] inputs fold into rows and come back in their shape
    got = linear(x.reshape(1, 5, 64), w)
    np.testing.assert_allclose(np.asarray(got).reshape(5, 80), np.asarray(x @ w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("transposed", [False, True])
def test_gradients_and_vmap(transposed):
    K, N = (64, 48)
    x, w = _inputs(3, K, N, transposed, seed=3)
    loss = lambda f: (lambda x, w: jnp.sum(jnp.tanh(f(x, w))))
    got = jax.grad(loss(lambda x, w: linear(x, w, transposed)), argnums=(0, 1))(x, w)
    want = jax.grad(loss(lambda x, w: linear_reference(x, w, transposed)), argnums=(0, 1))(x, w)
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-5)
    xs = jnp.stack([x, 2 * x])                                    # [2, 3, K]
    np.testing.assert_allclose(np.asarray(jax.vmap(lambda x: linear(x, w, transposed))(xs)),
                               np.asarray(linear_reference(xs, w, transposed)), rtol=1e-5, atol=1e-5)


def test_bad_input_names_the_problem():
    x, w = _inputs(3, 64, 48, False)
    with pytest.raises(ValueError, match="K = 32"):
        small_m_matmul(x[:, :32], w)
    with pytest.raises(ValueError, match="2-D"):
        small_m_matmul(x[None], w)


def test_library_is_rebuilt_for_a_changed_source(tmp_path, monkeypatch):
    """The cache key covers every source and header: an edited kernel gets a new shared object, not the stale one."""
    cxx = build.compiler()
    path = build.library_path(cxx)
    for name in ("SOURCES", "HEADERS"):
        files = getattr(build, name)
        edited = tmp_path / f"edited-{name}"
        edited.write_text(open(files[-1]).read() + "\n// edited\n")
        with monkeypatch.context() as patch:
            patch.setattr(build, name, files[:-1] + (str(edited),))
            assert build.library_path(cxx) != path
    assert build.library_path(cxx) == path
    monkeypatch.setenv(settings.CACHE_ENV, str(tmp_path / "cache"))
    assert build.library_path(cxx).startswith(str(tmp_path / "cache"))


# ------------------------------------------------------------------------------------------ Q4_1 weights

def _q4_1(K, N, seed=0):
    """Random Q4_1 blocks with float16-valued scales and minimums (as a GGUF file holds them), and the float32
    matrix they stand for by gguf's formula (numpy: d * q, then + m)."""
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 16, (K, N), dtype=np.uint8)
    d = (rng.standard_normal((K // 32, N)) * 0.02).astype(np.float16).astype(np.float32)
    m = (rng.standard_normal((K // 32, N)) * 0.1).astype(np.float16).astype(np.float32)
    dense = np.repeat(d, 32, axis=0) * q.astype(np.float32) + np.repeat(m, 32, axis=0)
    return Q4_1Matrix.from_blocks(q, d, m), dense


# (K, N): narrow (strips past 2 rows), wide (N >= 1024: row-major up to 9 rows), K not a multiple of 64 (a block
# straddles the two halves of K).
Q4_1_SHAPES = [(64, 96), (96, 1024), (32, 64)]


@pytest.mark.parametrize("K,N", Q4_1_SHAPES)
def test_q4_1_kernel_equals_the_float32_kernel_on_the_dequantized_weights(K, N):
    """Bit for bit, for every M (row-major, strips, chunked strips) and thread split: the blocks hold exactly the
    float32 values and the kernel sums them in the float32 kernel's order."""
    blocks, dense = _q4_1(K, N)
    np.testing.assert_array_equal(np.asarray(blocks.dequantize()), dense)
    w = Q4_1Matrix(*map(jnp.asarray, blocks))
    for M in [1, 2, 3, 5, 9, 10, 13, 72, 129]:
        x = jnp.asarray(np.random.default_rng(M).standard_normal((M, K), dtype=np.float32))
        want = np.asarray(small_m_matmul(x, jnp.asarray(dense)))
        for parts in (1, 2, 3):
            np.testing.assert_array_equal(np.asarray(small_m_matmul_q4_1(x, w, parts=parts)), want)
        np.testing.assert_allclose(want, np.asarray(x, np.float64) @ dense.astype(np.float64), rtol=1e-4, atol=1e-4)


def test_q4_1_planted_bugs_are_seen():
    """One nibble, one scale or one minimum changed changes the product (the equality above can fail)."""
    blocks, dense = _q4_1(64, 96)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, 64), dtype=np.float32))
    want = np.asarray(small_m_matmul_q4_1(x, Q4_1Matrix(*map(jnp.asarray, blocks))))
    nibbles, scale, minimum = (np.array(a) for a in blocks)
    nibbles[40, 7] ^= 1
    scale2, minimum2 = scale.copy(), minimum.copy()
    scale2[1, 50] *= 2
    minimum2[0, 3] += 0.5
    for bad in ((nibbles, scale, minimum), (blocks.nibbles, scale2, minimum), (blocks.nibbles, scale, minimum2)):
        got = np.asarray(small_m_matmul_q4_1(x, Q4_1Matrix(*map(jnp.asarray, bad))))
        assert not np.array_equal(got, want)


def test_q4_1_matmul_dispatch():
    """linear takes a Q4_1Matrix in jit like an array: the kernel up to MAX_ROWS rows, the dequantized weights through
    XLA's dot past it (equal to the reference), leading dims kept; transposed products refused."""
    blocks, dense = _q4_1(64, 96)
    w = Q4_1Matrix(*map(jnp.asarray, blocks))
    for shape in [(2, 3, 64), (MAX_ROWS + 8, 64)]:
        x = jnp.asarray(np.random.default_rng(2).standard_normal(shape, dtype=np.float32))
        got = np.asarray(jax.jit(linear)(x, w))
        assert got.shape == (*shape[:-1], 96)
        want = np.asarray(linear(x, jnp.asarray(dense)))
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="transposed"):
        linear(x, w, transposed=True)
    with pytest.raises(ValueError, match="float32 x"):
        small_m_matmul_q4_1(x.astype(jnp.bfloat16), w)


def test_q4_1_blocks_refuse_bad_shapes():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="K % 32"):
        Q4_1Matrix.from_blocks(rng.integers(0, 16, (40, 64), dtype=np.uint8), np.ones((1, 64)), np.ones((1, 64)))
    with pytest.raises(ValueError, match="scale and minimum"):
        Q4_1Matrix.from_blocks(rng.integers(0, 16, (64, 64), dtype=np.uint8), np.ones((1, 64)), np.ones((2, 64)))
    with pytest.raises(ValueError, match="0..15"):
        Q4_1Matrix.from_blocks(np.full((32, 32), 16, np.uint8), np.ones((1, 32)), np.ones((1, 32)))


# ------------------------------------------------------------------------------------------ Q8_0 weights (nt)

def _q8_0(N, K, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.integers(-128, 128, (N, K), dtype=np.int8)
    d = (rng.standard_normal((N, K // 32)) * 0.01).astype(np.float16).astype(np.float32)
    return Q8_0Matrix(jnp.asarray(q), jnp.asarray(d)), np.repeat(d, 32, axis=1) * q.astype(np.float32)


@pytest.mark.parametrize("N,K", [(37, 64), (130, 96), (70, 32)])
def test_q8_0_kernel_equals_the_float32_kernel_on_the_dequantized_weights(N, K):
    w, dense = _q8_0(N, K)
    np.testing.assert_array_equal(np.asarray(w.dequantize()), dense)
    for M in [1, 2, 5, 7, 13, 17, 40, 72, 129]:
        x = jnp.asarray(np.random.default_rng(M).standard_normal((M, K), dtype=np.float32))
        want = np.asarray(small_m_matmul(x, jnp.asarray(dense), True))
        for parts in (1, 2, 3):
            np.testing.assert_array_equal(np.asarray(small_m_matmul_q8_0(x, w, parts=parts)), want)
        np.testing.assert_array_equal(np.asarray(jax.jit(lambda x, w: linear(x, w, True))(x, w)), want)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((MAX_ROWS + 3, K), dtype=np.float32))
    np.testing.assert_allclose(np.asarray(linear(x, w, True)), np.asarray(x) @ dense.T, rtol=1e-4, atol=1e-4)
    values = np.array(w.values)
    values[N // 2, 5] ^= 1                                              # a planted bug is seen
    assert not np.array_equal(np.asarray(small_m_matmul_q8_0(x[:3], Q8_0Matrix(jnp.asarray(values), w.scale))),
                              np.asarray(small_m_matmul_q8_0(x[:3], w)))
    with pytest.raises(ValueError, match="transposed"):
        linear(x, w)


# ------------------------------------------------------------- blocks times 8-bit activations (llama.cpp's arithmetic)

def _llama_cpp_product(x, q, scale, minimum=None):
    """numpy, float64 after the integer part: x's rows quantized per block of 32 (round half to even), exact integer
    dots, then sum over blocks of scale * d * I (+ minimum * d * sum q). q [K, N] int, scale/minimum [K / 32, N]."""
    M, K = x.shape
    xb = x.reshape(M, K // 32, 32)
    d = (np.abs(xb).max(-1) / np.float32(127)).astype(np.float32)
    inverse = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
    xq = np.rint(xb * inverse[..., None]).astype(np.int64)                            # [M, B, 32]
    dots = np.einsum("mbk,bkn->mbn", xq, q.reshape(K // 32, 32, -1).astype(np.int64)).astype(np.float64)
    y = scale[None].astype(np.float64) * d[..., None] * dots
    if minimum is not None:
        y += minimum[None].astype(np.float64) * d[..., None] * xq.sum(-1)[..., None]
    return y.sum(1)


def _q4_1_int8(K, N, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 16, (K, N), dtype=np.uint8)
    d = (rng.standard_normal((K // 32, N)) * 0.01).astype(np.float32)
    m = (rng.standard_normal((K // 32, N)) * 0.01).astype(np.float32)
    w = Q4_1Int8Matrix.from_q4_1(Q4_1Matrix.from_blocks(q, d, m))
    return Q4_1Int8Matrix(*map(jnp.asarray, w)), q, d, m


@pytest.mark.parametrize("K,N", [(32, 32), (96, 96), (576, 192)])
def test_q4_1_int8_kernel_is_llama_cpp_arithmetic_and_rows_independent_of_m(K, N):
    w, q, d, m = _q4_1_int8(K, N)
    np.testing.assert_array_equal(np.asarray(unpack_q4_1_int8(w.packed)), q)          # the packing round trip
    x = np.random.default_rng(1).standard_normal((40, K), dtype=np.float32)
    full = np.asarray(small_m_matmul_q4_1_int8(jnp.asarray(x), w))
    want = _llama_cpp_product(x, q, d, m)
    np.testing.assert_allclose(full, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    np.testing.assert_allclose(np.asarray(q4_1_int8_reference(jnp.asarray(x), *w)), full, rtol=1e-5,
                               atol=1e-5 * np.abs(want).max())
    dense = x @ (np.repeat(d, 32, 0) * q + np.repeat(m, 32, 0))                      # near the float32 product
    assert np.abs(full - dense).max() < 0.05 * np.abs(dense).max()
    for M in [1, 2, 3, 5, 8, 9, 10, 17, 40]:
        for parts in (1, 2, 3):
            np.testing.assert_array_equal(np.asarray(small_m_matmul_q4_1_int8(jnp.asarray(x[:M]), w, parts=parts)),
                                          full[:M])
    got = jax.jit(linear)(jnp.asarray(x[:6].reshape(2, 3, K)), w)                    # [..., K] through the dispatch
    np.testing.assert_array_equal(np.asarray(got).reshape(6, N), full[:6])


@pytest.mark.parametrize("N,K", [(16, 32), (80, 96), (48, 576)])
def test_q8_0_int8_kernel_is_llama_cpp_arithmetic_and_rows_independent_of_m(N, K):
    w8, dense = _q8_0(N, K)
    w = Q8_0Int8Matrix(*map(jnp.asarray, Q8_0Int8Matrix.from_q8_0(w8)))
    np.testing.assert_array_equal(np.asarray(unpack_q8_0_int8(w.packed)), np.asarray(w8.values))
    x = np.random.default_rng(1).standard_normal((40, K), dtype=np.float32)
    full = np.asarray(small_m_matmul_q8_0_int8(jnp.asarray(x), w))
    want = _llama_cpp_product(x, np.asarray(w8.values).T, np.asarray(w8.scale).T)
    np.testing.assert_allclose(full, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    np.testing.assert_allclose(np.asarray(q8_0_int8_reference(jnp.asarray(x), *w)), full, rtol=1e-5,
                               atol=1e-5 * np.abs(want).max())
    assert np.abs(full - x @ dense.T).max() < 0.05 * np.abs(x @ dense.T).max()
    for M in [1, 2, 5, 9, 10, 40]:
        for parts in (1, 2, 3):
            np.testing.assert_array_equal(np.asarray(small_m_matmul_q8_0_int8(jnp.asarray(x[:M]), w, parts=parts)),
                                          full[:M])
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda x, w: linear(x, w, True))(jnp.asarray(x[:3]), w)),
                                  full[:3])


def test_int8_activations_round_half_to_even_like_the_reference():
    """One block whose largest |x| is 127 (d = 1): x = 2.5 and -3.5 are ties; scale 1, minimum 0, so y is the
    integer dot itself, exactly, in the kernel and in the reference."""
    x = np.zeros((1, 32), np.float32)
    x[0, :4] = [127.0, 2.5, -3.5, 0.5]
    q = np.zeros((32, 32), np.uint8)
    q[1, 0] = q[2, 1] = q[3, 2] = 1                                      # column n reads x[n + 1]
    w = Q4_1Int8Matrix(*map(jnp.asarray, Q4_1Int8Matrix.from_q4_1(
        Q4_1Matrix.from_blocks(q, np.ones((1, 32), np.float32), np.zeros((1, 32), np.float32)))))
    got = np.asarray(small_m_matmul_q4_1_int8(jnp.asarray(x), w))[0, :3]
    np.testing.assert_array_equal(got, [2.0, -4.0, 0.0])
    np.testing.assert_array_equal(np.asarray(q4_1_int8_reference(jnp.asarray(x), *w))[0, :3], got)
    xq, d, s = quantize_rows_q8(jnp.asarray(x))
    assert float(d[0, 0]) == 1.0 and float(s[0, 0]) == 127 + 2 - 4 + 0


def test_int8_planted_bugs_are_seen():
    w, q, d, m = _q4_1_int8(64, 32)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, 64), dtype=np.float32))
    good = np.asarray(small_m_matmul_q4_1_int8(x, w))
    packed = np.array(w.packed)
    packed[1, 2, 5] ^= 0x10                                             # one high nibble
    assert not np.array_equal(np.asarray(small_m_matmul_q4_1_int8(x, w._replace(packed=jnp.asarray(packed)))), good)
    swapped = np.asarray(w.packed)
    swapped = (swapped >> 4) | ((swapped & 15) << 4)                    # the halves' order of k swapped
    assert not np.allclose(np.asarray(small_m_matmul_q4_1_int8(x, w._replace(packed=jnp.asarray(swapped)))), good,
                           atol=1e-3)
    minimum = np.array(w.minimum)
    minimum[1, 7] += 1.0                                                # one block's minimum
    assert not np.array_equal(np.asarray(small_m_matmul_q4_1_int8(x, w._replace(minimum=jnp.asarray(minimum)))),
                              good)
    w8 = Q8_0Int8Matrix(*map(jnp.asarray, Q8_0Int8Matrix.from_q8_0(_q8_0(32, 64)[0])))
    good = np.asarray(small_m_matmul_q8_0_int8(x, w8))
    packed = np.array(w8.packed)
    packed[0, 3, 9] ^= 1
    assert not np.array_equal(np.asarray(small_m_matmul_q8_0_int8(x, w8._replace(packed=jnp.asarray(packed)))), good)


def test_int8_blocks_refuse_bad_input():
    w, *_ = _q4_1_int8(64, 32)
    x = jnp.ones((2, 64), jnp.float32)
    with pytest.raises(ValueError, match=r"is w \[K, N\]"):
        linear(x, w, transposed=True)
    with pytest.raises(ValueError, match="float32 x"):
        linear(x.astype(jnp.bfloat16), w)
    with pytest.raises(ValueError, match="x \\[M, 64\\]"):
        small_m_matmul_q4_1_int8(jnp.ones((2, 32), jnp.float32), w)
    with pytest.raises(ValueError, match="N % 16"):
        Q8_0Int8Matrix.from_q8_0(_q8_0(37, 64)[0])
    w8 = Q8_0Int8Matrix(*map(jnp.asarray, Q8_0Int8Matrix.from_q8_0(_q8_0(32, 64)[0])))
    with pytest.raises(ValueError, match="read transposed"):
        linear(x, w8)


# ------------------------------------------------------------------------------- float32 w in panels (PanelMatrix)

@pytest.mark.parametrize("K,N", [(40, 80), (64, 1536), (2, 16)])
def test_panels_equal_the_float32_kernel_on_the_row_major_weights(K, N):
    """Bit for bit, for every M (the row-major kernel's row-major sums at few rows, its strips at more) and thread
    split: the panels hold w's values, summed in the same order."""
    x, w = _inputs(max(ROWS), K, N, False, seed=3)
    panels = PanelMatrix.from_dense(np.asarray(w))
    np.testing.assert_array_equal(np.asarray(panels.dequantize()), np.asarray(w))
    panels = PanelMatrix(jnp.asarray(panels.panels))
    for M in [1, 2, 3, 5, 6, 7, 9, 13, 25, 72]:      # row-major sums, strips of each height, several row blocks
        want = np.asarray(small_m_matmul(x[:M], w))
        for parts in (1, 2, 3):
            np.testing.assert_array_equal(np.asarray(small_m_matmul_panels(x[:M], panels, parts=parts)), want,
                                          err_msg=f"M={M} parts={parts}")


def test_panels_planted_bugs_are_seen():
    """One value changed, or the two halves of the rows swapped, changes the product (the equality can fail)."""
    x, w = _inputs(5, 64, 96, False, seed=4)
    panels = np.asarray(PanelMatrix.from_dense(np.asarray(w)).panels)
    want = np.asarray(small_m_matmul(x, w))
    changed = panels.copy()
    changed[1, 3, 7, 5] += 1.0
    for bad in (changed, panels[::-1]):
        assert not np.array_equal(np.asarray(small_m_matmul_panels(x, PanelMatrix(jnp.asarray(bad)))), want)


def test_panels_dispatch_concatenation_and_gradients():
    """linear takes a PanelMatrix in jit like an array (leading dims kept; past MAX_ROWS the kernel MAX_ROWS rows
    at a time, each row as alone), concatenated panels give each matrix's own columns, x's gradient is the dense
    one's; transposed products and shapes the panels cannot hold are refused."""
    _, w1 = _inputs(1, 64, 48, False, seed=5)
    _, w2 = _inputs(1, 64, 32, False, seed=6)
    fused = PanelMatrix.concatenate([PanelMatrix.from_dense(np.asarray(w)) for w in (w1, w2)])
    fused = PanelMatrix(jnp.asarray(fused.panels))
    assert fused.shape == (64, 80) and fused.dtype == jnp.float32
    for shape in [(2, 3, 64), (MAX_ROWS + 8, 64)]:
        x = jnp.asarray(np.random.default_rng(7).standard_normal(shape, dtype=np.float32))
        got = np.asarray(jax.jit(linear)(x, fused))
        assert got.shape == (*shape[:-1], 80)
        for w, cols in ((w1, slice(0, 48)), (w2, slice(48, 80))):
            flat = x.reshape(-1, 64)
            want = np.concatenate([np.asarray(small_m_matmul(flat[i:i + MAX_ROWS], w))
                                   for i in range(0, flat.shape[0], MAX_ROWS)])
            np.testing.assert_array_equal(got[..., cols].reshape(-1, cols.stop - cols.start), want)
    x = jnp.asarray(np.random.default_rng(8).standard_normal((3, 64), dtype=np.float32))
    dense = jnp.concatenate([w1, w2], axis=1)
    grad = jax.grad(lambda x: jnp.sum(jnp.sin(linear(x, fused))))(x)
    np.testing.assert_allclose(grad, jax.grad(lambda x: jnp.sum(jnp.sin(x @ dense)))(x), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="transposed"):
        linear(x, fused, transposed=True)
    with pytest.raises(ValueError, match="K even"):
        PanelMatrix.from_dense(np.ones((3, 16), np.float32))
    with pytest.raises(ValueError, match="N % 16"):
        PanelMatrix.from_dense(np.ones((4, 24), np.float32))
    with pytest.raises(ValueError, match="float32"):
        PanelMatrix.from_dense(np.ones((4, 16), np.float64))
    with pytest.raises(ValueError, match="one K"):
        PanelMatrix.concatenate([PanelMatrix.from_dense(np.ones((4, 16), np.float32)),
                                 PanelMatrix.from_dense(np.ones((6, 16), np.float32))])
