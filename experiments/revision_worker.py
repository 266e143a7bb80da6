"""One side of experiments.compare_revisions: run as a program with a revision's code first on sys.path
(PYTHONPATH=<worktree>), it measures THAT revision's specjax (and takes the timer, experiments.costs.fastest_seconds,
from it too) while this file comes from the working tree.

  PYTHONPATH=<revision dir> python experiments/revision_worker.py programs '{"methods": [...], ...}'
  PYTHONPATH=<revision dir> python experiments/revision_worker.py parts '{"batch_sizes": [...], ...}'

It prints READY <json> once it has compiled everything, then one ROUND <json> per stdin line (one timing round:
the harness alternates the sides round by round), and exits at the end of stdin.
  programs  READY: per method the optimized HLO of generate()'s decode loop (instructions, a hash with source
            metadata stripped, XLA's flop and byte estimates) and a hash of the greedy tokens; ROUND: per method
            tokens/s of one generate() call (stats: the loop and the host transfer, as generate() times it).
  parts     plain greedy decoding per batch size. READY: the shapes; ROUND: per batch size the seconds of
            full / half (the loop making N or N/2 new tokens, same buffer and caches: their difference / (N/2) is
            one step, prefill and compilation cancel out), forward (one cached target forward over T = 1 per row at
            its mid-run length over the loop's caches, carried through a lax.fori_loop and donated as the loop's
            state is, so its writes are in place), attention (the forward's attention alone, every layer) and
            cache_write (its cache writes alone), each per inner iteration.

Supported revisions: the current API (specjax.api.prepare, specjax.decode.decode_loop) and the one before it
(ded6b81: specjax.api.make_drafter, specjax.decode.decode); `loop_call` is the only place that tells them apart.
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import dataclasses
import hashlib
import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import specjax
from specjax import SpecConfig, api
from specjax.cache import GroupedKVCache, KVCache
from specjax.models.llama import forward, kv_heads
from experiments.costs import fastest_seconds

try:                                         # the op's definition in specjax.ops
    from specjax.ops import verify_attention_reference
except ImportError:                          # before specjax.ops: beside the Pallas kernel
    from pallas_kernels.verify_attention.reference import verify_attention_reference

try:                                         # generate() = prepare() + run(), the loop named decode_loop
    from specjax.decode import decode_loop as LOOP
    prepare = api.prepare
except ImportError:                          # ded6b81: generate() in one piece, the loop named decode
    from specjax.decode import decode as LOOP
    prepare = None

INNER = 16                                   # forward/attention/write iterations per timed call


def loop_call(model, prompts: list, config: SpecConfig, drafter=None, pad_to: int | None = None,
              prefill_groups: int = 4) -> tuple[tuple, dict]:
    """The decode loop's arguments exactly as this revision's generate() passes them (no mesh, seed 0)."""
    if prepare is not None:
        p = prepare(model, prompts, config, drafter, pad_to=pad_to, prefill_groups=prefill_groups)
        return ((p.target_params, p.draft_params, p.prompts, p.prompt_lengths, p.request_keys, jnp.int32(p.eos_id)),
                dict(cfg=p.model.config, drafter=p.drafter, spec=p.config, buffer_len=p.buffer_len,
                     prefill_groups=p.prefill_groups, prefill_order=p.prefill_order, cache_sizes=p.cache_sizes))
    ids = api.encode_all(model, prompts, "prompt")                   # ded6b81's generate(), step by step
    config = config.for_batch(len(ids))
    width = pad_to or api.prompt_bucket(max(map(len, ids)))
    buffer_len = config.max_cache_len or api.buffer_length(width, config.max_new_tokens, config.k)
    width = min(width, buffer_len)
    order, groups = api.plan_prefill([len(p) for p in ids], width, prefill_groups)
    keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.PRNGKey(0), jnp.arange(len(ids), dtype=jnp.uint32))
    drafter_obj, draft_params = api.make_drafter(model, config, drafter, ids, buffer_len)
    eos = model.eos_token_id if (config.stop_at_eos and model.eos_token_id is not None) else -1
    return ((model.params, draft_params, api.right_pad(ids, width), np.asarray([len(p) for p in ids], np.int32),
             np.asarray(keys), jnp.int32(eos)),
            dict(cfg=model.config, drafter=drafter_obj, spec=config, buffer_len=buffer_len, prefill_groups=groups,
                 prefill_order=None if len(groups) == 1 else order,
                 cache_sizes=api.group_cache_sizes(groups, buffer_len, config.max_new_tokens, config.k)))


def stripped_hlo(compiled_text: str) -> str:
    """Optimized HLO without what changes when only source locations do: the metadata attributes, everything
    before the first computation (the source-location tables) and the stack-frame ids."""
    text = re.sub(r", metadata=\{[^}]*\}", "", compiled_text)
    text = text[re.search(r"^(%|ENTRY)", text, re.M).start():]
    return re.sub(r", stack_frame_id=\d+", "", text)


def method_config(method: str, max_new_tokens: int, k: int) -> SpecConfig:
    if method == "none":
        return SpecConfig(max_new_tokens=max_new_tokens, stop_at_eos=False)
    return SpecConfig(method=method, num_speculative_tokens=k, max_new_tokens=max_new_tokens, stop_at_eos=False)


class Programs:
    """Each method's compiled decode loop and generate() call on the shipped target (and draft)."""

    def __init__(self, s: dict):
        self.target = specjax.load_model(s["target"], weight_format=s.get("weight_format", "auto"))
        self.drafters = {**({"draft_model": specjax.load_model(s["draft"])} if s.get("draft") else {}),
                         **s.get("drafters", {})}
        self.prompts, self.pad_to = s["prompts"], s["pad_to"]
        self.configs = {m: method_config(m, s["max_new_tokens"], s["k"]) for m in s["methods"]}

    def generate(self, method: str):
        return specjax.generate(self.target, self.prompts, self.configs[method], drafter=self.drafters.get(method),
                                pad_to=self.pad_to)

    def ready(self) -> dict:
        report = {}
        for m, config in self.configs.items():
            args, kwargs = loop_call(self.target, self.prompts, config, self.drafters.get(m), self.pad_to)
            compiled = LOOP.lower(*args, **kwargs).compile()
            text = stripped_hlo(compiled.as_text())
            cost = compiled.cost_analysis()
            cost = cost[0] if isinstance(cost, list) else cost
            tokens = self.generate(m).tokens                             # also compiles generate()'s own call
            report[m] = {"hlo_instructions": sum(1 for line in text.splitlines() if " = " in line),
                         "hlo_sha256": hashlib.sha256(text.encode()).hexdigest()[:16],
                         "flops": float(cost.get("flops", -1)), "bytes_accessed": float(cost.get("bytes accessed", -1)),
                         "tokens_sha256": hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]}
        return report

    def round(self) -> dict:
        out = {}
        for m in self.configs:
            stats = self.generate(m).stats
            out[m] = stats["generated_tokens"] / stats["wall_s"]
        return out


def _looped(body, carry):
    """(timed call, fresh input): INNER iterations of body in one jitted fori_loop whose carry is donated, as the
    decode loop's state is (else XLA copies the whole cache into the loop on every call, counted as its time); a
    fresh copy of the carry is made off the clock for each call."""
    run = jax.jit(lambda c: lax.fori_loop(0, INNER, body, c), donate_argnums=0)
    return (lambda c: jax.block_until_ready(run(c)),
            lambda: jax.block_until_ready(jax.tree_util.tree_map(jnp.copy, carry)))


class Parts:
    """Where a plain decode loop step goes, per batch size (see the module docstring)."""

    def __init__(self, s: dict):
        model = specjax.load_model(s["target"])
        cfg, new = model.config, s["max_new_tokens"]
        hkv = kv_heads(model.params, cfg)
        self.info, self.calls = {}, {}
        for B in s["batch_sizes"]:
            texts = [s["prompts"][i % len(s["prompts"])] for i in range(B)]
            args, kw = loop_call(model, texts, method_config("none", new, 0))
            # The half run keeps the full run's buffer and caches, so that the two differ in their steps only.
            half = {**kw, "spec": dataclasses.replace(kw["spec"], max_new_tokens=new // 2)}
            buf, sizes, groups, order = kw["buffer_len"], kw["cache_sizes"], kw["prefill_groups"], kw["prefill_order"]
            plens = jnp.asarray(args[3])
            lengths = plens + new // 2                                   # each row at its mid-run length
            if sizes:
                cuts = np.cumsum([0] + [rows for rows, _ in groups])
                parts = [(jnp.asarray(order[a:b]), size) for a, b, size in zip(cuts[:-1], cuts[1:], sizes)]
                cache = GroupedKVCache.of([KVCache.init(cfg.num_layers, len(r), size, hkv, cfg.head_dim)
                                           for r, size in parts], [r for r, _ in parts], lengths)
                part_caches = lambda cache: cache.parts
            else:
                parts = [(slice(None), buf)]
                cache = KVCache.init(cfg.num_layers, B, buf, hkv, cfg.head_dim).replace(lengths=lengths)
                part_caches = lambda cache: (cache,)

            def fwd_body(i, c, B=B):
                acc, cache = c
                out = forward(model.params, cfg, jnp.full((B, 1), i % cfg.vocab_size, jnp.int32), cache)
                return acc + out.logits[0, 0, 0], out.cache.replace(lengths=cache.lengths)

            q0 = jnp.ones((B, 1, cfg.num_heads, cfg.head_dim), jnp.float32)

            def attn_body(i, c, q0=q0, parts=parts, part_caches=part_caches):
                acc, cache = c
                for layer in range(cfg.num_layers):
                    for (rows, _), part in zip(parts, part_caches(cache)):
                        o = verify_attention_reference(q0[rows] * (i + layer), part.k[layer], part.v[layer],
                                                       cache.lengths[rows] + 1, keys_transposed=cache.keys_transposed)
                        acc = acc + o[0, 0, 0, 0]
                return acc, cache

            kv0 = jnp.ones((B, 1, hkv, cfg.head_dim), jnp.float32)

            def write_body(i, c, kv0=kv0):
                acc, cache = c
                for layer in range(cfg.num_layers):
                    cache = cache.write(layer, kv0 * i, kv0 * i, cache.lengths)
                return acc + jax.tree_util.tree_leaves(cache)[0].ravel()[0], cache

            carry = (jnp.float32(0), cache)
            self.calls[B] = {"full": (lambda a=args, k=kw: jax.block_until_ready(LOOP(*a, **k)), None, 1),
                             "half": (lambda a=args, k=half: jax.block_until_ready(LOOP(*a, **k)), None, 1),
                             **{name: (*_looped(body, carry), INNER) for name, body in
                                (("forward", fwd_body), ("attention", attn_body), ("cache_write", write_body))}}
            for fn, fresh, _ in self.calls[B].values():
                fn() if fresh is None else fn(fresh())                   # compile
            self.info[B] = {"prompt_pad": int(args[2].shape[1]), "buffer": buf,
                            "cache_slots": list(sizes or [buf]),
                            "slots_per_row": sum((B if isinstance(r, slice) else len(r)) * size
                                                 for r, size in parts) / B}

    def ready(self) -> dict:
        return self.info

    def round(self) -> dict:
        return {B: {name: fastest_seconds(fn, 1, fresh) / div for name, (fn, fresh, div) in calls.items()}
                for B, calls in self.calls.items()}


MODES = {"programs": Programs, "parts": Parts}


def main() -> None:
    mode, settings = sys.argv[1], json.loads(sys.argv[2])
    worker = MODES[mode](settings)
    print("READY " + json.dumps(worker.ready()), flush=True)
    for _ in sys.stdin:
        print("ROUND " + json.dumps(worker.round()), flush=True)


if __name__ == "__main__":
    main()
