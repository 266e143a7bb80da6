"""Draft-model loss: a small LM distilled from the frozen target (specjax.drafters.draft_model)."""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax

from specjax.models.config import ModelConfig
from specjax.models.llama import full_logits
from train.losses.common import forward_kl, frozen_target_features


def distill_loss_fn(draft_cfg: ModelConfig, target_cfg: ModelConfig, ce_weight: float,
                    temperature: float) -> Callable:
    """(1 - ce_weight) * KL(p_target || p_draft) + ce_weight * CE per token, the frozen target's logits computed on
    the fly (caching [tokens, V] logits for a whole corpus costs more than recomputing them). Forward KL on the
    full distribution is what speculative sampling rewards (acceptance = 1 - TV(p, q))."""
    def loss_fn(params, batch, rng, target_params):
        del rng
        inputs, labels = batch[:, :-1], batch[:, 1:]
        t_logits = frozen_target_features(target_params, target_cfg, inputs).logits / temperature
        d_logits = full_logits(params, draft_cfg, inputs)
        t_logp = jax.nn.log_softmax(t_logits)
        d_logp_t = jax.nn.log_softmax(d_logits / temperature)
        kl = forward_kl(t_logp, d_logp_t).mean()
        ce = optax.softmax_cross_entropy_with_integer_labels(d_logits, labels).mean()
        agree = jnp.mean(jnp.argmax(d_logits, -1) == jnp.argmax(t_logits, -1))
        return (1 - ce_weight) * kl + ce_weight * ce, {"kl": kl, "ce": ce, "top1_agree": agree}
    return loss_fn
