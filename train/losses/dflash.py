"""The DFlash block drafter's loss (specjax.drafters.dflash): blocks anchored at random committed positions of each
row, filled in one forward from the target's features of the positions before the anchor, each block position
trained toward the target's own distribution for its token, early positions weighted more.

Rows [B, R] (train.data.LabeledRows or plain rows with a fixed first_label). The frozen target runs over the whole
row once: features of every position (the drafter's context keys/values) and logits z_p (z_p predicts token p + 1).
A block anchored at a (the last committed token) holds [x_a, mask x k] at positions a .. a + k and sees the context
positions < a; its position i (1..k) drafts token a + i, whose target distribution is softmax(z_{a+i-1}); it counts
when token a + i is a label of the row (inside its span). Anchors are drawn uniformly from the positions whose
next token is a label. A drafter with a draft vocabulary (d2t) is trained toward the target's distribution over
those N tokens, only where the target's top token is one of them (EAGLE-3's rule); its held-out agreement counts
every position, a target top token outside the vocabulary as a miss.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from specjax.drafters.base import target_weight
from specjax.drafters.dflash import DFlashConfig, block_forward, block_inputs, context_features, context_kv, draft_logits
from specjax.drafters.draft_vocab import check_vocab_map, draft_to_target, t2d_from_d2t
from specjax.models.config import ModelConfig
from train.losses.common import ChainAgreement, acceptance_probability, frozen_target_features, label_mask, labeled, masked_mean, sample_anchors, soft_ce, \
    target_features


def _draft_ids(config: DFlashConfig, d2t) -> jax.Array | None:
    """The target id of every draft id (int32 [N]), or None for a drafter over the whole vocabulary."""
    if config.draft_vocab_size is None:
        if d2t is not None:
            raise ValueError("a d2t map was given for a DFlash drafter without a draft vocabulary")
        return None
    if d2t is None:
        raise ValueError(f"a DFlash drafter with a draft vocabulary of {config.draft_vocab_size} needs its d2t map")
    d2t = check_vocab_map(d2t, config.vocab_size, config.draft_vocab_size, "DFlash loss")
    return jnp.asarray(draft_to_target(d2t), jnp.int32)


def _blocks(params: dict, config: DFlashConfig, rows, target_params: dict, tf, anchors: jax.Array, k: int,
            draft_ids: jax.Array | None):
    """Every anchor's block: anchors [B, A] -> (drafter logits [B, A, k, N|V], target logits [B, A, k, N|V] (at the
    draft vocabulary's ids), the drafter's top token as a target id [B, A, k], the target's top token [B, A, k],
    label mask [B, A, k])."""
    tokens = rows.tokens
    B, R = tokens.shape
    A = anchors.shape[1]
    feats = context_features(params, config, tf.layers)                             # [B, R, H]
    positions = jnp.broadcast_to(jnp.arange(R), (B, R))
    ctx_k, ctx_v = [], []
    for lp in params["layers"]:
        kk, vv = context_kv(lp, config, feats, positions)                           # [B, R, Hkv, D]
        rep = lambda x: jnp.repeat(jnp.swapaxes(x, 1, 2), A, axis=0)               # [B * A, Hkv, R, D]
        ctx_k.append(rep(kk))
        ctx_v.append(rep(vv))
    flat = anchors.reshape(B * A)
    anchor_tok = jnp.take_along_axis(tokens, anchors, axis=1).reshape(B * A)
    x = block_inputs(params, target_weight(target_params, "embed"), anchor_tok, k)    # [B * A, k + 1, H]
    block_pos = flat[:, None] + jnp.arange(k + 1)[None, :]
    visible = jnp.arange(R)[None, :] < flat[:, None]                                # the positions before the anchor
    hidden = block_forward(params, config, x, block_pos, ctx_k, ctx_v, visible)
    lm_head = target_weight(target_params, "lm_head")
    logits = draft_logits(params, config, hidden[:, 1:], lm_head).reshape(B, A, k, -1)
    at = jnp.clip(anchors[..., None] + jnp.arange(k), 0, R - 1)                     # z_{a+i-1}, i = 1..k
    teacher = tf.teacher_logits(lm_head, at=at.reshape(B, A * k), ids=draft_ids).reshape(B, A, k, -1)
    target_top = jnp.take_along_axis(tf.top_tokens(), at.reshape(B, A * k), axis=1).reshape(B, A, k)
    pred = jnp.argmax(logits, -1)
    if draft_ids is not None:
        pred = draft_ids[pred]
    label_at = anchors[..., None] + jnp.arange(1, k + 1)                            # token a + i, [B, A, k]
    valid = label_mask(rows, label_at.reshape(B, A * k)).reshape(B, A, k) & (label_at < R)
    return logits, teacher, pred, target_top, valid


def dflash_loss_fn(target_cfg: ModelConfig, config: DFlashConfig, first_label: int, *, block_k: int | None = None,
                   anchors_per_row: int = 8, position_decay: float = 0.8, d2t=None) -> Callable:
    """Loss = sum_i position_decay^(i-1) * mean soft cross-entropy of block position i (1..k) against the target's
    distribution for that token, over the sampled anchors' label positions; k = block_k or config.block_size - 1.
    d2t: the draft vocabulary map of a drafter that has one (required then). Metrics per position: ce, top-1
    agreement with the target's argmax (acc<i-1>)."""
    k = block_k or config.block_size - 1
    draft_ids = _draft_ids(config, d2t)
    in_vocab = None if draft_ids is None else jnp.asarray(t2d_from_d2t(d2t, config.vocab_size))

    def loss_fn(params, batch, rng, target_params):
        rows, tf = target_features(batch, first_label, target_params, target_cfg, config.target_layers)
        anchors = sample_anchors(rng, rows, anchors_per_row)
        logits, teacher, pred, top, valid = _blocks(params, config, rows, target_params, tf, anchors, k, draft_ids)
        trained = valid if in_vocab is None else valid & in_vocab[top]
        total, metrics = 0.0, {}
        for i in range(k):
            ce = masked_mean(soft_ce(logits[:, :, i], jax.nn.softmax(teacher[:, :, i])), trained[:, :, i])
            total = total + position_decay ** i * ce
            metrics[f"ce{i}"] = ce
            metrics[f"acc{i}"] = masked_mean(pred[:, :, i] == top[:, :, i], valid[:, :, i])
        return total, metrics
    return loss_fn


def dflash_agreements(params: dict, target_params: dict, target_cfg: ModelConfig, config: DFlashConfig, rows,
                      first_label: int, num_steps: int, stride: int = 1, d2t=None) -> ChainAgreement:
    """Blocks anchored every `stride` positions of rows, teacher-forced: the block anchored at the last committed
    token a is what a decode loop's step from committed length L = a + 1 drafts; entry [b, i, L] is its position
    i + 1 (token L + i), a hit when its top token is the target's top token there."""
    rows = labeled(rows, first_label)
    B, R = rows.tokens.shape
    tf = frozen_target_features(target_params, target_cfg, rows.tokens, config.target_layers)
    anchors = jnp.broadcast_to(jnp.arange(0, R - 1, stride, dtype=jnp.int32), (B, (R - 2) // stride + 1))
    draft_ids = _draft_ids(config, d2t)
    logits, _, pred, top, valid = _blocks(params, config, rows, target_params, tf, anchors, num_steps, draft_ids)
    A = anchors.shape[1]
    at = jnp.clip(anchors[..., None] + jnp.arange(num_steps), 0, R - 1).reshape(B, A * num_steps)
    full = tf.teacher_logits(target_weight(target_params, "lm_head"), at=at).reshape(B, A, num_steps, -1)
    L = anchors[0] + 1
    put = lambda x, dtype: jnp.zeros((B, num_steps, R + 1), dtype).at[:, :, L].set(jnp.swapaxes(x, 1, 2))
    return ChainAgreement(put(pred == top, bool), put(acceptance_probability(logits, full, draft_ids), jnp.float32),
                          put(valid, bool))


def dflash_accuracy(params: dict, target_params: dict, target_cfg: ModelConfig, config: DFlashConfig, rows,
                    first_label: int, num_steps: int, stride: int = 4, d2t=None) -> tuple[jax.Array, ...]:
    """Held-out greedy acceptance counts of blocks anchored every `stride` positions (dflash_agreements'
    ChainAgreement.counts): (hits [n], labels [n]) per block position, and (chain_hits [n], chains): chains whose n
    labels are all inside the span, chain_hits[i] counting those whose positions 1..i+1 all agree with the target's
    argmax (on greedy rows exactly what greedy verification of an n-token block accepts from that anchor).
    train.self_distill.chain_metrics reads them."""
    return dflash_agreements(params, target_params, target_cfg, config, rows, first_label, num_steps, stride,
                             d2t).counts()
