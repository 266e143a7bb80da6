"""Runs in its own process with 8 virtual CPU devices (tests/workers.py sets XLA_FLAGS before jax starts): plain greedy
decoding on one device, and every conformance factory, greedy, on a (2, 4) mesh; prints one JSON object of tokens
and stats. (Each factory's single-device greedy output is plain greedy output: the conformance greedy matrix checks
that, so comparing with plain saves a compile per factory.)

Coverage: every drafter module of the package runs here through its factory -- base (none), draft_model (and
draft_model-target_embedding: our artifact of a draft reading the target's embedding, loaded by path), ngram,
predicted, medusa (shared and target_head projections), eagle (eagle, eagle3), suffix (its global cache on the
mesh), lookahead, mtp (mtp, mtp_heads), pard (and pard-target_embedding: our artifact, loaded by path), layer_skip
(drafting over the target's sharded cache), dflash (and dflash-draft_vocab: draft_vocab.py's map and its scatter to
the target's vocabulary, saved as an artifact with its int64 d2t and loaded by path) -- and the worker fails if a
registered method has no factory. The Medusa heads go through artifacts.py on the way: saved as a drafter artifact
and passed as a directory, so the artifact convention is exercised on the mesh too."""
from __future__ import annotations

import json
import os
import sys
import tempfile

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import specjax  # noqa: E402
from specjax import SpecConfig, sharding  # noqa: E402
from conformance_factories import FACTORIES, Case  # noqa: E402
from tiny import ragged_prompts, tiny_model  # noqa: E402

VOCAB = 64
MAX_NEW = 16


def main() -> None:
    assert jax.device_count() == 8, jax.devices()
    # Every dim the model axis splits is divisible by 4: heads 8, kv heads 4, intermediate 64, vocab 64.
    target = tiny_model(0, vocab=VOCAB, hidden=32, heads=8, kv_heads=4)
    prompts = ragged_prompts(5, vocab=VOCAB, seed=5)         # 5 rows: padded to the data axis of 2
    plain = specjax.generate(target, prompts, SpecConfig(max_new_tokens=MAX_NEW)).tokens
    case = Case(target, 3, prompts, plain)
    out: dict = {"plain": plain, "tokens": {}, "stats": {}}
    mesh = sharding.make_mesh(2, 4)
    tmp = tempfile.mkdtemp()
    for name, factory in FACTORIES.items():
        kw, drafter = factory(case)
        if name == "medusa":                  # through specjax/drafters/artifacts.py: save, then load by path
            from specjax.drafters import medusa
            medusa.save_heads(os.path.join(tmp, "heads"), drafter, target, "# conformance heads\n", dtype="float32")
            drafter = os.path.join(tmp, "heads")
        if name == "dflash-draft_vocab":      # the d2t map (an integer tensor) through the artifact convention
            from specjax.drafters import dflash
            dflash.save(os.path.join(tmp, "dflash"), drafter, target, "# conformance block drafter\n", dtype="float32")
            drafter = os.path.join(tmp, "dflash")
        if name == "draft_model-target_embedding":   # our draft model artifact (layers, head, d2t), loaded by path
            from specjax.drafters import draft_model
            draft_model.save(os.path.join(tmp, "draft"), drafter, target, "# conformance draft\n", dtype="float32")
            drafter = os.path.join(tmp, "draft")
        if name == "pard-target_embedding":   # our PARD artifact (layers, masks, d2t), loaded by path
            from specjax.drafters import pard
            pard.save_target_embedding(os.path.join(tmp, "pard"), drafter, target, "# conformance PARD\n",
                                       dtype="float32")
            drafter = os.path.join(tmp, "pard")
        res = specjax.generate(target, prompts, SpecConfig(**kw, max_new_tokens=MAX_NEW), drafter=drafter, mesh=mesh)
        out["tokens"][name] = res.tokens
        out["stats"][name] = {k: res.stats[k] for k in ("accepted", "rejected")}
    from specjax.drafters import registry
    run = {FACTORIES[n](case)[0].get("method", "none") for n in FACTORIES}
    missing = [m for m in registry.methods() if registry.get(m).build.__module__.startswith("specjax.drafters.")
               and m not in run]
    assert not missing, f"registered methods with no conformance factory: {missing}"
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
