"""EAGLE drafter losses (specjax.drafters.eagle): EAGLE-1 (feature regression + soft cross-entropy through the
target's LM head) and EAGLE-3 (soft cross-entropy over a draft vocabulary, fused low/mid/high target layers), with
the training-time test unroll.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from specjax.drafters.base import target_weight
from specjax.drafters.eagle import draft_to_target, forward_sequence, t2d_from_d2t, ttt_forward
from specjax.models.config import ModelConfig
from train.losses.common import (ChainAgreement, LabeledRows, TargetFeatures, acceptance_probability,
                                 frozen_target_features, label_mask, label_window, labeled, masked_mean, soft_ce,
                                 target_features)

# Rows [B, R] (R = prompt + target-generated tokens). The frozen target runs over the whole row: features f_0..f_{R-1}
# (EAGLE-1: the final normed hidden state; EAGLE-3: the outputs of config.target_layers) and logits z_0..z_{R-1}
# (z_p predicts token p + 1). The drafter runs over T = R - 1 entries, entry t = (embed(x_{t+1}), f_t)
# (specjax.drafters.eagle.forward_sequence's alignment). Step i of an unrolled drafter (ttt_forward) at index t
# regresses f_{t+i+1} and predicts token x_{t+i+2}, whose target distribution is softmax(z_{t+i+1}); indices whose
# step-i target lies past the row are masked out. A label counts when the token
# it predicts is target-generated (t + i + 2 inside the row's label span, train.data.LabeledRows; for rows
# of one layout the last index predicts the token after the row, which the target's distribution there describes).


def _smooth_l1(x: jax.Array, y: jax.Array) -> jax.Array:
    """Smooth L1 (Huber, beta 1) averaged over the feature dim: [..., H] -> [...]."""
    d = jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))
    return jnp.mean(jnp.where(d < 1.0, 0.5 * d * d, d - 0.5), axis=-1)


def _draft_vocabulary(config, d2t) -> tuple[jax.Array | None, jax.Array | None]:
    """EAGLE-3's draft vocabulary: (draft id -> target id [N] int32, target id -> in the draft vocabulary [V] bool);
    (None, None) for EAGLE-1, which drafts over the whole vocabulary."""
    if config.kind != "eagle3":
        return None, None
    return jnp.asarray(draft_to_target(d2t), jnp.int32), jnp.asarray(t2d_from_d2t(d2t, config.vocab_size))


def _target_weights(config, target_params: dict) -> dict:
    names = ("embed", "lm_head") if config.kind == "eagle" else ("embed",)
    return {n: target_weight(target_params, n) for n in names}


def _features(tf: TargetFeatures, config):
    """The drafter's feature input from the target's forward over rows: EAGLE-1 the final normed hidden state
    [B, R, H], EAGLE-3 the tuple of config.target_layers outputs."""
    return tf.hidden if config.kind == "eagle" else tuple(tf.layers)


def _unroll(params: dict, config, rows: jax.Array, feats, num_steps: int, target_weights: dict,
            at: jax.Array | None = None):
    """Drafter over rows [B, R] with the target's features of every position (a [B, R, H] array or a tuple of them;
    positions 0..R-2 are read) -> (hidden [n, B, T|W, H], logits [n, B, T|W, V|N]), T = R - 1; at [B, W]: the
    indices whose outputs are wanted (ttt_forward's window), None: all."""
    tokens = rows[:, 1:]
    if isinstance(feats, (tuple, list)):
        feats = tuple(f[:, :-1] for f in feats)
    else:
        feats = feats[:, :-1]
    if num_steps == 1 and at is None:
        hidden, logits = forward_sequence(params, config, tokens, feats, target_weights)
        return hidden[None], logits[None]
    return ttt_forward(params, config, tokens, feats, num_steps, target_weights, at=at)


def _steps(params: dict, config, tf: TargetFeatures, rows: LabeledRows, feats, num_steps: int,
           target_weights: dict, lm_head: jax.Array, draft_ids, in_vocab, at: jax.Array | None = None):
    """Per-step aligned pieces over the drafter's indices t (all T = R - 1, or the window at [B, W]: consecutive
    indices): yields (i, indices [B, W], drafter hidden [B, W, H], drafter logits [B, W, V|N], target feature
    f_{t+i+1} [B, W, H], target logits z_{t+i+1} [B, W, V|N] (EAGLE-3: at the draft vocabulary's ids), label mask
    [B, W] (token t + i + 2 is target-generated; EAGLE-3: and the target's top token inside the draft vocabulary),
    drafter top token as a target id [B, W], target top token [B, W], whether the step-i target lies inside the row
    [B, W]: outside it, the label mask is off)."""
    B, R = rows.tokens.shape
    idx = jnp.broadcast_to(jnp.arange(R - 1, dtype=jnp.int32), (B, R - 1)) if at is None else at
    W = idx.shape[1]
    hidden, logits = _unroll(params, config, rows.tokens, feats, num_steps, target_weights, at)
    # the teacher once over every position some step reads (t + 1 .. t + n), each step a slice of it
    span = idx[:, :1] + 1 + jnp.arange(W + num_steps - 1, dtype=jnp.int32)
    inside_span = span < R
    span = jnp.minimum(span, R - 1)
    if tf.top is None and tf.logits is None and draft_ids is not None:
        full = tf.teacher_logits(lm_head, at=span)                          # one head product gives both
        teacher, tops = full[..., draft_ids], jnp.argmax(full, -1)
    else:
        teacher, tops = tf.teacher_logits(lm_head, at=span, ids=draft_ids), tf.top_tokens(lm_head, at=span)
    for i in range(num_steps):
        there = span[:, i:i + W]                                             # the target position step i reads
        z, top = teacher[:, i:i + W], tops[:, i:i + W]
        valid = label_mask(rows, idx + i + 2) & inside_span[:, i:i + W]
        lg = logits[i]
        pred = jnp.argmax(lg, -1)
        if draft_ids is not None:
            pred = draft_ids[pred]
            valid = valid & in_vocab[top]
        f_next = jnp.take_along_axis(tf.hidden, there[..., None], axis=1)
        yield i, idx, hidden[i], lg, f_next, z, valid, pred, top, inside_span[:, i:i + W]


def eagle_loss_fn(target_cfg: ModelConfig, config, first_label: int, *, num_steps: int = 1,
                  step_decay: float = 0.8, reg_weight: float = 1.0, ce_weight: float = 0.1, noise: float = 0.1,
                  d2t=None, max_span: int | None = None) -> Callable:
    """EAGLE drafter loss, loss_fn(params, batch, rng, target_params) -> (loss, metrics); batch = rows [B, R] of
    target-generated text (labels before index first_label, the corpus prompt, are not trained on); a batch of
    LabeledRows (chat rows) carries its own label spans instead.

    EAGLE-1 (config.kind "eagle"; the reference's weights v_w = 1.0, p_w = 0.1): per step
        reg_weight * SmoothL1(h_t, f_{t+1}) (mean over the feature dim) + ce_weight * CE(softmax(z_{t+1}), drafter
        logits through the target's LM head) -- soft cross-entropy against the target's full next-token
        distribution, as the reference trainer (its target_p = softmax(head(target feature))).
        Input noise: U(-noise, noise) added to every input feature (the paper's data augmentation; the reference's
        uniform noise of width 0.2 at 512 tokens); none on the regression targets.
    EAGLE-3 (kind "eagle3"; d2t the draft vocabulary map, required): no feature regression; per step a soft CE
        against the target's distribution restricted to the draft vocabulary (softmax of z gathered at the draft
        vocab's target ids, i.e. the target's probabilities there renormalised), masked where the target's top
        token is outside the draft vocabulary (the reference's position_mask); noise as above (default 0 for it).
    num_steps > 1: the training-time test (specjax.drafters.eagle.ttt_forward: step i feeds step i-1's output back
    with ground-truth token embeddings); total = sum_i step_decay**i * loss_i (EAGLE-3's 0.8**i over 7 steps).
    Every per-step term is a mean over its valid labels. Metrics per step: loss, ce, (reg), top-1 agreement of the
    drafter's argmax with the target's; EAGLE-3 also in_vocab = share of labels whose target top token is drafted.
    max_span: the longest label span of any row (train.losses.common.max_label_span); the drafter then unrolls only
    over the indices whose labels can be inside it (label_window; step 0 still reads every position's keys), the
    same loss at the cost of the answers rather than of the batch's width (chat rows: prompts of up to several
    hundred tokens before answers of at most a few hundred).
    """
    is3 = config.kind == "eagle3"
    if is3 and d2t is None:
        raise ValueError("an EAGLE-3 loss needs the draft vocabulary map d2t")
    draft_ids, in_vocab = _draft_vocabulary(config, d2t)
    layers = config.target_layers if is3 else ()

    def loss_fn(params, batch, rng, target_params):
        # no [B, R, V] teacher logits: each step reads the teacher at its own positions, over the draft vocabulary
        rows, tf = target_features(batch, first_label, target_params, target_cfg, layers, logits=False)
        tw = _target_weights(config, target_params)
        feats = _features(tf, config)
        if noise:
            if is3:
                keys = jax.random.split(rng, len(feats))
                feats = tuple(f + jax.random.uniform(k, f.shape, f.dtype, -noise, noise) for f, k in zip(feats, keys))
            else:
                feats = feats + jax.random.uniform(rng, feats.shape, feats.dtype, -noise, noise)
        total, metrics = 0.0, {}
        lm_head = target_weight(target_params, "lm_head")
        T = rows.tokens.shape[1] - 1
        size = T if max_span is None else min(T, max_span + num_steps)
        # index t's step i reads label t + i + 2: from num_steps + 1 before the first label through the last one
        at = label_window(rows, T, size, num_steps + 1)[0] if size < T else None
        for i, idx, h, lg, f_next, z, valid, pred, top, inside in _steps(params, config, tf, rows, feats, num_steps,
                                                                        tw, lm_head, draft_ids, in_vocab, at):
            if is3:
                ce = masked_mean(soft_ce(lg, jax.nn.softmax(z)), valid)
                step_loss = ce
                gen = label_mask(rows, idx + i + 2) & inside
                metrics[f"in_vocab{i}"] = masked_mean(in_vocab[top], gen)
            else:
                ce = masked_mean(soft_ce(lg, jax.nn.softmax(z)), valid)
                reg = masked_mean(_smooth_l1(h, f_next), valid)
                step_loss = reg_weight * reg + ce_weight * ce
                metrics[f"reg{i}"] = reg
            metrics[f"ce{i}"] = ce
            metrics[f"acc{i}"] = masked_mean(pred == top, valid)
            total = total + step_decay ** i * step_loss
        return total, metrics
    return loss_fn


def eagle_agreements(params: dict, target_params: dict, target_cfg: ModelConfig, config, rows, first_label: int,
                     num_steps: int = 4, d2t=None) -> ChainAgreement:
    """The drafter unrolled num_steps steps on its own outputs (step 0 teacher-forced, steps i > 0 via ttt_forward;
    token inputs are the row's tokens), no noise, at every committed length L of the rows: draft i + 1 is step i
    at index L - 2 (it drafts token L + i from the real features of positions 0..L - 2), a hit when its top token
    (EAGLE-3: mapped to its target id) is the target's top token there (a target top token outside the draft
    vocabulary is a miss). On rows the target decoded greedily, a greedy decode loop's step from length L drafts
    exactly these tokens (experiments.acceptance_replay checks it)."""
    is3 = config.kind == "eagle3"
    draft_ids, in_vocab = _draft_vocabulary(config, d2t)
    rows = labeled(rows, first_label)
    tw = _target_weights(config, target_params)
    tf = frozen_target_features(target_params, target_cfg, rows.tokens, config.target_layers if is3 else ())
    lm_head = target_weight(target_params, "lm_head")
    full = tf.teacher_logits(lm_head)                                   # [B, R, V]
    B, R = rows.tokens.shape
    T = R - 1
    agree, accept, valid = (jnp.zeros((B, num_steps, R + 1), d) for d in (bool, jnp.float32, bool))
    rows_ = jnp.arange(B)[:, None]
    for i, idx, _, lg, _, _, _, pred, top, inside in _steps(params, config, tf, rows, _features(tf, config),
                                                            num_steps, tw, lm_head, draft_ids, in_vocab):
        L = idx + 2                                                     # step i's index t is length t + 2
        there = jnp.minimum(idx + i + 1, T)
        agree = agree.at[rows_, i, L].set((pred == top) & inside)
        full_there = jnp.take_along_axis(full, there[..., None], axis=1)
        accept = accept.at[rows_, i, L].set(jnp.where(inside, acceptance_probability(lg, full_there, draft_ids), 0))
        valid = valid.at[rows_, i, L].set(label_mask(rows, L + i) & inside)
    return ChainAgreement(agree, accept, valid)


def eagle_accuracy(params: dict, target_params: dict, target_cfg: ModelConfig, config, rows,
                   first_label: int, num_steps: int = 4, d2t=None) -> tuple[jax.Array, jax.Array, jax.Array,
                                                                            jax.Array]:
    """Held-out acceptance proxy counts (eagle_agreements' ChainAgreement.counts): (hits [n], labels [n]) per step
    over target-generated labels -- marginal per-step top-1 agreement -- and (chain_hits [n], chains) over the
    committed lengths whose n drafts are all target-generated labels: chain_hits[i] counts those where steps 0..i
    ALL agree (on rows decoded greedily this is exactly greedy acceptance of an n-token chain; sum_i chain_hits[i] /
    chains = expected accepted drafts per step)."""
    return eagle_agreements(params, target_params, target_cfg, config, rows, first_label, num_steps, d2t).counts()
