"""Llama-family decoder (Llama 2/3, Vicuna, Mistral, Qwen2) as pure functions over a params pytree.

One forward serves prefill (T = prompt), decode (T = 1) and verify (T = k + 1 chain, or T tree nodes with a mask):
the T new tokens are written into the KV cache at each row's `cache.lengths` and attend to everything before them.

params = {"embed": [V, H], "layers": [{attn_norm [H], wq [H, Hq*D], wk/wv [H, Hkv*D], (bq, bk, bv),
          wo [Hq*D, H], mlp_norm [H], w_gate/w_up [H, I], w_down [I, H]}, ...], "final_norm": [H],
          "lm_head": [H, V] (absent when tied)}
With load_model(weight_format="gguf") a layer holds its matrices as specjax.models.weights.Q4_1Matrix blocks,
the projections fused: wqkv [H, (Hq + 2 Hkv) D] in place of wq, wk, wv and w_gate_up [H, 2 I] in place of w_gate,
w_up (fewer, wider products; each column computed as in its own matrix), and "embed_blocks" (a Q8_0Matrix of embed's
values) may serve as the tied LM head.
Under a mesh the placed arrays may be wider than the config says (specjax.sharding.Layout): embed / lm_head padded
to Vp >= V entries and wk/wv (bk/bv) holding each kv head several times. forward reads the kv-head count from
the weights (kv_heads) and cuts the logits back to cfg.vocab_size, so callers never see either.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp

from specjax import ops
from specjax.cache import GroupedKVCache, KVCache
from specjax.models.config import ModelConfig


class ForwardOut(NamedTuple):
    logits: jax.Array                  # [B, T, V] float32 ([B, 1, V] with logits_at)
    hidden: jax.Array                  # [B, T, H] last hidden state after the final norm (what lm_head reads)
    layer_hidden: tuple                # outputs of the requested decoder layers, in the requested order, each
                                       # [B, T, H] (the residual stream after that layer, before any norm)
    cache: KVCache | GroupedKVCache    # new entries written; lengths NOT advanced (the caller commits)


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """The RMS norm op (specjax.ops.rms_norm)."""
    return ops.rms_norm(x, w, eps)


def rope_inv_freq(cfg: ModelConfig) -> jax.Array:
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    rs = cfg.rope_scaling_dict
    if not rs:
        return inv
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "linear":
        return inv / rs["factor"]
    if kind == "llama3":
        factor, lo, hi = rs["factor"], rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
        old = rs.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv
        lo_wl, hi_wl = old / lo, old / hi
        scaled = jnp.where(wavelen > lo_wl, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= hi_wl) & (wavelen <= lo_wl)
        return jnp.where(is_mid, mid, scaled)
    return inv


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """x [B, T, H, D], positions [B, T]; HF's rotate-half convention (specjax.ops.rope)."""
    return ops.rope(x, positions, inv_freq)


def attention(q, cache: KVCache | GroupedKVCache, layer: int, lengths, mask, *, implementation: str, q_positions,
              sliding_window):
    """q [B, T, Hq, D] over cache layer `layer` (specjax.ops.attention; implementation: SpecConfig's). Lengths
    include the T new entries. A grouped cache: each group's queries over its own (narrower) buffer."""
    if isinstance(cache, GroupedKVCache):
        shared_mask = mask is None or mask.ndim == 2             # causal, or one [T, T] tree mask for every row
        def one_group(part, q, lengths, q_positions, row_mask):
            return attention(q, part, layer, lengths, mask if shared_mask else row_mask,
                             implementation=implementation, q_positions=q_positions, sliding_window=sliding_window)
        return cache.per_group(one_group, q, lengths, q_positions, None if shared_mask else mask)
    return ops.attention(q, cache.k[layer], cache.v[layer], lengths, mask, q_positions=q_positions,
                         sliding_window=sliding_window, keys_transposed=cache.keys_transposed,
                         implementation=implementation)


def forward(params: dict, cfg: ModelConfig, tokens: jax.Array, cache: KVCache | GroupedKVCache, *,
            depths: jax.Array | None = None, mask: jax.Array | None = None,
            hidden_layers: Sequence[int] = (), implementation: str = "xla",
            input_embeds: jax.Array | None = None, logits_at: jax.Array | None = None,
            layers: Sequence[int] | None = None) -> ForwardOut:
    """tokens [B, T] int32. New tokens occupy cache slots lengths .. lengths + T - 1; their RoPE positions are
    lengths + depths (depths [T] or [B, T]; default arange(T), i.e. a chain). mask: None (causal) or a tree
    ancestor mask [T, T] / [B, T, T]. Caller must guarantee lengths + T <= cache.size.
    logits_at [B] int: the logits of only that position of each row ([B, 1, V]); a prefill needs only its last
    prompt position's, and the LM head over every position of a batch of long prompts is a fifth of its cost.
    layers (static): the decoder layers to run, in order (None: all); each writes its own cache layer and the
    others are left as they were (layer-skip drafting runs a subset of the target over the target's cache)."""
    B, T = tokens.shape
    if depths is None:
        depths = jnp.arange(T, dtype=jnp.int32)
    positions = cache.lengths[:, None] + jnp.broadcast_to(depths, (B, T))     # [B, T]
    inv_freq = rope_inv_freq(cfg)

    bad = [i for i in hidden_layers if not -1 < i < len(params["layers"])]
    if bad:
        raise ValueError(f"hidden_layers {bad} out of range: the model has {len(params['layers'])} decoder layers")
    x = params["embed"][tokens] if input_embeds is None else input_embeds    # [B, T, H]
    layer_hidden = {}
    for i in range(len(params["layers"])) if layers is None else layers:
        x, cache = decoder_layer(params["layers"][i], cfg, x, positions, cache, i, mask,
                                 implementation=implementation, inv_freq=inv_freq)
        if i in hidden_layers:
            layer_hidden[i] = x
    hidden = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    if logits_at is None:
        logits = lm_head(params, hidden, cfg.vocab_size)
    else:
        logits = lm_head(params, jnp.take_along_axis(hidden, logits_at[:, None, None], axis=1), cfg.vocab_size)
    return ForwardOut(logits, hidden, tuple(layer_hidden[i] for i in hidden_layers), cache)


def decoder_layer(lp: dict, cfg: ModelConfig, x: jax.Array, positions: jax.Array, cache: KVCache, index: int,
                  mask: jax.Array | None = None, *, implementation: str = "xla",
                  inv_freq: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
    """One pre-norm decoder layer over x [B, T, H] at RoPE positions [B, T]: its keys/values are written into
    cache layer `index` at each row's cache.lengths and the T queries attend to everything before them (mask: as
    forward's). -> (residual stream after the layer [B, T, H], cache; lengths not advanced). Also the layer of
    drafters that run decoder layers of their own over target features (MTP modules, multi-token heads)."""
    B, T = x.shape[:2]
    Hq, Hkv, D = cfg.num_heads, layer_kv_heads(lp, cfg), cfg.head_dim
    if inv_freq is None:
        inv_freq = rope_inv_freq(cfg)
    h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
    if "wqkv" in lp:                   # fused (panels, quantized): one product, its columns those of wq | wk | wv
        qkv = ops.linear(h, lp["wqkv"])                                      # [B, T, (Hq + 2 Hkv) D]
        if cfg.attention_bias:
            qkv = qkv + jnp.concatenate([lp["bq"], lp["bk"], lp["bv"]], axis=-1)
        q, k, v = ops.rope_qkv(qkv, positions, inv_freq, Hq, Hkv)           # q [B, T, Hq, D], k and v [B, T, Hkv, D]
    else:
        q, k, v = ops.linear(h, lp["wq"]), ops.linear(h, lp["wk"]), ops.linear(h, lp["wv"])
        if cfg.attention_bias:
            q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
        q = apply_rope(q.reshape(B, T, Hq, D), positions, inv_freq)      # [B, T, Hq, D]
        k = apply_rope(k.reshape(B, T, Hkv, D), positions, inv_freq)     # [B, T, Hkv, D]
        v = v.reshape(B, T, Hkv, D)
    cache = cache.write(index, k, v, cache.lengths)
    o = attention(q, cache, index, cache.lengths + T, mask, implementation=implementation,
                  q_positions=positions, sliding_window=cfg.sliding_window)
    x = x + ops.linear(o.reshape(B, T, Hq * D), lp["wo"])
    h = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
    if "w_gate_up" in lp:
        gate_up = ops.linear(h, lp["w_gate_up"])                              # [B, T, 2 I]
    else:                              # side by side for the same SwiGLU: a row's bits whatever the weight format
        gate_up = jnp.concatenate([ops.linear(h, lp["w_gate"]), ops.linear(h, lp["w_up"])], axis=-1)
    return x + ops.linear(ops.swiglu(gate_up), lp["w_down"]), cache


def lm_head(params: dict, hidden: jax.Array, vocab_size: int | None = None) -> jax.Array:
    """hidden [..., H] -> float32 logits [..., vocab_size]. A vocabulary padded for a mesh is cut off here rather
    than masked, so that every later shape, reduction over the vocabulary and random draw is the one-device one
    (a wider distribution, even one with zeros in its padding, could round or draw differently)."""
    if "lm_head" in params:
        logits = ops.linear(hidden, params["lm_head"]).astype(jnp.float32)                    # [..., Vp]
    elif "head_panels" in params:      # the tied embedding's transpose in panels (load_model's panels format)
        logits = ops.linear(hidden, params["head_panels"])
    elif "embed_blocks" in params:     # the tied embedding's quantized blocks (the same values as embed)
        logits = ops.linear(hidden, params["embed_blocks"], transposed=True)
    else:
        logits = ops.linear(hidden, params["embed"], transposed=True).astype(jnp.float32)     # tied: embed.T
    return logits if vocab_size is None or logits.shape[-1] == vocab_size else logits[..., :vocab_size]


def kv_heads(params: dict, cfg: ModelConfig) -> int:
    """KV heads the weights hold: cfg.num_kv_heads, or a multiple once specjax.sharding replicated them for a
    model axis larger than num_kv_heads (each copy identical, so attention is unchanged). Size caches with it."""
    return layer_kv_heads(params["layers"][0], cfg)


def layer_kv_heads(lp: dict, cfg: ModelConfig) -> int:
    """kv_heads of one layer's weights (fused projections are never replicated: cfg.num_kv_heads)."""
    return lp["wk"].shape[-1] // cfg.head_dim if "wk" in lp else cfg.num_kv_heads


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32, std: float = 0.02) -> dict:
    """Random init (normal(0, std) matrices, unit norms); for tests, benchmarks and training from scratch."""
    H, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    keys = iter(jax.random.split(key, 8 * cfg.num_layers + 2))
    normal = lambda shape: (std * jax.random.normal(next(keys), shape)).astype(dtype)
    layers = []
    for _ in range(cfg.num_layers):
        lp = {"attn_norm": jnp.ones((H,), dtype), "wq": normal((H, cfg.num_heads * D)),
              "wk": normal((H, cfg.num_kv_heads * D)), "wv": normal((H, cfg.num_kv_heads * D)),
              "wo": normal((cfg.num_heads * D, H)) / math.sqrt(2 * cfg.num_layers),
              "mlp_norm": jnp.ones((H,), dtype), "w_gate": normal((H, I)), "w_up": normal((H, I)),
              "w_down": normal((I, H)) / math.sqrt(2 * cfg.num_layers)}
        if cfg.attention_bias:
            lp.update(bq=normal((cfg.num_heads * D,)), bk=normal((cfg.num_kv_heads * D,)),
                      bv=normal((cfg.num_kv_heads * D,)))
        layers.append(lp)
    params = {"embed": normal((cfg.vocab_size, H)), "layers": layers, "final_norm": jnp.ones((H,), dtype)}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = normal((H, cfg.vocab_size))
    return params


def full_logits(params: dict, cfg: ModelConfig, tokens: jax.Array, **kw) -> jax.Array:
    """Plain causal forward over whole sequences, no persistent cache: [B, T] -> [B, T, V]."""
    B, T = tokens.shape
    cache = KVCache.init(cfg.num_layers, B, T, kv_heads(params, cfg), cfg.head_dim, params["embed"].dtype)
    return forward(params, cfg, tokens, cache, **kw).logits
