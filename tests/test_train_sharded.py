"""train.loop under a ("data", "model") mesh: the same per-step losses as on one device, the frozen target split over
"model", checkpoints restored in their sharded layout; and the frozen-target feature forward of train.losses.common.

jax fixes its device count when it first starts, so the mesh runs are in a subprocess
(tests/_train_sharded_worker.py) with 8 virtual CPU devices; it reports JSON and the tests here assert on it.
Run with -s to see the losses.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _train_sharded_worker import np_init
from specjax.models.llama import full_logits
from train import skeleton
from train.losses.common import frozen_target_features
from workers import run_worker


@pytest.fixture(scope="module")
def result() -> dict:
    # Compile-time flags only (both runs get them): the worker's cost is XLA compiling two backward passes.
    return run_worker("_train_sharded_worker.py", xla_flags="--xla_backend_optimization_level=0 "
                                                            "--xla_llvm_disable_expensive_passes=true")


@pytest.mark.parametrize("recipe", ["distill", "head"])
def test_same_losses_on_a_mesh(result, recipe):
    single, mesh = result["losses"][f"{recipe}@single"], result["losses"][f"{recipe}@2x4"]
    print(f"\n{recipe} one device: {single}\n{recipe} 2x4 mesh:   {mesh}")
    assert len(single) == len(mesh) == 4
    np.testing.assert_allclose(mesh, single, rtol=1e-5)
    assert single[-1] < single[0]                                    # it trains


@pytest.mark.parametrize("recipe", ["distill", "head"])
def test_frozen_target_split_over_model(result, recipe):
    layout = result["layout"][recipe]
    frozen = layout["frozen"]
    for layer in (0, 1):
        assert frozen[f"['layers'][{layer}]['wq']"] == [None, "model"]
        assert frozen[f"['layers'][{layer}]['w_down']"] == ["model", None]
        assert frozen[f"['layers'][{layer}]['attn_norm']"] == []
    assert frozen["['embed']"] == ["model", None]
    assert layout["frozen_wq_shard"] == [32, 8]                      # wq [32, 32]: columns over model=4
    if recipe == "distill":                                          # a Llama draft: the target's layout
        assert layout["trained"]["['embed']"] == ["model", None]
        assert layout["trained"]["['layers'][0]['wq']"] == [None, "model"]
    else:                                                            # head weights: replicated by default
        assert layout["trained"] == {"['b']": [], "['w']": []}


def test_resume_under_mesh(result):
    assert result["resumed_from"] == 2
    np.testing.assert_allclose(result["losses"]["head@2x4-resumed"], result["losses"]["head@2x4"], rtol=0,
                               atol=1e-6)


def test_frozen_target_features():
    cfg = skeleton.lm_config(vocab_size=64, hidden=32, layers=2, heads=2, kv_heads=1, intermediate=64, max_len=64,
                             eos_id=0)
    params = np_init(cfg, 0, std=0.1)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 8)), jnp.int32)

    @jax.jit                                     # one compile for everything checked (eager dispatch is slow)
    def run(p):
        feats = frozen_target_features(p, cfg, tokens, layers=(1, 0, -1))
        total = lambda p: sum(jnp.sum(x) for x in jax.tree.leaves(frozen_target_features(p, cfg, tokens)))
        return feats, full_logits(p, cfg, tokens), jax.grad(total)(p)

    feats, logits, grads = run(params)
    np.testing.assert_allclose(feats.logits, logits, rtol=1e-6, atol=1e-6)
    assert feats.hidden.shape == (2, 8, 32) and len(feats.layers) == 3
    np.testing.assert_array_equal(feats.layers[0], feats.layers[2])   # -1 is the last layer, in the order asked
    assert not np.allclose(feats.layers[0], feats.layers[1])
    assert all(float(jnp.abs(g).max()) == 0 for g in jax.tree.leaves(grads))   # frozen: no gradient reaches it
    with pytest.raises(ValueError, match="out of range"):
        frozen_target_features(params, cfg, tokens, layers=(2,))
