"""The multi-token drafter: its modules / heads run with a KV cache each on the loop's target features; registered
as the methods "mtp" and "mtp_heads".

Cache alignment (both; the EAGLE convention): the drafter's KV-cache entry e belongs to target position e, entries
0 .. committed length - 2 are committed (lengths = committed - 1), and `hidden` holds each module's / head's output
at the last committed entry.
  mtp: module 1's entry e pairs (h^0_e, x_{e+1}); module d's entry e pairs (h^{d-1} at entry e - 1, x_{e+1}) -- the
       DeepSeek chain (module d at position s reads h^{d-1}_s and x_{s+d}) with module d's positions shifted by d - 1,
       which RoPE's relative positions make the same computation, and which lets every module commit the same
       entries. Every module's entry e predicts x_{e+2}. Entry 0 of module d > 1 has no h^{d-1} (zeros), in training
       and inference alike. Propose: draft 1 = module 1's stored output; for d = 2..min(k, D) module d runs the
       d - 1 entries L-1 .. L+d-3 past the committed ones (L = committed length), pairing module d-1's outputs at
       L-2 .. L+d-4 (the stored one, then its own speculative block) with drafts 1..d-1, so each draft is exactly
       what the modules computed in training on the drafted prefix; beyond D one entry of module D per draft on its
       previous output. Speculative entries lie past the committed length and are overwritten at the next commit.
       Commit: for d = 1..D the W = k + 1 verified entries from the old length, module d's hidden inputs being
       module d-1's stored output followed by its commit block (module 1: the target's features).
  mtp_heads: head i's entry e = head i's layer over the trunk feature of position e; no tokens.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specjax.cache import KVCache
from specjax.drafters.base import Context, Draft, pick_tokens
from specjax.drafters.mtp.checkpoint import load
from specjax.drafters.mtp.config import MTPConfig, MTPWeights
from specjax.drafters.mtp.model import block_positions, fresh_cache, module_input, output_logits, shift_in
from specjax.drafters.registry import BuildRequest, DrafterSpec, Option, register
from specjax.models.llama import decoder_layer
from specjax.sampling import SamplingParams


# ------------------------------------------------------------------------------------------------- the drafters

class MTPState(NamedTuple):
    cache: KVCache          # one layer per module / head; lengths = committed length - 1
    hidden: jax.Array       # [D, B, H] each module's / head's output at the last committed entry


@dataclasses.dataclass(frozen=True)
class MTPDrafter:
    k: int
    config: MTPConfig
    cache_size: int
    implementation: str = "xla"

    @property
    def target_layers(self) -> tuple:
        return (self.config.trunk_layer,) if self.config.kind == "mtp_heads" else ()

    @property
    def target_weights(self) -> tuple:
        return ("embed", "lm_head") if self.config.kind == "mtp" else ("lm_head",)

    @property
    def _used(self) -> int:
        """Modules / heads that run: the first min(k, D) (module d only reads modules before it)."""
        return min(self.k, self.config.depth)

    def _entries(self, params) -> list:
        return (params["modules"] if self.config.kind == "mtp" else params["heads"])[:self._used]

    def _features(self, target_out) -> jax.Array:
        return target_out.hidden if self.config.kind == "mtp" else target_out.layer_hidden[0]

    def _run_all(self, params, ctx: Context, feats, tokens, cache: KVCache, first_hidden):
        """Every module / head over the block of entries at cache.lengths: feats [B, T, H] (target features),
        tokens [B, T] (mtp: x_{e+1} of each entry), first_hidden [D, B, H] (mtp: each module's output one entry
        before the block) -> (outputs [D, B, T, H], cache with the entries written, lengths not advanced)."""
        c = self.config.layer
        pos = block_positions(cache.lengths, feats.shape[1])
        outs = []
        if self.config.kind == "mtp":
            emb = ctx.target_weights["embed"][tokens].astype(feats.dtype)
            hid = feats
            for d, mp in enumerate(self._entries(params)):
                out, cache = decoder_layer(mp["layer"], c, module_input(mp, c, hid, emb), pos, cache, d,
                                           implementation=self.implementation)
                outs.append(out)
                hid = shift_in(first_hidden[d], out)
        else:
            for d, hp in enumerate(self._entries(params)):
                out, cache = decoder_layer(hp["layer"], c, feats, pos, cache, d, implementation=self.implementation)
                outs.append(out)
        return jnp.stack(outs), cache

    def _head_logits(self, params, ctx: Context, d: int, h: jax.Array) -> jax.Array:
        return output_logits(self._entries(params)[d], self.config.layer, h, ctx.target_weights["lm_head"])

    def init(self, params, ctx: Context, target_out, sp):
        c = self.config.layer
        feats = self._features(target_out)
        B, P = feats.shape[:2]
        idx = np.minimum(np.arange(1, P + 1), ctx.tokens.shape[1] - 1)
        cache = fresh_cache(c, self._used, B, self.cache_size, feats.dtype)
        zeros = jnp.zeros((self._used, B, c.hidden_size), feats.dtype)
        outs, cache = self._run_all(params, ctx, feats, ctx.tokens[:, idx], cache, zeros)
        last = jnp.take_along_axis(outs, (ctx.prompt_length - 1)[None, :, None, None], axis=2)[:, :, 0]
        return MTPState(cache.replace(lengths=ctx.prompt_length), last)

    def propose(self, params, state: MTPState, ctx: Context, keys, sp: SamplingParams):
        k = self.k
        step_keys = jax.vmap(lambda key: jax.random.split(key, k))(keys)          # [B, k] keys
        if self.config.kind == "mtp_heads":
            picks = [pick_tokens(self._head_logits(params, ctx, d, state.hidden[d]), step_keys[:, d], sp)
                     for d in range(k)]
            return self._draft(picks), state
        c, D = self.config.layer, self.config.depth
        base = state.cache.lengths                                                 # L - 1
        cache = state.cache
        picks = [pick_tokens(self._head_logits(params, ctx, 0, state.hidden[0]), step_keys[:, 0], sp)]
        chain = state.hidden[0][:, None]      # the latest module's outputs from entry L-2 on: [B, n, H]
        for j in range(2, k + 1):                                                  # draft j
            drafts = jnp.stack([p[0] for p in picks], 1)                           # [B, j - 1]
            if j <= D:             # module j: the j - 1 entries L-1 .. L+j-3, on module j-1's L-2 .. L+j-4
                d, hid, toks, start = j - 1, chain, drafts, base
            else:                  # beyond D: module D once more, one entry, on its own previous output
                d, hid, toks, start = D - 1, chain[:, -1:], drafts[:, -1:], base + j - 2
            mp = self._entries(params)[d]
            x = module_input(mp, c, hid, ctx.target_weights["embed"][toks].astype(hid.dtype))
            out, cache = decoder_layer(mp["layer"], c, x, block_positions(start, x.shape[1]),
                                       cache.replace(lengths=start), d, implementation=self.implementation)
            chain = (jnp.concatenate([state.hidden[d][:, None], out], 1) if j <= D
                     else jnp.concatenate([chain, out], 1))
            picks.append(pick_tokens(self._head_logits(params, ctx, d, out[:, -1]), step_keys[:, j - 1], sp))
        return self._draft(picks), MTPState(cache.replace(lengths=base), state.hidden)

    @staticmethod
    def _draft(picks) -> Draft:
        tokens, probs, confidence = (None if picks[0][i] is None else jnp.stack([p[i] for p in picks], 1)
                                     for i in range(3))                            # [B, k], [B, k, V], [B, k]
        return Draft(tokens, probs, confidence=confidence)

    def commit(self, params, state: MTPState, ctx, num_accepted, target_out, verified):
        feats = self._features(target_out)
        W = feats.shape[1]                                                         # k + 1
        old = state.cache.lengths
        idx = jnp.minimum(old[:, None] + 1 + jnp.arange(W), ctx.tokens.shape[1] - 1)
        toks = jnp.take_along_axis(ctx.tokens, idx, axis=1)                        # accepted drafts, then the bonus
        outs, cache = self._run_all(params, ctx, feats, toks, state.cache, state.hidden)
        new_len = ctx.length - 1                                                   # old + n + 1 unless clipped
        at = jnp.clip(new_len - old - 1, 0, W - 1)
        hidden = jnp.take_along_axis(outs, at[None, :, None, None], axis=2)[:, :, 0]
        return MTPState(cache.replace(lengths=new_len), hidden)



# --------------------------------------------------------------------------------------------------- registry

_ACCEPTS = {"mtp": "MTP modules: a directory, a shipped name or mtp.load(...)",
            "mtp_heads": "a multi-token target's heads: its directory (holding mtp_heads/), the heads' directory, a "
                         "shipped name or mtp.load(..., kind='mtp_heads')"}


def _build(req: BuildRequest, kind: str):
    w = req.drafter                     # registry.build has loaded a path or name and checked the type
    if w is None:
        raise TypeError(f"method={kind!r} needs drafter=<{_ACCEPTS[kind]}>, got None")
    if w.config.kind != kind:
        raise ValueError(f"drafter {w.name!r} holds {w.config.kind!r} weights; use method={w.config.kind!r}")
    k = req.config.k
    if kind == "mtp_heads" and k > w.config.depth:
        raise ValueError(f"k={k} but the multi-token target {w.name!r} has {w.config.depth} extra heads (it was "
                         f"trained to predict {w.config.depth + 1} tokens): k <= {w.config.depth}")
    if kind == "mtp" and k > w.config.depth and not req.config.option("reuse_last_module"):
        raise ValueError(f"k={k} drafts but {w.name!r} has {w.config.depth} MTP modules (depths beyond were never "
                         f"trained): use k <= {w.config.depth}, or drafter_options={{'reuse_last_module': True}} to "
                         "run the last module again beyond its depth (vLLM's way)")
    return MTPDrafter(k, w.config, req.buffer_len, req.config.implementation), w.params


register(DrafterSpec(
    "mtp", lambda req: _build(req, "mtp"), accepts=_ACCEPTS["mtp"],
    load=lambda target, path: load(path, target, "mtp"), artifact=MTPWeights,
    options={"reuse_last_module": Option(False, lambda v: isinstance(v, bool),
                                         "True: draft beyond the trained depth D by running module D again on its "
                                         "own output (vLLM's way); False: k > D is an error")}))
register(DrafterSpec(
    "mtp_heads", lambda req: _build(req, "mtp_heads"), accepts=_ACCEPTS["mtp_heads"],
    load=lambda target, path: load(path, target, "mtp_heads"), artifact=MTPWeights))
