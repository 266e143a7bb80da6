"""KVCache in both key layouts: writes at per-row offsets, a tree step's compaction and a prefill's placement leave
the same keys and values in the same slots, so attention over either layout reads one cache. A GroupedKVCache
(rows in groups, each group's buffer narrower) holds and attends to what one buffer does."""
import itertools
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.cache import GroupedKVCache, KVCache, keys_transposed_by_default
from specjax.models.llama import attention

B, L, S, Hkv, D = 3, 2, 12, 2, 4


def entries(seed, T):
    k, v = jax.random.normal(jax.random.PRNGKey(seed), (2, B, T, Hkv, D))
    return k, v


def history(keys_transposed):
    """Writes at ragged starts (one clamped at the end), then a compaction, then a placement of a narrower cache
    into two of the rows. -> [(keys [B, Hkv, S, D], values) per layer]."""
    cache = KVCache.init(L, B, S, Hkv, D, keys_transposed=keys_transposed)
    starts = jnp.asarray([0, 5, S - 1])                                   # the last row's write is clamped to S - 3
    for layer in range(L):
        cache = cache.write(layer, *entries(layer, 3), starts)
    cache = cache.compact(jnp.asarray([[2, 0], [7, 5], [11, 9]]), jnp.asarray([1, 6, 3]))
    part = KVCache.init(L, 2, 4, Hkv, D, keys_transposed=keys_transposed)
    for layer in range(L):
        part = part.write(layer, *(x[:2, :4] for x in entries(10 + layer, 4)), jnp.zeros(2, jnp.int32))
    cache = cache.place(jnp.asarray([2, 0]), part)
    return [(np.asarray(cache.keys(i)), np.asarray(cache.v[i])) for i in range(L)], cache


def test_layouts_hold_the_same_entries():
    plain, c0 = history(False)
    transposed, c1 = history(True)
    assert c0.k[0].shape == (B, Hkv, S, D) and c1.k[0].shape == (B, Hkv, D, S) and c1.size == c0.size == S
    for (k0, v0), (k1, v1) in zip(plain, transposed):
        np.testing.assert_array_equal(k1, k0)
        np.testing.assert_array_equal(v1, v0)
    # Spot checks against the writes themselves, so that a bug shared by both layouts fails too.
    k_written, v_written = entries(1, 3)                                  # layer 1's writes, [B, 3, Hkv, D]
    keys, values = plain[1]
    for slot, t in ((5, 0), (6, 2), (7, 0)):                             # row 1: slots 7, 5 compacted to 6, 7
        np.testing.assert_array_equal(keys[1, :, slot], np.asarray(k_written[1, t]))
    np.testing.assert_array_equal(values[2, :, 4], np.asarray(v_written[2, 0]))     # clamped write, then moved
    placed = np.asarray(entries(10, 4)[0][1])                             # part row 1 -> row 0, layer 0
    np.testing.assert_array_equal(plain[0][0][0, :, :4], np.swapaxes(placed, 0, 1))


def test_place_refuses_another_layout():
    with pytest.raises(ValueError, match="different layouts"):
        KVCache.init(1, 2, 8, Hkv, D, keys_transposed=True).place(slice(None), KVCache.init(1, 2, 4, Hkv, D,
                                                                                           keys_transposed=False))


def test_default_layout_follows_the_backend():
    assert keys_transposed_by_default() == (jax.default_backend() == "cpu")
    assert KVCache.init(1, 1, 8, Hkv, D).keys_transposed == keys_transposed_by_default()


def grouped_and_one(row_groups, sizes):
    """The same writes at ragged starts and one compaction into a GroupedKVCache (groups of the batch rows
    row_groups, buffers `sizes` wide) and into one buffer of S slots -> (grouped, one)."""
    rows = [jnp.asarray(r, jnp.int32) for r in row_groups]
    parts = [KVCache.init(L, len(r), size, Hkv, D) for r, size in zip(row_groups, sizes)]
    lengths = jnp.asarray([2, 4, 1])
    grouped = GroupedKVCache.of(parts, rows, lengths)
    one = KVCache.init(L, B, S, Hkv, D).replace(lengths=lengths)
    for layer in range(L):
        grouped = grouped.write(layer, *entries(layer, 3), lengths)
        one = one.write(layer, *entries(layer, 3), lengths)
    src, dst = jnp.asarray([[4, 2], [6, 5], [3, 1]]), jnp.asarray([2, 4, 1])
    return grouped.compact(src, dst), one.compact(src, dst)


@pytest.mark.parametrize("row_groups, sizes", [([[2, 0], [1]], [8, S]), ([[1], [2], [0]], [8, 8, 12])])
def test_grouped_cache_holds_and_attends_as_one_buffer(row_groups, sizes):
    grouped, one = grouped_and_one(row_groups, sizes)
    for part, rows in zip(grouped.parts, grouped.rows):
        for layer in range(L):
            n = part.size
            np.testing.assert_array_equal(part.keys(layer), one.keys(layer)[rows, :, :n])
            np.testing.assert_array_equal(part.v[layer], one.v[layer][rows, :, :n])
    T, Hq = 3, 4
    q = jax.random.normal(jax.random.PRNGKey(5), (B, T, Hq, D))
    positions = grouped.lengths[:, None] + jnp.arange(T)
    tree = jnp.tril(jnp.ones((T, T), bool)).at[2, 1].set(False)                  # node 2 a child of the root
    per_row = jnp.stack([tree, jnp.tril(jnp.ones((T, T), bool)), tree])
    for mask, implementation in itertools.product((None, tree, per_row), ("xla", "pallas_tpu", "pallas_gpu")):
        run = lambda cache: attention(q, cache, 1, grouped.lengths + T, mask, implementation=implementation,
                                      q_positions=positions, sliding_window=None)
        np.testing.assert_allclose(run(grouped), run(one), atol=1e-5)


def test_grouped_cache_keeps_rows_apart():
    """Planted check: the same entries with two rows' group membership swapped read differently."""
    grouped, one = grouped_and_one([[2, 0], [1]], [8, S])
    swapped = grouped.replace(rows=(jnp.asarray([0, 2]), grouped.rows[1]))
    q = jax.random.normal(jax.random.PRNGKey(5), (B, 1, 4, D))
    run = lambda cache: attention(q, cache, 0, grouped.lengths + 1, None, implementation="xla",
                                  q_positions=grouped.lengths[:, None], sliding_window=None)
    np.testing.assert_allclose(run(grouped), run(one), atol=1e-6)
    assert not np.allclose(run(swapped), run(one), atol=1e-3)


# ------------------------------------------------------------------------ the CPU cache-write kernel (in place)

@pytest.mark.parametrize("keys_transposed", [True, False])
def test_cache_write_kernel_is_the_scatter_bit_for_bit_with_its_gradients(keys_transposed):
    """cpu_kernels.cache_write's kernel against its reference (the scatter) at ragged starts, one clamped at the end,
    T = 1 to the whole buffer; gradients through it are the reference's. A planted bug (one slot off) is seen."""
    from cpu_kernels.cache_write import write_kv_cpu
    from specjax.ops import write_kv, write_kv_reference
    if jax.default_backend() != "cpu":
        pytest.skip("a CPU kernel")
    rng = np.random.default_rng(0)
    for B, T, size in [(1, 1, 20), (1, 9, 32), (3, 5, 17), (2, 4, 4)]:
        k_buf = jnp.asarray(rng.standard_normal((B, Hkv, D, size) if keys_transposed else (B, Hkv, size, D)),
                            jnp.float32)
        v_buf = jnp.asarray(rng.standard_normal((B, Hkv, size, D)), jnp.float32)
        k_new, v_new = (jnp.asarray(rng.standard_normal((B, T, Hkv, D)), jnp.float32) for _ in range(2))
        starts = jnp.asarray(rng.integers(0, size + 5, B), jnp.int32)
        args = (k_buf, v_buf, k_new, v_new, starts)
        want = write_kv_reference(*args, keys_transposed)
        got = jax.jit(write_kv_cpu, static_argnums=5)(*args, keys_transposed)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        if T < size:                   # a planted bug: every row's block one slot away
            at = jnp.clip(starts, 0, size - T)
            off_by_one = write_kv_reference(*args[:4], jnp.where(at > 0, at - 1, at + 1), keys_transposed)
            for g, w in zip(got, off_by_one):
                assert not np.array_equal(np.asarray(g), np.asarray(w))

        def loss(write):
            weights = lambda x: jnp.arange(x.size, dtype=jnp.float32).reshape(x.shape)
            return lambda *a: sum(jnp.sum(x * weights(x)) for x in write(*a, starts, keys_transposed))
        for g, w in zip(jax.grad(loss(write_kv), argnums=(0, 1, 2, 3))(*args[:4]),
                        jax.grad(loss(write_kv_reference), argnums=(0, 1, 2, 3))(*args[:4])):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_cache_write_kernel_updates_in_place_and_names_bad_input():
    """Under jit with the buffers donated, the compiled write copies no buffer; shapes that do not fit are named."""
    from cpu_kernels.cache_write import write_kv_cpu
    if jax.default_backend() != "cpu":
        pytest.skip("a CPU kernel")
    k_buf, v_buf = jnp.zeros((1, Hkv, D, 64)), jnp.zeros((1, Hkv, 64, D))
    new, starts = jnp.ones((1, 9, Hkv, D)), jnp.zeros((1,), jnp.int32)
    write = jax.jit(lambda *a: write_kv_cpu(*a, True), donate_argnums=(0, 1))
    hlo = write.lower(k_buf, v_buf, new, new, starts).compile().as_text()
    assert "specjax_cache_write" in hlo and " copy(" not in hlo and "copy-start" not in hlo
    with pytest.raises(ValueError, match="do not fit keys"):
        write_kv_cpu(k_buf, v_buf, new, new, starts, False)             # keys slots-last passed as slots-first
    with pytest.raises(ValueError, match="at least 80 slots"):
        write_kv_cpu(k_buf, v_buf, jnp.ones((1, 80, Hkv, D)), jnp.ones((1, 80, Hkv, D)), starts, True)
    with pytest.raises(ValueError, match="starts \\[B\\]"):
        write_kv_cpu(k_buf, v_buf, new, new, jnp.zeros((2,), jnp.int32), True)
