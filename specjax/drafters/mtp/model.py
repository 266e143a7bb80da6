"""The multi-token drafters' layer maths, as pure functions over params: the pieces the drafter runs against its KV
cache and the cache-free forwards training uses (mtp_forward_sequence, heads_forward_sequence)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.cache import KVCache
from specjax.drafters.mtp.config import MTPConfig
from specjax.models.config import ModelConfig
from specjax.models.llama import decoder_layer, lm_head, rms_norm


def module_input(mp: dict, c: ModelConfig, hid: jax.Array, emb: jax.Array) -> jax.Array:
    """MTP module input: proj([RMSNorm(h); RMSNorm(embedding)]) [B, T, H]."""
    x = jnp.concatenate([rms_norm(hid, mp["norm_h"], c.rms_norm_eps), rms_norm(emb, mp["norm_e"], c.rms_norm_eps)],
                        -1)
    return x @ mp["proj"]


def output_logits(mp: dict, c: ModelConfig, out: jax.Array, lm_head_w: jax.Array) -> jax.Array:
    """A module's / head's output [..., H] -> float32 logits over the target vocabulary [..., V]."""
    return lm_head({"lm_head": lm_head_w}, rms_norm(out, mp["final_norm"], c.rms_norm_eps))


def fresh_cache(c: ModelConfig, layers: int, batch: int, size: int, dtype) -> KVCache:
    """An empty KV cache of `layers` layers shaped for the layer config c (one layer per module / head)."""
    return KVCache.init(layers, batch, size, c.num_kv_heads, c.head_dim, dtype)


def block_positions(start: jax.Array, T: int) -> jax.Array:
    """RoPE positions [B, T] of a block of T entries from each row's start [B]."""
    return start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]                  # [B, T]


def shift_in(first: jax.Array, block: jax.Array) -> jax.Array:
    """[B, H] and [B, T, H] -> [B, T, H]: first, then block[:, :T-1] (the previous module's outputs one entry
    earlier)."""
    return jnp.concatenate([first[:, None].astype(block.dtype), block[:, :-1]], axis=1)


def mtp_forward_sequence(params: dict, config: MTPConfig, tokens: jax.Array, features: jax.Array,
                         target_weights: dict) -> tuple[jax.Array, jax.Array]:
    """Teacher-forced MTP modules over whole sequences (training), no persistent cache.

    Entry e pairs features[:, e] (the target's final normed hidden state of position e) with tokens[:, e] (the
    token at position e + 1), as inference does: tokens = ids[:, 1:], features = the target's hidden of
    ids[:, :-1]. Returns (outputs [D, B, T, H] pre-norm, logits [D, B, T, V]); every module's logits[:, :, e]
    predict ids[:, e + 2]; module d's entries e < d (0-based d) have no causal chain behind them (padding)."""
    c = config.layer
    B, T = tokens.shape
    emb = target_weights["embed"][tokens]
    pos = block_positions(jnp.zeros((B,), jnp.int32), T)
    hid, outs = features.astype(emb.dtype), []
    for d, mp in enumerate(params["modules"]):
        cache = fresh_cache(c, 1, B, T, emb.dtype)
        out, _ = decoder_layer(mp["layer"], c, module_input(mp, c, hid, emb), pos, cache, 0)
        outs.append(out)
        hid = shift_in(jnp.zeros((B, c.hidden_size), out.dtype), out)
    outs = jnp.stack(outs)
    logits = jnp.stack([output_logits(mp, c, o, target_weights["lm_head"]) for mp, o in zip(params["modules"], outs)])
    return outs, logits


def heads_forward_sequence(params: dict, config: MTPConfig, trunk: jax.Array, lm_head_w: jax.Array
                           ) -> tuple[jax.Array, jax.Array]:
    """Multi-token heads over whole sequences: trunk [B, T, H] (the trunk's output at every position) -> (outputs
    [D, B, T, H], logits [D, B, T, V]); head d (0-based, the model's head d + 2) at t predicts the token at
    t + d + 2."""
    c = config.layer
    B, T = trunk.shape[:2]
    pos = block_positions(jnp.zeros((B,), jnp.int32), T)
    outs = [decoder_layer(hp["layer"], c, trunk, pos, fresh_cache(c, 1, B, T, trunk.dtype), 0)[0]
            for hp in params["heads"]]
    outs = jnp.stack(outs)
    return outs, jnp.stack([output_logits(hp, c, o, lm_head_w) for hp, o in zip(params["heads"], outs)])
