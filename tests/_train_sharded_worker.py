"""Runs in its own process with 8 virtual CPU devices (tests/test_train_sharded.py sets XLA_FLAGS before jax starts)
and prints one JSON object: per-step losses of two frozen-target recipes trained by train.loop on one device and on
a (2, 4) mesh, the layout of the frozen target and the trained params, and a resume under the mesh."""
from __future__ import annotations

import json
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from specjax import sharding  # noqa: E402
from specjax.models.llama import init_params  # noqa: E402
from train import data, loop, skeleton  # noqa: E402
from train.losses.common import frozen_target_features  # noqa: E402
from train.losses.draft_model import distill_loss_fn  # noqa: E402

STEPS = 4
# Every dim the "model" axis splits is divisible by 4: heads 4, kv heads 4, intermediate 64, vocab 64.
TARGET = skeleton.lm_config(vocab_size=64, hidden=32, layers=2, heads=4, kv_heads=4, intermediate=64, max_len=64,
                            eos_id=0)
DRAFT = skeleton.lm_config(vocab_size=64, hidden=16, layers=1, heads=2, kv_heads=1, intermediate=32, max_len=64,
                           eos_id=0)


def np_init(cfg, seed: int, std: float) -> dict:
    """init_params' layout (unit norms, normal(0, std) matrices) drawn with numpy: jax's eager random init compiles
    a program per leaf shape, which costs more than the rest of a small test."""
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
    return jax.tree.map(lambda s: np.ones(s.shape, np.float32) if len(s.shape) == 1
                        else (std * rng.standard_normal(s.shape)).astype(np.float32), shapes)


def head_loss_fn(params, batch, rng, target_params):
    """A Medusa/EAGLE-3-style head: a linear map of the frozen target's final hidden state and two layers'
    outputs at position i, predicting token i + 2."""
    del rng
    feats = frozen_target_features(target_params, TARGET, batch[:, :-1], layers=(0, -1))
    x = jnp.concatenate([feats.hidden, *feats.layers], axis=-1)[:, :-1]
    logits = x @ params["w"] + params["b"]
    labels = batch[:, 2:]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return ce, {"acc": jnp.mean(jnp.argmax(logits, -1) == labels)}


def main() -> None:
    assert jax.device_count() == 8, jax.devices()
    target = np_init(TARGET, 0, std=0.1)
    tokens = (np.cumsum(np.random.default_rng(0).integers(1, 3, 4000)) % 64).astype(np.uint16)
    batches = data.PackedBatches(tokens, seq_len=16, batch_size=4, seed=0)
    recipes = {
        "distill": (np_init(DRAFT, 1, std=0.02), distill_loss_fn(DRAFT, TARGET, 0.1, 1.0)),
        "head": ({"w": (0.02 * np.random.default_rng(2).standard_normal((3 * TARGET.hidden_size, 64))
                        ).astype(np.float32), "b": np.zeros((64,), np.float32)}, head_loss_fn),
    }
    mesh = sharding.make_mesh(2, 4)

    def train(name, mesh, ckpt_dir=None, stop_at=None):
        params, loss_fn = recipes[name]
        frozen = loop.place(target, mesh) if mesh is not None else target
        cfg = loop.TrainConfig(steps=STEPS, lr=1e-2, warmup_steps=1, log_every=100, save_every=100, mesh=mesh,
                               ckpt_dir=ckpt_dir, stop_at=stop_at)
        return loop.train(params, loss_fn, batches.batch, cfg, frozen=frozen, log=lambda m: None), frozen

    out: dict = {"losses": {}, "layout": {}}
    for name in recipes:
        out["losses"][f"{name}@single"] = train(name, None)[0].losses
        res, frozen = train(name, mesh)
        out["losses"][f"{name}@2x4"] = res.losses
        spec = lambda x: [a if a is None else str(a) for a in x.sharding.spec]
        out["layout"][name] = {
            "frozen": {jax.tree_util.keystr(p): spec(x) for p, x in jax.tree_util.tree_leaves_with_path(frozen)},
            "frozen_wq_shard": list(frozen["layers"][0]["wq"].addressable_shards[0].data.shape),
            "trained": {jax.tree_util.keystr(p): spec(x) for p, x in jax.tree_util.tree_leaves_with_path(res.params)},
        }
    # Checkpoint and resume under the mesh (the head recipe: its step compiles fastest; resume itself is
    # recipe-independent and tests/test_train_resume.py covers it on one device).
    with tempfile.TemporaryDirectory() as d:
        first = train("head", mesh, d, stop_at=2)[0]
        second = train("head", mesh, d)[0]
        out["losses"]["head@2x4-resumed"] = first.losses + second.losses
        out["resumed_from"] = second.start_step
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
