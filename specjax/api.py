"""The user-facing entry points: load_model() and generate() = prepare() + run(). Nothing in the library imports
this module."""
from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from specjax.checkpoints import available_drafters, available_models
from specjax.config import SpecConfig
from specjax.decode import decode_loop
from specjax.drafters import registry
from specjax.inputs import encode_all, right_pad
from specjax.metrics import summarize
from specjax.models.model import Model, load_model
from specjax.planning import buffer_length, group_cache_sizes, plan_prefill, prompt_bucket
from specjax.sharding import shard_for_generate, to_host

__all__ = ["GenerateResult", "Model", "Prepared", "available_drafters", "available_models", "compiled_text",
           "generate", "load_model", "prepare", "run"]


@dataclasses.dataclass
class GenerateResult:
    tokens: list[list[int]]
    texts: list[str] | None
    stats: dict


@dataclasses.dataclass(frozen=True)
class Prepared:
    """One generate() call, validated, planned and placed, ready to run (and to run again: experiments time
    run() on one Prepared). Built by prepare()."""
    model: Model
    config: SpecConfig                 # resolved for this batch size (the draft_len_schedule's k applied)
    request: registry.BuildRequest     # what the drafter was built from (its finish hook gets it back)
    drafter: Any                       # the static drafter object (an argument of the compiled loop)
    draft_params: Any                  # its arrays, placed
    target_params: dict                # placed
    prompts: jax.Array                 # [B', P] right-padded ids (B' >= B: padded to the mesh's data axis)
    prompt_lengths: jax.Array          # [B']
    request_keys: jax.Array            # [B', 2] one PRNG key per request
    eos_id: int                        # -1: no stop token
    prefill_groups: tuple              # ((num_rows, width), ...)
    prefill_order: Any                 # [B] rows in prompt-length order, None for one group
    cache_sizes: tuple | None          # each group's own cache slots, None: one buffer
    mesh: Mesh | None

    @property
    def num_requests(self) -> int:
        return len(self.request.prompts)

    @property
    def buffer_len(self) -> int:
        return self.request.buffer_len


def _as_config(config) -> SpecConfig:
    if config is None:
        return SpecConfig()
    if isinstance(config, dict):
        known = {f.name for f in dataclasses.fields(SpecConfig)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"config has unknown fields {unknown}; SpecConfig fields are {sorted(known)}")
        return SpecConfig(**config)
    if not isinstance(config, SpecConfig):
        raise TypeError(f"config must be a SpecConfig (or a dict of its fields), got {type(config).__name__}")
    return config


def prepare(model: Model, prompts: Sequence, config: SpecConfig | dict | None = None, drafter: Any = None,
            seed: int = 0, request_ids: Sequence[int] | None = None, mesh: Mesh | None = None,
            pad_to: int | None = None, prefill_groups: int = 4) -> Prepared:
    """Everything generate() does before decoding: validate the request (the config checked against its method
    and completed: registry.resolve), tokenize, plan the prefill and the caches, build the drafter (loading a
    directory or shipped name once) and place the arrays. Arguments as generate()'s."""
    config = registry.resolve(_as_config(config))   # checked against its method and completed (the static jit arg)
    if not isinstance(model, Model):
        raise TypeError(f"model must be a specjax Model (specjax.load_model(...)), got {type(model).__name__}")
    ids = encode_all(model, prompts, "prompt")
    scheduled = config.for_batch(len(ids))         # the draft_len_schedule's k for this many requests (resolved)
    if scheduled.method != config.method:          # k = 0 at this batch size: plain decoding, no drafter
        drafter = None
    config = scheduled
    k = config.k
    longest = max(map(len, ids))
    needed = longest + config.max_new_tokens + k + 1
    if config.max_cache_len is not None and needed > config.max_cache_len:
        raise ValueError(f"prompt too long for the cache: the longest prompt has {longest} tokens; with "
                         f"max_new_tokens={config.max_new_tokens} and {k + 1} verify slots it needs {needed} "
                         f"cache entries > max_cache_len={config.max_cache_len}")
    if longest + config.max_new_tokens > model.config.max_position_embeddings:
        raise ValueError(f"prompt ({longest} tokens) + max_new_tokens ({config.max_new_tokens}) exceeds the "
                         f"model's max_position_embeddings={model.config.max_position_embeddings}")
    width = prompt_bucket(longest)
    if pad_to is not None:
        if pad_to < longest:
            raise ValueError(f"pad_to={pad_to} is shorter than the longest prompt ({longest} tokens)")
        width = pad_to
    if not isinstance(prefill_groups, int) or prefill_groups < 1:
        raise ValueError(f"prefill_groups must be a positive int, got {prefill_groups!r}")
    buffer_len = config.max_cache_len or buffer_length(width, config.max_new_tokens, k)
    width = min(width, buffer_len)                 # padding must fit the buffer (the real tokens always do)
    rids = list(range(len(ids))) if request_ids is None else list(request_ids)
    if len(rids) != len(ids):
        raise ValueError(f"{len(rids)} request_ids for {len(ids)} prompts")
    request = registry.BuildRequest(config, model, drafter, ids, buffer_len)
    drafter_obj, draft_params = registry.build(request)
    keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.PRNGKey(seed), jnp.asarray(rids, jnp.uint32))
    rows = [right_pad(ids, width), np.asarray([len(p) for p in ids], np.int32), np.asarray(keys)]
    params = model.params
    if mesh is None:
        order, groups = plan_prefill([len(p) for p in ids], width, prefill_groups)
    else:                    # batch padded to the data axis with dummy rows (dropped by run); one prefill forward
        params, draft_params, rows = shard_for_generate(mesh, model, config.method, drafter_obj, draft_params, rows)
        order, groups = None, ((rows[0].shape[0], width),)
    eos = model.eos_token_id if (config.stop_at_eos and model.eos_token_id is not None) else -1
    return Prepared(model, config, request, drafter_obj, draft_params, params, *rows, eos, groups,
                    None if len(groups) == 1 else order,
                    group_cache_sizes(groups, buffer_len, config.max_new_tokens, k), mesh)


def _loop_arguments(p: Prepared) -> tuple:
    return p.target_params, p.draft_params, p.prompts, p.prompt_lengths, p.request_keys, jnp.int32(p.eos_id)


def _loop_settings(p: Prepared) -> dict:
    return dict(cfg=p.model.config, drafter=p.drafter, spec=p.config, buffer_len=p.buffer_len,
                prefill_groups=p.prefill_groups, prefill_order=p.prefill_order, cache_sizes=p.cache_sizes)


def _under_mesh(p: Prepared):
    """The context the loop is traced in: under the call's mesh, if it has one."""
    return jax.set_mesh(p.mesh) if p.mesh is not None else contextlib.nullcontext()


def compiled_text(prepared: Prepared) -> str:
    """The program run() runs for a prepared call (its one compiled decode loop), as XLA's text."""
    with _under_mesh(prepared):
        return decode_loop.lower(*_loop_arguments(prepared), **_loop_settings(prepared)).compile().as_text()


def run(prepared: Prepared) -> GenerateResult:
    """Decode a prepared call: the one compiled loop, outputs to the host (the caller's row order), the
    drafter's finish hook, texts and stats (stats["wall_s"] and the rates time the loop and the host transfer,
    not prepare())."""
    p = prepared
    t0 = time.perf_counter()
    with _under_mesh(p):
        tokens, num_new, stats = decode_loop(*_loop_arguments(p), **_loop_settings(p))
    n, ids = p.num_requests, p.request.prompts
    tokens, num_new = to_host(tokens)[:n], to_host(num_new)[:n]
    stats = jax.tree_util.tree_map(lambda x: to_host(x)[:n], stats)
    wall = time.perf_counter() - t0
    out = [tokens[i, len(q):len(q) + int(num_new[i])].tolist() for i, q in enumerate(ids)]
    registry.finish(p.request, out)
    texts = [p.model.detokenize(o) for o in out] if p.model.tokenizer is not None else None
    return GenerateResult(out, texts, {**summarize(stats, num_new, wall), "buffer_len": p.buffer_len,
                                       "num_speculative_tokens": p.config.k,
                                       "prefill_groups": [list(g) for g in p.prefill_groups],  # [[rows, width], ...]
                                       "cache_slots": list(p.cache_sizes or [p.buffer_len])})  # per group, or one


def generate(model: Model, prompts: Sequence, config: SpecConfig | dict | None = None, drafter: Any = None,
             seed: int = 0, request_ids: Sequence[int] | None = None, mesh: Mesh | None = None,
             pad_to: int | None = None, prefill_groups: int = 4) -> GenerateResult:
    """Decode each prompt (a string or a list of token ids) with `config.method` (any registered method:
    specjax.drafters.registry.methods()). `drafter` is what that method drafts from: a loaded artifact (a specjax
    Model for draft_model), a directory or a shipped name, predictions for "predicted", None for ngram/none. Greedy
    output equals plain greedy decoding token for token; sampled output is distributed exactly as the target's. A
    request's random stream is fold_in(key(seed), request_id), so its output does not depend on its batch mates.
    mesh: a specjax.sharding.make_mesh() mesh; weights (target and draft) are split over its "model" axis and
    requests over "data" -- the same tokens as on one device. A vocabulary the model axis does not divide is
    padded and kv heads fewer than the axis are replicated (specjax.layout.Layout); tokens and logits keep the
    model's vocab_size.
    pad_to: pad every prompt to this width (one compiled program for every batch of prompts up to pad_to tokens,
    given the same prefill groups); default: prompt_bucket of the longest.
    prefill_groups: at most this many prefill forwards. The rows are taken in prompt-length order and cut where
    that minimises padded prompt tokens (plan_prefill), each group prefilled at its own width and, where that pays,
    decoded over a KV cache only as wide as its rows need (stats["cache_slots"]); outputs keep the caller's row
    order. 1 = one forward over every prompt padded to the longest. Under a mesh: one forward.
    Equivalent to run(prepare(...)); prepare once and run several times to time or reuse a call."""
    return run(prepare(model, prompts, config, drafter, seed, request_ids, mesh, pad_to, prefill_groups))
