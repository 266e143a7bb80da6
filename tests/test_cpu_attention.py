"""The CPU kernels that fix the order of the forward's sums (cpu_kernels.verify_attention, .rope, .rms_norm) and
the layer's other kernels (.swiglu, rope's fused q | k | v split): their
values against the references and an independent float64 attention, and their point: a query row's bits do not
depend on the call it is computed in (a T = k + 1 verify pass vs k + 1 one-position steps, a tree node vs its
committed path, a row alone vs in a batch), down to the whole model on SmolLM2-sized shapes."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels import build
from cpu_kernels.rms_norm import rms_norm_cpu
from cpu_kernels.rope import rope_cpu, rope_qkv_cpu
from cpu_kernels.swiglu import swiglu_cpu
from cpu_kernels.verify_attention import applies, verify_attention_cpu
from specjax import settings
from specjax.ops import (attention, rms_norm, rms_norm_reference, rope, rope_qkv, rope_qkv_reference, rope_reference,
                         swiglu, swiglu_reference, verify_attention_reference)
from specjax.cache import KVCache
from specjax.models import Model
from specjax.models.config import ModelConfig
from specjax.models.llama import forward, init_params
from test_verify_attention import check, make_inputs, naive, parents_to_mask, path

pytestmark = pytest.mark.skipif(build.load() is None, reason="no C++ compiler: the CPU kernels are not built")


def transposed(k):
    return jnp.swapaxes(k, 2, 3)                                # [B, Hkv, S, D] -> a CPU cache's [B, Hkv, D, S]


# B, T, S, Hq, Hkv, D, lengths: head dims a multiple of the vector width and not (12, 72: the scalar tail)
SHAPES = [(2, 4, 50, 2, 2, 64, [4, 50]), (3, 5, 70, 9, 3, 64, [17, 33, 64]), (1, 1, 40, 8, 1, 12, [29]),
          (2, 17, 48, 8, 2, 72, [17, 45])]


@pytest.mark.parametrize("B,T,S,Hq,Hkv,D,lengths", SHAPES)
def test_kernel_equals_naive_and_reference_on_chains(B, T, S, Hq, Hkv, D, lengths):
    q, k, v, lengths = make_inputs(B, T, S, Hq, Hkv, D, jnp.float32, lengths)      # unused slots hold NaN
    out = verify_attention_cpu(q, transposed(k), v, lengths)
    check(out, naive(q, k, v, lengths)[0], jnp.float32, "vs naive")
    check(out, verify_attention_reference(q, k, v, lengths), jnp.float32, "vs reference")


def test_kernel_equals_naive_on_trees_and_the_reference_with_a_window():
    parents = [[-1, 0, 0, 1, 2, 1], [-1, 0, 1, 2, 3, 4]]
    q, k, v, lengths = make_inputs(2, 6, 40, 9, 3, 64, jnp.float32, [23, 40], seed=1)
    mask = jnp.asarray(np.stack([parents_to_mask(p) for p in parents]))
    check(verify_attention_cpu(q, transposed(k), v, lengths, mask), naive(q, k, v, lengths, parents)[0],
          jnp.float32, "per-row trees")
    check(verify_attention_cpu(q, transposed(k), v, lengths, mask[0]), naive(q, k, v, lengths, [parents[0]] * 2)[0],
          jnp.float32, "one shared tree")
    positions = (lengths - 6)[:, None] + jnp.arange(6)[None]
    for window in (1, 5, 30):
        got = verify_attention_cpu(q, transposed(k), v, lengths, mask, q_positions=positions, sliding_window=window)
        want = verify_attention_reference(q, k, v, lengths, mask, q_positions=positions, sliding_window=window)
        check(got, want, jnp.float32, f"sliding window {window}")


def _cache(k, v, length):
    """One row's cache holding k, v [Hkv, n, D] in its first n slots (slots-last keys), the rest NaN."""
    Hkv, n, D = k.shape
    S = n + 8
    kk = jnp.full((1, Hkv, D, S), jnp.nan).at[0, :, :, :n].set(jnp.swapaxes(k, 1, 2))
    vv = jnp.full((1, Hkv, S, D), jnp.nan).at[0, :, :n].set(v)
    return kk, vv, jnp.asarray([length], jnp.int32)


@pytest.mark.parametrize("D", [64, 12])
def test_a_row_is_the_same_bits_in_any_call(D):
    """A chain position in a T = 6 pass = the same query as a T = 1 call over the same columns; a tree node = a T = 1
    call over its committed path (prefix + ancestors, contiguous); a row alone = the same row in a batch of 3."""
    T, S, Hq, Hkv = 6, 60, 9, 3
    q, k, v, lengths = make_inputs(3, T, S, Hq, Hkv, D, jnp.float32, [31, 60, 12], seed=2)
    run = jax.jit(verify_attention_cpu)
    chain = np.asarray(run(q, transposed(k), v, lengths))
    for b in range(3):
        alone = np.asarray(run(q[b:b + 1], transposed(k[b:b + 1]), v[b:b + 1], lengths[b:b + 1]))
        np.testing.assert_array_equal(alone[0], chain[b])
        start = int(lengths[b]) - T
        for t in range(T):
            one = run(q[b:b + 1, t:t + 1], *_cache(k[b, :, :start + t + 1], v[b, :, :start + t + 1], start + t + 1))
            np.testing.assert_array_equal(np.asarray(one)[0, 0], chain[b, t])
    parents = [-1, 0, 0, 1, 2, 1]
    mask = jnp.asarray(parents_to_mask(parents))
    tree = np.asarray(run(q, transposed(k), v, lengths, mask))
    b, start = 1, int(lengths[1]) - T
    for t in range(T):
        cols = list(range(start)) + [start + j for j in path(parents, t)]
        one = run(q[b:b + 1, t:t + 1], *_cache(k[b][:, cols], v[b][:, cols], len(cols)))
        np.testing.assert_array_equal(np.asarray(one)[0, 0], tree[b, t])


def test_the_bitwise_check_sees_an_order_change():
    """Planted: the same keys and values in another column order are the same attention up to rounding, but the
    kernel sums them in another order, and the bitwise comparison of the test above says so."""
    q, k, v, lengths = make_inputs(1, 1, 40, 9, 3, 64, jnp.float32, [40], seed=3)
    out = np.asarray(verify_attention_cpu(q, transposed(k), v, lengths))
    order = list(range(38, -1, -1)) + [39]                      # the prefix reversed, the new column last
    swapped = np.asarray(verify_attention_cpu(q, transposed(k[:, :, order]), v[:, :, order], lengths))
    np.testing.assert_allclose(swapped, out, atol=1e-5)
    assert not np.array_equal(swapped, out)


def test_dispatch_gradients_and_bad_input():
    q, k, v, lengths = make_inputs(2, 3, 20, 4, 2, 16, jnp.float32, [9, 20])
    k, v = jnp.nan_to_num(k), jnp.nan_to_num(v)
    ref = lambda q, k, v, lengths: verify_attention_reference(q, k, v, lengths, keys_transposed=True)
    kern = lambda q, k, v, lengths: attention(q, k, v, lengths, keys_transposed=True)
    weights = jax.random.normal(jax.random.PRNGKey(1), q.shape)
    # Under jit, as training takes it: lengths (and the mask) are traced values beside the differentiated ones.
    grad = lambda f: jax.jit(jax.grad(lambda *a: (f(*a) * weights).sum(), argnums=(0, 1, 2)))
    for got, want in zip(grad(kern)(q, transposed(k), v, lengths), grad(ref)(q, transposed(k), v, lengths)):
        np.testing.assert_allclose(got, want, atol=1e-5)
    assert applies(jnp.float32, keys_transposed=False) is not None
    assert applies(jnp.bfloat16, keys_transposed=True) is not None
    with settings.use_backends(attention="xla"):             # the definition, exactly
        off = jax.jit(lambda q, k, v, lengths: attention(q, k, v, lengths, keys_transposed=True))
        np.testing.assert_array_equal(off(q, transposed(k), v, lengths), jax.jit(ref)(q, transposed(k), v, lengths))
    with pytest.raises(ValueError, match=r"k_cache \[B, Hkv, D, S\]"):
        verify_attention_cpu(q, k, v, lengths)                  # keys not slots-last
    with pytest.raises(ValueError, match="multiple"):
        verify_attention_cpu(q[:, :, :3], transposed(k), v, lengths)
    with pytest.raises(ValueError, match="float32"):
        verify_attention_cpu(q.astype(jnp.bfloat16), transposed(k), v, lengths)


def test_rope_kernel_values_gradients_and_bad_input():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 5, 3, 64)), jnp.float32)
    positions = jnp.asarray(rng.integers(0, 8000, (2, 5)), jnp.int32)
    inv_freq = 1.0 / (1e5 ** (jnp.arange(0, 64, 2, dtype=jnp.float32) / 64))
    np.testing.assert_allclose(rope_cpu(x, positions, inv_freq), rope_reference(x, positions, inv_freq), atol=2e-6)
    g = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
    grad = lambda f: jax.grad(lambda x: (f(x, positions, inv_freq) * g).sum())(x)
    np.testing.assert_allclose(grad(jax.jit(rope)), grad(rope_reference), atol=1e-5)
    one = rope_cpu(x[:1, 2:3], positions[:1, 2:3], inv_freq)    # a position's bits whatever the call
    np.testing.assert_array_equal(np.asarray(one)[0, 0], np.asarray(rope_cpu(x, positions, inv_freq))[0, 2])
    with pytest.raises(ValueError, match="positions"):
        rope_cpu(x, positions[:, :3], inv_freq)
    with pytest.raises(ValueError, match="inv_freq"):
        rope_cpu(x, positions, inv_freq[:8])


def test_rope_qkv_kernel_is_rope_of_the_split_to_the_bit():
    rng = np.random.default_rng(3)
    Hq, Hkv, D = 9, 3, 64
    qkv = jnp.asarray(rng.standard_normal((2, 5, (Hq + 2 * Hkv) * D)), jnp.float32)
    positions = jnp.asarray(rng.integers(0, 8000, (2, 5)), jnp.int32)
    inv_freq = 1.0 / (1e5 ** (jnp.arange(0, D, 2, dtype=jnp.float32) / D))
    q, k, v = jax.jit(rope_qkv_cpu, static_argnums=(3, 4))(qkv, positions, inv_freq, Hq, Hkv)
    parts = np.split(np.asarray(qkv), [Hq * D, (Hq + Hkv) * D], axis=-1)
    np.testing.assert_array_equal(q, rope_cpu(jnp.asarray(parts[0].reshape(2, 5, Hq, D)), positions, inv_freq))
    np.testing.assert_array_equal(k, rope_cpu(jnp.asarray(parts[1].reshape(2, 5, Hkv, D)), positions, inv_freq))
    np.testing.assert_array_equal(v, parts[2].reshape(2, 5, Hkv, D))
    for got, want in zip((q, k, v), rope_qkv_reference(qkv, positions, inv_freq, Hq, Hkv)):
        np.testing.assert_allclose(got, want, atol=2e-6)
    shifted = rope_cpu(jnp.asarray(parts[0].reshape(2, 5, Hq, D)), positions + 1, inv_freq)
    assert not np.array_equal(q, shifted)                           # planted: a position off by one is seen
    g = [jnp.asarray(rng.standard_normal(a.shape), jnp.float32) for a in (q, k, v)]
    loss = lambda f: lambda x: sum((a * b).sum() for a, b in zip(f(x, positions, inv_freq, Hq, Hkv), g))
    np.testing.assert_allclose(jax.grad(loss(rope_qkv))(qkv), jax.grad(loss(rope_qkv_reference))(qkv), atol=1e-5)
    with pytest.raises(ValueError, match="rope_qkv takes"):
        rope_qkv_cpu(qkv[..., :-2], positions, inv_freq, Hq, Hkv)   # not (Hq + 2 Hkv) heads of D
    with pytest.raises(ValueError, match="rope_qkv takes"):
        rope_qkv_cpu(qkv, positions[:, :3], inv_freq, Hq, Hkv)


def test_swiglu_kernel_values_rows_gradients_and_bad_input():
    rng = np.random.default_rng(4)
    for I in (1536, 40):                                        # a multiple of the vector width, and a tail
        x = jnp.asarray(rng.standard_normal((2, 9, 2 * I)) * 4, jnp.float32)
        x = x.at[0, 0, :4].set(jnp.asarray([-100.0, 100.0, 0.0, -0.0]))   # past exp's range both ways, zeros
        got = np.asarray(jax.jit(swiglu_cpu)(x))
        np.testing.assert_allclose(got, swiglu_reference(x), rtol=3e-6, atol=1e-30)
        assert np.isfinite(got).all()
        np.testing.assert_array_equal(np.asarray(swiglu_cpu(x[1:, 3:4]))[0, 0], got[1, 3])   # alone = batched
        assert not np.allclose(got, jax.nn.silu(x[..., I:]) * x[..., :I], rtol=1e-3)    # planted: halves swapped
        g = jnp.asarray(rng.standard_normal(got.shape), jnp.float32)
        grad = lambda f: jax.grad(lambda x: (f(x) * g).sum())(x)
        np.testing.assert_allclose(grad(jax.jit(swiglu)), grad(swiglu_reference), rtol=1e-5, atol=1e-5)
    big = jnp.asarray(rng.standard_normal((8, 9, 3072)), jnp.float32)   # cut over the threads
    np.testing.assert_allclose(swiglu_cpu(big), swiglu_reference(big), rtol=3e-6, atol=1e-30)
    with pytest.raises(ValueError, match=r"gate \| up"):
        swiglu_cpu(x[..., :-1])


def test_rms_norm_kernel_values_gradients_rows_and_bad_input():
    rng = np.random.default_rng(1)
    for H in (576, 40):                                         # a multiple of the vector width, and a tail
        x = jnp.asarray(rng.standard_normal((2, 5, H)) * 3, jnp.float32)
        w = jnp.asarray(rng.standard_normal(H), jnp.float32)
        np.testing.assert_allclose(rms_norm_cpu(x, w, 1e-5), rms_norm_reference(x, w, 1e-5), rtol=2e-6, atol=2e-6)
        norm = jax.jit(lambda x: rms_norm(x, w, 1e-5))
        np.testing.assert_array_equal(np.asarray(norm(x[1:, 3:4]))[0, 0], np.asarray(norm(x))[1, 3])   # alone = batched
        g = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
        grad = lambda f: jax.grad(lambda x, w: (f(x, w, 1e-5) * g).sum(), argnums=(0, 1))(x, w)
        for got, want in zip(grad(rms_norm), grad(rms_norm_reference)):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match=r"weight \[H\]"):
        rms_norm_cpu(x, w[:8], 1e-5)


def _smollm2_shaped(layers=2, vocab=512, seed=0) -> Model:
    """SmolLM2-135M's layer shapes (hidden 576, 9 query / 3 kv heads of 64, MLP 1536), random weights."""
    cfg = ModelConfig(vocab_size=vocab, hidden_size=576, intermediate_size=1536, num_layers=layers, num_heads=9,
                      num_kv_heads=3, head_dim=64, rope_theta=1e5, tie_word_embeddings=True, eos_token_id=None,
                      max_position_embeddings=4096)
    return Model(cfg, init_params(cfg, jax.random.PRNGKey(seed), std=0.1), None, "smollm2-shaped")


def test_forward_verify_pass_equals_one_position_steps_bit_for_bit():
    """The model end to end on SmolLM2-sized layers: the logits and every layer's output of a T = 5 verify pass equal
    those of five T = 1 decode steps, bit for bit; a row of a batch equals the row alone; a tree pass's node equals
    decoding its root-to-node path. (Before the kernels, XLA's attention and its fusion of RoPE into the one-slot
    cache write put them ~1e-5 apart in the logits: greedy exactness held by a margin, not by construction.)"""
    model = _smollm2_shaped()
    cfg, L = model.config, model.config.num_layers
    fwd = jax.jit(lambda p, t, c, mask=None, depths=None: forward(p, cfg, t, c, mask=mask, depths=depths,
                                                                  hidden_layers=tuple(range(L))))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, cfg.vocab_size, n).tolist() for n in (37, 20)]
    new = rng.integers(1, cfg.vocab_size, (2, 5))

    def prefilled(rows):
        caches = []
        for r in rows:                              # each row's prompt alone, then stacked: ragged lengths
            c = KVCache.init(L, 1, 64, cfg.num_kv_heads, cfg.head_dim)
            out = fwd(model.params, jnp.asarray([prompts[r]], jnp.int32), c)
            caches.append(out.cache.replace(lengths=jnp.asarray([len(prompts[r])], jnp.int32)))
        return jax.tree.map(lambda *xs: jnp.concatenate(xs), *caches) if len(rows) > 1 else caches[0]

    both = fwd(model.params, jnp.asarray(new, jnp.int32), prefilled([0, 1]))
    for r in (0, 1):
        alone = fwd(model.params, jnp.asarray(new[r:r + 1], jnp.int32), prefilled([r]))
        np.testing.assert_array_equal(np.asarray(alone.logits)[0], np.asarray(both.logits)[r])
        cache = prefilled([r])
        for t in range(5):
            step = fwd(model.params, jnp.asarray(new[r:r + 1, t:t + 1], jnp.int32), cache)
            cache = step.cache.replace(lengths=step.cache.lengths + 1)
            np.testing.assert_array_equal(np.asarray(step.logits)[0, 0], np.asarray(both.logits)[r, t])
            for layer in range(L):
                np.testing.assert_array_equal(np.asarray(step.layer_hidden[layer])[0, 0],
                                              np.asarray(both.layer_hidden[layer])[r, t])
    parents = [-1, 0, 0, 1, 2]
    depths = jnp.asarray([len(path(parents, i)) - 1 for i in range(5)], jnp.int32)
    tree = fwd(model.params, jnp.asarray(new[:1], jnp.int32), prefilled([0]), jnp.asarray(parents_to_mask(parents)),
               depths)
    for node in range(5):
        cache = prefilled([0])
        for j in path(parents, node):
            step = fwd(model.params, jnp.asarray([[new[0, j]]], jnp.int32), cache)
            cache = step.cache.replace(lengths=step.cache.lengths + 1)
        np.testing.assert_array_equal(np.asarray(step.logits)[0, 0], np.asarray(tree.logits)[0, node])
