"""The EAGLE drafter: one decoder layer with its own KV cache, run on the loop's target features; registered as
the methods "eagle" (EAGLE-1 / EAGLE-2) and "eagle3".

Cache / feature alignment (the same for both kinds, and for training: see model.forward_sequence):
  drafter KV-cache entry t holds the pair (embed(x_{t+1}), feature of position t), at RoPE position t. Its output
  h_t predicts the feature of position t + 1 and its logits predict x_{t+2}.
  init:    the whole padded prompt block: tokens ctx.tokens[:, 1:P+1] with features of positions 0..P-1 (the
           prefill); entry prompt_length - 1 pairs the first generated token with the last prompt feature, so the
           cache holds prompt_length valid entries (later ones are stale, never read) and the output there gives
           the first draft of the next step (kept in the state as `hidden`).
  propose: draft 1 from the stored hidden; draft i + 1 from feeding (embed(d_i), own previous output) at entry
           committed + i - 1, written past the committed length (overwritten at the next commit). Trees: every
           node's input is (embed(node token), its parent's output; the root's = the stored hidden), at position
           committed length + depth - 1, attending to the committed cache and its ancestors (the layer re-runs
           over the partial tree block at each depth; nothing is written to the committed cache).
  commit:  the verify output (a chain's, or a tree's gathered along the accepted path: sequence order either way)
           covers positions L-1 .. L-1+D for the old committed length L; the pairs (x_{L+j}, feature L-1+j),
           j = 0..D, are written at entries L-1+j (fixed width D+1, ragged: each row's cache grows to its new
           committed length - 1 = L + n) and the output at j = n (the bonus token paired with the last accepted
           feature) is the next first-draft state. The tokens are read at old cache length + 1 + j from
           ctx.tokens, so rows clipped by EOS / max_new_tokens stay consistent.
  P-EAGLE (config.parallel_drafting): propose drafts 1 from the stored hidden as above, and drafts 2..D from ONE
           forward of D - 1 entries (mask embedding, shared hidden) at entries committed .. committed + D - 2,
           causal among themselves (nothing kept); D = k for a chain, the tree's depth for a tree built from the
           depths' distributions (tree_search.tree_from_position_logits). init and commit are EAGLE-3's.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from specjax import tree_search
from specjax.cache import KVCache
from specjax.drafters.base import (Context, Draft, block_draft, chain_of_picks, chain_scan, last_tokens,
                                   pick_tokens)
from specjax.drafters.draft_vocab import draft_to_target, full_vocab_logits
from specjax.drafters.eagle.checkpoint import check_target, load
from specjax.drafters.eagle.config import EagleConfig, EagleWeights
from specjax.drafters.eagle.model import (draft_logits, embed_table, layer_inputs, layer_output, mask_inputs,
                                          project_features, project_qkv)
from specjax.drafters.registry import BuildRequest, DrafterSpec, register
from specjax.layout import fit_spec, leaf_spec
from specjax.models.llama import attention
from specjax.sampling import SamplingParams
from specjax.trees import TreeSpec, draft_depth, mask_from_parents


class EagleState(NamedTuple):
    cache: KVCache          # one layer; lengths = committed length - 1 (the pairs of every committed token)
    hidden: jax.Array       # [B, H] output at the last committed entry: its logits give the first draft


@dataclasses.dataclass(frozen=True)
class EagleDrafter:
    k: int
    config: EagleConfig
    cache_size: int
    own_embed: bool = False
    implementation: str = "xla"
    tree: TreeSpec | None = None      # a static tree of k + 1 nodes
    num_steps: int = 0                # > 0: an EAGLE-2 dynamic tree
    topk: int = 0

    @property
    def target_layers(self) -> tuple:
        return self.config.target_layers if self.config.kind == "eagle3" else ()

    @property
    def target_weights(self) -> tuple:
        return (() if self.own_embed else ("embed",)) + (("lm_head",) if self.config.kind == "eagle" else ())

    @property
    def is_tree(self) -> bool:
        return self.tree is not None or self.num_steps > 0

    @property
    def parallel_depth(self) -> int:
        """P-EAGLE: the depths one propose drafts at once (a chain's k, a tree's depth)."""
        return draft_depth(self.tree, self.num_steps, self.k)

    # -- pieces
    def _features(self, params, target_out) -> jax.Array:
        feats = target_out.hidden if self.config.kind == "eagle" else target_out.layer_hidden
        return project_features(params, self.config, feats)

    def _run(self, params, ctx: Context, tokens, hid, cache: KVCache, depths=None, mask=None, emb=None):
        """Feed pairs (tokens [B, T] or their embeddings emb [B, T, H], hidden inputs [B, T, H]) at each row's
        cache length (positions length + depths) -> (outputs [B, T, H], cache with the entries written, lengths
        not advanced)."""
        c = self.config.layer
        B, T = hid.shape[:2]
        if depths is None:
            depths = jnp.arange(T, dtype=jnp.int32)
        positions = cache.lengths[:, None] + jnp.broadcast_to(jnp.asarray(depths, jnp.int32), (B, T))
        if emb is None:
            emb = embed_table(params, ctx.target_weights)[tokens].astype(hid.dtype)
        resid, x_in = layer_inputs(params, self.config, emb, hid)
        q, k, v = project_qkv(params["layer"], c, x_in, positions)
        cache = cache.write(0, k, v, cache.lengths)
        o = attention(q, cache, 0, cache.lengths + T, mask, implementation=self.implementation,
                      q_positions=positions, sliding_window=None)
        return layer_output(params, self.config, resid, o.reshape(B, T, -1)), cache

    def _logits(self, params, ctx: Context, hidden) -> jax.Array:
        """[..., H] -> float32 logits over the TARGET vocabulary [..., V]."""
        if self.config.kind == "eagle":
            return draft_logits(params, self.config, hidden, ctx.target_weights)
        return full_vocab_logits(draft_logits(params, self.config, hidden), params["vocab_map"],
                                 self.config.vocab_size)

    # -- protocol
    def init(self, params, ctx: Context, target_out, sp):
        c = self.config.layer
        B, P = target_out.hidden.shape[:2]
        idx = np.minimum(np.arange(1, P + 1), ctx.tokens.shape[1] - 1)
        feats = self._features(params, target_out)
        cache = KVCache.init(1, B, self.cache_size, c.num_kv_heads, c.head_dim, params["layer"]["wq"].dtype)
        out, cache = self._run(params, ctx, ctx.tokens[:, idx], feats, cache)
        last = jnp.take_along_axis(out, (ctx.prompt_length - 1)[:, None, None], axis=1)[:, 0]
        return EagleState(cache.replace(lengths=ctx.prompt_length), last)

    def parallel_logits(self, params, state: EagleState, ctx: Context) -> jax.Array:
        """P-EAGLE: the draft logits of every depth over the target vocabulary [B, D, V]: depth 1 from the stored
        hidden, depths 2..D from one forward of D - 1 mask entries past the committed cache."""
        D = self.parallel_depth
        first = self._logits(params, ctx, state.hidden)[:, None]
        if D == 1:
            return first
        emb, hid = mask_inputs(params, state.hidden.shape[0], D - 1, state.hidden.dtype)
        out, _ = self._run(params, ctx, None, hid, state.cache, emb=emb)
        return jnp.concatenate([first, self._logits(params, ctx, out)], 1)

    def propose(self, params, state: EagleState, ctx: Context, keys, sp: SamplingParams):
        if self.config.parallel_drafting:
            logits = self.parallel_logits(params, state, ctx)
            return block_draft(logits, ctx, keys, sp, self.tree, self.num_steps, self.topk, self.k + 1), state
        if self.is_tree:
            return self._propose_tree(params, state, ctx)
        k = self.k
        step_keys = jax.vmap(lambda key: jax.random.split(key, k))(keys)          # [B, k] keys
        tok, p, conf = pick_tokens(self._logits(params, ctx, state.hidden), step_keys[:, 0], sp)
        if k == 1:
            return Draft(tok[:, None], None if p is None else p[:, None], confidence=conf[:, None]), state

        def body(carry, key_i):
            cache, tok, h = carry
            out, cache = self._run(params, ctx, tok[:, None], h[:, None], cache)
            h = out[:, 0]
            nxt, q, c = pick_tokens(self._logits(params, ctx, h), key_i, sp)
            return (cache.replace(lengths=cache.lengths + 1), nxt, h), (nxt, q, c)

        (cache, _, _), rest = chain_scan(body, (state.cache, tok, state.hidden), jnp.swapaxes(step_keys[:, 1:], 0, 1),
                                         ctx, conf)
        tokens, probs, confidence = chain_of_picks((tok, p, conf), rest)                  # [B, k, ...]
        state = EagleState(cache.replace(lengths=state.cache.lengths), state.hidden)    # drafts: stale entries
        return Draft(tokens, probs, confidence=confidence), state

    def _propose_tree(self, params, state: EagleState, ctx: Context):
        root = last_tokens(ctx, 1)[:, 0]
        B, H = state.hidden.shape
        root_h = state.hidden

        # The search's state: every node fed so far (tokens, in-block parents, depths, hidden inputs, outputs);
        # each call re-runs the layer over the whole partial tree with its mask, nothing is written for good.
        def node_logits(block, tokens, parents, depths):
            toks, pars, deps, feats, outs = block
            n = tokens.shape[1]
            if outs.shape[1] == 0:                                          # depth 1: children of the root
                parent_h = jnp.broadcast_to(root_h[:, None], (B, n, H))
            else:
                got = jnp.take_along_axis(outs, jnp.maximum(parents, 0)[..., None], axis=1)
                parent_h = jnp.where(parents[..., None] < 0, root_h[:, None], got)
            toks, pars = jnp.concatenate([toks, tokens], 1), jnp.concatenate([pars, parents], 1)
            deps, feats = np.concatenate([deps, np.asarray(depths)]), jnp.concatenate([feats, parent_h], 1)
            out, _ = self._run(params, ctx, toks, feats, state.cache, depths=deps - 1,
                               mask=mask_from_parents(pars))
            return self._logits(params, ctx, out[:, -n:]), (toks, pars, deps, feats, out)

        empty = jnp.zeros((B, 0, H), root_h.dtype)
        block = (jnp.zeros((B, 0), jnp.int32), jnp.zeros((B, 0), jnp.int32), np.zeros(0, np.int32), empty, empty)
        root_logits = self._logits(params, ctx, root_h)
        tree, _ = tree_search.search(self.tree, self.num_steps, self.topk, self.k + 1, root, root_logits,
                                     node_logits, block)
        return Draft(tree.tokens[:, 1:], None, tree), state

    def commit(self, params, state: EagleState, ctx, num_accepted, target_out, verified):
        W = target_out.hidden.shape[1]                                     # k + 1 (chain) or depth + 1 (tree)
        old = state.cache.lengths
        idx = jnp.minimum(old[:, None] + 1 + jnp.arange(W), ctx.tokens.shape[1] - 1)
        toks = jnp.take_along_axis(ctx.tokens, idx, axis=1)                # accepted drafts, then the bonus
        out, cache = self._run(params, ctx, toks, self._features(params, target_out), state.cache)
        new_len = ctx.length - 1                                           # = old + n + 1 unless clipped / done
        at = jnp.clip(new_len - old - 1, 0, W - 1)                         # = num_accepted for a running row
        hidden = jnp.take_along_axis(out, at[:, None, None], axis=1)[:, 0]
        return EagleState(cache.replace(lengths=new_len), hidden)



# --------------------------------------------------------------------------------------------------- registry

_ACCEPTS = "EAGLE weights: a directory (ours or a published layout), a shipped name, or eagle.load(...)"


def _build(req: BuildRequest, kind: str):
    w = req.drafter                     # registry.build has loaded a path or name and checked the type
    if w is None:
        raise TypeError(f"method={kind!r} needs drafter=<{_ACCEPTS}>, got None")
    if w.kind != kind:
        raise ValueError(f"drafter {w.name!r} is an {w.kind!r} drafter; use method={w.kind!r}")
    check_target(w, req.target)
    cfg = req.config
    steps, topk = (cfg.num_steps or 0), (cfg.topk or 0)
    width = cfg.tree.topk if cfg.tree is not None else topk
    vocab = w.config.out_vocab_size
    if width > vocab:
        raise ValueError(f"the tree asks for the top-{width} draft tokens per node but the drafter's "
                         f"{'draft ' if kind == 'eagle3' else ''}vocabulary has only {vocab}")
    params = dict(w.params)
    if kind == "eagle3":
        params["vocab_map"] = jnp.asarray(draft_to_target(w.d2t), jnp.int32)
    extra = max(0, (steps - 1) * topk - (cfg.k + 1))      # a dynamic tree's frontier block past the verify slots
    return EagleDrafter(cfg.k, w.config, req.buffer_len + extra, "embed" in w.params, cfg.implementation,
                        cfg.tree, steps, topk), params


def _param_specs(drafter: EagleDrafter, params, mesh):
    own = {"fc_w": P(), "fc_b": P(), "fc_norm": P(), "hidden_norm": P(), "vocab_map": P(), "mask_embed": P(),
           "mask_hidden": P()}

    def spec(path, x):
        key = next((p.key for p in reversed(path) if isinstance(p, jax.tree_util.DictKey)), None)
        s = own[key] if key in own else leaf_spec(key)      # Llama names: the target's layout
        return fit_spec(s, x.shape, mesh) if mesh is not None else s
    return jax.tree_util.tree_map_with_path(spec, params)


def _spec(kind: str) -> DrafterSpec:
    return DrafterSpec(kind, lambda req: _build(req, kind), accepts=_ACCEPTS,
                       load=lambda target, path: load(path, target, kind), artifact=EagleWeights, trees=True,
                       param_specs=_param_specs)


register(_spec("eagle"))
register(_spec("eagle3"))
