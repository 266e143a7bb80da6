"""Tensor parallelism for a checkpoint the model axis does not divide (issue 16), in its own process with 8 virtual
CPU devices (tests/test_tp_layout.py sets XLA_FLAGS before jax starts). Prints one JSON object.

The target has an odd vocabulary (517: padded to 640 on model axes 2..8) and 2 kv heads under 8 query heads
(replicated 2x on model=4, 4x on model=8); the draft model is the same architecture with noise, so it is padded
and replicated too. Each method runs on one device and on every mesh; the test asserts identical tokens.

    python tests/_tp_worker.py [method,...]        # default: all of METHODS

A method not in METHODS is a conformance factory (tests/conformance_factories.py) (e.g. medusa, eagle, eagle3,
draft_model-dynamic_tree): head drafters keep their own vocabulary-wide weights replicated (their param_specs
replicate what the model axis does not divide) and read the target's LM head / embedding cut back to the
logical vocabulary.
"""
from __future__ import annotations

import json
import os
import sys

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import specjax  # noqa: E402
from specjax import SpecConfig, layout, sharding  # noqa: E402
from specjax.cache import KVCache  # noqa: E402
from specjax.models.llama import kv_heads  # noqa: E402
from conformance_factories import FACTORIES, Case  # noqa: E402
from tiny import perturbed, ragged_prompts, tiny_model  # noqa: E402

VOCAB = 517
MESHES = [(8, 1), (2, 4), (1, 8)]
MAX_NEW = 12
# method name -> (SpecConfig fields, which drafter). "tree": a static 4-node tree proposed by the draft model.
METHODS = {
    "none": (dict(), None),
    "chain": (dict(method="draft_model", num_speculative_tokens=3), "draft"),
    "ngram": (dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3), None),
    "tree": (dict(method="draft_model", tree_choices=((0,), (1,), (0, 0))), "draft"),
    "sampled": (dict(method="draft_model", num_speculative_tokens=3, temperature=1.0), "draft"),
}


def main(methods: list[str]) -> None:
    assert jax.device_count() == 8, jax.devices()
    target = tiny_model(0, vocab=VOCAB, hidden=64, heads=8, kv_heads=2)
    draft = perturbed(target, 0.02)                         # accepts some drafts, rejects others
    # 5 rows: padded on every data axis > 1. Each prompt is text, its greedy continuation, and the text again (a
    # revision of earlier output: prompt lookup's case), so that prompt lookup both accepts and rejects on this
    # random toy, whose own output repeats nothing.
    text = ragged_prompts(5, vocab=VOCAB, seed=5)
    continued = specjax.generate(target, text, SpecConfig(max_new_tokens=MAX_NEW)).tokens
    prompts = [list(t) + list(c) + list(t) for t, c in zip(text, continued)]
    out: dict = {"tokens": {}, "stats": {}, "memory": {}}
    for method in methods:
        if method in METHODS:
            kw, which = METHODS[method]
            drafter = draft if which else None
        else:
            plain = specjax.generate(target, prompts, SpecConfig(max_new_tokens=MAX_NEW)).tokens
            kw, drafter = FACTORIES[method](Case(target, 3, prompts, plain))
        cfg = SpecConfig(max_new_tokens=MAX_NEW, **kw)
        for shape in [None] + MESHES:
            mesh = sharding.make_mesh(*shape) if shape else None
            res = specjax.generate(target, prompts, cfg, drafter=drafter, mesh=mesh, seed=3)
            key = f"{method}@{shape[0]}x{shape[1]}" if shape else f"{method}@single"
            out["tokens"][key] = res.tokens
            out["stats"][key] = {k: res.stats[k] for k in ("accepted", "rejected") if k in res.stats}

    # Per-device bytes, measured, against layout.memory_per_device (float32: 4 bytes).
    B, S = 8, 64
    for shape in MESHES:
        mesh = sharding.make_mesh(*shape)
        params = sharding.shard_params(target.params, target.config, mesh)
        with jax.set_mesh(mesh):                             # KVCache.init pins the cache layout under a mesh
            cache = jax.jit(lambda: KVCache.init(target.config.num_layers, B, S, kv_heads(params, target.config),
                                                 target.config.head_dim))()
        arith = layout.memory_per_device(target.config, *shape, dtype_bytes=4)
        out["memory"][f"{shape[0]}x{shape[1]}"] = {
            "params": sorted(set(sharding.bytes_per_device(params).values())),
            "cache": sorted(set(sharding.bytes_per_device((cache.k, cache.v)).values())),
            "params_arith": arith.params, "params_replication": arith.params_replication,
            "params_padding": arith.params_padding,
            "cache_arith": arith.kv_per_token * B // shape[0] * S,
            "kv_per_token_replication": arith.kv_per_token_replication,
            "layout": arith.layout._asdict(),
            "embed_shape": list(params["embed"].shape),
            "wk_shard_shape": list(params["layers"][0]["wk"].addressable_shards[0].data.shape)}
    # Loading a checkpoint straight into the layout (sharding.placer: each device reads its own source rows) gives
    # the arrays shard_params places; saving it again writes the logical checkpoint back.
    import tempfile
    import numpy as np
    from specjax.models.hf_io import load_pretrained, save_pretrained
    out["load"] = {}
    with tempfile.TemporaryDirectory() as d:
        save_pretrained(target.params, target.config, d)
        for shape in [(2, 4), (1, 8)]:
            mesh = sharding.make_mesh(*shape)
            loaded = specjax.load_model(d, mesh=mesh)
            placed = sharding.shard_params(target.params, target.config, mesh)
            same = jax.tree_util.tree_map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))
                                                            and a.sharding.is_equivalent_to(b.sharding, a.ndim)),
                                          loaded.params, placed)
            save_pretrained(loaded.params, loaded.config, os.path.join(d, "again"))
            again, _, _ = load_pretrained(os.path.join(d, "again"))
            back = jax.tree_util.tree_map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))),
                                          again, target.params)
            out["load"][f"{shape[0]}x{shape[1]}"] = {"same_as_placed": all(jax.tree_util.tree_leaves(same)),
                                                     "saved_back": all(jax.tree_util.tree_leaves(back))}
    out["memory"]["total_params"] = sum(x.nbytes for x in jax.tree_util.tree_leaves(target.params))
    out["memory"]["total_cache"] = 2 * target.config.num_layers * B * S * 2 * target.config.head_dim * 4
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main([m for m in sys.argv[1].split(",") if m] if len(sys.argv) > 1 else list(METHODS))
