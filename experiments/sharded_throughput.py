"""Tokens/s of plain greedy and draft_model speculative decoding on a (data, model) mesh vs one device, and the
per-device memory (weights and KV cache).

  python -m experiments.sharded_throughput --meshes=1x8,2x4,8x1 --new_tokens=64
  python -m experiments.sharded_throughput --vocab=4099 --kv_heads=2      # padded vocabulary, replicated kv heads

Runs on however many devices jax sees; on a CPU-only machine the script asks XLA for --devices virtual devices
(they share the host's cores, so this measures the overhead of the sharded program, not a speedup).
The drafter is the target with noise added (same size as the target): it exercises the speculative loop on
the mesh; its tokens/s is not a speculative speedup claim.
"""
from __future__ import annotations

import os
import sys

# jax reads XLA_FLAGS once, at startup: set the virtual device count before importing it.
_n = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--devices=")), "8")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={_n}").strip()

import time  # noqa: E402

from absl import app, flags  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

import specjax  # noqa: E402
from specjax import SpecConfig, layout, sharding  # noqa: E402
from specjax.models import Model  # noqa: E402
from specjax.models.config import ModelConfig  # noqa: E402
from specjax.models.llama import init_params  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("devices", 8, "virtual CPU devices (read before jax starts)")
flags.DEFINE_list("meshes", ["1x8", "2x4", "8x1"], "data x model meshes to compare with one device")
flags.DEFINE_integer("hidden", 256, "hidden size")
flags.DEFINE_integer("layers", 4, "decoder layers")
flags.DEFINE_integer("heads", 8, "attention heads")
flags.DEFINE_integer("kv_heads", 0, "kv heads (0: = heads); fewer than the model axis are replicated")
flags.DEFINE_integer("vocab", 4096, "vocabulary (one the model axis does not divide is padded)")
flags.DEFINE_integer("batch", 8, "requests per generate call")
flags.DEFINE_integer("prompt_len", 32, "prompt tokens")
flags.DEFINE_integer("new_tokens", 64, "generated tokens per request")
flags.DEFINE_integer("k", 4, "draft tokens per step")
flags.DEFINE_float("draft_noise", 0.002, "std of the noise added to the target's weights to make the drafter")
flags.DEFINE_integer("repeats", 3, "timed runs (median reported)")


def build() -> tuple[Model, Model]:
    h = FLAGS.hidden
    cfg = ModelConfig(vocab_size=FLAGS.vocab, hidden_size=h, intermediate_size=2 * h, num_layers=FLAGS.layers,
                      num_heads=FLAGS.heads, num_kv_heads=FLAGS.kv_heads or FLAGS.heads, head_dim=h // FLAGS.heads,
                      max_position_embeddings=4096)
    params = init_params(cfg, jax.random.PRNGKey(0), std=0.1)
    leaves, tree = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
    noisy = [x + FLAGS.draft_noise * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    return Model(cfg, params, None, "target"), Model(cfg, jax.tree_util.tree_unflatten(tree, noisy), None, "draft")


def timed(fn) -> tuple[float, object]:
    res = fn()                                              # compile + warm up
    times = []
    for _ in range(FLAGS.repeats):
        t0 = time.perf_counter()
        res = fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), res


def main(_):
    target, draft = build()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, FLAGS.vocab, FLAGS.prompt_len).tolist() for _ in range(FLAGS.batch)]
    runs = {"plain": (SpecConfig(max_new_tokens=FLAGS.new_tokens), None),
            "draft_model": (SpecConfig(method="draft_model", num_speculative_tokens=FLAGS.k,
                                       max_new_tokens=FLAGS.new_tokens), draft)}
    cfg = target.config
    param_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(target.params))
    print(f"{jax.device_count()} devices ({jax.devices()[0].platform}); model {cfg.num_layers}L h{cfg.hidden_size} "
          f"{cfg.num_heads}q/{cfg.num_kv_heads}kv heads, vocab {cfg.vocab_size}, "
          f"{target.config.num_params() / 1e6:.1f}M params ({param_bytes / 2**20:.1f} MiB f32); batch "
          f"{FLAGS.batch}, prompt {FLAGS.prompt_len}, {FLAGS.new_tokens} new tokens, k={FLAGS.k}")
    print(f"{'mesh':>8} {'method':>12} {'tok/s':>9} {'vs 1 dev':>9} {'alpha':>6} {'same':>5} "
          f"{'params/dev MiB':>15} {'kv cache/dev MiB':>17} {'kv copies':>9} {'vocab placed':>12}")
    base: dict[str, tuple[float, list]] = {}
    for mesh_name in ["single"] + FLAGS.meshes:
        mesh = None if mesh_name == "single" else sharding.make_mesh(*map(int, mesh_name.split("x")))
        if mesh is None:
            per_dev, data, model = param_bytes, 1, 1
        else:
            per_dev = max(sharding.bytes_per_device(sharding.shard_params(target.params, cfg, mesh)).values())
            data, model = (dict(zip(mesh.axis_names, mesh.axis_sizes))[a] for a in ("data", "model"))
        mem = layout.memory_per_device(cfg, data, model, dtype_bytes=4)    # cache per device, kv copies counted
        for name, (spec, drafter) in runs.items():
            wall, res = timed(lambda: specjax.generate(target, prompts, spec, drafter=drafter, mesh=mesh))
            tps = res.stats["generated_tokens"] / wall
            if mesh is None:
                base[name] = (tps, res.tokens)
            ratio, same = tps / base[name][0], res.tokens == base[name][1]
            alpha = res.stats["alpha"]
            # Weights of the drafter (same size as the target here) double the params per device.
            w = per_dev * (2 if drafter is not None else 1)
            # The cache generate() allocated (its buffer_len), rows per device.
            kv = (mem.kv_per_token * res.stats["buffer_len"] * -(-FLAGS.batch // data)
                  * (2 if drafter is not None else 1))
            print(f"{mesh_name:>8} {name:>12} {tps:9.1f} {ratio:8.2f}x {alpha:6.2f} {str(same):>5} "
                  f"{w / 2**20:15.2f} {kv / 2**20:17.2f} {mem.layout.kv_repeat:>9} {mem.layout.vocab:>12}",
                  flush=True)


if __name__ == "__main__":
    app.run(main)
