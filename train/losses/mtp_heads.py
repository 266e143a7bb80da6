"""Multi-token prediction from scratch (Gloeckle et al. 2024; specjax.drafters.mtp, kind "mtp_heads"): a Llama whose
last decoder layer is head 1, and extra heads over a trunk layer's output, trained together on text."""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax

from specjax.drafters.base import target_weight
from specjax.drafters.mtp import heads_forward_sequence
from specjax.models.config import ModelConfig
from train.losses.common import causal_forward


def multi_token_lm_loss_fn(cfg: ModelConfig, heads_config) -> Callable:
    """Gloeckle et al. (2024) multi-token prediction from scratch: params = {"lm": a Llama (its last decoder layer
    is head 1), "heads": the extra heads (specjax.drafters.mtp, kind "mtp_heads", reading the output of decoder
    layer heads_config.trunk_layer)}. Loss = sum over heads of the mean cross-entropy of head i (1-based) at t
    against token t + i, as the paper (each head's own positions: the last i - 1 of a window have no label).
    Metrics: ce<i> per head, ppl of head 1."""
    trunk = heads_config.trunk_layer

    def loss_fn(params, batch, rng):
        del rng
        inputs = batch[:, :-1]
        T = inputs.shape[1]
        out = causal_forward(params["lm"], cfg, inputs, hidden_layers=(trunk,))
        ce = [optax.softmax_cross_entropy_with_integer_labels(out.logits, batch[:, 1:]).mean()]
        _, logits = heads_forward_sequence(params, heads_config, out.layer_hidden[0],
                                           target_weight(params["lm"], "lm_head"))
        for d in range(logits.shape[0]):                   # head d + 2: label at t + d + 2
            ce.append(optax.softmax_cross_entropy_with_integer_labels(logits[d, :, :T - d - 1],
                                                                      batch[:, d + 2:]).mean())
        metrics = {f"ce{i + 1}": c for i, c in enumerate(ce)}
        metrics["ppl"] = jnp.exp(ce[0])
        return sum(ce), metrics
    return loss_fn


def multi_token_accuracy(params: dict, cfg: ModelConfig, heads_config, windows: jax.Array,
                         weights: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Held-out counts for a multi-token model over windows [B, L + 1] (weights [B, L]: 1 on scored tokens):
    per extra head d (the model's head d + 2) at position t, hits against the text's token t + d + 2 and
    agreement with head 1's argmax at position t + d + 1 (teacher-forced: what greedy self-speculation accepts
    when the earlier drafts were right), and the label counts. -> (text_hits [D], head1_hits [D], labels [D])."""
    inputs = windows[:, :-1]
    T = inputs.shape[1]
    out = causal_forward(params["lm"], cfg, inputs, hidden_layers=(heads_config.trunk_layer,))
    head1 = jnp.argmax(out.logits, -1)                                   # [B, T] predicts t + 1
    _, logits = heads_forward_sequence(params, heads_config, out.layer_hidden[0],
                                       target_weight(params["lm"], "lm_head"))
    pred = jnp.argmax(logits, -1)                                        # [D, B, T]
    text, own, n = [], [], []
    for d in range(pred.shape[0]):
        m = T - d - 1
        w = weights[:, d + 1:] * weights[:, :m]
        text.append(jnp.sum((pred[d, :, :m] == windows[:, d + 2:]) * w))
        own.append(jnp.sum((pred[d, :, :m] == head1[:, d + 1:]) * w))
        n.append(jnp.sum(w))
    return jnp.stack(text), jnp.stack(own), jnp.stack(n)
