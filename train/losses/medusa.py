"""Medusa heads' losses (specjax.drafters.medusa): k heads on the target's final hidden state, head i predicting
token t + i + 2; Medusa-1 trains the heads on a frozen target, Medusa-2 the heads and the target jointly."""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax

from specjax.drafters.medusa import head_logits
from specjax.models.config import ModelConfig
from specjax.drafters.base import target_weight
from train.losses.common import (causal_forward, forward_kl, frozen_target_features, label_mask, label_window,
                                 labeled, masked_mean, soft_ce, target_features)


def _head_teacher(teacher_logits: jax.Array, ahead: int) -> jax.Array:
    """The target's logits for the token `ahead` + 1 positions after each input position: teacher_logits [B, T, V]
    (index p predicts token p + 1) -> [B, T, V] (rows past the window repeat the last one; they are masked)."""
    T = teacher_logits.shape[1]
    return jnp.take(teacher_logits, jnp.minimum(jnp.arange(T) + ahead, T - 1), axis=1)


def medusa_terms(heads: dict, hidden: jax.Array, rows, decay: float, teacher_logits: jax.Array | None = None,
                 lm_head: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-head masked loss of Medusa heads on hidden [B, T, H] (T = L, inputs rows.tokens[:, :-1]; rows
    train.data.LabeledRows): head i at position t predicts token t + i + 2; labels outside each row's label span
    (prompt tokens, padding) and past the window are masked. lm_head: the target's, for target_head heads.
    With teacher_logits [B, T, V] (the target's own logits over the inputs, under stop_gradient) the loss is soft
    cross-entropy against the target's distribution for that token and accuracy is agreement with the target's
    argmax: what verification accepts, which for a jointly trained (Medusa-2) target is no longer the token the
    original target wrote. Without them: hard CE on batch's tokens.
    -> (weighted sum of head losses, per-head losses [K], per-head top-1 accuracy [K])."""
    B, T, _ = hidden.shape
    batch = rows.tokens
    logits = head_logits(heads, hidden, lm_head)                          # [B, T, K, V]
    K = logits.shape[2]
    total, per_head, acc = 0.0, [], []
    for i in range(K):
        label_at = jnp.arange(T) + i + 2                                   # index into batch [L + 1]
        valid = (label_at <= T)[None, :] & label_mask(rows, label_at)      # [B, T]
        if teacher_logits is None:
            labels = jnp.take(batch, jnp.minimum(label_at, T), axis=1)     # [B, T]
            loss = optax.softmax_cross_entropy_with_integer_labels(logits[:, :, i], labels)
        else:
            teacher = _head_teacher(teacher_logits, i + 1)                 # [B, T, V]
            labels = jnp.argmax(teacher, -1)
            loss = soft_ce(logits[:, :, i], jax.nn.softmax(teacher.astype(jnp.float32)))
        w = jnp.broadcast_to(valid, loss.shape)
        li = masked_mean(loss, w)
        per_head.append(li)
        acc.append(masked_mean(jnp.argmax(logits[:, :, i], -1) == labels, w))
        total = total + decay ** i * li
    return total, jnp.stack(per_head), jnp.stack(acc)


def medusa_loss_fn(cfg: ModelConfig, decay: float, first_label: int, joint: bool = False, kl_weight: float = 1.0,
                   heads_weight: float = 1.0, soft_labels: bool = True, max_span: int | None = None) -> Callable:
    """Medusa-1 (joint=False): params are the heads; the frozen target's final hidden state feeds them.
    Medusa-2 (joint=True): params = {"heads", "target"}; the trained target's hidden state feeds the heads and
    kl_weight * KL(p_frozen_original || p_trained) keeps its next-token distribution, heads_weight scales the
    heads' loss (Medusa's lambda_0). batch [B, L + 1]: rows of target-generated text; labels before index
    first_label (the corpus prompt) are not trained on. soft_labels: the heads learn the (trained, for Medusa-2)
    target's own distribution for each token (see medusa_terms) instead of the row's tokens. max_span (Medusa-1):
    the longest label span of any row (train.losses.common.max_label_span); the heads and the teacher then run only
    over the positions whose labels can be inside it (label_window), the same loss at the cost of the answers
    rather than the batch's width."""
    def loss_fn(params, batch, rng, target_params):
        del rng
        if not joint:
            rows, frozen = target_features(batch, first_label, target_params, cfg)
            lm_head = target_weight(target_params, "lm_head")
            hidden = frozen.hidden[:, :-1]                                     # [B, T, H]
            T = hidden.shape[1]
            # head i at position t reads label t + i + 2 and the teacher at t + i + 1: K + 1 positions before
            # the first label through the last one
            K = params["w"].shape[0]
            size = T if max_span is None else min(T, max_span + K)
            if size < T:
                at, rows = label_window(rows, T, size, K + 1)
                hidden = jnp.take_along_axis(hidden, at[..., None], axis=1)    # [B, size, H]
                teacher = frozen.teacher_logits(lm_head, at=at) if soft_labels else None
            else:
                teacher = frozen.teacher_logits(lm_head)[:, :-1] if soft_labels else None
            loss, per_head, acc = medusa_terms(params, hidden, rows, decay, teacher, lm_head)
            return loss, {**{f"ce{i}": per_head[i] for i in range(per_head.shape[0])},
                          **{f"acc{i}": acc[i] for i in range(acc.shape[0])}}
        rows = labeled(batch, first_label)
        inputs = rows.tokens[:, :-1]
        original = frozen_target_features(target_params, cfg, inputs).logits
        out = causal_forward(params["target"], cfg, inputs)
        heads_loss, per_head, acc = medusa_terms(params["heads"], out.hidden, rows, decay,
                                                 jax.lax.stop_gradient(out.logits) if soft_labels else None,
                                                 target_weight(params["target"], "lm_head"))
        kl = forward_kl(jax.nn.log_softmax(original), jax.nn.log_softmax(out.logits)).mean()
        return kl_weight * kl + heads_weight * heads_loss, {
            "kl": kl, **{f"ce{i}": per_head[i] for i in range(per_head.shape[0])},
            **{f"acc{i}": acc[i] for i in range(acc.shape[0])}}
    return loss_fn


def medusa_accuracy(heads: dict, target_params: dict, cfg: ModelConfig, rows, first_label: int,
                    topk: int = 5) -> tuple[jax.Array, jax.Array]:
    """Held-out accuracy counts against what greedy verification accepts, the target's own argmax for each token
    (teacher-forced on rows; for the original target's greedy rows that is the row's token itself):
    rows [B, L + 1] -> (hits [K, topk] = that token within each head's top-1..top-k, valid labels [K]); divide for
    cumulative top-k accuracy."""
    rows = labeled(rows, first_label)
    inputs = rows.tokens[:, :-1]
    target = frozen_target_features(target_params, cfg, inputs)
    logits = head_logits(heads, target.hidden, target_weight(target_params, "lm_head"))   # [B, T, K, V]
    B, T, K, _ = logits.shape
    hits, counts = [], []
    for i in range(K):
        label_at = jnp.arange(T) + i + 2
        valid = (label_at <= T)[None, :] & label_mask(rows, label_at)
        labels = jnp.argmax(_head_teacher(target.logits, i + 1), -1)      # [B, T]
        lg = logits[:, :, i]                                               # [B, T, V]
        # The label's rank = how many tokens score strictly higher (a sort-free top-k test; ties favour it).
        label_logit = jnp.take_along_axis(lg, labels[..., None], -1)
        rank = jnp.sum(lg > label_logit, -1)                              # [B, T]
        within = rank[..., None] < jnp.arange(1, topk + 1)                # [B, T, topk] hit within top-1..top-k
        w = jnp.broadcast_to(valid, labels.shape)
        hits.append(jnp.sum(within * w[..., None], axis=(0, 1)))
        counts.append(jnp.sum(w))
    return jnp.stack(hits), jnp.stack(counts)
