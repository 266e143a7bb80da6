"""load_model(weight_format="panels") / to_panels: the same float32 values rearranged for the CPU kernel (each layer
matrix a PanelMatrix, q/k/v and gate/up fused). The model's logits are the float32 model's bit for bit, and so is
its greedy output, plain and speculative (a chain that shares the target's layers, a draft model, a tree), batch 1
and 3; a mesh and an HF export read them back row-major; load_model takes panels by default where the kernel runs.
A tied head whose vocabulary the kernel takes (a multiple of 16) gets panels of its own: the hidden states stay bit
for bit, the logits equal up to float32 rounding, and speculative greedy output is its plain greedy output."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from cpu_kernels import build
from specjax import SpecConfig, settings
from specjax.models.hf_io import load_pretrained
from specjax.models.weights import PanelMatrix
from specjax.models.model import Model, from_panels, to_panels, weight_arrays
from specjax.cache import KVCache
from specjax.drafters.base import target_weight
from specjax.models.llama import forward
from tiny import BASELINE_MAX_NEW, ragged_prompts, tiny_model

pytestmark = pytest.mark.skipif(build.load() is None, reason="no C++ compiler: the kernel cannot be built here")


@pytest.fixture(scope="module")
def panels(target):
    return Model(target.config, to_panels(target.params), target.tokenizer, "tiny-panels")


def test_layers_are_panels_and_logits_are_bit_identical(target, panels):
    layer = panels.params["layers"][0]
    assert {"wqkv", "wo", "w_gate_up", "w_down"} <= set(layer) and "wq" not in layer and "w_up" not in layer
    assert all(isinstance(layer[k], PanelMatrix) for k in ("wqkv", "wo", "w_gate_up", "w_down"))
    np.testing.assert_array_equal(np.asarray(layer["wo"].dequantize()), np.asarray(target.params["layers"][0]["wo"]))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, target.config.vocab_size, (2, 11)), jnp.int32)
    np.testing.assert_array_equal(np.asarray(panels.logits(ids)), np.asarray(target.logits(ids)))


def test_greedy_output_is_the_float32_models(panels, draft, baselines):
    batch = 3                          # rows of different lengths (batch 1: the mesh test below)
    prompts = ragged_prompts(batch, seed=batch)
    skip = dict(drafter_options=dict(skip_layers=[1]))
    for method, opts, drafter in (("none", {}, None), ("ngram", dict(num_speculative_tokens=4), None),
                                  ("draft_model", dict(num_speculative_tokens=3), draft),
                                  ("layer_skip", dict(num_steps=2, topk=2, num_draft_tokens=4, **skip), None)):
        cfg = SpecConfig(method=method, max_new_tokens=BASELINE_MAX_NEW, **opts)
        assert specjax.generate(panels, prompts, cfg, drafter=drafter).tokens == baselines[batch], (method, batch)


def test_a_mesh_and_an_export_read_the_panels_back_row_major(target, panels, baselines, tmp_path):
    """generate(mesh=...) places the row-major matrices (panels are one device's layout) and save_pretrained
    writes them: the same greedy tokens, the same weights read back."""
    back = from_panels(panels.params, panels.config)
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(target.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    cfg = SpecConfig(max_new_tokens=BASELINE_MAX_NEW)
    assert specjax.generate(panels, ragged_prompts(1, seed=1), cfg, mesh=mesh).tokens == baselines[1]
    assert specjax.generate(panels, ragged_prompts(1, seed=1), SpecConfig(
        method="ngram", num_speculative_tokens=4, max_new_tokens=BASELINE_MAX_NEW)).tokens == baselines[1]
    panels.save_pretrained(tmp_path / "out")
    saved, _, _ = load_pretrained(tmp_path / "out")
    np.testing.assert_array_equal(np.asarray(saved["layers"][1]["wk"]), np.asarray(target.params["layers"][1]["wk"]))
    with pytest.raises(ValueError, match="weight_format"):
        specjax.load_model("stdlib-target", weight_format="panel")


def test_load_model_chooses_panels_where_the_kernel_runs():
    """weight_format="auto": panels on a CPU with the kernels on; row-major with the linear op's backend set to xla,
    another dtype, or when asked for float32."""
    assert isinstance(specjax.load_model("stdlib-draft").params["layers"][0]["wqkv"], PanelMatrix)
    assert "wq" in specjax.load_model("stdlib-draft", weight_format="float32").params["layers"][0]
    assert "wq" in specjax.load_model("stdlib-draft", dtype=jnp.bfloat16).params["layers"][0]
    with settings.use_backends(linear="xla"):
        assert "wq" in specjax.load_model("stdlib-draft").params["layers"][0]


def test_a_tied_head_in_panels_of_its_own():
    """vocab 64: to_panels adds head_panels (embed.T), which the model's head and a drafter reading the target's
    output head (layer-skip) both use; from_panels drops it; counts see the embedding once."""
    row_major = tiny_model(3, vocab=64, tie_word_embeddings=True)
    panels = Model(row_major.config, to_panels(row_major.params), None, "tiny64-panels")
    head = panels.params["head_panels"]
    assert isinstance(head, PanelMatrix) and head.shape == (32, 64)
    np.testing.assert_array_equal(np.asarray(head.dequantize()), np.asarray(row_major.params["embed"]).T)
    assert set(target_weight(panels.params, "output_head")) == {"head_panels"}
    assert "head_panels" not in from_panels(panels.params, panels.config)
    assert sum(x.size for x in weight_arrays(panels.params)) == row_major.config.num_params()
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 11)), jnp.int32)
    cache = lambda m: KVCache.init(m.config.num_layers, 2, 16, m.config.num_kv_heads, m.config.head_dim)
    out_panels = forward(panels.params, panels.config, ids, cache(panels))
    out_rows = forward(row_major.params, row_major.config, ids, cache(row_major))
    np.testing.assert_array_equal(np.asarray(out_panels.hidden), np.asarray(out_rows.hidden))
    np.testing.assert_allclose(np.asarray(out_panels.logits), np.asarray(out_rows.logits), rtol=1e-5, atol=1e-5)
    zeroed = {**panels.params, "head_panels": PanelMatrix(jnp.zeros_like(head.panels))}     # the head read is its own
    assert not np.any(np.asarray(forward(zeroed, panels.config, ids, cache(panels)).logits))
    skip = dict(drafter_options=dict(skip_layers=[1]))
    for batch in (1, 3):
        prompts = ragged_prompts(batch, vocab=64, seed=batch)
        plain = specjax.generate(panels, prompts, SpecConfig(max_new_tokens=BASELINE_MAX_NEW)).tokens
        for method, opts, drafter in (("ngram", dict(num_speculative_tokens=4), None),
                                      ("layer_skip", dict(num_steps=2, topk=2, num_draft_tokens=4, **skip), None),
                                      ("layer_skip", dict(num_speculative_tokens=3, **skip), None)):
            cfg = SpecConfig(method=method, max_new_tokens=BASELINE_MAX_NEW, **opts)
            assert specjax.generate(panels, prompts, cfg, drafter=drafter).tokens == plain, (method, batch)
