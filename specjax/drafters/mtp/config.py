"""The multi-token drafters' configuration and loaded weights: MTPConfig, MTPWeights, and the layers' random init."""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from specjax.models.config import ModelConfig
from specjax.models.llama import init_params as init_llama_params

KINDS = ("mtp", "mtp_heads")


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
