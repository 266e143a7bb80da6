"""The DFlash block drafter's maths as pure functions over its params, shared by the drafter and its training loss
(train.losses.dflash): the context features and their keys / values (context_features, context_kv), the block's
inputs (block_inputs), the draft layers over a block (block_forward) and the draft logits (draft_logits)."""
from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp

from specjax.ops import linear
from specjax.drafters.dflash.config import DFlashConfig
from specjax.models.llama import apply_rope, rms_norm


def _inv_freq(cfg: DFlashConfig) -> jax.Array:
    return 1.0 / (cfg.rope_theta ** (jnp.arange(0, cfg.head_dim, 2, dtype=jnp.float32) / cfg.head_dim))


def context_features(params: dict, cfg: DFlashConfig, layer_hidden: Sequence[jax.Array]) -> jax.Array:
    """The target's layer outputs (each [B, T, H_t], in cfg.target_layers' order) -> context features [B, T, H]."""
    feats = linear(jnp.concatenate(list(layer_hidden), -1), params["fc"])
    return rms_norm(feats, params["hidden_norm"], cfg.rms_norm_eps)


def context_kv(lp: dict, cfg: DFlashConfig, feats: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One layer's keys / values of context features [B, T, H] at positions [B, T] -> [B, T, Hkv, D] each."""
    B, T = feats.shape[:2]
    k = linear(feats, lp["wk"]).reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
    k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    v = linear(feats, lp["wv"]).reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
    return apply_rope(k, positions, _inv_freq(cfg)), v


def block_forward(params: dict, cfg: DFlashConfig, x: jax.Array, positions: jax.Array, ctx_k: Sequence[jax.Array],
                  ctx_v: Sequence[jax.Array], ctx_visible: jax.Array) -> jax.Array:
    """The draft layers over a block x [B, T, H] at positions [B, T], each layer's queries attending to its context
    keys / values ctx_k[l], ctx_v[l] [B, Hkv, S, D] (a KVCache's layout) where ctx_visible [B, S] (True: a context
    position of this row), and to every block position -> final-normed hidden [B, T, H]. Drafting and training
    share it."""
    B, T, H = x.shape
    Hq, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    group, eps, inv = Hq // Hkv, cfg.rms_norm_eps, _inv_freq(cfg)
    S = ctx_visible.shape[1]
    for lp, k_c, v_c in zip(params["layers"], ctx_k, ctx_v):
        h = rms_norm(x, lp["attn_norm"], eps)
        q = apply_rope(rms_norm(linear(h, lp["wq"]).reshape(B, T, Hq, D), lp["q_norm"], eps), positions, inv)
        k_b = apply_rope(rms_norm(linear(h, lp["wk"]).reshape(B, T, Hkv, D), lp["k_norm"], eps), positions, inv)
        v_b = linear(h, lp["wv"]).reshape(B, T, Hkv, D)
        qg = q.reshape(B, T, Hkv, group, D) / math.sqrt(D)
        s_ctx = jnp.einsum("btkgd,bksd->bkgts", qg, k_c)                   # [B, Hkv, group, T, S]
        s_ctx = jnp.where(ctx_visible[:, None, None, None, :], s_ctx, -jnp.inf)
        s_blk = jnp.einsum("btkgd,bukd->bkgtu", qg, k_b)                    # the block sees itself whole
        p = jax.nn.softmax(jnp.concatenate([s_ctx, s_blk], -1), -1)
        o = jnp.einsum("bkgts,bksd->btkgd", p[..., :S], v_c) + jnp.einsum("bkgtu,bukd->btkgd", p[..., S:], v_b)
        x = x + linear(o.reshape(B, T, Hq * D), lp["wo"])
        h = rms_norm(x, lp["mlp_norm"], eps)
        x = x + linear(jax.nn.silu(linear(h, lp["w_gate"])) * linear(h, lp["w_up"]), lp["w_down"])
    return rms_norm(x, params["final_norm"], eps)


def draft_logits(params: dict, cfg: DFlashConfig, hidden: jax.Array, target_lm_head: jax.Array) -> jax.Array:
    """Final-normed block hidden [..., H] -> float32 logits [..., N] over the draft vocabulary (the drafter's own
    head), or [..., V] through the target's LM head when it has none. Drafting and training share it."""
    if cfg.draft_vocab_size is not None:
        return linear(hidden, params["lm_head"].astype(hidden.dtype)).astype(jnp.float32)
    # the target's head as given (a tied head is embed.T: XLA's dot reads it in place, a kernel call would copy it)
    return (hidden @ target_lm_head.astype(hidden.dtype)).astype(jnp.float32)


def block_inputs(params: dict, embed: jax.Array, anchor: jax.Array, num_masks: int) -> jax.Array:
    """[embed(anchor), mask x num_masks]: anchor [B] -> [B, 1 + num_masks, H]."""
    first = embed[anchor][:, None, :]
    masks = jnp.broadcast_to(params["mask_embed"], (anchor.shape[0], num_masks, embed.shape[-1]))
    return jnp.concatenate([first, masks.astype(first.dtype)], 1)
