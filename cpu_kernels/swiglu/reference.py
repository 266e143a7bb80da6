"""Pure-jnp SwiGLU: the semantics of the CPU kernel and the model's path everywhere else."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def swiglu_reference(gate_up: jax.Array) -> jax.Array:
    """gate_up [..., 2 I] (a fused gate | up projection's output) -> silu(gate) * up [..., I]."""
    gate, up = jnp.split(gate_up, 2, axis=-1)
    return jax.nn.silu(gate) * up
