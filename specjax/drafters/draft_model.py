"""A separate small Llama-family LM with its own KV cache proposes k tokens, one sequential step each.

Cache bookkeeping: the draft cache holds the committed tokens except the last; a proposal resets its length to
that (rolling back rejected drafts) and feeds the last committed token. After a fully accepted chain the k-th
draft token was never fed, so that proposal rewinds one more entry and feeds the last TWO tokens instead (the
catch-up; re-writing an entry with identical contents). Which case applies follows from the cache length alone.

Trees (SpecInfer-style; static TreeSpec, or a dynamic EAGLE-2 tree when num_steps > 0), searched by
specjax.tree_search: children are the drafter's top-k tokens (deterministic, in greedy and sampled mode alike,
exact for any tree shape, including one pruned by draft scores). Each depth re-runs the draft model over the
partial tree (tree mask, nothing committed to its cache); simple, and the draft model is small. The catch-up feeds the last
max_depth + 1 committed tokens, since a tree step never fed the accepted path in sequence order.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from specjax import tree_search
from specjax.cache import KVCache
from specjax.drafters.base import Context, Draft, chain_of_picks, chain_scan, last_tokens, pick_tokens
from specjax.drafters.registry import BuildRequest, DrafterSpec, register
from specjax.layout import apply_layout, axis_size, param_specs, plan_layout
from specjax.models.config import ModelConfig
from specjax.models.llama import forward, kv_heads
from specjax.models.model import Model, load_model
from specjax.sampling import SamplingParams
from specjax.trees import TreeSpec


@dataclasses.dataclass(frozen=True)
class DraftModelDrafter:
    k: int
    config: ModelConfig
    cache_size: int
    implementation: str = "xla"
    tree: TreeSpec | None = None      # a static tree of k + 1 nodes
    num_steps: int = 0                # > 0: a dynamic tree of num_steps depth, topk children per node
    topk: int = 0
    target_layers = ()                # reads nothing of the target but its tokens
    target_weights = ()

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

    def _forward(self, params, ctx: Context, tokens: jax.Array, cache: KVCache, **kw):
        """The draft's forward over tokens (a drafter that embeds or projects differently, PARD's, has its own)."""
        return forward(params, self.config, tokens, cache, implementation=self.implementation, **kw)

    def init(self, params, ctx: Context, target_out, sp):
        B = ctx.tokens.shape[0]
        cfg = self.config
        cache = KVCache.init(cfg.num_layers, B, self.cache_size, kv_heads(params, cfg), cfg.head_dim,
                             params["final_norm"].dtype)
        prompt = ctx.tokens[:, :int(target_out.hidden.shape[1])]                 # [B, P] right-padded prompt
        # Only the cache is kept: one position's logits instead of the LM head over the whole prompt.
        out = self._forward(params, ctx, prompt, cache, logits_at=ctx.prompt_length - 1)
        return out.cache.replace(lengths=ctx.prompt_length)

    def _step(self, params, cache, tokens, key, sp: SamplingParams):
        out = forward(params, self.config, tokens, cache, implementation=self.implementation)
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
            lambda c: self._step(params, c.replace(lengths=ctx.length - 2), last_tokens(ctx, 2), step_keys[:, 0], sp),
            lambda c: self._step(params, c.replace(lengths=ctx.length - 1), last_tokens(ctx, 1), step_keys[:, 0], sp),
            cache)

        def body(carry, key_i):
            cache, tok = carry
            cache, nxt, p, c = self._step(params, cache, tok[:, None], key_i, sp)
            return (cache, nxt), (nxt, p, c)

        (cache, _), rest = chain_scan(body, (cache, tok), jnp.swapaxes(step_keys[:, 1:], 0, 1), ctx, conf)
        tokens, probs, confidence = chain_of_picks((tok, probs, conf), rest)              # [B, k, ...]
        return Draft(tokens, probs, confidence=confidence), cache

    def _propose_tree(self, params, cache: KVCache, ctx: Context) -> tuple[Draft, KVCache]:
        cache, root_logits = self._catch_up(params, cache, ctx, self.tree_depth + 1)
        root = last_tokens(ctx, 1)[:, 0]
        # each depth re-runs the draft model over the whole partial tree with its mask; nothing is committed
        run = lambda toks, depths, mask: forward(params, self.config, toks, cache, depths=depths, mask=mask,
                                                 implementation=self.implementation).logits
        tree = tree_search.search_by_rerun(self.tree, self.num_steps, self.topk, self.k + 1, root, root_logits, run)
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

    def commit(self, params, cache, ctx, num_accepted, target_out, verified):
        return cache


def check_same_vocabulary(target, draft, extra_tokens: int = 0) -> None:
    """A drafter must speak the target's vocabulary, or its tokens mean something else (silent garbage).
    extra_tokens: draft-only tokens appended after the target's (PARD's mask tokens); the draft's first
    target-vocab_size ids must still map to the target's strings."""
    V = target.config.vocab_size
    if draft.config.vocab_size != V + extra_tokens:
        want = f"{V}" if not extra_tokens else \
            f"the target's {V} plus its {extra_tokens} mask tokens = {V + extra_tokens}"
        raise ValueError(f"vocabulary mismatch: draft model {draft.name!r} has vocab_size "
                         f"{draft.config.vocab_size}, target {target.name!r} has {V}; expected {want}")
    if target.tokenizer is not None and draft.tokenizer is not None:
        vocab = draft.tokenizer.get_vocab()
        if extra_tokens:
            vocab = {t: i for t, i in vocab.items() if i < V}
        if target.tokenizer.get_vocab() != vocab:
            raise ValueError(f"vocabulary mismatch: draft model {draft.name!r} and target {target.name!r} have "
                             f"the same {V}-token vocabulary size but different tokenizers (token ids map to "
                             "different strings): the draft was made for another tokenizer")


def _load(target: Model, path_or_name: str) -> Model:
    return load_model(path_or_name)                  # a directory or a shipped model's name


def _build(req: BuildRequest):
    config, draft = req.config, req.drafter
    if draft is None:
        raise TypeError("method='draft_model' needs drafter=<a loaded specjax Model, a model directory or a "
                        "shipped model name>, got None")
    check_same_vocabulary(req.target, draft)
    steps, topk = (config.num_steps or 0), (config.topk or 0)        # 0: chain or static tree
    width = config.tree.topk if config.tree is not None else topk
    if width > req.target.config.vocab_size:
        raise ValueError(f"the tree asks for the top-{width} draft tokens per node but the vocabulary has only "
                         f"{req.target.config.vocab_size}")
    extra = DraftModelDrafter.extra_cache_slots(config.k, steps, topk)
    return DraftModelDrafter(config.k, draft.config, req.buffer_len + extra, config.implementation, config.tree,
                             steps, topk), draft.params


def prepare_llama_params(drafter, params, mesh):
    """A drafter that is a Llama (drafter.config: its ModelConfig) laid out by the target's rules (vocabulary
    padded, kv heads replicated), leniently: a small draft model whose query heads or MLP the model axis does not
    divide keeps those dims replicated instead of being refused."""
    m = axis_size(mesh, "model")
    return apply_layout(params, drafter.config, plan_layout(drafter.config, m, what="draft model", strict=False))


def llama_param_specs(drafter, params, mesh):
    """A Llama drafter's partition specs: the target's layout, dims the mesh does not divide replicated."""
    return param_specs(drafter.config, params, mesh)


register(DrafterSpec("draft_model", _build, accepts="a specjax Model, a model directory or a shipped model name",
                     load=_load, artifact=Model, trees=True, prepare_params=prepare_llama_params,
                     param_specs=llama_param_specs))
