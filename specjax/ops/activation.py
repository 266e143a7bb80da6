"""The SwiGLU op over a fused gate | up projection."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.ops import backends

__all__ = ["swiglu", "swiglu_reference"]


def swiglu_reference(gate_up: jax.Array) -> jax.Array:
    """The definition: gate_up [..., 2 I] (a fused gate | up projection's output) -> silu(gate) * up [..., I]."""
    gate, up = jnp.split(gate_up, 2, axis=-1)
    return jax.nn.silu(gate) * up


def swiglu(gate_up: jax.Array) -> jax.Array:
    """gate_up [..., 2 I] -> [..., I]."""
    return backends.call("swiglu", swiglu_reference, gate_up)
