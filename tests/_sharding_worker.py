"""Runs in its own process with 8 virtual CPU devices (tests/test_sharding.py sets XLA_FLAGS before jax starts)
and prints one JSON object: tokens on one device and on several meshes, per-device bytes, error messages."""
from __future__ import annotations

import json
import os
import sys
import tempfile

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import specjax  # noqa: E402
from tiny import perturbed, ragged_prompts, tiny_model  # noqa: E402
from specjax import SpecConfig  # noqa: E402
from specjax import layout, sharding  # noqa: E402

VOCAB = 64
MESHES = [(1, 8), (2, 4), (8, 1)]
METHODS = {"none": dict(), "draft_model": dict(num_speculative_tokens=3),
           "ngram": dict(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)}


def main() -> None:
    assert jax.device_count() == 8, jax.devices()
    # Every sharded dim divisible by 8: heads 8, kv heads 8, vocab 64, intermediate 128.
    target = tiny_model(0, vocab=VOCAB, hidden=64, heads=8, kv_heads=8)
    near = perturbed(target, 0.02)                          # accepts some drafts, rejects others
    small_draft = tiny_model(1, vocab=VOCAB, hidden=16, layers=1, heads=2, kv_heads=1, name="small")
    prompts = ragged_prompts(5, vocab=VOCAB, seed=5)         # 5 rows: padded on every data axis > 1
    out: dict = {"tokens": {}, "stats": {}}

    def run(method: str, mesh_shape, drafter=None, tag: str = ""):
        mesh = sharding.make_mesh(*mesh_shape) if mesh_shape else None
        cfg = SpecConfig(method=method, max_new_tokens=16, **METHODS[method])
        res = specjax.generate(target, prompts, cfg, drafter=drafter, mesh=mesh)
        key = f"{method}{tag}@{mesh_shape[0]}x{mesh_shape[1]}" if mesh_shape else f"{method}{tag}@single"
        out["tokens"][key] = res.tokens
        out["stats"][key] = {k: res.stats[k] for k in ("accepted", "rejected") if k in res.stats}

    for shape in [None] + MESHES:
        for method in METHODS:
            run(method, shape, near if method == "draft_model" else None)
    # A draft model with 1 kv head / 2 heads: its undividable dims stay replicated, the target is still split.
    run("draft_model", None, small_draft, "-small")
    run("draft_model", (2, 4), small_draft, "-small")

    # Per-device parameter bytes vs the total; the replicated norms are the only part not divided.
    total = sum(x.nbytes for x in jax.tree_util.tree_leaves(target.params))
    norms = sum(x.nbytes for p, x in jax.tree_util.tree_leaves_with_path(target.params) if "norm" in str(p[-1]))
    out["memory"] = {"total": total, "norms": norms}
    for shape in MESHES:
        mesh = sharding.make_mesh(*shape)
        per = sharding.bytes_per_device(sharding.shard_params(target.params, target.config, mesh))
        out["memory"][f"{shape[0]}x{shape[1]}"] = sorted(per.values())

    # Clear errors for meshes that cannot split the model (kv heads and vocabulary no longer refuse: they are
    # replicated and padded, tests/test_tp_layout.py; query heads must still split evenly).
    errors = {}
    for name, model in [("heads", tiny_model(0, vocab=VOCAB, hidden=48, heads=6, kv_heads=2))]:
        try:
            specjax.generate(model, prompts[:1], SpecConfig(max_new_tokens=2), mesh=sharding.make_mesh(1, 8))
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    try:
        layout.validate_mesh(target.config, sharding.make_mesh(2, 4), batch=5)
        errors["batch"] = None
    except ValueError as e:
        errors["batch"] = str(e)
    out["errors"] = errors

    # Loading straight into the sharded layout: same values, each leaf with its spec.
    from specjax.models.hf_io import save_pretrained
    with tempfile.TemporaryDirectory() as d:
        save_pretrained(target.params, target.config, d)
        mesh = sharding.make_mesh(2, 4)
        loaded = specjax.load_model(d, mesh=mesh)
        specs = layout.param_specs(loaded.config, loaded.params, mesh)
        same = jax.tree_util.tree_map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))),
                                      loaded.params, target.params)
        placed = jax.tree_util.tree_map(lambda a, s: a.sharding.spec == s, loaded.params, specs)
        out["load"] = {"equal": all(jax.tree_util.tree_leaves(same)),
                       "specs_ok": all(jax.tree_util.tree_leaves(placed)),
                       "wq_shard_shape": list(loaded.params["layers"][0]["wq"].addressable_shards[0].data.shape),
                       "tokens": specjax.generate(loaded, prompts, SpecConfig(max_new_tokens=16), mesh=mesh).tokens}
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
