"""The seam between the model and its backends (specjax.ops): every backend choice of every op computes the op's
definition on the tiny model (the CPU kernels and the Pallas attention through the seam, to float32 rounding), the
choice in force is the one that runs (and xla traces no backend at all), gradients through a backend are the
definition's, a backend written as a user would write one is one file plus one registration line
(tests/_two_pass_rms_norm_backend.py), and a bad choice is named."""
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import _two_pass_rms_norm_backend as two_pass
import specjax
from specjax import SpecConfig, ops, settings
from specjax.cache import KVCache
from specjax.models.llama import forward
from tiny import ragged_prompts, tiny_model


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(0)


def _forward_logits(model, prompts):
    """A prefill over the padded prompts and a 3-position verify-like forward after it (decode and verify
    shapes), jitted: the logits of both."""
    cfg = model.config
    ids = jnp.asarray(np.stack([np.resize(p, 12) for p in prompts]), jnp.int32)

    @jax.jit
    def run(params, ids):
        cache = KVCache.init(cfg.num_layers, ids.shape[0], 32, cfg.num_kv_heads, cfg.head_dim)
        first = forward(params, cfg, ids, cache)
        cache = first.cache.replace(lengths=first.cache.lengths + ids.shape[1])
        second = forward(params, cfg, ids[:, :3], cache)
        return first.logits, second.logits
    return run(model.params, ids)


CHOICES = [(op, choice) for op in settings.OPS for choice in ("auto", "xla", *ops.registered_backends(op))]


@pytest.mark.parametrize("op,choice", CHOICES, ids=[f"{op}-{c}" for op, c in CHOICES])
def test_every_backend_choice_computes_the_definition(tiny, op, choice):
    prompts = ragged_prompts(3, seed=4)
    with settings.use_backends("xla"):
        want = _forward_logits(tiny, prompts)
    with settings.use_backends("xla", **{op: choice}):
        got = _forward_logits(tiny, prompts)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)


def test_greedy_decoding_on_xla_everywhere_is_the_default_backends(tiny):
    """The library runs with no backend at all (every op its XLA-lowered definition): the same greedy tokens,
    plain and speculative, as with the CPU kernels."""
    prompts = ragged_prompts(4, seed=5)
    configs = (SpecConfig(max_new_tokens=12), SpecConfig(method="ngram", num_speculative_tokens=3, max_new_tokens=12))
    default = [specjax.generate(tiny, prompts, c).tokens for c in configs]
    with settings.use_backends("xla"):
        assert [specjax.generate(tiny, prompts, c).tokens for c in configs] == default


def test_the_choice_in_force_is_the_one_that_runs(tiny):
    x, w = jnp.ones((2, 3, 8)), jnp.linspace(0.5, 1.5, 8)
    two_pass.TRACED.clear()
    with settings.use_backends(rms_norm="two_pass_rms_norm"):
        jax.jit(lambda x: ops.rms_norm(x, w, 1e-5))(x)
    assert two_pass.TRACED == [(2, 3, 8)]
    for choice in ("xla", "auto"):
        with settings.use_backends(rms_norm=choice):
            jax.jit(lambda x: ops.rms_norm(x, w, 1e-5))(x)
    assert two_pass.TRACED == [(2, 3, 8)]                  # neither traced the test backend
    with settings.use_backends("xla"):                     # xla: no custom call of any backend in the program
        text = jax.jit(lambda p, t: forward(p, tiny.config, t, KVCache.init(2, 1, 8, 2, 8)).logits).lower(
            tiny.params, jnp.ones((1, 4), jnp.int32)).as_text()
        assert "custom_call" not in text


def test_gradients_through_a_backend_are_the_definitions():
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 16))
    w = jnp.linspace(0.5, 1.5, 16)
    loss = lambda x, w: jnp.sum(jnp.sin(ops.rms_norm(x, w, 1e-5)))
    with settings.use_backends("xla"):
        want = jax.grad(loss, argnums=(0, 1))(x, w)
    for choice in ops.registered_backends("rms_norm"):
        with settings.use_backends(rms_norm=choice):
            got = jax.grad(loss, argnums=(0, 1))(x, w)
        for g, r in zip(got, want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-6)


def test_a_bad_choice_is_named():
    with pytest.raises(ValueError, match="no backend named 'nope' for op 'rms_norm'"):
        with settings.use_backends(rms_norm="nope"):
            ops.rms_norm(jnp.ones((2, 8)), jnp.ones((8,)), 1e-5)
    with pytest.raises(ValueError, match="unknown op 'softmax'"):
        with settings.use_backends(softmax="xla"):
            pass
    with pytest.raises(ValueError, match="a backend choice is"):
        with settings.use_backends(rms_norm="no spaces"):
            pass
    with pytest.raises(ValueError, match="may not be named 'xla'"):
        ops.register_backend("rms_norm", ops.Backend("xla", lambda x, w, eps: x))


def test_the_library_runs_without_its_backend_packages(tiny):
    """Without cpu_kernels and pallas_kernels (as if not installed) specjax imports and decodes on XLA alone: the
    tokens of the in-process run with every op on its definition."""
    prompts = ragged_prompts(3, seed=6)
    with settings.use_backends("xla"):
        want = specjax.generate(tiny, prompts, SpecConfig(max_new_tokens=10)).tokens
    code = ("import sys, json; sys.modules['cpu_kernels'] = None; sys.modules['pallas_kernels'] = None\n"
            "import specjax; from specjax import SpecConfig, ops; from tiny import tiny_model, ragged_prompts\n"
            "assert ops.registered_backends('linear') == () and ops.registered_backends('attention') == ()\n"
            f"print(json.dumps(specjax.generate(tiny_model(0), ragged_prompts(3, seed=6), "
            "SpecConfig(max_new_tokens=10)).tokens))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.abspath(__file__)), env={**os.environ, "JAX_PLATFORMS": "cpu"},
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == json.dumps(want)
