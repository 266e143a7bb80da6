"""The DFlash drafter: its draft layers run over a block of mask positions against a cache of the target's context
features; registered as the method "dflash".

State: the context keys/values of every draft layer (a KVCache whose lengths = committed tokens - 1: the anchor has
no target feature until it is verified). init writes the prompt's features; commit writes the features the verify
pass computed at the anchor and the accepted drafts (positions L .. L + n), as EAGLE's drafter follows the
accepted path.
"""
from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp

from specjax.cache import KVCache
from specjax.checkpoints import resolve
from specjax.drafters.base import Context, block_draft, last_tokens
from specjax.drafters.dflash.checkpoint import load, load_published
from specjax.drafters.dflash.config import KIND, DFlashConfig, DFlashWeights
from specjax.drafters.dflash.model import block_forward, block_inputs, context_features, context_kv, draft_logits
from specjax.drafters.draft_vocab import draft_to_target, full_vocab_logits
from specjax.drafters.registry import BuildRequest, DrafterSpec, register
from specjax.sampling import SamplingParams
from specjax.trees import TreeSpec, draft_depth


@dataclasses.dataclass(frozen=True)
class DFlashDrafter:
    k: int
    config: DFlashConfig
    cache_size: int
    tree: TreeSpec | None = None     # a static tree: a node of depth d and rank r holds block position d's r-th token
    num_steps: int = 0               # a dynamic tree (with topk): num_steps block positions searched best-first
    topk: int = 0
    target_weights = ("embed", "lm_head")

    @property
    def target_layers(self) -> tuple[int, ...]:
        return self.config.target_layers

    @property
    def is_tree(self) -> bool:
        return self.tree is not None or self.num_steps > 0

    @property
    def block_drafts(self) -> int:
        """Block positions after the anchor that one propose fills: a chain's k, a tree's depth."""
        return draft_depth(self.tree, self.num_steps, self.k)

    def _write(self, params, cache: KVCache, layer_hidden, starts: jax.Array) -> KVCache:
        """Context keys/values of the features layer_hidden (each [B, T, H_t]) at positions starts + 0..T-1."""
        feats = context_features(params, self.config, layer_hidden)
        B, T = feats.shape[:2]
        positions = starts[:, None] + jnp.arange(T)[None, :]
        for l, lp in enumerate(params["layers"]):
            k, v = context_kv(lp, self.config, feats, positions)
            cache = cache.write(l, k, v, starts)
        return cache

    def init(self, params, ctx: Context, target_out, sp):
        B = ctx.tokens.shape[0]
        cfg = self.config
        cache = KVCache.init(cfg.num_layers, B, self.cache_size, cfg.num_kv_heads, cfg.head_dim,
                             keys_transposed=False)
        cache = self._write(params, cache, target_out.layer_hidden, jnp.zeros((B,), jnp.int32))
        return cache.replace(lengths=ctx.prompt_length)          # the prompt's features; stale ones past it

    def block_logits(self, params, cache: KVCache, ctx: Context) -> jax.Array:
        """The block's draft logits over the target vocabulary [B, block_drafts, V]: one forward over the anchor and
        block_drafts mask positions. A block shorter than the trained one changes every position's output (the
        attention inside it is bidirectional), but only by the masks it no longer sees: on SmolLM2's drafter the
        held-out acceptance of the first 3 positions was the same with 4 positions as with all 8, which cost more."""
        cfg, n = self.config, self.block_drafts
        w = ctx.target_weights
        anchor = last_tokens(ctx, 1)[:, 0]                                       # [B] at position length - 1
        x = block_inputs(params, w["embed"], anchor, n)                          # [B, n + 1, H]
        positions = (ctx.length - 1)[:, None] + jnp.arange(n + 1)[None, :]
        visible = jnp.arange(cache.size)[None, :] < cache.lengths[:, None]      # [B, S]
        hidden = block_forward(params, cfg, x, positions, [cache.keys(l) for l in range(cfg.num_layers)],
                               list(cache.v), visible)
        logits = draft_logits(params, cfg, hidden[:, 1:], w["lm_head"])          # [B, n, N | V]
        if cfg.draft_vocab_size is not None:
            logits = full_vocab_logits(logits, params["vocab_map"], cfg.vocab_size)   # [B, n, V]
        return logits

    def propose(self, params, cache: KVCache, ctx: Context, keys, sp: SamplingParams):
        logits = self.block_logits(params, cache, ctx)
        return block_draft(logits, ctx, keys, sp, self.tree, self.num_steps, self.topk, self.k + 1), cache

    def commit(self, params, cache: KVCache, ctx, num_accepted, target_out, verified):
        # the verify pass's features at the anchor and the drafts (sequence order); n + 1 of them are committed now
        cache = self._write(params, cache, target_out.layer_hidden, cache.lengths)
        return cache.replace(lengths=ctx.length - 1)                 # every committed token but the new last one


def _load(target, path_or_name: str) -> DFlashWeights:
    """Ours (a specjax artifact or shipped name) or the public layout."""
    path = resolve(path_or_name, "drafter")
    with open(os.path.join(path, "config.json")) as f:
        ours = "specjax_drafter" in json.load(f)
    return load(path, target) if ours else load_published(path, target)


def _build(req: BuildRequest):
    weights, config, target = req.drafter, req.config, req.target
    if weights is None:
        raise TypeError("method='dflash' needs drafter=<a DFlash artifact directory, a shipped name or "
                        "dflash.DFlashWeights>, got None")
    cfg = weights.config
    tc = target.config
    if (cfg.hidden_size, cfg.vocab_size) != (tc.hidden_size, tc.vocab_size):
        raise ValueError(f"DFlash drafter {weights.name!r} is for hidden {cfg.hidden_size} / vocab {cfg.vocab_size}; "
                         f"the target has {tc.hidden_size} / {tc.vocab_size}")
    bad = [l for l in cfg.target_layers if not 0 <= l < tc.num_layers]
    if bad or not cfg.target_layers:
        raise ValueError(f"DFlash drafter {weights.name!r} reads target layers {list(cfg.target_layers)}; the target "
                         f"has {tc.num_layers} decoder layers (indices 0..{tc.num_layers - 1})")
    steps, topk = (config.num_steps or 0), (config.topk or 0)
    drafter = DFlashDrafter(config.k, cfg, req.buffer_len, config.tree, steps, topk)
    positions = drafter.block_drafts
    if positions > cfg.block_size - 1:
        what = (f"k={config.k} drafts" if not config.is_tree else
                f"a tree {positions} deep (num_steps)" if config.tree is None else f"a tree {positions} deep")
        raise ValueError(f"{what} more positions than the DFlash drafter {weights.name!r} fills (its block is "
                         f"{cfg.block_size}: the anchor and {cfg.block_size - 1} drafts)")
    width = config.tree.topk if config.tree is not None else topk
    vocab = cfg.draft_vocab_size or cfg.vocab_size
    if width > vocab:
        raise ValueError(f"the tree asks for the top-{width} tokens of a block position but the DFlash drafter "
                         f"{weights.name!r} drafts from {vocab} tokens")
    params = weights.params
    if cfg.draft_vocab_size is not None:
        params = dict(params, vocab_map=jnp.asarray(draft_to_target(weights.d2t), jnp.int32))
    return drafter, params


register(DrafterSpec(KIND, _build, accepts="a DFlash directory (ours or the public layout), a shipped name or "
                                         "dflash.DFlashWeights", load=_load, artifact=DFlashWeights, trees=True))
