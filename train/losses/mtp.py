"""DeepSeek-style MTP modules on a frozen target (specjax.drafters.mtp, kind "mtp"): module d drafts the token d + 1
after the bonus token through the causal chain of modules 0..d, trained on the target's own distribution."""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from specjax.drafters.base import target_weight
from specjax.drafters.mtp import mtp_forward_sequence
from specjax.models.config import ModelConfig
from train.losses.common import frozen_target_features, masked_mean, soft_ce


def _module_logits_and_teacher(params: dict, config, target_params: dict, target_cfg: ModelConfig, rows: jax.Array):
    """MTP modules teacher-forced over rows [B, R] -> (logits [D, B, T, V], the target's logits at positions
    1..R-1 [B, T, V]), T = R - 1: every module's entry e predicts the token at e + 2, whose target distribution is
    the target's logits at position e + 1."""
    tw = {n: target_weight(target_params, n) for n in ("embed", "lm_head")}
    tf = frozen_target_features(target_params, target_cfg, rows)
    _, logits = mtp_forward_sequence(params, config, rows[:, 1:], tf.hidden[:, :-1], tw)
    return logits, tf.logits[:, 1:]


def mtp_loss_fn(target_cfg: ModelConfig, config, first_label: int, depth_decay: float = 1.0) -> Callable:
    """DeepSeek-style MTP modules on a frozen target, loss_fn(params, batch, rng, target_params); batch = rows
    [B, R] of target-generated text (labels before index first_label are the corpus prompt: not trained on).
    Module d (0-based) at entry e drafts the token at e + 2 through the causal chain of modules 0..d; its loss is
    the soft cross-entropy against the target's own distribution for that token (what verification accepts),
    over entries e >= d (module d's chain exists there) -- total = sum_d depth_decay**d * loss_d (DeepSeek's
    lambda-weighted mean over depths, up to scale). Metrics per module: ce<d>, acc<d> (argmax agreement)."""
    def loss_fn(params, batch, rng, target_params):
        del rng
        logits, teacher = _module_logits_and_teacher(params, config, target_params, target_cfg, batch)
        T = teacher.shape[1]
        probs = jax.nn.softmax(teacher.astype(jnp.float32))
        top = jnp.argmax(teacher, -1)
        total, metrics = 0.0, {}
        for d in range(logits.shape[0]):
            e = jnp.arange(T)
            valid = jnp.broadcast_to((e >= d) & (e + 2 >= first_label), top.shape)
            ce = masked_mean(soft_ce(logits[d], probs), valid)
            metrics[f"ce{d}"] = ce
            metrics[f"acc{d}"] = masked_mean(jnp.argmax(logits[d], -1) == top, valid)
            total = total + depth_decay ** d * ce
        return total, metrics
    return loss_fn


def mtp_accuracy(params: dict, target_params: dict, target_cfg: ModelConfig, config, rows: jax.Array,
                 first_label: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Held-out acceptance counts of MTP modules, as eagle_accuracy: a chain started at entry s drafts token s + 1 + j
    with module j (1-based) at entry s + j - 1, teacher-forced on the row's tokens (on greedy rows exactly what
    greedy verification sees when the earlier drafts were right). Returns per module (hits [D], labels [D]) of
    top-1 agreement with the target's argmax, and (chain_hits [D], chains): starts where modules 1..j all agree."""
    logits, teacher = _module_logits_and_teacher(params, config, target_params, target_cfg, rows)
    D, B, T = logits.shape[:3]
    top = jnp.argmax(teacher, -1)                                       # [B, T]
    pred = jnp.argmax(logits, -1)                                       # [D, B, T]
    Tc = T - D + 1
    chain_valid = jnp.broadcast_to(jnp.arange(Tc) + 2 >= first_label, (B, Tc))
    hits, counts, chain_hits, all_ok = [], [], [], jnp.ones((B, Tc), bool)
    for d in range(D):
        e = jnp.arange(T)
        valid = jnp.broadcast_to((e >= d) & (e + 2 >= first_label), top.shape)
        ok = pred[d] == top
        hits.append(jnp.sum(ok & valid))
        counts.append(jnp.sum(valid))
        all_ok = all_ok & ok[:, d:d + Tc]
        chain_hits.append(jnp.sum(all_ok & chain_valid))
    return jnp.stack(hits), jnp.stack(counts), jnp.stack(chain_hits), jnp.sum(chain_valid)
