"""A separate small Llama-family LM with its own KV cache proposes k tokens, one sequential step each.

Cache bookkeeping: the draft cache holds the committed tokens except the last. Each proposal rewinds one extra
entry and first feeds the last TWO committed tokens; that single T=2 step is the catch-up after a fully accepted
chain (the k-th draft token was never fed to the drafter) and is harmless otherwise (it rewrites an entry with
identical contents). Rollback of rejected drafts is just the length reset.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.cache import KVCache
from specjax.drafters.base import Context, Draft, last_tokens
from specjax.models.config import ModelConfig
from specjax.models.llama import forward
from specjax.sampling import SamplingParams, probabilities, sample


@dataclasses.dataclass(frozen=True)
class DraftModelDrafter:
    num_tokens: int
    config: ModelConfig
    cache_size: int
    implementation: str = "xla"

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
        k = self.num_tokens
        step_keys = jax.vmap(lambda key: jax.random.split(key, k))(keys)        # [B, k] keys
        cache = cache.replace(lengths=ctx.length - 2)
        cache, tok, probs = self._step(params, cache, last_tokens(ctx, 2), step_keys[:, 0], sp)

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

    def commit(self, params, cache, ctx, num_accepted, target_out):
        return cache
