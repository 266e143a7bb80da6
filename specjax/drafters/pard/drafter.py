"""The PARD drafter: one draft forward per step over the uncached committed tokens and k - 1 masks; registered as
the method "pard".

KV cache under partial acceptance: only committed tokens are kept. After a proposal the cache holds every
committed token at slot = position (the block re-writes entries that were already there with identical contents);
the mask entries lie past the committed length and are overwritten by the next proposal. A step commits at most
k + 1 new tokens, so a block of width k + 1 always reaches back to the first uncached one: one forward of 2k
positions per step, against k sequential steps for a draft_model drafter. While a row has fewer committed tokens
than the block is wide, the block starts at 0 and runs past the last committed token into stale slots; the masks
are then placed by explicit positions and an explicit attention mask that hides those slots.
"""
from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from specjax.cache import KVCache
from specjax.checkpoints import resolve
from specjax.drafters.base import Context, Draft, pick_block
from specjax.drafters.draft_model import DraftModelDrafter, llama_param_specs, prepare_llama_params
from specjax.drafters.draft_vocab import draft_to_target, full_vocab_logits
from specjax.drafters.pard.checkpoint import check, check_target_embedding, load, load_target_embedding
from specjax.drafters.pard.config import CONFIG_KEY, KIND, PardModel, TargetEmbeddingPard
from specjax.drafters.pard.model import embed_tokens
from specjax.drafters.registry import BuildRequest, DrafterSpec, register
from specjax.models.config import ModelConfig
from specjax.models.llama import forward
from specjax.models.model import Model
from specjax.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class PardDrafter:
    k: int
    config: ModelConfig               # the draft's (vocab_size = the target's + the masks; reading the target's
                                      # embedding: its head's width, the target's V or the draft vocabulary's N)
    vocab_size: int                   # the target's: draft logits are cut to it
    mask_token_ids: tuple[int, ...]   # the k - 1 masks this drafter feeds
    cache_size: int
    implementation: str = "xla"
    reads_target_embedding: bool = False   # a TargetEmbeddingPard
    draft_vocab_size: int | None = None    # its own head's width (params: lm_head, vocab_map), or None
    target_layers = ()                # reads nothing of the target's features, only its tokens

    @property
    def target_weights(self) -> tuple[str, ...]:
        if not self.reads_target_embedding:
            return ()
        return ("embed",) if self.draft_vocab_size else ("embed", "output_head")

    def _forward(self, params, ctx: Context, tokens: jax.Array, cache: KVCache, **kw):
        if not self.reads_target_embedding:
            return forward(params, self.config, tokens, cache, implementation=self.implementation, **kw)
        w = ctx.target_weights
        x = embed_tokens(params["mask_embed"], w["embed"], tokens)                       # [B, T, H]
        # the target's head as it stores it (a tied one read in place), or the draft vocabulary's own
        head = {} if self.draft_vocab_size else w["output_head"]
        return forward(dict(params, **head), self.config, tokens, cache, input_embeds=x,
                       implementation=self.implementation, **kw)

    def init(self, params, ctx: Context, target_out, sp) -> KVCache:
        """The draft's prefill over the prompt, as a draft model's (the masks are only ever fed by propose)."""
        return DraftModelDrafter.init(self, params, ctx, target_out, sp)

    def draft_logits(self, params, cache: KVCache, ctx: Context) -> tuple[jax.Array, KVCache]:
        """The one draft forward -> (logits [B, k, V] of drafts 1..k, cut to the target's vocabulary; the cache
        holding every committed token, lengths = ctx.length)."""
        k, w = self.k, self.k + 1
        B = ctx.tokens.shape[0]
        start = jnp.maximum(ctx.length - w, 0)                                          # [B]
        block = jnp.take_along_axis(ctx.tokens, start[:, None] + jnp.arange(w), axis=1)  # [B, w]
        root = ctx.length - 1 - start                         # [B] the last committed token's index in the block
        masks = jnp.broadcast_to(jnp.asarray(self.mask_token_ids, jnp.int32), (B, k - 1))
        tokens = jnp.concatenate([block, masks], axis=1)                                 # [B, 2k]
        # Mask j sits at position length + j whatever the block held past the root.
        depths = jnp.concatenate([jnp.broadcast_to(jnp.arange(w), (B, w)),
                                  root[:, None] + 1 + jnp.arange(k - 1)], axis=1)         # [B, 2k]
        q = jnp.arange(w + k - 1)[:, None]                                               # query index
        c = jnp.arange(w + k - 1)[None, :]                                               # key index
        # Block rows: causal. Mask rows: the block up to the root (never the stale slots past it), then the
        # masks up to themselves.
        mask = jnp.where(q < w, c <= q, (c <= root[:, None, None]) | ((c >= w) & (c <= q)))  # [B, 2k, 2k]
        out = self._forward(params, ctx, tokens, cache.replace(lengths=start), depths=depths, mask=mask)
        logits = out.logits[..., :self.vocab_size]                                       # [B, 2k, V | N]
        first = jnp.take_along_axis(logits, root[:, None, None], axis=1)                 # [B, 1, V | N]
        logits = jnp.concatenate([first, logits[:, w:]], axis=1)                         # [B, k, V | N]
        if self.draft_vocab_size:
            logits = full_vocab_logits(logits, params["vocab_map"], self.vocab_size)     # [B, k, V]
        return logits, out.cache.replace(lengths=ctx.length)

    def propose(self, params, cache: KVCache, ctx: Context, keys, sp: SamplingParams):
        logits, cache = self.draft_logits(params, cache, ctx)                           # [B, k, V]
        tokens, probs, confidence = pick_block(logits, keys, sp)                       # [B, k, ...]
        return Draft(tokens, probs, confidence=confidence), cache

    def commit(self, params, cache, ctx, num_accepted, target_out, verified):
        return cache                      # the next proposal's block feeds whatever was committed


def _load(target: Model, path_or_name: str) -> PardModel | TargetEmbeddingPard:
    """An HF PARD draft (its own vocabulary + masks), or our artifact of one reading the target's embedding."""
    path = resolve(path_or_name, "drafter")
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    if CONFIG_KEY not in hf and "config" in hf and "target" in hf:
        return load_target_embedding(path, target)
    return load(path)


def _build(req: BuildRequest):
    pard = req.drafter
    if pard is None:
        raise TypeError("method='pard' needs drafter=<a PARD draft directory, a shipped name such as "
                        "'stdlib-draft-pard', or specjax.drafters.pard.load(...)>, got None")
    k, V = req.config.k, req.target.config.vocab_size
    # 2k extra slots: a block that starts at 0 for a short row can reach past the target's buffer.
    size = req.buffer_len + 2 * k
    if isinstance(pard, TargetEmbeddingPard):
        check_target_embedding(req.target, pard, k)
        N = pard.draft_vocab_size
        cfg = dataclasses.replace(pard.config, vocab_size=N or V)     # the width of the head it projects through
        params = pard.params if N is None else dict(pard.params, vocab_map=jnp.asarray(draft_to_target(pard.d2t),
                                                                                          jnp.int32))
        return PardDrafter(k, cfg, V, pard.mask_token_ids[:k - 1], size, req.config.implementation,
                           reads_target_embedding=True, draft_vocab_size=N), params
    check(req.target, pard, k)
    return PardDrafter(k, pard.model.config, V, pard.mask_token_ids[:k - 1], size,
                       req.config.implementation), pard.model.params


def _prepare_params(drafter: PardDrafter, params, mesh):
    """An own-vocabulary draft is laid out like a draft model; one reading the target's embedding (a few layers
    and small tables) stays replicated."""
    return params if drafter.reads_target_embedding else prepare_llama_params(drafter, params, mesh)


def _param_specs(drafter: PardDrafter, params, mesh):
    if drafter.reads_target_embedding:
        return jax.tree.map(lambda _: PartitionSpec(), params)
    return llama_param_specs(drafter, params, mesh)


register(DrafterSpec(KIND, _build, accepts="a PARD draft directory (its own vocabulary, or our artifact of one "
                     "reading the target's embedding), a shipped name, pard.load(...) or a TargetEmbeddingPard",
                     load=_load, artifact=(PardModel, TargetEmbeddingPard), prepare_params=_prepare_params,
                     param_specs=_param_specs))
