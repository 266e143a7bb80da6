"""A separate small Llama-family LM with its own KV cache proposes k tokens, one sequential step each.

Cache bookkeeping: the draft cache holds the committed tokens except the last; a proposal resets its length to
that (rolling back rejected drafts) and feeds the last committed token. After a fully accepted chain the k-th
draft token was never fed, so that proposal rewinds one more entry and feeds the last TWO tokens instead (the
catch-up; re-writing an entry with identical contents). Which case applies follows from the cache length alone.

Trees (SpecInfer-style; static TreeSpec, or a dynamic EAGLE-2 tree when num_steps > 0): children are the
drafter's top-k tokens (deterministic, in greedy and sampled mode alike: verify.tree_sampled case (a), exact for
any tree shape, including one pruned by draft scores). Each depth re-runs the draft model over the partial tree
(tree mask, nothing committed to its cache); simple, and the draft model is small. The catch-up feeds the last
max_depth + 1 committed tokens, since a tree step never fed the accepted path in sequence order.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from specjax.cache import KVCache
from specjax.drafters.base import Context, Draft, last_tokens
from specjax.models.config import ModelConfig
from specjax.models.llama import forward
from specjax.sampling import SamplingParams, probabilities, sample
from specjax.trees import Tree, TreeSpec, build_dynamic_tree, expand_frontier, mask_from_parents, tree_from_spec


@dataclasses.dataclass(frozen=True)
class DraftModelDrafter:
    num_tokens: int
    config: ModelConfig
    cache_size: int
    implementation: str = "xla"
    tree: TreeSpec | None = None      # a static tree of num_tokens + 1 nodes
    num_steps: int = 0                # > 0: a dynamic tree of num_steps depth, topk children per node
    topk: int = 0

    @property
    def is_tree(self) -> bool:
        return self.tree is not None or self.num_steps > 0

    @property
    def tree_depth(self) -> int:
        return self.tree.max_depth if self.tree is not None else self.num_steps

    @staticmethod
    def extra_cache_slots(num_tokens: int, num_steps: int, topk: int) -> int:
        """Draft cache slots needed beyond the target's buffer: a dynamic tree's frontier block ((num_steps - 1)
        * topk nodes past the committed tokens) can outgrow the num_tokens + 1 verify slots the buffer reserves."""
        return max(0, (num_steps - 1) * topk - (num_tokens + 1))

    def init(self, params, ctx: Context, target_out, sp):
        B = ctx.tokens.shape[0]
        cfg = self.config
        cache = KVCache.init(cfg.num_layers, B, self.cache_size, cfg.num_kv_heads, cfg.head_dim,
                             params["embed"].dtype)
        prompt = ctx.tokens[:, :int(target_out.logits.shape[1])]                 # [B, P] right-padded prompt
        out = forward(params, cfg, prompt, cache, implementation=self.implementation)
        return out.cache.replace(lengths=ctx.prompt_length)

    def _step(self, params, cache, tokens, key, sp: SamplingParams):
        out = forward(params, self.config, tokens, cache, implementation=self.implementation)
        cache = out.cache.replace(lengths=cache.lengths + tokens.shape[1])
        logits = out.logits[:, -1]                                              # [B, V]
        if sp.greedy:
            return cache, jnp.argmax(logits, -1).astype(jnp.int32), None
        probs = probabilities(logits, sp)
        return cache, jax.vmap(sample)(key, probs), probs

    def propose(self, params, cache: KVCache, ctx: Context, keys, sp: SamplingParams):
        if self.is_tree:
            return self._propose_tree(params, cache, ctx)
        k = self.num_tokens
        step_keys = jax.vmap(lambda key: jax.random.split(key, k))(keys)        # [B, k] keys
        # After a proposal the cache holds length + k - 2 entries of the old length, so the new length exceeds it
        # by more than one only when all k drafts were accepted (the k-th was never fed): catch up with a T=2
        # step then (for every row, which is harmless), else a T=1 step (on CPU a 2-row step costs ~2 1-row ones).
        behind = jnp.any(ctx.length - 1 > cache.lengths)
        cache, tok, probs = lax.cond(
            behind,
            lambda c: self._step(params, c.replace(lengths=ctx.length - 2), last_tokens(ctx, 2), step_keys[:, 0], sp),
            lambda c: self._step(params, c.replace(lengths=ctx.length - 1), last_tokens(ctx, 1), step_keys[:, 0], sp),
            cache)

        def body(carry, key_i):
            cache, tok = carry
            cache, nxt, p = self._step(params, cache, tok[:, None], key_i, sp)
            return (cache, nxt), (nxt, p)

        (cache, _), (rest, rest_p) = jax.lax.scan(body, (cache, tok), jnp.swapaxes(step_keys[:, 1:], 0, 1))
        tokens = jnp.concatenate([tok[:, None], jnp.swapaxes(rest, 0, 1)], axis=1)    # [B, k]
        if sp.greedy:
            return Draft(tokens), cache
        all_p = jnp.concatenate([probs[:, None], jnp.swapaxes(rest_p, 0, 1)], axis=1)  # [B, k, V]
        return Draft(tokens, all_p), cache

    def _propose_tree(self, params, cache: KVCache, ctx: Context) -> tuple[Draft, KVCache]:
        cache, root_logits = self._catch_up(params, cache, ctx, self.tree_depth + 1)
        root = last_tokens(ctx, 1)[:, 0]
        if self.tree is not None:
            tree = self._static_tree(params, cache, root, root_logits)
        else:
            tree = self._dynamic_tree(params, cache, root, root_logits)
        return Draft(tree.tokens[:, 1:], None, tree), cache

    def _catch_up(self, params, cache: KVCache, ctx: Context, width: int) -> tuple[KVCache, jax.Array]:
        """Feed committed tokens from max(length - width, 0) (re-writing entries with identical contents) so the
        cache holds every committed token, the root included -> (cache, root logits [B, V]). When length < width
        the block runs past the root into stale slots, which lie beyond the new length and are never read."""
        start = jnp.maximum(ctx.length - width, 0)                                  # [B]
        block = jnp.take_along_axis(ctx.tokens, start[:, None] + jnp.arange(width), axis=1)   # [B, width]
        out = forward(params, self.config, block, cache.replace(lengths=start), implementation=self.implementation)
        root_at = (ctx.length - 1 - start)[:, None, None]
        return out.cache.replace(lengths=ctx.length), jnp.take_along_axis(out.logits, root_at, axis=1)[:, 0]

    def _tree_logits(self, params, cache: KVCache, tokens, parents, depths) -> jax.Array:
        """Draft logits [B, N, V] after each of N tree nodes (tokens [B, N]; parents within the block, -1 = the
        root, which is in the cache; depths [N] / [B, N] from 0 = children of the root). Cache untouched."""
        out = forward(params, self.config, tokens, cache, depths=depths, mask=mask_from_parents(parents),
                      implementation=self.implementation)
        return out.logits

    def _static_tree(self, params, cache: KVCache, root, root_logits) -> Tree:
        spec = self.tree
        B = root.shape[0]
        ends = np.searchsorted(spec.depths, np.arange(spec.max_depth + 1), side="right")   # nodes of depth <= d
        tokens = jnp.zeros((B, spec.num_nodes), jnp.int32).at[:, 0].set(root)
        logits = root_logits[:, None]                                               # [B, 1, V] after node 0
        for d in range(1, spec.max_depth + 1):            # breadth-first order: depth d is ends[d-1]:ends[d]
            if d > 1:                                     # logits after every node of depth < d
                n = ends[d - 1]
                blk = self._tree_logits(params, cache, tokens[:, 1:n], spec.parents[1:n] - 1, spec.depths[1:n] - 1)
                logits = jnp.concatenate([root_logits[:, None], blk], axis=1)      # [B, n, V]
            top = lax.top_k(logits, spec.topk)[1].astype(jnp.int32)                # [B, n, K]
            nodes = np.arange(ends[d - 1], ends[d])
            tokens = tokens.at[:, nodes].set(top[:, spec.parents[nodes], spec.ranks[nodes]])
        return tree_from_spec(spec, tokens)

    def _dynamic_tree(self, params, cache: KVCache, root, root_logits) -> Tree:
        """EAGLE-2: keep a frontier of the topk best nodes by cumulative draft log-prob; each frontier node
        proposes its topk children; build_dynamic_tree keeps the num_tokens best candidates overall."""
        B, W = root.shape[0], self.topk
        logp, tok = lax.top_k(jax.nn.log_softmax(root_logits), W)                  # [B, K] children of the root
        cand_tok, cand_logp = [jnp.broadcast_to(tok[:, None], (B, W, W))], [jnp.broadcast_to(logp[:, None], (B, W, W))]
        frontier_parent = [jnp.zeros((B, W), jnp.int32)]                           # unused at depth 0
        start = jnp.where(jnp.arange(W) == 0, 0.0, -jnp.inf)                       # the root sits in slot 0
        _, nxt, scores = expand_frontier(jnp.broadcast_to(start, (B, W)), cand_logp[0], W)
        blk_tok, blk_par = [], []                         # frontier nodes so far, depth-major; parents in-block
        for d in range(1, self.num_steps):
            blk_tok.append(jnp.take_along_axis(cand_tok[-1].reshape(B, W * W), nxt, axis=1))    # [B, W]
            blk_par.append(jnp.full((B, W), -1, jnp.int32) if d == 1 else (d - 2) * W + nxt // W)
            frontier_parent.append(nxt)
            logits = self._tree_logits(params, cache, jnp.concatenate(blk_tok, 1), jnp.concatenate(blk_par, 1),
                                       np.repeat(np.arange(d, dtype=np.int32), W))[:, -W:]          # [B, W, V]
            logp, tok = lax.top_k(jax.nn.log_softmax(logits), W)                    # [B, W, K]
            cand_tok.append(tok)
            cand_logp.append(logp)
            _, nxt, scores = expand_frontier(scores, logp, W)
        return build_dynamic_tree(root, jnp.stack(cand_tok, 1).astype(jnp.int32), jnp.stack(cand_logp, 1),
                                  jnp.stack(frontier_parent, 1), self.num_tokens + 1)

    def commit(self, params, cache, ctx, num_accepted, target_out):
        return cache
