"""Tensor parallelism for any checkpoint (issue 16): vocabulary padding and kv-head replication.

The arithmetic (specjax.layout.plan_layout / apply_layout / memory_per_device) is tested here in-process, on one
device. Identical tokens on (8, 1), (2, 4) and (1, 8) meshes of virtual CPU devices, and measured per-device bytes
against the arithmetic, run in tests/_tp_worker.py (a subprocess: jax fixes its device count at startup).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import layout
from specjax.models.config import ModelConfig
from specjax.models.llama import full_logits, kv_heads
from tiny import tiny_model
from workers import run_worker

GiB = 2 ** 30
# config.json fields of the published checkpoints (no download): the shapes the memory arithmetic is about.
LLAMA_31_8B = dict(architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096,
                   intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8)
QWEN_25_7B = dict(architectures=["Qwen2ForCausalLM"], vocab_size=152064, hidden_size=3584,
                  intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4)
LLAMA_31_70B = dict(architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=8192,
                    intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8)


def test_padded_vocab():
    assert layout.padded_vocab(517, 1) == 517
    assert layout.padded_vocab(64, 8) == 64                     # divisible: left as it is (no copy)
    assert layout.padded_vocab(517, 4) == layout.padded_vocab(517, 8) == 640
    assert layout.padded_vocab(32001, 8) == 32128                # Vicuna / Llama-2 + pad token
    assert layout.padded_vocab(50257, 16) == 50304               # GPT-2
    assert layout.padded_vocab(517, 12) == 768                   # lcm(12, 128) = 384


@pytest.mark.parametrize("model,repeat", [(1, 1), (2, 1), (4, 2), (8, 4)])
def test_kv_replication_plan(model, repeat):
    cfg = tiny_model(0, vocab=517, hidden=64, heads=8, kv_heads=2).config
    lay = layout.plan_layout(cfg, model)
    assert lay.kv_repeat == repeat and lay.kv_heads == 2 * repeat and lay.kv_heads % model == 0
    # Each device's contiguous block of query heads reads only the kv heads the same device holds.
    q_per_dev, kv_per_dev = cfg.num_heads // model, lay.kv_heads // model
    group = cfg.num_heads // lay.kv_heads
    for dev in range(model):
        read = {j // group for j in range(dev * q_per_dev, (dev + 1) * q_per_dev)}
        assert read <= set(range(dev * kv_per_dev, (dev + 1) * kv_per_dev))


def test_kv_replication_not_a_multiple():
    # 3 kv heads on a model axis of 4: lcm(3, 4) = 12 placed kv heads, one per query head.
    cfg = ModelConfig(vocab_size=64, hidden_size=96, intermediate_size=64, num_layers=1, num_heads=12,
                      num_kv_heads=3, head_dim=8)
    assert layout.plan_layout(cfg, 4) == layout.Layout(4, 64, 12, 4)


def test_impossible_layout_names_a_mesh_that_works():
    cfg = ModelConfig.from_hf(QWEN_25_7B)                          # 28 query heads: 8 does not divide them
    with pytest.raises(ValueError, match=r"num_heads=28.*\[1, 2, 4\], e\.g\. make_mesh\(data=2, model=4\)"):
        layout.plan_layout(cfg, 8, devices=8)
    with pytest.raises(ValueError, match=r"make_mesh\(data=4, model=4\)"):
        layout.memory_per_device(cfg, 1, 16)
    # Not strict (a draft model): the heads stay replicated, the vocabulary is still padded.
    small = tiny_model(1, vocab=517, hidden=16, layers=1, heads=2, kv_heads=1).config
    assert layout.plan_layout(small, 4, strict=False) == layout.Layout(4, 640, 1, 1)


def test_apply_layout_keeps_the_model():
    model = tiny_model(0, vocab=517, hidden=64, heads=8, kv_heads=2)
    cfg, params = model.config, model.params
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 517, (2, 9)), jnp.int32)
    want = full_logits(params, cfg, tokens)
    for m in (4, 8):
        lay = layout.plan_layout(cfg, m)
        placed = layout.apply_layout(params, cfg, lay)
        assert placed["embed"].shape == (640, 64) and placed["lm_head"].shape == (64, 640)
        assert not np.any(np.asarray(placed["embed"][517:])) and not np.any(np.asarray(placed["lm_head"][:, 517:]))
        assert kv_heads(placed, cfg) == lay.kv_heads
        D = cfg.head_dim
        wk, wk0 = np.asarray(placed["layers"][0]["wk"]), np.asarray(params["layers"][0]["wk"])
        for j in range(lay.kv_heads):                               # placed kv head j is source head j // repeat
            src = j // lay.kv_repeat
            assert np.array_equal(wk[:, j * D:(j + 1) * D], wk0[:, src * D:(src + 1) * D])
        got = full_logits(placed, cfg, tokens)
        assert got.shape == want.shape                                # the padded vocabulary is cut off
        # float32 sums in another blocking (padded shapes) differ by ~1e-5 on logits of ~5; a misplaced head or
        # row moves them by O(1).
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-5)
        assert np.array_equal(np.argmax(got, -1), np.argmax(want, -1))
        again = layout.apply_layout(placed, cfg, lay)               # placing twice is a no-op
        assert all(a is b for a, b in zip(jax.tree_util.tree_leaves(again), jax.tree_util.tree_leaves(placed)))
        back = layout.logical_params(placed, cfg)                   # and the inverse gives the checkpoint back
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(back),
                                                        jax.tree_util.tree_leaves(params)))
    # Laid out for model=8 (4 copies of each kv head), the params serve model=4 as they are.
    placed8 = layout.apply_layout(params, cfg, layout.plan_layout(cfg, 8))
    again = layout.apply_layout(placed8, cfg, layout.plan_layout(cfg, 4))
    assert all(a is b for a, b in zip(jax.tree_util.tree_leaves(again), jax.tree_util.tree_leaves(placed8)))


def test_memory_arithmetic_real_shapes():
    l8, q7, l70 = (ModelConfig.from_hf(c) for c in (LLAMA_31_8B, QWEN_25_7B, LLAMA_31_70B))
    # 70B on 8 devices: the split the module docstring works out by hand (17.6 GB of bf16 weights, 40 KiB/token).
    m = layout.memory_per_device(l70, 1, 8)
    assert m.params == pytest.approx(17.64e9, rel=1e-3) and m.kv_per_token == 40 * 1024
    assert m.params_replication == m.params_padding == 0
    # 70B on 16 devices, (1, 16): refused before, now each kv head is held twice.
    m16 = layout.memory_per_device(l70, 1, 16)
    assert m16.layout.kv_repeat == 2 and m16.kv_per_token == 40 * 1024 and m16.kv_per_token_replication == 20 * 1024
    assert m16.params == pytest.approx((l70.num_params() * 2 - 3 * 8192 * 80 * 2) / 16 + 3 * 8192 * 80 * 2
                                       + m16.params_replication, rel=1e-3)
    # Llama 3.1 8B on 16: 8 kv heads -> 2 copies each; Qwen2.5 7B: the model axis stops at 4 (28 query heads).
    assert layout.memory_per_device(l8, 1, 16).layout.kv_repeat == 2
    assert layout.working_model_axes(q7, 16) == [1, 2, 4]
    assert layout.memory_per_device(q7, 2, 4).params < 4.0 * GiB


@pytest.fixture(scope="module")
def worker() -> dict:
    return run_worker("_tp_worker.py", "")           # no decoding: bytes and loading only


@pytest.fixture(scope="module")
def memory(worker) -> dict:
    return worker["memory"]


@pytest.mark.parametrize("mesh", ["2x4", "1x8"])
def test_load_into_the_layout_and_save_back(worker, mesh):
    assert worker["load"][mesh] == {"same_as_placed": True, "saved_back": True}


@pytest.mark.parametrize("mesh", ["8x1", "2x4", "1x8"])
def test_measured_bytes_match_the_arithmetic(memory, mesh):
    mem = memory[mesh]
    assert mem["params"] == [mem["params_arith"]], mem                # every device holds the same bytes
    assert mem["cache"] == [mem["cache_arith"]], mem
    data, model = map(int, mesh.split("x"))
    # The cost of replication: the cache per device is the even split times kv_repeat.
    assert mem["cache"][0] == memory["total_cache"] // (data * model) * mem["layout"]["kv_repeat"]
    if model > 1:
        assert mem["embed_shape"] == [640, 64] and mem["wk_shard_shape"] == [64, 8]   # one kv head per device
        assert mem["params_replication"] > 0 and mem["params_padding"] > 0


@pytest.fixture(scope="module")
def identity() -> dict:
    return run_worker("_tp_worker.py", timeout=1800)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["8x1", "2x4", "1x8"])
@pytest.mark.parametrize("method", ["none", "chain", "ngram", "tree", "sampled"])
def test_same_tokens_as_one_device(identity, method, mesh):
    tokens = identity["tokens"]
    assert tokens[f"{method}@{mesh}"] == tokens[f"{method}@single"]
    if method != "sampled":
        assert tokens[f"{method}@single"] == tokens["none@single"]   # greedy speculative == plain
    if method != "none":
        stats = identity["stats"][f"{method}@{mesh}"]
        assert stats["accepted"] > 0 and stats["rejected"] > 0, stats  # acceptance and rollback both ran


HEAD_FACTORIES = ["medusa", "medusa-static_tree", "eagle", "eagle3", "draft_model-dynamic_tree"]


@pytest.fixture(scope="module")
def heads() -> dict:
    return run_worker("_tp_worker.py", ",".join(HEAD_FACTORIES), timeout=1800)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["8x1", "2x4", "1x8"])
@pytest.mark.parametrize("method", HEAD_FACTORIES)
def test_head_drafters_same_tokens(heads, method, mesh):
    # Head drafters (tests/conformance_factories.py) on the padded, kv-replicated target: they read its LM head
    # and embedding cut back to the logical vocabulary; their own vocabulary-wide weights stay replicated.
    tokens = heads["tokens"]
    assert tokens[f"{method}@{mesh}"] == tokens[f"{method}@single"]
