"""The multi-token drafters' configuration, fresh params and layer maths, as pure functions over params: the
pieces the drafter runs against its KV cache and the cache-free forwards training uses (mtp_forward_sequence,
heads_forward_sequence)."""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from specjax.cache import KVCache
from specjax.models.config import ModelConfig
from specjax.models.llama import decoder_layer, init_params as init_llama_params, lm_head, rms_norm

KINDS = ("mtp", "mtp_heads")


# ------------------------------------------------------------------------------------------------ configuration

@dataclasses.dataclass(frozen=True)
class MTPConfig:
    """What a multi-token drafter is (hashable: part of the static drafter object).

    kind: "mtp" (DeepSeek modules) or "mtp_heads" (Gloeckle heads).
    layer: the decoder layer's shape as a Llama ModelConfig (hidden_size = the target's; vocab_size = the
      target's; num_layers 1; intermediate_size may differ from the target's).
    depth: D, the number of MTP modules, or of extra heads (n - 1) of a multi-token target.
    trunk_layer: mtp_heads only: the target decoder layer whose output the heads read (the trunk's last).
    """
    kind: str
    layer: ModelConfig
    depth: int
    trunk_layer: int | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"multi-token drafter kind must be one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.depth, int) or self.depth < 1:
            raise ValueError(f"depth (MTP modules / extra heads) must be a positive int, got {self.depth!r}")
        if (self.kind == "mtp_heads") != (self.trunk_layer is not None):
            raise ValueError("trunk_layer is required for mtp_heads and meaningless for mtp")

    def to_dict(self) -> dict:
        c = self.layer
        return {"kind": self.kind, "depth": self.depth, "trunk_layer": self.trunk_layer,
                "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "num_heads": c.num_heads,
                "num_kv_heads": c.num_kv_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
                "rope_theta": c.rope_theta, "vocab_size": c.vocab_size,
                "max_position_embeddings": c.max_position_embeddings}

    @classmethod
    def from_dict(cls, d: dict) -> "MTPConfig":
        layer = ModelConfig(vocab_size=int(d["vocab_size"]), hidden_size=int(d["hidden_size"]),
                            intermediate_size=int(d["intermediate_size"]), num_layers=1,
                            num_heads=int(d["num_heads"]), num_kv_heads=int(d["num_kv_heads"]),
                            head_dim=int(d["head_dim"]), rope_theta=float(d["rope_theta"]),
                            rms_norm_eps=float(d["rms_norm_eps"]),
                            max_position_embeddings=int(d.get("max_position_embeddings", 2048)))
        trunk = d.get("trunk_layer")
        return cls(d["kind"], layer, int(d["depth"]), None if trunk is None else int(trunk))


class MTPWeights(NamedTuple):
    """A loaded multi-token drafter. params: {"modules": [D x {norm_h [H], norm_e [H], proj [2H, H], layer {...},
    final_norm [H]}]} (mtp) or {"heads": [D x {layer {...}, final_norm [H]}]} (mtp_heads); layer = one Llama
    decoder layer's dict (attn_norm, wq, wk, wv, wo, mlp_norm, w_gate, w_up, w_down)."""
    config: MTPConfig
    params: dict
    name: str = ""


def layer_config(target_config: ModelConfig, intermediate_size: int | None = None) -> ModelConfig:
    """The target's layer shape (one layer), optionally with another MLP width."""
    return dataclasses.replace(target_config, num_layers=1,
                               intermediate_size=intermediate_size or target_config.intermediate_size)


def init_params(key: jax.Array, config: MTPConfig, target_params: dict | None = None, std: float = 0.02) -> dict:
    """Random layers (llama.init_params' scheme); final norms from the target's when given. An MTP module's proj
    starts as identity on the hidden half (+ noise): a fresh module passes its input feature through, like a
    fresh EAGLE-1 drafter."""
    H = config.layer.hidden_size
    keys = jax.random.split(key, 2 * config.depth)
    norm = (jnp.asarray(target_params["final_norm"], jnp.float32) if target_params is not None
            else jnp.ones((H,), jnp.float32))
    out = []
    for d in range(config.depth):
        layer = init_llama_params(config.layer, keys[2 * d], std=std)["layers"][0]
        entry = {"layer": layer, "final_norm": norm}
        if config.kind == "mtp":
            proj = std * jax.random.normal(keys[2 * d + 1], (2 * H, H))
            entry.update(norm_h=jnp.ones((H,)), norm_e=jnp.ones((H,)), proj=proj.at[:H].add(jnp.eye(H)))
        out.append(entry)
    return {"modules" if config.kind == "mtp" else "heads": out}


# ----------------------------------------------------------------------------------------------- the layer math

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
