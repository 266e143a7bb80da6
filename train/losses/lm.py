"""Language-model loss: next-token cross-entropy (a target pre-trained from scratch, and every recipe's held-out
eval of an LM)."""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax

from specjax.models.config import ModelConfig
from specjax.models.llama import full_logits


def next_token_nll(params: dict, cfg: ModelConfig, windows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """windows [B, L+1] -> (per-token NLL [B, L], logits [B, L, V])."""
    logits = full_logits(params, cfg, windows[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:]), logits


def lm_loss_fn(cfg: ModelConfig) -> Callable:
    """Next-token cross-entropy (pre-training a target from scratch)."""
    def loss_fn(params, batch, rng):
        del rng
        loss = next_token_nll(params, cfg, batch)[0].mean()
        return loss, {"ppl": jnp.exp(loss)}
    return loss_fn
