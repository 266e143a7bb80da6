"""The draft model drafter: k sequential steps of the draft's own forward over its own KV cache; registered as the
method "draft_model".

Cache bookkeeping: the draft cache holds the committed tokens except the last; a proposal resets its length to
that (rolling back rejected drafts) and feeds the last committed token. After a fully accepted chain the k-th
draft token was never fed, so that proposal rewinds one more entry and feeds the last TWO tokens instead (the
catch-up; re-writing an entry with identical contents). Which case applies follows from the cache length alone.

Trees (SpecInfer-style; static TreeSpec, or a dynamic EAGLE-2 tree when num_steps > 0), searched by
specjax.tree_search: children are the drafter's top-k tokens (deterministic, in greedy and sampled mode alike,
exact for any tree shape, including one pruned by draft scores). Each depth re-runs the draft model over the
partial tree (tree mask, nothing committed to its cache); simple, and the draft model is small. The catch-up feeds
the last max_depth + 1 committed tokens, since a tree step never fed the accepted path in sequence order.
"""
from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from specjax import checkpoints, tree_search
from specjax.cache import KVCache
from specjax.drafters.base import Context, Draft, chain_of_picks, chain_scan, last_tokens, pick_tokens
from specjax.drafters.draft_model.checkpoint import check_same_vocabulary, check_target, load
from specjax.drafters.draft_model.config import KIND, TargetEmbeddingDraft
from specjax.drafters.draft_model.model import forward_params
from specjax.drafters.draft_vocab import draft_to_target, full_vocab_logits
from specjax.drafters.registry import BuildRequest, DrafterSpec, register
from specjax.layout import apply_layout, axis_size, param_specs, plan_layout
from specjax.models.config import ModelConfig
from specjax.models.llama import ForwardOut, forward, kv_heads
from specjax.models.model import Model, load_model
from specjax.sampling import SamplingParams
from specjax.trees import TreeSpec

@dataclasses.dataclass(frozen=True)
class DraftModelDrafter:
    k: int
    config: ModelConfig               # the draft's; a TargetEmbeddingDraft's with vocab_size = its head's width
    cache_size: int
    implementation: str = "xla"
    tree: TreeSpec | None = None      # a static tree of k + 1 nodes
    num_steps: int = 0                # > 0: a dynamic tree of num_steps depth, topk children per node
    topk: int = 0
    target_embedding: bool = False    # a TargetEmbeddingDraft: embeds with the target's embedding
    vocab_size: int | None = None     # with a draft vocabulary (params["vocab_map"]): the target's V, which the
                                      # config.vocab_size = N draft logits are scattered to
    target_layers = ()                # reads nothing of the target's features, only its tokens

    @property
    def target_weights(self) -> tuple[str, ...]:
        if not self.target_embedding:
            return ()
        return ("embed",) if self.vocab_size else ("embed", "output_head")

    @property
    def is_tree(self) -> bool:
        return self.tree is not None or self.num_steps > 0

    @property
    def tree_depth(self) -> int:
        return self.tree.max_depth if self.tree is not None else self.num_steps

    @staticmethod
    def extra_cache_slots(k: int, num_steps: int, topk: int) -> int:
        """Draft cache slots needed beyond the target's buffer: a dynamic tree's frontier block ((num_steps - 1)
        * topk nodes past the committed tokens) can outgrow the k + 1 verify slots the buffer reserves."""
        return max(0, (num_steps - 1) * topk - (k + 1))

    def _forward(self, params, ctx: Context, tokens: jax.Array, cache: KVCache, **kw) -> ForwardOut:
        """The draft's forward over tokens, its logits over the TARGET's vocabulary (a drafter that embeds or
        projects differently, PARD's, has its own)."""
        out = forward(forward_params(params, ctx.target_weights) if self.target_embedding else params, self.config,
                      tokens, cache, implementation=self.implementation, **kw)
        if self.vocab_size:
            out = out._replace(logits=full_vocab_logits(out.logits, params["vocab_map"], self.vocab_size))
        return out

    def init(self, params, ctx: Context, target_out, sp):
        B = ctx.tokens.shape[0]
        cfg = self.config
        cache = KVCache.init(cfg.num_layers, B, self.cache_size, kv_heads(params, cfg), cfg.head_dim,
                             params["final_norm"].dtype)
        prompt = ctx.tokens[:, :int(target_out.hidden.shape[1])]                 # [B, P] right-padded prompt
        # Only the cache is kept: one position's logits instead of the LM head over the whole prompt.
        out = self._forward(params, ctx, prompt, cache, logits_at=ctx.prompt_length - 1)
        return out.cache.replace(lengths=ctx.prompt_length)

    def _step(self, params, ctx: Context, cache, tokens, key, sp: SamplingParams):
        out = self._forward(params, ctx, tokens, cache)
        cache = out.cache.replace(lengths=cache.lengths + tokens.shape[1])
        return (cache,) + pick_tokens(out.logits[:, -1], key, sp)                # tokens [B], q, confidence

    def propose(self, params, cache: KVCache, ctx: Context, keys, sp: SamplingParams):
        if self.is_tree:
            return self._propose_tree(params, cache, ctx)
        k = self.k
        step_keys = jax.vmap(lambda key: jax.random.split(key, k))(keys)        # [B, k] keys
        # After a proposal the cache holds length + k - 2 entries of the old length, so the new length exceeds it
        # by more than one only when all k drafts were accepted (the k-th was never fed): catch up with a T=2
        # step then (for every row, which is harmless), else a T=1 step (on CPU a 2-row step costs ~2 1-row ones).
        behind = jnp.any(ctx.length - 1 > cache.lengths)
        cache, tok, probs, conf = lax.cond(
            behind,
            lambda c: self._step(params, ctx, c.replace(lengths=ctx.length - 2), last_tokens(ctx, 2), step_keys[:, 0],
                                 sp),
            lambda c: self._step(params, ctx, c.replace(lengths=ctx.length - 1), last_tokens(ctx, 1), step_keys[:, 0],
                                 sp),
            cache)

        def body(carry, key_i):
            cache, tok = carry
            cache, nxt, p, c = self._step(params, ctx, cache, tok[:, None], key_i, sp)
            return (cache, nxt), (nxt, p, c)

        (cache, _), rest = chain_scan(body, (cache, tok), jnp.swapaxes(step_keys[:, 1:], 0, 1), ctx, conf)
        tokens, probs, confidence = chain_of_picks((tok, probs, conf), rest)              # [B, k, ...]
        return Draft(tokens, probs, confidence=confidence), cache

    def _propose_tree(self, params, cache: KVCache, ctx: Context) -> tuple[Draft, KVCache]:
        cache, root_logits = self._catch_up(params, cache, ctx, self.tree_depth + 1)
        root = last_tokens(ctx, 1)[:, 0]
        # each depth re-runs the draft model over the whole partial tree with its mask; nothing is committed
        run = lambda toks, depths, mask: self._forward(params, ctx, toks, cache, depths=depths, mask=mask).logits
        tree = tree_search.search_by_rerun(self.tree, self.num_steps, self.topk, self.k + 1, root, root_logits, run)
        return Draft(tree.tokens[:, 1:], None, tree), cache

    def _catch_up(self, params, cache: KVCache, ctx: Context, width: int) -> tuple[KVCache, jax.Array]:
        """Feed committed tokens from max(length - width, 0) (re-writing entries with identical contents) so the
        cache holds every committed token, the root included -> (cache, root logits [B, V]). When length < width
        the block runs past the root into stale slots, which lie beyond the new length and are never read."""
        start = jnp.maximum(ctx.length - width, 0)                                  # [B]
        block = jnp.take_along_axis(ctx.tokens, start[:, None] + jnp.arange(width), axis=1)   # [B, width]
        out = self._forward(params, ctx, block, cache.replace(lengths=start))
        root_at = (ctx.length - 1 - start)[:, None, None]
        return out.cache.replace(lengths=ctx.length), jnp.take_along_axis(out.logits, root_at, axis=1)[:, 0]

    def commit(self, params, cache, ctx, num_accepted, target_out, verified):
        return cache


def _load(target: Model, path_or_name: str) -> Model | TargetEmbeddingDraft:
    """A model directory or shipped model name -> its Model; our artifact of a draft reading the target's embedding
    -> a TargetEmbeddingDraft."""
    path = checkpoints.resolve(path_or_name, "model")
    if os.path.isdir(path) and checkpoints.artifact_kind(path) == KIND:
        return load(path, target)
    return load_model(path_or_name)


def _build(req: BuildRequest):
    config, draft = req.config, req.drafter
    if draft is None:
        raise TypeError(f"method='draft_model' needs drafter=<{_ACCEPTS}>, got None")
    V = req.target.config.vocab_size
    if isinstance(draft, TargetEmbeddingDraft):
        check_target(req.target, draft)
        vocab = draft.draft_vocab_size or V
    else:
        check_same_vocabulary(req.target, draft)
        vocab = V
    steps, topk = (config.num_steps or 0), (config.topk or 0)        # 0: chain or static tree
    width = config.tree.topk if config.tree is not None else topk
    if width > vocab:
        raise ValueError(f"the tree asks for the top-{width} draft tokens per node but the draft's vocabulary has "
                         f"only {vocab}")
    size = req.buffer_len + DraftModelDrafter.extra_cache_slots(config.k, steps, topk)
    if not isinstance(draft, TargetEmbeddingDraft):
        return DraftModelDrafter(config.k, draft.config, size, config.implementation, config.tree, steps,
                                 topk), draft.params
    N = draft.draft_vocab_size
    params = draft.params if N is None else dict(draft.params, vocab_map=jnp.asarray(draft_to_target(draft.d2t),
                                                                                     jnp.int32))
    head = dataclasses.replace(draft.config, vocab_size=vocab)         # the width of the head it projects through
    return DraftModelDrafter(config.k, head, size, config.implementation, config.tree, steps, topk,
                             target_embedding=True, vocab_size=V if N else None), params


def prepare_llama_params(drafter, params, mesh):
    """A drafter that is a Llama (drafter.config: its ModelConfig) laid out by the target's rules (vocabulary
    padded, kv heads replicated), leniently: a small draft model whose query heads or MLP the model axis does not
    divide keeps those dims replicated instead of being refused."""
    m = axis_size(mesh, "model")
    return apply_layout(params, drafter.config, plan_layout(drafter.config, m, what="draft model", strict=False))


def llama_param_specs(drafter, params, mesh):
    """A Llama drafter's partition specs: the target's layout, dims the mesh does not divide replicated."""
    return param_specs(drafter.config, params, mesh)


def _prepare_params(drafter: DraftModelDrafter, params, mesh):
    """A Model draft is laid out like the target; one reading the target's embedding (a few layers and a small
    head) stays replicated."""
    return params if drafter.target_embedding else prepare_llama_params(drafter, params, mesh)


def _param_specs(drafter: DraftModelDrafter, params, mesh):
    if drafter.target_embedding:
        return jax.tree.map(lambda _: PartitionSpec(), params)
    return llama_param_specs(drafter, params, mesh)


_ACCEPTS = ("a specjax Model, a model directory or a shipped model name, or a draft reading the target's "
            "embedding (its artifact directory, draft_model.load(...) or a TargetEmbeddingDraft)")

register(DrafterSpec(KIND, _build, accepts=_ACCEPTS, load=_load, artifact=(Model, TargetEmbeddingDraft), trees=True,
                     prepare_params=_prepare_params, param_specs=_param_specs))
