"""Verify-attention kernels (Pallas GPU/Triton and TPU/Mosaic, both in interpret mode on CPU) vs the reference and
vs independently built naive attention. Unused cache slots are poisoned with NaN in every case."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from pallas_kernels.verify_attention import (MASK_VALUE, validate_tree_mask, verify_attention,
                                             verify_attention_reference)

# (implementation, tunables): the Triton kernel in generic interpret mode, its flash-decoding split variant with
# small blocks (ragged block edges, several splits, some empty), and the Mosaic kernel in TPU interpret mode.
KERNELS = [
    pytest.param("pallas_gpu", {}, id="gpu"),
    pytest.param("pallas_gpu", {"num_splits": 3, "block_kv": 16}, id="gpu-split3-bk16"),
    pytest.param("pallas_tpu", {"block_kv": 24}, id="tpu-bk24"),
]
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def parents_to_mask(parents):
    """parents[i] < i (parents[0] == -1) -> bool [T, T] ancestor mask (node sees itself and its ancestors)."""
    T = len(parents)
    m = np.zeros((T, T), bool)
    for i in range(T):
        j = i
        while j >= 0:
            m[i, j] = True
            j = parents[j]
    return m


def path(parents, i):
    out = []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return out[::-1]


def make_inputs(B, T, S, Hq, Hkv, D, dtype, lengths, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(ks[0], (B, T, Hq, D), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (B, Hkv, S, D), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (B, Hkv, S, D), jnp.float32).astype(dtype)
    lengths = jnp.asarray(lengths, jnp.int32)
    used = (jnp.arange(S)[None, :] < lengths[:, None])[:, None, :, None]
    k = jnp.where(used, k, jnp.nan).astype(dtype)                      # poison unused slots
    v = jnp.where(used, v, jnp.nan).astype(dtype)
    return q, k, v, lengths


def naive(q, k, v, lengths, parents_per_batch=None):
    """Independent float64 numpy attention: row b, query t sees the committed prefix [0, lengths-T) plus the new
    slots on its root-to-t path (chain when parents is None). Returns out [B, T, Hq, D], lse [B, T, Hq]."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    lengths = np.asarray(lengths)
    B, T, Hq, D = q.shape
    G = Hq // k.shape[1]
    out = np.zeros(q.shape)
    lse = np.zeros(q.shape[:3])
    for b in range(B):
        start = lengths[b] - T
        for t in range(T):
            new = list(range(t + 1)) if parents_per_batch is None else path(parents_per_batch[b], t)
            cols = list(range(start)) + [start + j for j in new]
            for h in range(Hq):
                kk, vv = k[b, h // G, cols], v[b, h // G, cols]
                s = kk @ q[b, t, h] / np.sqrt(D)
                mx = s.max()
                p = np.exp(s - mx)
                out[b, t, h] = p @ vv / p.sum()
                lse[b, t, h] = mx + np.log(p.sum())
    return out, lse


def check(got, want, dtype, what=""):
    got = np.asarray(jnp.asarray(got, jnp.float32))
    assert np.isfinite(got).all(), f"{what}: non-finite values"
    np.testing.assert_allclose(got, np.asarray(want, np.float32), atol=TOL[dtype], rtol=0, err_msg=what)


# B, T, S, Hq, Hkv, D, dtype, lengths
CHAIN_CASES = [
    pytest.param(2, 4, 50, 2, 2, 64, jnp.float32, [4, 50], id="g1-d64-f32-len=T-and-full"),
    pytest.param(3, 5, 70, 8, 2, 128, jnp.bfloat16, [17, 33, 64], id="g4-d128-bf16-ragged"),
    pytest.param(1, 1, 40, 8, 1, 64, jnp.float32, [29], id="g8-decode-T1"),
    pytest.param(2, 16, 48, 8, 1, 64, jnp.float32, [16, 45], id="g8-T16-multi-rowblock"),
    # A prefill's many new entries: the GPU kernel's tail runs in several windows (SmolLM2's group of 3).
    pytest.param(2, 150, 200, 3, 1, 64, jnp.float32, [150, 200], id="g3-prefill-T150"),
]
TREE_CASES = [
    # parents per row; [T, T] mask when all rows share one tree
    pytest.param(2, 5, 60, 4, 4, 64, jnp.float32, [23, 60], [[-1, 0, 0, 1, 2]], id="g1-shared-tree"),
    pytest.param(2, 6, 70, 8, 2, 128, jnp.bfloat16, [40, 9],
                 [[-1, 0, 0, 0, 1, 4], [-1, 0, 1, 2, 3, 4]], id="g4-d128-bf16-per-row-trees"),
    pytest.param(1, 7, 33, 8, 1, 64, jnp.float32, [30], [[-1, 0, 1, 0, 3, 1, 5]], id="g8-tree"),
    pytest.param(1, 70, 100, 2, 1, 64, jnp.float32, [90],
                 [[-1] + [int(p) for p in np.random.default_rng(0).integers(0, np.arange(1, 70))]],
                 id="g2-tree-70-nodes"),
]


# The reference in every formulation and both key layouts (a CPU cache stores its keys slots-last).
REFERENCE_VARIANTS = pytest.mark.parametrize("formulation, keys_transposed", [
    (f, t) for f in ("dot", "fused", "fused_scores") for t in (False, True)])


def key_layout(k, keys_transposed):
    return jnp.swapaxes(k, 2, 3) if keys_transposed else k


@REFERENCE_VARIANTS
def test_reference_equals_naive_causal(formulation, keys_transposed):
    q, k, v, lengths = make_inputs(3, 4, 20, 4, 2, 16, jnp.float32, [4, 11, 20])
    out, lse = verify_attention_reference(q, key_layout(k, keys_transposed), v, lengths, return_lse=True,
                                          formulation=formulation, keys_transposed=keys_transposed)
    want, want_lse = naive(q, k, v, lengths)
    check(out, want, jnp.float32, "reference out")
    check(lse, want_lse, jnp.float32, "reference lse")


@REFERENCE_VARIANTS
def test_reference_tree_equals_naive_path(formulation, keys_transposed):
    parents = [[-1, 0, 0, 1, 2], [-1, 0, 1, 1, 0]]
    q, k, v, lengths = make_inputs(2, 5, 16, 2, 1, 16, jnp.float32, [9, 16])
    mask = jnp.asarray(np.stack([parents_to_mask(p) for p in parents]))
    kw = dict(formulation=formulation, keys_transposed=keys_transposed)
    kk = key_layout(k, keys_transposed)
    out, lse = verify_attention_reference(q, kk, v, lengths, mask, return_lse=True, **kw)
    want, want_lse = naive(q, k, v, lengths, parents)
    check(out, want, jnp.float32, "reference tree out")
    check(lse, want_lse, jnp.float32, "reference tree lse")
    # A shared [T, T] mask with B > 1 (broadcast over the batch).
    out2 = verify_attention_reference(q, kk, v, lengths, mask[0], **kw)
    check(out2, naive(q, k, v, lengths, [parents[0]] * 2)[0], jnp.float32, "reference shared tree")


def test_reference_auto_formulation_by_size():
    """On a CPU "auto" takes the fused loops for a few query rows over a large cache, the dots otherwise, and for
    one new entry in all over keys stored slots-last the fused scores with the values' dot; every formulation gives
    the naive answer (checked above), so the choice only moves time."""
    from specjax.ops.attention import FUSED_MIN_KV_BYTES, FUSED_MAX_ROWS, _formulation
    cpu = jax.default_backend() == "cpu"
    assert _formulation("auto", 2, 4, FUSED_MAX_ROWS, FUSED_MIN_KV_BYTES, True) == (cpu, cpu)
    assert _formulation("auto", 2, 4, FUSED_MAX_ROWS + 1, FUSED_MIN_KV_BYTES, True) == (False, False)
    assert _formulation("auto", 2, 4, 2, FUSED_MIN_KV_BYTES - 1, False) == (False, False)
    for kv_bytes in (0, FUSED_MIN_KV_BYTES):                   # a batch-1 decode step, either size
        assert _formulation("auto", 1, 1, 3, kv_bytes, True) == (cpu, False)
    assert _formulation("auto", 2, 1, 3, 0, True) == (False, False)
    assert _formulation("auto", 1, 1, 3, 0, False) == (False, False)
    assert _formulation("fused_scores", 8, 5, 40, 0, False) == (True, False)
    with pytest.raises(ValueError, match="formulation"):
        _formulation("einsum", 1, 1, 2, 0, True)


def test_reference_single_entry_equals_naive():
    """The batch-1 decode step's shape (one new entry), where "auto" mixes the two formulations on a CPU."""
    q, k, v, lengths = make_inputs(1, 1, 20, 4, 2, 16, jnp.float32, [13])
    for keys_transposed in (False, True):
        out, lse = verify_attention_reference(q, key_layout(k, keys_transposed), v, lengths, return_lse=True,
                                              keys_transposed=keys_transposed)
        want, want_lse = naive(q, k, v, lengths)
        check(out, want, jnp.float32, "reference out, one new entry")
        check(lse, want_lse, jnp.float32, "reference lse, one new entry")


@pytest.mark.parametrize("impl,kw", KERNELS)
@pytest.mark.parametrize("B,T,S,Hq,Hkv,D,dtype,lengths", CHAIN_CASES)
def test_chain(impl, kw, B, T, S, Hq, Hkv, D, dtype, lengths):
    q, k, v, lengths = make_inputs(B, T, S, Hq, Hkv, D, dtype, lengths)
    out, lse = verify_attention(q, k, v, lengths, implementation=impl, return_lse=True, **kw)
    assert out.dtype == dtype and out.shape == q.shape and lse.shape == (B, T, Hq) and lse.dtype == jnp.float32
    ref, ref_lse = verify_attention_reference(q, k, v, lengths, return_lse=True)
    want, want_lse = naive(q, k, v, lengths)
    check(out, ref, dtype, "vs reference")
    check(out, want, dtype, "vs naive causal")
    check(lse, ref_lse, dtype, "lse vs reference")
    check(lse, want_lse, dtype, "lse vs naive")


@pytest.mark.parametrize("impl,kw", KERNELS)
@pytest.mark.parametrize("B,T,S,Hq,Hkv,D,dtype,lengths,parents", TREE_CASES)
def test_tree(impl, kw, B, T, S, Hq, Hkv, D, dtype, lengths, parents):
    q, k, v, lengths = make_inputs(B, T, S, Hq, Hkv, D, dtype, lengths, seed=1)
    masks = np.stack([parents_to_mask(p) for p in parents])
    validate_tree_mask(masks)
    mask = jnp.asarray(masks[0] if len(parents) == 1 else masks)
    per_row = parents * B if len(parents) == 1 else parents
    out, lse = verify_attention(q, k, v, lengths, mask, implementation=impl, return_lse=True, **kw)
    want, want_lse = naive(q, k, v, lengths, per_row)
    ref, ref_lse = verify_attention_reference(q, k, v, lengths, mask, return_lse=True)
    check(out, want, dtype, "vs naive tree path")
    check(out, ref, dtype, "vs reference")
    check(lse, want_lse, dtype, "lse vs naive")
    check(lse, ref_lse, dtype, "lse vs reference")


@pytest.mark.parametrize("impl,kw", KERNELS)
def test_chain_mask_equals_causal(impl, kw):
    q, k, v, lengths = make_inputs(2, 4, 30, 4, 1, 64, jnp.float32, [7, 30])
    chain = jnp.asarray(parents_to_mask([-1, 0, 1, 2]))
    assert (np.asarray(chain) == np.tril(np.ones((4, 4), bool))).all()
    a = verify_attention(q, k, v, lengths, chain, implementation=impl, **kw)
    b = verify_attention(q, k, v, lengths, None, implementation=impl, **kw)
    check(a, b, jnp.float32, "chain mask vs causal")


@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu"])
def test_odd_shapes(impl):
    """head_dim not a power of two (GPU pads it), GQA group 3, cache smaller than a block, 0/1 int mask."""
    q, k, v, lengths = make_inputs(2, 3, 13, 6, 2, 24, jnp.float32, [3, 13])
    parents = [-1, 0, 0]
    mask = jnp.asarray(parents_to_mask(parents).astype(np.int32))
    out, lse = verify_attention(q, k, v, lengths, mask, implementation=impl, return_lse=True)
    want, want_lse = naive(q, k, v, lengths, [parents] * 2)
    check(out, want, jnp.float32, "odd shapes")
    check(lse, want_lse, jnp.float32, "odd shapes lse")


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_lowers_for_device(platform):
    """Cross-lower at Llama-3-8B shapes (no device needed): catches Triton rules (power-of-two tiles) and
    Mosaic block-shape rules at trace/lowering time. Device compilation itself is not exercised here."""
    import functools
    from pallas_kernels.verify_attention.gpu import verify_attention_gpu
    from pallas_kernels.verify_attention.tpu import verify_attention_tpu
    B, T, S = 2, 5, 1000
    q = jax.ShapeDtypeStruct((B, T, 32, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, 8, S, 128), jnp.bfloat16)
    lengths = jax.ShapeDtypeStruct((B,), jnp.int32)
    mask = jax.ShapeDtypeStruct((B, T, T), jnp.bool_)
    if platform == "cuda":
        fns = [functools.partial(verify_attention_gpu, scale=0.1, num_splits=n) for n in (1, 4)]
        target = "triton"
    else:
        fns = [functools.partial(verify_attention_tpu, scale=0.1)]
        target = "tpu_custom_call"
    for fn in fns:
        for m in (None, mask):
            text = jax.jit(fn).trace(q, kv, kv, lengths, m).lower(lowering_platforms=(platform,)).as_text()
            assert target in text


def _pallas_calls(jaxpr) -> list:
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            found.append(eqn)
        for sub in jax.core.jaxprs_in_params(eqn.params):
            found += _pallas_calls(sub)
    return found


def _largest_load_rows(jaxpr) -> int:
    """The most rows any load in a kernel's jaxpr (its loops' bodies included) reads at once."""
    rows = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("get", "load"):
            shape = eqn.outvars[0].aval.shape
            rows = max(rows, shape[0] if len(shape) == 2 else 0)
        for sub in jax.core.jaxprs_in_params(eqn.params):
            rows = max(rows, _largest_load_rows(sub))
    return rows


@pytest.mark.parametrize("mask", [False, True], ids=["chain", "tree"])
def test_gpu_kernel_windows_stay_small_for_many_new_entries(mask):
    """The Triton kernel reads the cache in windows of at most max(64, block_kv) rows whatever T is: a prefill of
    512 new entries read as one window asked an H200 for 262,400 bytes of shared memory (it has 232,448), at
    SmolLM2's shapes in float32. The program still lowers for a GPU."""
    import functools
    from pallas_kernels.verify_attention.gpu import verify_attention_gpu
    B, T, S = 1, 512, 1024
    q = jax.ShapeDtypeStruct((B, T, 9, 64), jnp.float32)
    kv = jax.ShapeDtypeStruct((B, 3, S, 64), jnp.float32)
    lengths = jax.ShapeDtypeStruct((B,), jnp.int32)
    tree = jax.ShapeDtypeStruct((B, T, T), jnp.bool_) if mask else None
    fn = functools.partial(verify_attention_gpu, scale=0.125, interpret=True)
    kernels = _pallas_calls(jax.make_jaxpr(fn)(q, kv, kv, lengths, tree).jaxpr)
    assert len(kernels) == 1
    assert 0 < _largest_load_rows(kernels[0].params["jaxpr"]) <= 64
    fn = jax.jit(functools.partial(verify_attention_gpu, scale=0.125))
    text = fn.trace(q, kv, kv, lengths, tree).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text


def test_xla_implementation_and_dispatch():
    q, k, v, lengths = make_inputs(2, 3, 20, 4, 2, 16, jnp.float32, [5, 20])
    ref = verify_attention_reference(q, k, v, lengths)
    check(verify_attention(q, k, v, lengths, implementation="xla"), ref, jnp.float32, "xla")
    check(verify_attention(q, k, v, lengths, implementation="pallas"), ref, jnp.float32, "pallas (cpu)")
    # sm_scale is honoured
    out = verify_attention(q, k, v, lengths, implementation="pallas", sm_scale=0.3)
    check(out, verify_attention_reference(q, k, v, lengths, sm_scale=0.3), jnp.float32, "sm_scale")


@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu"])
def test_inside_jit_and_while_loop(impl):
    """The decode loop calls the kernel inside jit and lax.while_loop with traced lengths."""
    B, T, S, Hq, Hkv, D = 2, 3, 32, 4, 2, 64
    q, k, v, _ = make_inputs(B, T, S, Hq, Hkv, D, jnp.float32, [S, S])
    mask = jnp.asarray(parents_to_mask([-1, 0, 0]))

    @jax.jit
    def run(q, k, v, start):
        def body(c):
            i, lengths, acc = c
            o = verify_attention(q, k, v, lengths, mask, implementation=impl)
            return i + 1, lengths + T, acc + o
        return lax.while_loop(lambda c: c[0] < 3, body, (0, start, jnp.zeros_like(q)))[2]

    start = jnp.array([3, 10], jnp.int32)
    got = run(q, k, v, start)
    want = sum(verify_attention_reference(q, k, v, start + T * i, mask) for i in range(3))
    check(got, want, jnp.float32, "while_loop")


@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu"])
def test_empty_prefix_matches_reference(impl):
    """lengths == T (empty committed prefix): finite and equal to the reference, lse included."""
    q, k, v, lengths = make_inputs(1, 2, 16, 2, 1, 64, jnp.float32, [2])
    out, lse = verify_attention(q, k, v, lengths, implementation=impl, return_lse=True)
    ref, ref_lse = verify_attention_reference(q, k, v, lengths, return_lse=True)
    check(out, ref, jnp.float32, impl)
    check(lse, ref_lse, jnp.float32, impl)
    assert MASK_VALUE < -1e38


@pytest.mark.parametrize("impl", ["xla", "pallas_gpu", "pallas_tpu"])
def test_bad_inputs_raise(impl):
    q, k, v, lengths = make_inputs(2, 4, 16, 4, 2, 16, jnp.float32, [8, 8])
    call = lambda *a, **kw: verify_attention(*a, implementation=impl, **kw)
    with pytest.raises(ValueError, match="do not fit"):
        call(jnp.zeros((2, 20, 4, 16)), k, v, lengths)
    with pytest.raises(ValueError, match="multiple"):
        call(jnp.zeros((2, 4, 3, 16)), k, v, lengths)
    with pytest.raises(ValueError, match="shapes differ"):
        call(q, k, v[:, :, :8], lengths)
    with pytest.raises(ValueError, match="head_dim"):
        call(q, k[..., :8], v[..., :8], lengths)
    with pytest.raises(ValueError, match="mask"):
        call(q, k, v, lengths, jnp.ones((3, 3), bool))
    with pytest.raises(ValueError, match="mask"):
        call(q, k, v, lengths, jnp.ones((3, 4, 4), bool))
    with pytest.raises(ValueError, match="lengths"):
        call(q, k, v, lengths[:1])
    with pytest.raises(ValueError, match="implementation"):
        verify_attention(q, k, v, lengths, implementation="cuda")


def test_validate_tree_mask():
    validate_tree_mask(parents_to_mask([-1, 0, 0, 1, 2]))
    validate_tree_mask(np.tril(np.ones((4, 4), bool)))
    validate_tree_mask(np.stack([parents_to_mask([-1, 0, 1]), parents_to_mask([-1, 0, 0])]))
    bad_self = parents_to_mask([-1, 0, 0])
    bad_self[2, 2] = False
    with pytest.raises(ValueError, match="see itself"):
        validate_tree_mask(bad_self)
    no_parent = np.eye(3, dtype=bool)
    with pytest.raises(ValueError, match="parent"):
        validate_tree_mask(no_parent)
    validate_tree_mask(no_parent, single_root=False)          # a forest of roots is allowed on request
    later = parents_to_mask([-1, 0, 0])
    later[1, 2] = True
    with pytest.raises(ValueError, match="later"):
        validate_tree_mask(later)
    not_closed = parents_to_mask([-1, 0, 1, 2])
    not_closed[3, 1] = False                                     # sees parent 2 but not grandparent 1
    with pytest.raises(ValueError, match="ancestor"):
        validate_tree_mask(not_closed)
    two_paths = parents_to_mask([-1, 0, 0, 2])
    two_paths[3, 1] = True                                       # 1 is not an ancestor of its parent 2
    with pytest.raises(ValueError, match="path"):
        validate_tree_mask(two_paths)
