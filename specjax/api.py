"""Public entry points: load_model() and generate()."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import SpecConfig
from specjax.decode import buffer_length, decode, group_cache_sizes, round_up
from specjax.drafters import registry
from specjax.metrics import summarize
from specjax.models.config import ModelConfig
from specjax.models.llama import full_logits
from specjax.sharding import shard_for_generate, to_host

CHECKPOINT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints")


@dataclasses.dataclass
class Model:
    config: ModelConfig
    params: dict
    tokenizer: Any = None           # tokenizers.Tokenizer or None
    name: str = ""

    def logits(self, tokens) -> jax.Array:
        """Full forward, no cache: int32 [B, T] -> float32 [B, T, V]."""
        return _full_logits(self.params, self.config, jnp.asarray(tokens, jnp.int32))

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"model {self.name!r} has no tokenizer; pass token-id lists instead of strings")
        return self.tokenizer.encode(text).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids)) if self.tokenizer is not None else ""

    @property
    def eos_token_id(self) -> int | None:
        return self.config.eos_token_id


_full_logits = jax.jit(full_logits, static_argnums=1)


def available_models() -> list[str]:
    """Shipped target / draft models (checkpoints/ entries in HF format); drafter artifacts (Medusa heads, EAGLE
    drafters) are not models and are listed by available_drafters()."""
    return [d for d, kind in _shipped_kinds() if kind is None]


def available_drafters() -> list[str]:
    """Shipped drafter artifacts, usable as drafter=<name> with their method."""
    return [d for d, kind in _shipped_kinds() if kind is not None]


def _shipped_kinds() -> list[tuple[str, str | None]]:
    """(name, drafter kind or None for a model) of every checkpoints/ entry with a config.json."""
    if not os.path.isdir(CHECKPOINT_DIR):
        return []
    return [(d, _drafter_kind(os.path.join(CHECKPOINT_DIR, d))) for d in sorted(os.listdir(CHECKPOINT_DIR))
            if os.path.isfile(os.path.join(CHECKPOINT_DIR, d, "config.json"))]


def _drafter_kind(path: str) -> str | None:
    """The method of the drafter artifact in directory `path` (its config.json's specjax_drafter), None for a
    model or a config.json that does not parse (the model loader reports that)."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            return json.load(f).get("specjax_drafter")
    except (OSError, ValueError):
        return None


def load_model(path_or_name: str, dtype=jnp.float32, mesh=None) -> Model:
    """A Hugging Face Llama/Qwen2/Mistral directory, or the name of a shipped model in checkpoints/."""
    from specjax.models.hf_io import load_pretrained
    path = path_or_name
    if not os.path.isdir(path):
        shipped = os.path.join(CHECKPOINT_DIR, path_or_name)
        if not os.path.isdir(shipped):
            raise FileNotFoundError(f"no model directory {path_or_name!r} and no shipped model of that name "
                                    f"(shipped: {available_models()})")
        path = shipped
    kind = _drafter_kind(path)
    if kind is not None:
        raise ValueError(f"{path_or_name!r} is a {kind!r} drafter artifact, not a model: pass it as "
                         f"generate(..., SpecConfig(method={kind!r}), drafter={path_or_name!r})")
    if mesh is not None:         # each tensor read straight into its sharded layout (specjax.sharding)
        from specjax.sharding import load_pretrained_sharded
        params, cfg, tokenizer = load_pretrained_sharded(path, mesh, dtype=dtype)
    else:
        params, cfg, tokenizer = load_pretrained(path, dtype=dtype)
    return Model(cfg, params, tokenizer, os.path.basename(os.path.normpath(path)))


@dataclasses.dataclass
class GenerateResult:
    tokens: list[list[int]]
    texts: list[str] | None
    stats: dict


def prompt_bucket(n: int) -> int:
    """A padded prompt width for an n-token prompt: at least 16, rounded up to a quarter of its octave (at most
    25% padding; a power-of-two bucket wasted up to half, 512 slots for a 319-token prompt), so recompiles stay
    logarithmic in the prompt length."""
    if n <= 16:
        return 16
    return round_up(n, 1 << ((n - 1).bit_length() - 3))


def plan_prefill(lengths: Sequence[int], width: int, max_groups: int) -> tuple[np.ndarray, tuple]:
    """Rows sorted by prompt length and cut into at most max_groups groups of consecutive sorted rows, each
    prefilled at its own padded width (prompt_bucket of its longest; `width` for the last) so as to minimise the
    padded prompt tokens -> (order [B] int32: the rows' indices in sorted order, ((num_rows, width), ...))."""
    order = np.argsort(np.asarray(lengths), kind="stable").astype(np.int32)
    sl = [int(lengths[i]) for i in order]
    B = len(sl)
    # A group can end only where the bucket grows, or at the last row: O(max_groups * ends^2) on a few buckets.
    ends = [j for j in range(B - 1) if prompt_bucket(sl[j]) < prompt_bucket(sl[j + 1])] + [B - 1]
    w_at = lambda j: width if j == B - 1 else min(prompt_bucket(sl[j]), width)
    # best[g][e]: (padded tokens, cuts) of rows 0..ends[e] in g + 1 groups, the last ending at ends[e].
    best = [[((ends[e] + 1) * w_at(ends[e]), (ends[e],)) for e in range(len(ends))]]
    for _ in range(1, max(max_groups, 1)):
        prev, row = best[-1], []
        for e in range(len(ends)):
            options = [prev[e]] + [(prev[d][0] + (ends[e] - ends[d]) * w_at(ends[e]), prev[d][1] + (ends[e],))
                                   for d in range(e)]
            row.append(min(options))
        best.append(row)
    cuts, start, groups = best[-1][-1][1], 0, []
    for end in cuts:
        groups.append((end + 1 - start, w_at(end)))
        start = end + 1
    return order, tuple(groups)


def right_pad(rows: list[list[int]], width: int) -> np.ndarray:
    """Token-id lists -> int32 [len(rows), width], zero-padded on the right."""
    out = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


def encode_all(model: Model, items, what: str) -> list[list[int]]:
    """Strings or token-id lists, one per request -> token-id lists, checked against the model's vocabulary."""
    if items is None:
        raise TypeError(f"{what}s must be a list (one entry per request), got None")
    if isinstance(items, (str, bytes)) or not hasattr(items, "__len__") \
            or (len(items) and isinstance(items[0], (int, np.integer))):
        raise TypeError(f"{what}s must be a list (one entry per request), got a single {type(items).__name__}")
    if len(items) == 0:
        raise ValueError(f"no {what}s: pass at least one (a string or a list of token ids)")
    out = []
    for i, p in enumerate(items):
        if not isinstance(p, str) and not hasattr(p, "__iter__"):
            raise TypeError(f"{what} {i} must be a string or a list of token ids, got {type(p).__name__}")
        ids = model.encode(p) if isinstance(p, str) else [int(t) for t in p]
        if not ids:
            raise ValueError(f"{what} {i} is empty (0 tokens); every request needs at least one token")
        bad = [t for t in ids if not 0 <= t < model.config.vocab_size]
        if bad:
            raise ValueError(f"{what} {i} has token ids outside [0, {model.config.vocab_size}): {bad[:5]}")
        out.append(ids)
    return out


def make_drafter(target: Model, config: SpecConfig, drafter: Any, prompts: list[list[int]], buffer_len: int):
    """-> (static drafter object, its array params), built by the method's registered builder."""
    return registry.get(config.method).build(registry.BuildRequest(config, target, drafter, prompts, buffer_len))


def finish_drafter(target: Model, config: SpecConfig, drafter: Any, prompts: list[list[int]], buffer_len: int,
                   outputs: list[list[int]]) -> None:
    """Hand the outputs to the method's `finish` hook, if it has one (a drafter that learns across calls)."""
    finish = registry.get(config.method).finish
    if finish is not None:
        finish(registry.BuildRequest(config, target, drafter, prompts, buffer_len), outputs)


def generate(model: Model, prompts: Sequence, config: SpecConfig | None = None, drafter: Any = None,
             seed: int = 0, request_ids: Sequence[int] | None = None, mesh=None,
             pad_to: int | None = None, prefill_groups: int = 4) -> GenerateResult:
    """Decode each prompt (a string or a list of token ids) with `config.method` (any registered method:
    specjax.drafters.registry.methods()). `drafter` is what that method drafts from: a loaded artifact (a specjax
    Model for draft_model), a directory or a shipped name, predictions for "predicted", None for ngram/none. Greedy output equals plain
    greedy decoding token for token; sampled output is distributed exactly as the target's. A request's random
    stream is fold_in(key(seed), request_id), so its output does not depend on its batch mates.
    mesh: a specjax.sharding.make_mesh() mesh; weights (target and draft) are split over its "model" axis and
    requests over "data" -- the same tokens as on one device. A vocabulary the model axis does not divide is
    padded and kv heads fewer than the axis are replicated (specjax.sharding.Layout); tokens and logits keep the
    model's vocab_size.
    pad_to: pad every prompt to this width (one compiled program for every batch of prompts up to pad_to tokens,
    given the same prefill groups); default: prompt_bucket of the longest.
    prefill_groups: at most this many prefill forwards. The rows are taken in prompt-length order and cut where
    that minimises padded prompt tokens (plan_prefill), each group prefilled at its own width and, where that pays,
    decoded over a KV cache only as wide as its rows need (stats["cache_slots"]); outputs keep the caller's row
    order. 1 = one forward over every prompt padded to the longest. Under a mesh: one forward."""
    if config is None:
        config = SpecConfig()
    elif isinstance(config, dict):
        known = {f.name for f in dataclasses.fields(SpecConfig)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"config has unknown fields {unknown}; SpecConfig fields are {sorted(known)}")
        config = SpecConfig(**config)
    elif not isinstance(config, SpecConfig):
        raise TypeError(f"config must be a SpecConfig (or a dict of its fields), got {type(config).__name__}")
    if not isinstance(model, Model):
        raise TypeError(f"model must be a specjax Model (specjax.load_model(...)), got {type(model).__name__}")
    ids = encode_all(model, prompts, "prompt")
    scheduled = config.for_batch(len(ids))         # the draft_len_schedule's k for this many requests
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
    P = prompt_bucket(longest)
    if pad_to is not None:
        if pad_to < longest:
            raise ValueError(f"pad_to={pad_to} is shorter than the longest prompt ({longest} tokens)")
        P = pad_to
    if not isinstance(prefill_groups, int) or prefill_groups < 1:
        raise ValueError(f"prefill_groups must be a positive int, got {prefill_groups!r}")
    buffer_len = config.max_cache_len or buffer_length(P, config.max_new_tokens, k)
    P = min(P, buffer_len)                           # padding must fit the buffer (the real tokens always do)
    rids = list(range(len(ids))) if request_ids is None else list(request_ids)
    if len(rids) != len(ids):
        raise ValueError(f"{len(rids)} request_ids for {len(ids)} prompts")
    if mesh is None:
        order, groups = plan_prefill([len(p) for p in ids], P, prefill_groups)
    prompt_arr = right_pad(ids, P)
    base = jax.random.PRNGKey(seed)
    keys = jax.vmap(jax.random.fold_in, (None, 0))(base, jnp.asarray(rids, jnp.uint32))
    drafter_obj, draft_params = make_drafter(model, config, drafter, ids, buffer_len)
    eos = model.eos_token_id if (config.stop_at_eos and model.eos_token_id is not None) else -1

    params, rows = model.params, [prompt_arr, np.asarray([len(p) for p in ids], np.int32), np.asarray(keys)]
    if mesh is not None:         # batch padded to the data axis with dummy rows, which are dropped below
        params, draft_params, rows = shard_for_generate(mesh, model, config.method, drafter_obj, draft_params, rows)
        order, groups = None, ((rows[0].shape[0], P),)        # one forward over the padded batch

    cache_sizes = group_cache_sizes(groups, buffer_len, config.max_new_tokens, k)
    t0 = time.perf_counter()
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():   # traced under the mesh
        tokens, num_new, stats = decode(params, draft_params, *rows, jnp.int32(eos), cfg=model.config,
                                        drafter=drafter_obj, spec=config, buffer_len=buffer_len,
                                        prefill_groups=groups, prefill_order=None if len(groups) == 1 else order,
                                        cache_sizes=cache_sizes)
    n = len(ids)
    tokens, num_new = to_host(tokens)[:n], to_host(num_new)[:n]
    stats = jax.tree_util.tree_map(lambda x: to_host(x)[:n], stats)
    wall = time.perf_counter() - t0
    out = [tokens[i, len(p):len(p) + int(num_new[i])].tolist() for i, p in enumerate(ids)]
    finish_drafter(model, config, drafter, ids, buffer_len, out)
    texts = [model.decode(o) for o in out] if model.tokenizer is not None else None
    return GenerateResult(out, texts, {**summarize(stats, num_new, wall), "buffer_len": buffer_len,
                                       "num_speculative_tokens": k,
                                       "prefill_groups": [list(g) for g in groups],   # [[rows, width], ...]
                                       "cache_slots": list(cache_sizes or [buffer_len])})    # per group, or one
