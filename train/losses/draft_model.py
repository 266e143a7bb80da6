"""Draft-model losses: a small LM distilled from the frozen target (specjax.drafters.draft_model): an own-vocabulary
draft on packed corpus windows (distill_loss_fn), or a draft reading the target's embedding, over the target's
vocabulary or a draft vocabulary, on rows with label spans (target_embedding_loss_fn, and its held-out counts
draft_agreements)."""
from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from specjax.drafters.base import target_weight
from specjax.drafters.draft_vocab import t2d_from_d2t, target_to_draft
from specjax.models.config import ModelConfig
from specjax.models.llama import full_logits
from train.losses.common import (ChainAgreement, DraftHead, LabeledRows, TargetFeatures, acceptance_probability,
                                 causal_forward, forward_kl, frozen_target_features, label_mask, label_window, labeled,
                                 masked_mean, target_features)


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


# A draft reading the target's embedding (specjax.drafters.draft_model.TargetEmbeddingDraft) runs over whole rows
# [B, R]: its output at position t predicts token t + 1, against the target's distribution z_t (teacher-forced,
# as the decode loop runs it on accepted tokens). A position counts when token t + 1 is a label (inside the row's
# span, train.data.LabeledRows; for plain rows of one layout the last position predicts the token after the row,
# which only the teacher describes, so it has no CE term). With a draft vocabulary the teacher is EAGLE-3's
# (train.losses.eagle): the target's distribution restricted to the draft vocabulary and renormalised (softmax of
# z at the draft vocabulary's ids), trained where the target's top token is one of them.


class Scored(NamedTuple):
    """The draft at positions at [B, W] of rows: what the loss and the held-out counts read."""
    logits: jax.Array          # [B, W, N | V] the draft's
    teacher: jax.Array         # [B, W, N | V] the target's (at the draft vocabulary's ids)
    full: jax.Array | None     # [B, W, V] the target's over its whole vocabulary, where it was computed
    pred: jax.Array            # [B, W] the draft's top token as a target id
    top: jax.Array             # [B, W] the target's top token
    labels: jax.Array          # [B, W] the row's next token (clipped inside the row)
    valid: jax.Array           # [B, W] the next token is a label
    in_row: jax.Array          # [B, W] the next token is inside the row (past it: only the teacher knows it)


def draft_hidden(params: dict, cfg: ModelConfig, head: DraftHead, tokens: jax.Array, target_params: dict) -> jax.Array:
    """The draft's final-normed hidden states over tokens [B, R] -> [B, R, H] (the head runs where a loss reads it)."""
    return causal_forward(head.forward_params(params, target_params), cfg, tokens).hidden


def _score(params: dict, cfg: ModelConfig, head: DraftHead, rows: LabeledRows, tf: TargetFeatures,
           target_params: dict, at: jax.Array | None = None, full: bool = False) -> Scored:
    """The draft over the rows, scored at positions at [B, W] (None: every position). full: also keep the target's
    logits over its whole vocabulary (what acceptance_probability reads)."""
    B, R = rows.tokens.shape
    at = jnp.broadcast_to(jnp.arange(R, dtype=jnp.int32), (B, R)) if at is None else at
    hidden = jnp.take_along_axis(draft_hidden(params, cfg, head, rows.tokens, target_params), at[..., None], axis=1)
    logits = head.logits(params, target_params, hidden)
    lm_head = target_weight(target_params, "lm_head", head.vocab_size)
    if full or (tf.top is None and tf.logits is None):          # one head product gives the teacher and the top
        z = tf.teacher_logits(lm_head, at=at)
        teacher, top = (z if head.draft_ids is None else z[..., head.draft_ids]), jnp.argmax(z, -1)
    else:
        z, teacher, top = None, tf.teacher_logits(lm_head, at=at, ids=head.draft_ids), tf.top_tokens(lm_head, at=at)
    nxt = at + 1
    labels = jnp.take_along_axis(rows.tokens, jnp.minimum(nxt, R - 1), axis=1)
    return Scored(logits, teacher, z if full else None, head.target_ids(jnp.argmax(logits, -1)), top, labels,
                  label_mask(rows, nxt), nxt < R)


def target_embedding_loss_fn(draft_cfg: ModelConfig, target_cfg: ModelConfig, ce_weight: float, temperature: float,
                             first_label: int, *, d2t=None, max_span: int | None = None) -> Callable:
    """distill_loss_fn's loss for a draft reading the target's embedding, over label positions only: (1 -
    ce_weight) * KL(p_target || p_draft) at `temperature` + ce_weight * CE of the row's next token, each a mean
    over its labels. With a draft vocabulary d2t the teacher is the target's distribution restricted to it and
    renormalised, the KL counted where the target's top token is inside it and the CE where the label is (EAGLE-3's
    rule, train.losses.eagle). batch: [B, R] token rows (labels from first_label) or chat rows, optionally with
    cached target features (train.losses.common.target_features). max_span: the longest label span of any row
    (max_label_span): the head and the teacher then run over each row's label window only (label_window; the draft's
    layers still read every position), the same loss at the cost of the answers rather than of the batch's width.
    Metrics: kl, ce, top-1 agreement with the target's argmax (top1_agree), and with a draft vocabulary in_vocab (the
    share of labels whose target top token it holds)."""
    head = DraftHead.of(target_cfg.vocab_size, True, d2t)
    V = target_cfg.vocab_size
    in_vocab = None if d2t is None else jnp.asarray(t2d_from_d2t(d2t, V))
    to_draft = None if d2t is None else jnp.maximum(jnp.asarray(target_to_draft(d2t, V)), 0)   # outside: masked

    def loss_fn(params, batch, rng, target_params):
        del rng
        rows, tf = target_features(batch, first_label, target_params, target_cfg, logits=False)
        R = rows.tokens.shape[1]
        # position t predicts label t + 1: the window starts one position before each row's first label
        at = None if max_span is None or max_span >= R else label_window(rows, R, max_span, 1)[0]
        sc = _score(params, draft_cfg, head, rows, tf, target_params, at)
        kl = forward_kl(jax.nn.log_softmax(sc.teacher / temperature), jax.nn.log_softmax(sc.logits / temperature))
        d_logp = jax.nn.log_softmax(sc.logits)
        kl_on, ce_on, labels = sc.valid, sc.valid & sc.in_row, sc.labels
        metrics = {}
        if in_vocab is not None:
            kl_on, ce_on, labels = kl_on & in_vocab[sc.top], ce_on & in_vocab[labels], to_draft[labels]
            metrics["in_vocab"] = masked_mean(in_vocab[sc.top], sc.valid)
        ce = -jnp.take_along_axis(d_logp, labels[..., None], -1)[..., 0]
        kl, ce = masked_mean(kl, kl_on), masked_mean(ce, ce_on)
        metrics.update(kl=kl, ce=ce, top1_agree=masked_mean(sc.pred == sc.top, sc.valid))
        return (1 - ce_weight) * kl + ce_weight * ce, metrics
    return loss_fn


def draft_agreements(params: dict, target_params: dict, draft_cfg: ModelConfig, target_cfg: ModelConfig, rows,
                     first_label: int, num_steps: int = 4, d2t=None) -> ChainAgreement:
    """A draft reading the target's embedding at every committed length L of the rows, teacher-forced (one forward
    over the row's tokens): draft i + 1 from tokens[:L] is the draft's output at position L - 1 + i, a hit when its
    top token (with a draft vocabulary: as a target id) is the target's top token there, its acceptance 1 - TV
    against the target's distribution at temperature 1. A chain's draft i + 1 reads the row's tokens where the
    decode loop reads its own drafts 1..i, which are the same tokens wherever drafts 1..i were all hits on a row
    the target decoded greedily: there the chain agreement (ChainAgreement.counts) is exactly what greedy
    verification of a k-draft chain accepts from L. (Its per-position agreements, counts()' hits, are then the same
    teacher-forced agreement at every draft position, not the free-running drafts' marginal one.)"""
    head = DraftHead.of(target_cfg.vocab_size, True, d2t)
    rows = labeled(rows, first_label)
    tf = frozen_target_features(target_params, target_cfg, rows.tokens, logits=False)
    sc = _score(params, draft_cfg, head, rows, tf, target_params, full=True)
    B, R = rows.tokens.shape
    hit = sc.pred == sc.top                                                          # [B, R] per position p
    accept = acceptance_probability(sc.logits, sc.full, head.draft_ids)
    # entry [b, i, L] reads position p = L - 1 + i (L = 0..R); positions outside 0..R-1 are not drafts
    p = jnp.arange(R + 1)[None, :] - 1 + jnp.arange(num_steps)[:, None]              # [n, R + 1]
    inside = (p >= 0) & (p < R)
    at = lambda x: jnp.where(inside[None], x[:, jnp.clip(p, 0, R - 1)], jnp.zeros((), x.dtype))
    return ChainAgreement(at(hit), at(accept), at(sc.valid))
