"""Medusa heads as loaded (MedusaHeads: heads, ResBlocks per head, layout, params) and fresh (init_heads: Medusa-1's
initialisation); the projection layouts (LAYOUTS)."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


KIND = "medusa"
LAYOUTS = ("per_head", "shared", "target_head")


class MedusaHeads(NamedTuple):
    """Loaded heads: num_heads K, ResBlocks per head, layout, and params
    {"w": [K, R, H, H], "b": [K, R, H], "proj": [K, H, V] (per_head) or [H, V] (shared); none (target_head)}."""
    num_heads: int
    num_layers: int
    layout: str
    params: dict
    name: str = ""
    vocab: int | None = None           # target_head: the target's vocabulary size (no projection of its own)

    @property
    def hidden_size(self) -> int:
        return int(self.params["w"].shape[-1])

    @property
    def vocab_size(self) -> int:
        """None for heads made in code through the target's LM head (target_head, vocab not given)."""
        if "proj" in self.params:
            return int(self.params["proj"].shape[-1])
        return None if self.vocab is None else int(self.vocab)


def init_heads(key: jax.Array, num_heads: int, num_layers: int, lm_head: jax.Array, layout: str) -> dict:
    """Medusa-1 initialisation: ResBlocks start at zero (each head starts as the identity), projections start
    as copies of the target's LM head [H, V] (target_head: it is the target's), so a fresh head predicts what the
    target predicts."""
    del key                                                   # zero/copy init is deterministic
    if layout not in LAYOUTS:
        raise ValueError(f"unknown Medusa layout {layout!r}; expected one of {LAYOUTS}")
    H = lm_head.shape[0]
    params = {"w": jnp.zeros((num_heads, num_layers, H, H), lm_head.dtype),
              "b": jnp.zeros((num_heads, num_layers, H), lm_head.dtype)}
    if layout != "target_head":
        params["proj"] = jnp.array(jnp.broadcast_to(lm_head, (num_heads,) + lm_head.shape) if layout == "per_head"
                                   else lm_head)
    return params
