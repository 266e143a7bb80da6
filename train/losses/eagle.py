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
from train.losses.common import (LabeledRows, TargetFeatures, frozen_target_features, label_mask, labeled,
                                 masked_mean, soft_ce, target_features)

# Rows [B, R] (R = prompt + target-generated tokens). The frozen target runs over the whole row: features f_0..f_{R-1}
# (EAGLE-1: the final normed hidden state; EAGLE-3: the outputs of config.target_layers) and logits z_0..z_{R-1}
# (z_p predicts token p + 1). The drafter runs over T = R - 1 entries, entry t = (embed(x_{t+1}), f_t)
# (specjax.drafters.eagle.forward_sequence's alignment). Step i of an unrolled drafter (ttt_forward) at index t
# regresses f_{t+i+1} and predicts token x_{t+i+2}, whose target distribution is softmax(z_{t+i+1}); so step i's
# outputs [:, :T - i] line up with the target's arrays [:, i + 1:] (no padding needed). A label counts when the token
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


def _unroll(params: dict, config, rows: jax.Array, feats, num_steps: int, target_weights: dict):
    """Drafter over rows [B, R] with the target's features of every position (a [B, R, H] array or a tuple of them;
    positions 0..R-2 are read) -> (hidden [n, B, T, H], logits [n, B, T, V|N]), T = R - 1."""
    tokens = rows[:, 1:]
    if isinstance(feats, (tuple, list)):
        feats = tuple(f[:, :-1] for f in feats)
    else:
        feats = feats[:, :-1]
    if num_steps == 1:
        hidden, logits = forward_sequence(params, config, tokens, feats, target_weights)
        return hidden[None], logits[None]
    return ttt_forward(params, config, tokens, feats, num_steps, target_weights)


def _steps(params: dict, config, tf: TargetFeatures, rows: LabeledRows, feats, num_steps: int,
                 target_weights: dict, lm_head: jax.Array, draft_ids, in_vocab):
    """Per-step aligned pieces: yields (i, drafter hidden [B, Ti, H], drafter logits [B, Ti, V|N], target feature
    [B, Ti, H], target logits [B, Ti, V|N] (EAGLE-3: at the draft vocabulary's ids), label mask [B, Ti]
    (target-generated token; EAGLE-3: and the target's top token inside the draft vocabulary), drafter top token as
    a target id [B, Ti], target top token [B, Ti])."""
    hidden, logits = _unroll(params, config, rows.tokens, feats, num_steps, target_weights)
    teacher, tops = tf.teacher_logits(lm_head, ids=draft_ids), tf.top_tokens()
    T = rows.tokens.shape[1] - 1
    for i in range(num_steps):
        Ti = T - i
        z = teacher[:, i + 1:]
        top = tops[:, i + 1:]
        valid = label_mask(rows, jnp.arange(Ti) + i + 2)
        lg = logits[i, :, :Ti]
        pred = jnp.argmax(lg, -1)
        if draft_ids is not None:
            pred = draft_ids[pred]
            valid = valid & in_vocab[top]
        yield i, hidden[i, :, :Ti], lg, tf.hidden[:, i + 1:], z, valid, pred, top


def eagle_loss_fn(target_cfg: ModelConfig, config, first_label: int, *, num_steps: int = 1,
                  step_decay: float = 0.8, reg_weight: float = 1.0, ce_weight: float = 0.1, noise: float = 0.1,
                  d2t=None) -> Callable:
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
    """
    is3 = config.kind == "eagle3"
    if is3 and d2t is None:
        raise ValueError("an EAGLE-3 loss needs the draft vocabulary map d2t")
    draft_ids, in_vocab = _draft_vocabulary(config, d2t)
    layers = config.target_layers if is3 else ()

    def loss_fn(params, batch, rng, target_params):
        rows, tf = target_features(batch, first_label, target_params, target_cfg, layers)
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
        for i, h, lg, f_next, z, valid, pred, top in _steps(params, config, tf, rows, feats, num_steps, tw,
                                                           lm_head, draft_ids, in_vocab):
            if is3:
                ce = masked_mean(soft_ce(lg, jax.nn.softmax(z)), valid)
                step_loss = ce
                gen = label_mask(rows, jnp.arange(valid.shape[1]) + i + 2)
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


def eagle_accuracy(params: dict, target_params: dict, target_cfg: ModelConfig, config, rows,
                   first_label: int, num_steps: int = 4, d2t=None) -> tuple[jax.Array, jax.Array, jax.Array,
                                                                            jax.Array]:
    """Held-out acceptance proxy counts of a drafter unrolled num_steps steps on its own outputs (step 0
    teacher-forced, steps i > 0 via ttt_forward; token inputs are the row's tokens), no noise.

    Step i at index t drafts token t + i + 2 from the real features of positions 0..t; a hit is the drafter's top
    token (EAGLE-3: mapped to its target id) equal to the target's top token there. Returns
    (hits [n], labels [n]) per step over target-generated labels -- marginal per-step top-1 agreement -- and
    (chain_hits [n], chains) over chain starts t whose n labels are all target-generated: chain_hits[i] counts
    starts where steps 0..i ALL agree (on rows decoded greedily this is exactly greedy acceptance of an n-token
    chain; sum_i chain_hits[i] / chains = expected accepted drafts per step)."""
    is3 = config.kind == "eagle3"
    draft_ids, in_vocab = _draft_vocabulary(config, d2t)
    rows = labeled(rows, first_label)
    tw = _target_weights(config, target_params)
    tf = frozen_target_features(target_params, target_cfg, rows.tokens, config.target_layers if is3 else ())
    feats = _features(tf, config)
    B, T = rows.tokens.shape[0], rows.tokens.shape[1] - 1
    Tc = T - num_steps + 1                             # chain starts whose every step stays inside the row
    # a chain counts when all its n labels do: its first (t + 2) and its last (t + n + 1) inside the span
    chain_valid = label_mask(rows, jnp.arange(Tc) + 2) & label_mask(rows, jnp.arange(Tc) + num_steps + 1)
    hits, counts, chain_hits, all_ok = [], [], [], jnp.ones((B, Tc), bool)
    for i, _, _, _, _, _, pred, top in _steps(params, config, tf, rows, feats, num_steps, tw,
                                              target_weight(target_params, "lm_head"), draft_ids, in_vocab):
        ok = pred == top                              # EAGLE-3: a target top token outside the vocab is a miss
        valid = label_mask(rows, jnp.arange(T - i) + i + 2)
        hits.append(jnp.sum(ok & valid))
        counts.append(jnp.sum(valid))
        all_ok = all_ok & ok[:, :Tc]
        chain_hits.append(jnp.sum(all_ok & chain_valid))
    return jnp.stack(hits), jnp.stack(counts), jnp.stack(chain_hits), jnp.sum(chain_valid)
