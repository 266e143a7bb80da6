"""Every training loss, as a pure function over params pytrees, plus the frozen-target forward the drafter losses read.

A recipe hands train.loop a `loss_fn(params, batch, rng[, frozen]) -> (scalar loss, metrics dict)`; the factories
here build those from a model config. Batches are int32 token windows [B, L + 1] (inputs w[:, :-1], next tokens
w[:, 1:]). Losses with a frozen target take its params as the 4th argument `frozen` (train.loop passes them into
the jitted step instead of closing over them, so they are neither baked into the program as constants nor
un-sharded).
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from specjax.cache import KVCache
from specjax.models.config import ModelConfig
from specjax.models.llama import forward, full_logits


class TargetFeatures(NamedTuple):
    logits: jax.Array                  # [B, T, V] float32
    hidden: jax.Array                  # [B, T, H] last hidden state after the final norm (what lm_head reads)
    layers: tuple[jax.Array, ...]      # the requested decoder layers' outputs [B, T, H], in the order asked


def frozen_target_features(params: dict, cfg: ModelConfig, tokens: jax.Array,
                           layers: Sequence[int] = ()) -> TargetFeatures:
    """The frozen target's full causal forward over tokens [B, T]: logits, final hidden state and the outputs of
    decoder `layers` (negative indices count from the top, like Python's), all under stop_gradient. What Medusa
    heads (final hidden), EAGLE-1 (final hidden + token), EAGLE-3 (low/mid/high layers) and MTP modules train on."""
    idx = [l % cfg.num_layers if -cfg.num_layers <= l < cfg.num_layers else None for l in layers]
    if None in idx:
        raise ValueError(f"layers {tuple(layers)} out of range for a {cfg.num_layers}-layer target")
    B, T = tokens.shape
    cache = KVCache.init(cfg.num_layers, B, T, cfg.num_kv_heads, cfg.head_dim, params["embed"].dtype)
    unique = tuple(sorted(set(idx)))
    out = forward(params, cfg, tokens, cache, hidden_layers=unique)
    by_layer = dict(zip(unique, out.layer_hidden))
    return jax.lax.stop_gradient(TargetFeatures(out.logits, out.hidden, tuple(by_layer[i] for i in idx)))


# ------------------------------------------------------------------------------------------ language models

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
        kl = jnp.sum(jnp.exp(t_logp) * (t_logp - d_logp_t), axis=-1).mean()
        ce = optax.softmax_cross_entropy_with_integer_labels(d_logits, labels).mean()
        agree = jnp.mean(jnp.argmax(d_logits, -1) == jnp.argmax(t_logits, -1))
        return (1 - ce_weight) * kl + ce_weight * ce, {"kl": kl, "ce": ce, "top1_agree": agree}
    return loss_fn


# ------------------------------------------------------------------------- heads on frozen-target features
# Medusa (k heads on `hidden`, head i predicting token t + i + 2), EAGLE-1/3 (one decoder layer over
# `hidden` / fused `layers` + the next token's embedding), MTP modules: each is a factory here returning
# loss_fn(head_params, batch, rng, target_params) that starts from frozen_target_features(...).


def _head_teacher(teacher_logits: jax.Array, ahead: int) -> jax.Array:
    """The target's logits for the token `ahead` + 1 positions after each input position: teacher_logits [B, T, V]
    (index p predicts token p + 1) -> [B, T, V] (rows past the window repeat the last one; they are masked)."""
    T = teacher_logits.shape[1]
    return jnp.take(teacher_logits, jnp.minimum(jnp.arange(T) + ahead, T - 1), axis=1)


def _medusa_terms(heads: dict, hidden: jax.Array, batch: jax.Array, first_label: int, decay: float,
                  teacher_logits: jax.Array | None = None):
    """Per-head masked loss of Medusa heads on hidden [B, T, H] (T = L, inputs batch[:, :-1]): head i at position t
    predicts batch[:, t + i + 2]; labels before index first_label (prompt tokens) and past the window are masked.
    With teacher_logits [B, T, V] (the target's own logits over the inputs, under stop_gradient) the loss is soft
    cross-entropy against the target's distribution for that token and accuracy is agreement with the target's
    argmax: what verification accepts, which for a jointly trained (Medusa-2) target is no longer the token the
    original target wrote. Without them: hard CE on batch's tokens.
    -> (weighted sum of head losses, per-head losses [K], per-head top-1 accuracy [K])."""
    from specjax.drafters.medusa import head_logits
    B, T, _ = hidden.shape
    logits = head_logits(heads, hidden)                                   # [B, T, K, V]
    K = logits.shape[2]
    total, per_head, acc = 0.0, [], []
    for i in range(K):
        label_at = jnp.arange(T) + i + 2                                   # index into batch [L + 1]
        valid = (label_at <= T) & (label_at >= first_label)                # [T]
        if teacher_logits is None:
            labels = jnp.take(batch, jnp.minimum(label_at, T), axis=1)     # [B, T]
            loss = optax.softmax_cross_entropy_with_integer_labels(logits[:, :, i], labels)
        else:
            teacher = _head_teacher(teacher_logits, i + 1)                 # [B, T, V]
            labels = jnp.argmax(teacher, -1)
            loss = _soft_ce(logits[:, :, i], jax.nn.softmax(teacher.astype(jnp.float32)))
        w = jnp.broadcast_to(valid, loss.shape)
        li = _masked_mean(loss, w)
        per_head.append(li)
        acc.append(_masked_mean(jnp.argmax(logits[:, :, i], -1) == labels, w))
        total = total + decay ** i * li
    return total, jnp.stack(per_head), jnp.stack(acc)


def medusa_loss_fn(cfg: ModelConfig, decay: float, first_label: int, joint: bool = False, kl_weight: float = 1.0,
                   heads_weight: float = 1.0, soft_labels: bool = True) -> Callable:
    """Medusa-1 (joint=False): params are the heads; the frozen target's final hidden state feeds them.
    Medusa-2 (joint=True): params = {"heads", "target"}; the trained target's hidden state feeds the heads and
    kl_weight * KL(p_frozen_original || p_trained) keeps its next-token distribution, heads_weight scales the
    heads' loss (Medusa's lambda_0). batch [B, L + 1]: rows of target-generated text; labels before index
    first_label (the corpus prompt) are not trained on. soft_labels: the heads learn the (trained, for Medusa-2)
    target's own distribution for each token (see _medusa_terms) instead of the row's tokens."""
    def loss_fn(params, batch, rng, target_params):
        del rng
        inputs = batch[:, :-1]
        if not joint:
            frozen = frozen_target_features(target_params, cfg, inputs)
            loss, per_head, acc = _medusa_terms(params, frozen.hidden, batch, first_label, decay,
                                                frozen.logits if soft_labels else None)
            return loss, {**{f"ce{i}": per_head[i] for i in range(per_head.shape[0])},
                          **{f"acc{i}": acc[i] for i in range(acc.shape[0])}}
        original = frozen_target_features(target_params, cfg, inputs).logits
        B, T = inputs.shape
        cache = KVCache.init(cfg.num_layers, B, T, cfg.num_kv_heads, cfg.head_dim, params["target"]["embed"].dtype)
        out = forward(params["target"], cfg, inputs, cache)
        heads_loss, per_head, acc = _medusa_terms(params["heads"], out.hidden, batch, first_label, decay,
                                                  jax.lax.stop_gradient(out.logits) if soft_labels else None)
        logp0 = jax.nn.log_softmax(original)
        kl = jnp.sum(jnp.exp(logp0) * (logp0 - jax.nn.log_softmax(out.logits)), -1).mean()
        return kl_weight * kl + heads_weight * heads_loss, {
            "kl": kl, **{f"ce{i}": per_head[i] for i in range(per_head.shape[0])},
            **{f"acc{i}": acc[i] for i in range(acc.shape[0])}}
    return loss_fn


def medusa_accuracy(heads: dict, target_params: dict, cfg: ModelConfig, rows: jax.Array, first_label: int,
                    topk: int = 5) -> tuple[jax.Array, jax.Array]:
    """Held-out accuracy counts against what greedy verification accepts, the target's own argmax for each token
    (teacher-forced on rows; for the original target's greedy rows that is the row's token itself):
    rows [B, L + 1] -> (hits [K, topk] = that token within each head's top-1..top-k, valid labels [K]); divide for
    cumulative top-k accuracy."""
    from specjax.drafters.medusa import head_logits
    inputs = rows[:, :-1]
    target = frozen_target_features(target_params, cfg, inputs)
    logits = head_logits(heads, target.hidden)                            # [B, T, K, V]
    B, T, K, _ = logits.shape
    hits, counts = [], []
    for i in range(K):
        label_at = jnp.arange(T) + i + 2
        valid = (label_at <= T) & (label_at >= first_label)
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


# ---------------------------------------------------------------------------------------------------- EAGLE
# Rows [B, R] (R = prompt + target-generated tokens). The frozen target runs over the whole row: features f_0..f_{R-1}
# (EAGLE-1: the final normed hidden state; EAGLE-3: the outputs of config.target_layers) and logits z_0..z_{R-1}
# (z_p predicts token p + 1). The drafter runs over T = R - 1 entries, entry t = (embed(x_{t+1}), f_t)
# (specjax.drafters.eagle.forward_sequence's alignment). Step i of an unrolled drafter (ttt_forward) at index t
# regresses f_{t+i+1} and predicts token x_{t+i+2}, whose target distribution is softmax(z_{t+i+1}); so step i's
# outputs [:, :T - i] line up with the target's arrays [:, i + 1:] (no padding needed). A label counts when the token
# it predicts is target-generated (t + i + 2 >= first_label; the last index predicts the token after the row, which
# the target's distribution there still describes).


def _smooth_l1(x: jax.Array, y: jax.Array) -> jax.Array:
    """Smooth L1 (Huber, beta 1) averaged over the feature dim: [..., H] -> [...]."""
    d = jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))
    return jnp.mean(jnp.where(d < 1.0, 0.5 * d * d, d - 0.5), axis=-1)


def _soft_ce(logits: jax.Array, probs: jax.Array) -> jax.Array:
    """-sum_v p_v log softmax(logits)_v: [..., V] -> [...]."""
    return -jnp.sum(probs * jax.nn.log_softmax(logits.astype(jnp.float32)), axis=-1)


def _masked_mean(x: jax.Array, w: jax.Array) -> jax.Array:
    w = w.astype(jnp.float32)
    return jnp.sum(x * w) / jnp.maximum(jnp.sum(w), 1.0)


def _eagle_target_weights(config, target_params: dict) -> dict:
    from specjax.drafters.base import target_weight
    names = ("embed", "lm_head") if config.kind == "eagle" else ("embed",)
    return {n: target_weight(target_params, n) for n in names}


def _eagle_features(tf: TargetFeatures, config):
    """The drafter's feature input from the target's forward over rows: EAGLE-1 the final normed hidden state
    [B, R, H], EAGLE-3 the tuple of config.target_layers outputs."""
    return tf.hidden if config.kind == "eagle" else tuple(tf.layers)


def _eagle_unroll(params: dict, config, rows: jax.Array, feats, num_steps: int, target_weights: dict):
    """Drafter over rows [B, R] with the target's features of every position (a [B, R, H] array or a tuple of them;
    positions 0..R-2 are read) -> (hidden [n, B, T, H], logits [n, B, T, V|N]), T = R - 1."""
    from specjax.drafters import eagle
    tokens = rows[:, 1:]
    if isinstance(feats, (tuple, list)):
        feats = tuple(f[:, :-1] for f in feats)
    else:
        feats = feats[:, :-1]
    if num_steps == 1:
        hidden, logits = eagle.forward_sequence(params, config, tokens, feats, target_weights)
        return hidden[None], logits[None]
    return eagle.ttt_forward(params, config, tokens, feats, num_steps, target_weights)


def _eagle_steps(params: dict, config, tf: TargetFeatures, rows: jax.Array, feats, num_steps: int,
                 target_weights: dict, first_label: int, draft_ids, in_vocab):
    """Per-step aligned pieces: yields (i, drafter hidden [B, Ti, H], drafter logits [B, Ti, V|N], target feature
    [B, Ti, H], target logits [B, Ti, V], label mask [B, Ti] (target-generated token; EAGLE-3: and the target's
    top token inside the draft vocabulary), drafter top token as a target id [B, Ti], target top token [B, Ti])."""
    hidden, logits = _eagle_unroll(params, config, rows, feats, num_steps, target_weights)
    T = rows.shape[1] - 1
    for i in range(num_steps):
        Ti = T - i
        z = tf.logits[:, i + 1:]
        top = jnp.argmax(z, -1)
        valid = jnp.broadcast_to(jnp.arange(Ti) + i + 2 >= first_label, top.shape)
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
    target-generated text (labels before index first_label, the corpus prompt, are not trained on).

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
    from specjax.drafters import eagle
    is3 = config.kind == "eagle3"
    if is3 and d2t is None:
        raise ValueError("an EAGLE-3 loss needs the draft vocabulary map d2t")
    draft_ids = jnp.asarray(eagle.draft_to_target(d2t), jnp.int32) if is3 else None
    in_vocab = jnp.asarray(eagle.t2d_from_d2t(d2t, config.vocab_size)) if is3 else None
    layers = config.target_layers if is3 else ()

    def loss_fn(params, batch, rng, target_params):
        tw = _eagle_target_weights(config, target_params)
        tf = frozen_target_features(target_params, target_cfg, batch, layers)
        feats = _eagle_features(tf, config)
        if noise:
            if is3:
                keys = jax.random.split(rng, len(feats))
                feats = tuple(f + jax.random.uniform(k, f.shape, f.dtype, -noise, noise) for f, k in zip(feats, keys))
            else:
                feats = feats + jax.random.uniform(rng, feats.shape, feats.dtype, -noise, noise)
        total, metrics = 0.0, {}
        for i, h, lg, f_next, z, valid, pred, top in _eagle_steps(params, config, tf, batch, feats, num_steps, tw,
                                                                  first_label, draft_ids, in_vocab):
            if is3:
                ce = _masked_mean(_soft_ce(lg, jax.nn.softmax(z[..., draft_ids])), valid)
                step_loss = ce
                gen = jnp.broadcast_to(jnp.arange(valid.shape[1]) + i + 2 >= first_label, valid.shape)
                metrics[f"in_vocab{i}"] = _masked_mean(in_vocab[top], gen)
            else:
                ce = _masked_mean(_soft_ce(lg, jax.nn.softmax(z)), valid)
                reg = _masked_mean(_smooth_l1(h, f_next), valid)
                step_loss = reg_weight * reg + ce_weight * ce
                metrics[f"reg{i}"] = reg
            metrics[f"ce{i}"] = ce
            metrics[f"acc{i}"] = _masked_mean(pred == top, valid)
            total = total + step_decay ** i * step_loss
        return total, metrics
    return loss_fn


def eagle_accuracy(params: dict, target_params: dict, target_cfg: ModelConfig, config, rows: jax.Array,
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
    from specjax.drafters import eagle
    is3 = config.kind == "eagle3"
    draft_ids = jnp.asarray(eagle.draft_to_target(d2t), jnp.int32) if is3 else None
    in_vocab = jnp.asarray(eagle.t2d_from_d2t(d2t, config.vocab_size)) if is3 else None
    tw = _eagle_target_weights(config, target_params)
    tf = frozen_target_features(target_params, target_cfg, rows, config.target_layers if is3 else ())
    feats = _eagle_features(tf, config)
    B, T = rows.shape[0], rows.shape[1] - 1
    Tc = T - num_steps + 1                             # chain starts whose every step stays inside the row
    chain_valid = jnp.broadcast_to(jnp.arange(Tc) + 2 >= first_label, (B, Tc))
    hits, counts, chain_hits, all_ok = [], [], [], jnp.ones((B, Tc), bool)
    for i, _, _, _, _, _, pred, top in _eagle_steps(params, config, tf, rows, feats, num_steps, tw, first_label,
                                                    draft_ids, in_vocab):
        ok = pred == top                              # EAGLE-3: a target top token outside the vocab is a miss
        valid = jnp.broadcast_to(jnp.arange(T - i) + i + 2 >= first_label, ok.shape)
        hits.append(jnp.sum(ok & valid))
        counts.append(jnp.sum(valid))
        all_ok = all_ok & ok[:, :Tc]
        chain_hits.append(jnp.sum(all_ok & chain_valid))
    return jnp.stack(hits), jnp.stack(counts), jnp.stack(chain_hits), jnp.sum(chain_valid)


# ------------------------------------------------------------------------------------ multi-token prediction

def multi_token_lm_loss_fn(cfg: ModelConfig, heads_config) -> Callable:
    """Gloeckle et al. (2024) multi-token prediction from scratch: params = {"lm": a Llama (its last decoder layer
    is head 1), "heads": the extra heads (specjax.drafters.mtp, kind "mtp_heads", reading the output of decoder
    layer heads_config.trunk_layer)}. Loss = sum over heads of the mean cross-entropy of head i (1-based) at t
    against token t + i, as the paper (each head's own positions: the last i - 1 of a window have no label).
    Metrics: ce<i> per head, ppl of head 1."""
    from specjax.drafters.base import target_weight
    from specjax.drafters.mtp import heads_forward_sequence
    trunk = heads_config.trunk_layer

    def loss_fn(params, batch, rng):
        del rng
        inputs = batch[:, :-1]
        B, T = inputs.shape
        cache = KVCache.init(cfg.num_layers, B, T, cfg.num_kv_heads, cfg.head_dim, params["lm"]["embed"].dtype)
        out = forward(params["lm"], cfg, inputs, cache, hidden_layers=(trunk,))
        ce = [optax.softmax_cross_entropy_with_integer_labels(out.logits, batch[:, 1:]).mean()]
        _, logits = heads_forward_sequence(params, heads_config, out.layer_hidden[0],
                                           target_weight(params["lm"], "lm_head"))
        for d in range(logits.shape[0]):                   # head d + 2: label at t + d + 2
            ce.append(optax.softmax_cross_entropy_with_integer_labels(logits[d, :, :T - d - 1], batch[:, d + 2:]).mean())
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
    from specjax.drafters.base import target_weight
    from specjax.drafters.mtp import heads_forward_sequence
    inputs = windows[:, :-1]
    B, T = inputs.shape
    cache = KVCache.init(cfg.num_layers, B, T, cfg.num_kv_heads, cfg.head_dim, params["lm"]["embed"].dtype)
    out = forward(params["lm"], cfg, inputs, cache, hidden_layers=(heads_config.trunk_layer,))
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


def _mtp_pieces(params: dict, config, target_params: dict, target_cfg: ModelConfig, rows: jax.Array):
    """MTP modules teacher-forced over rows [B, R] -> (logits [D, B, T, V], the target's logits at positions
    1..R-1 [B, T, V]), T = R - 1: every module's entry e predicts the token at e + 2, whose target distribution is
    the target's logits at position e + 1."""
    from specjax.drafters.base import target_weight
    from specjax.drafters.mtp import mtp_forward_sequence
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
        logits, teacher = _mtp_pieces(params, config, target_params, target_cfg, batch)
        T = teacher.shape[1]
        probs = jax.nn.softmax(teacher.astype(jnp.float32))
        top = jnp.argmax(teacher, -1)
        total, metrics = 0.0, {}
        for d in range(logits.shape[0]):
            e = jnp.arange(T)
            valid = jnp.broadcast_to((e >= d) & (e + 2 >= first_label), top.shape)
            ce = _masked_mean(_soft_ce(logits[d], probs), valid)
            metrics[f"ce{d}"] = ce
            metrics[f"acc{d}"] = _masked_mean(jnp.argmax(logits[d], -1) == top, valid)
            total = total + depth_decay ** d * ce
        return total, metrics
    return loss_fn


def mtp_accuracy(params: dict, target_params: dict, target_cfg: ModelConfig, config, rows: jax.Array,
                 first_label: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Held-out acceptance counts of MTP modules, as eagle_accuracy: a chain started at entry s drafts token s + 1 + j
    with module j (1-based) at entry s + j - 1, teacher-forced on the row's tokens (on greedy rows exactly what
    greedy verification sees when the earlier drafts were right). Returns per module (hits [D], labels [D]) of
    top-1 agreement with the target's argmax, and (chain_hits [D], chains): starts where modules 1..j all agree."""
    logits, teacher = _mtp_pieces(params, config, target_params, target_cfg, rows)
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


# ----------------------------------------------------------------------------------------------------- PARD
# Parallel drafting (specjax.drafters.pard) trained in one forward per batch, no per-cut-point copies. The inputs
# x_0..x_{T-1} are stream 0 (ordinary next-token prediction); for each of n context ends c_i, stream j = 1..k-1
# holds mask token j at RoPE position c_i + j: "the j-th mask after a context ending at c_i", predicting token
# c_i + j + 1. Every context end c = 0..T-1 gives the brief's dense form (stream j at every position p = c + j);
# a random subset of them (PARD's conditional drop-token idea, in the simplest form that keeps every mask's own
# context: a context end keeps all its masks or none) makes the mask streams n / T as expensive.


def pard_stream_mask(ends: jax.Array, T: int, k: int) -> jax.Array:
    """Boolean [P, P], P = T + (k - 1) n, over stream 0 (index p) and the mask streams (index T + (j - 1) n + i for
    mask j of context end ends[i]): real query p reads real keys <= p; mask j of end c_i reads real keys <= c_i
    and masks 1..j of the same end -- exactly what mask j sees at inference after a context ending at c_i."""
    n = ends.shape[0]
    real_q = jnp.arange(T)
    stream = jnp.concatenate([jnp.zeros(T, jnp.int32), jnp.repeat(jnp.arange(1, k), n)])     # [P]
    end = jnp.concatenate([real_q, jnp.tile(ends, k - 1)])            # [P] the context end each query extends
    ctx_id = jnp.concatenate([jnp.full(T, -1), jnp.tile(jnp.arange(n), k - 1)])              # [P]
    qs, qe, qi = stream[:, None], end[:, None], ctx_id[:, None]
    ks, ke, ki = stream[None, :], end[None, :], ctx_id[None, :]
    return ((ks == 0) & (ke <= qe)) | ((qs >= 1) & (ks >= 1) & (ki == qi) & (ks <= qs))


def pard_stream_logits(params: dict, cfg: ModelConfig, inputs: jax.Array, mask_token_ids: Sequence[int], k: int,
                       vocab_size: int, ends: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """inputs [B, T] (real tokens), ends [n] context ends (default: all T) -> (stream 0 logits [B, T, V], mask
    logits [B, k - 1, n, V]), cut to the target's vocab_size: [:, j - 1, i] is draft j + 1 for token ends[i] + j + 1
    from the context x_0..x_{ends[i]} followed by masks 1..j."""
    B, T = inputs.shape
    ends = jnp.arange(T) if ends is None else ends
    n = ends.shape[0]
    masks = jnp.repeat(jnp.asarray(mask_token_ids[:k - 1], jnp.int32), n)                   # [(k-1) n]
    tokens = jnp.concatenate([inputs, jnp.broadcast_to(masks, (B, (k - 1) * n))], axis=1)   # [B, P]
    positions = jnp.concatenate([jnp.arange(T)] + [ends + j for j in range(1, k)])          # [P]
    P = tokens.shape[1]
    cache = KVCache.init(cfg.num_layers, B, P, cfg.num_kv_heads, cfg.head_dim, params["embed"].dtype)
    out = forward(params, cfg, tokens, cache, depths=positions, mask=pard_stream_mask(ends, T, k))
    logits = out.logits[..., :vocab_size]
    return logits[:, :T], logits[:, T:].reshape(B, k - 1, n, vocab_size)


def _pard_targets(x: jax.Array, ends: jax.Array, k: int) -> jax.Array:
    """x [B, T, ...] indexed by position p (what predicts token p + 1) -> [B, k, n, ...]: stream j's entry for
    context end ends[i] is x at ends[i] + j (clipped; those past the window are masked by _pard_valid)."""
    T = x.shape[1]
    idx = jnp.minimum(ends[None, :] + jnp.arange(k)[:, None], T - 1)                          # [k, n]
    return jnp.take(x, idx, axis=1)


def _pard_valid(ends: jax.Array, T: int, k: int, first_label: int) -> jax.Array:
    """[k, n]: draft j + 1 of context end c predicts token c + j + 1, which must be in the window (<= T) and
    trained on (>= first_label)."""
    label = ends[None, :] + jnp.arange(k)[:, None] + 1
    return (label <= T) & (label >= first_label)


def pard_loss_fn(draft_cfg: ModelConfig, target_cfg: ModelConfig, mask_token_ids: Sequence[int], k: int,
                 ce_weight: float, first_label: int = 1, num_ends: int | None = None) -> Callable:
    """Per draft position j (stream 0 = draft 1: every position; mask stream j: num_ends context ends drawn per
    step from rng, all of them when None), mean over valid labels of (1 - ce_weight) * KL(p_target || p_draft) +
    ce_weight * CE (the default draft's distillation loss), the teacher being the frozen target's next-token
    distribution for the same token; positions weighted equally. batch [B, T + 1]; labels before index
    first_label are not trained on. Metrics per position: loss and top-1 agreement with the target's argmax."""
    V = target_cfg.vocab_size

    def terms(d_logits, t_logp, labels, valid):
        d_logp = jax.nn.log_softmax(d_logits)
        kl = jnp.sum(jnp.exp(t_logp) * (t_logp - d_logp), -1)
        ce = -jnp.take_along_axis(d_logp, labels[..., None], -1)[..., 0]
        agree = jnp.argmax(d_logits, -1) == jnp.argmax(t_logp, -1)
        return _masked_mean((1 - ce_weight) * kl + ce_weight * ce, valid), _masked_mean(agree, valid)

    def loss_fn(params, batch, rng, target_params):
        inputs, labels = batch[:, :-1], batch[:, 1:]
        T = inputs.shape[1]
        lo = max(first_label - 1, 0)                   # the first context end whose next token is a label
        ends = jnp.arange(T) if num_ends is None else jnp.sort(
            jax.random.choice(rng, jnp.arange(lo, T), (min(num_ends, T - lo),), replace=False))
        t_logp = jax.nn.log_softmax(frozen_target_features(target_params, target_cfg, inputs).logits)  # [B, T, V]
        real, masks = pard_stream_logits(params, draft_cfg, inputs, mask_token_ids, k, V, ends)
        valid = _pard_valid(ends, T, k, first_label)                                                  # [k, n]
        per, acc = [], []
        l0, a0 = terms(real, t_logp, labels, jnp.broadcast_to(jnp.arange(T) + 1 >= first_label, labels.shape))
        per.append(l0), acc.append(a0)
        t_at, lab_at = _pard_targets(t_logp, ends, k), _pard_targets(labels, ends, k)    # [B, k, n, V], [B, k, n]
        for j in range(1, k):
            lj, aj = terms(masks[:, j - 1], t_at[:, j], lab_at[:, j], jnp.broadcast_to(valid[j], lab_at[:, j].shape))
            per.append(lj), acc.append(aj)
        metrics = {f"loss{j}": per[j] for j in range(k)}
        metrics.update({f"acc{j}": acc[j] for j in range(k)})
        return sum(per) / k, metrics
    return loss_fn


def pard_accuracy(params: dict, target_params: dict, draft_cfg: ModelConfig, target_cfg: ModelConfig,
                  rows: jax.Array, mask_token_ids: Sequence[int], k: int, first_label: int = 1):
    """Held-out counts of a k-token parallel draft at every context end of rows [B, R] (teacher-forced: the row's
    tokens are the context). Draft j + 1 of context end c agrees when its argmax is the target's argmax for token
    c + j + 1. Returns (hits [k], labels [k]): per-draft-position top-1 agreement counts; (chain_hits [k],
    chains): over context ends whose k labels are all in the window and trained on, chain_hits[i] counts those
    where drafts 1..i+1 all agree -- on rows the target decoded greedily exactly what greedy verification
    accepts, so sum(chain_hits[:m]) / chains is the expected accepted length of an m-token parallel draft."""
    inputs = rows[:, :-1]
    B, T = inputs.shape
    ends = jnp.arange(T)
    t_top = jnp.argmax(frozen_target_features(target_params, target_cfg, inputs).logits, -1)    # [B, T]
    real, masks = pard_stream_logits(params, draft_cfg, inputs, mask_token_ids, k, target_cfg.vocab_size, ends)
    d_top = jnp.concatenate([jnp.argmax(real, -1)[:, None], jnp.argmax(masks, -1)], axis=1)     # [B, k, T]
    agree = d_top == _pard_targets(t_top, ends, k)                                              # [B, k, T]
    valid = jnp.broadcast_to(_pard_valid(ends, T, k, first_label), agree.shape)
    chain_valid = valid[:, 0] & valid[:, -1]           # the first label trained on, the k-th in the window
    all_ok = jnp.cumprod(agree, axis=1).astype(bool)                                            # [B, k, T]
    return (jnp.sum(agree & valid, axis=(0, 2)), jnp.sum(valid, axis=(0, 2)),
            jnp.sum(all_ok & chain_valid[:, None], axis=(0, 2)), jnp.sum(chain_valid))
