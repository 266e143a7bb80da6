"""Tokens/s of plain greedy and draft_model speculative decoding on a (data, model) mesh vs one device, and the
per-device memory (weights and KV cache).

  python -m experiments.sharded_throughput --meshes=1x8,2x4,8x1 --new_tokens=64
  python -m experiments.sharded_throughput --vocab=4099 --kv_heads=2      # padded vocabulary, replicated kv heads

Runs on however many devices jax sees; on a CPU-only machine the script asks XLA for --devices virtual devices
(they share the host's cores, so this measures the overhead of the sharded program, not a speedup).
The drafter is the target with noise added (same size as the target): it exercises the speculative loop on
the mesh; its tokens/s is not a speculative speedup claim. Each call is prepared once (specjax.api.prepare: the
arrays placed on the mesh) and its runs timed, plain and speculative in alternating rounds
(experiments.costs.fastest_alternating); the rows are written under --out (experiments.tables.write_table).
"""
from __future__ import annotations

import os
import sys

# jax reads XLA_FLAGS once, at startup: set the virtual device count before importing it.
_n = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--devices=")), "8")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={_n}").strip()

from absl import app, flags  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

from specjax import SpecConfig, api, layout, sharding  # noqa: E402
from specjax.models import Model  # noqa: E402
from specjax.models.config import ModelConfig  # noqa: E402
from specjax.models.llama import init_params  # noqa: E402
from specjax.models.model import weight_arrays  # noqa: E402
from experiments import costs  # noqa: E402
from experiments.tables import write_table  # noqa: E402

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
flags.DEFINE_integer("rounds", 3, "alternating timed rounds of plain and speculative decoding (the fastest kept)")
flags.DEFINE_string("out", "runs/sharded_throughput/sharded_throughput", "path stem of the table (.csv, .json)")


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


def main(_):
    target, draft = build()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, FLAGS.vocab, FLAGS.prompt_len).tolist() for _ in range(FLAGS.batch)]
    runs = {"plain": (SpecConfig(max_new_tokens=FLAGS.new_tokens), None),
            "draft_model": (SpecConfig(method="draft_model", num_speculative_tokens=FLAGS.k,
                                       max_new_tokens=FLAGS.new_tokens), draft)}
    cfg = target.config
    param_bytes = sum(x.nbytes for x in weight_arrays(target.params))
    print(f"{jax.device_count()} devices ({jax.devices()[0].platform}); model {cfg.num_layers}L h{cfg.hidden_size} "
          f"{cfg.num_heads}q/{cfg.num_kv_heads}kv heads, vocab {cfg.vocab_size}, "
          f"{target.config.num_params() / 1e6:.1f}M params ({param_bytes / 2**20:.1f} MiB f32); batch "
          f"{FLAGS.batch}, prompt {FLAGS.prompt_len}, {FLAGS.new_tokens} new tokens, k={FLAGS.k}")
    print(f"{'mesh':>8} {'method':>12} {'tok/s':>9} {'vs 1 dev':>9} {'alpha':>6} {'same':>5} "
          f"{'params/dev MiB':>15} {'kv cache/dev MiB':>17} {'kv copies':>9} {'vocab placed':>12}")
    base: dict[str, tuple[float, list]] = {}
    records = []
    for mesh_name in ["single"] + FLAGS.meshes:
        mesh = None if mesh_name == "single" else sharding.make_mesh(*map(int, mesh_name.split("x")))
        if mesh is None:
            per_dev, data, model = param_bytes, 1, 1
        else:
            per_dev = max(sharding.bytes_per_device(sharding.shard_params(target.params, cfg, mesh)).values())
            data, model = (dict(zip(mesh.axis_names, mesh.axis_sizes))[a] for a in ("data", "model"))
        mem = layout.memory_per_device(cfg, data, model, dtype_bytes=4)    # cache per device, kv copies counted
        prepared = {name: api.prepare(target, prompts, spec, drafter=drafter, mesh=mesh)
                    for name, (spec, drafter) in runs.items()}
        seconds, results = costs.fastest_alternating({name: (lambda p=p: api.run(p)) for name, p in
                                                      prepared.items()}, FLAGS.rounds)
        for name, (spec, drafter) in runs.items():
            wall, res = seconds[name], results[name]
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
            records.append(dict(mesh=mesh_name, method=name, tokens_per_s=tps, vs_one_device=ratio, alpha=alpha,
                                same_tokens=same, params_mib_per_device=w / 2**20, kv_cache_mib_per_device=kv / 2**20,
                                kv_copies=mem.layout.kv_repeat, vocab_placed=mem.layout.vocab))
    write_table(records, FLAGS.out, meta={name: FLAGS[name].value for name in (
        "devices", "meshes", "hidden", "layers", "heads", "kv_heads", "vocab", "batch", "prompt_len", "new_tokens", "k",
        "draft_noise", "rounds")} | {"device_count": jax.device_count(), "platform": jax.devices()[0].platform})


if __name__ == "__main__":
    app.run(main)
