"""PARD parallel-draft losses (specjax.drafters.pard): a draft model that predicts k tokens in one forward, the
real tokens followed by k - 1 mask tokens, distilled from the frozen target. The draft is a PardModel's Llama (its
own vocabulary + the masks) or a TargetEmbeddingPard's layers (the target's embedding; the target's LM head or an
own head over a draft vocabulary); rows are plain token rows (a fixed first label) or chat rows with their label
spans, with the target's features computed here or read from the feature cache (train.losses.common)."""
from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from specjax.drafters.base import target_weight
from specjax.drafters.draft_vocab import t2d_from_d2t, target_to_draft
from specjax.drafters.pard import embed_tokens
from specjax.models.config import ModelConfig
from train.losses.common import DraftHead, causal_forward, forward_kl, frozen_target_features, label_mask, \
    labeled, masked_mean, sample_anchors, target_features

# Parallel drafting (specjax.drafters.pard) trained in one forward per batch, no per-cut-point copies. The inputs
# x_0..x_{T-1} are stream 0 (ordinary next-token prediction); for each of n context ends c_i, stream j = 1..k-1
# holds mask token j at RoPE position c_i + j: "the j-th mask after a context ending at c_i", predicting token
# c_i + j + 1. Every context end c = 0..T-1 gives the brief's dense form (stream j at every position p = c + j);
# a random subset of them (PARD's conditional drop-token idea, in the simplest form that keeps every mask's own
# context: a context end keeps all its masks or none) makes the mask streams n / T as expensive. Each row draws its
# own context ends (chat rows' answers start at different positions).


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


def pard_stream_hidden(params: dict, cfg: ModelConfig, inputs: jax.Array, mask_token_ids: Sequence[int], k: int,
                       ends: jax.Array | None = None, head: DraftHead | None = None,
                       target_params: dict | None = None) -> tuple[jax.Array, jax.Array]:
    """inputs [B, T] (real tokens), ends [n] or [B, n] context ends (default: all T) -> final-normed hidden states
    (stream 0 [B, T, H], masks [B, k - 1, n, H]): [:, j - 1, i] drafts token ends[i] + j + 1 from the context
    x_0..x_{ends[i]} followed by masks 1..j. head / target_params: a TargetEmbeddingPard's (the target's embedding)."""
    B, T = inputs.shape
    ends = jnp.broadcast_to(jnp.arange(T) if ends is None else ends, (B, T if ends is None else ends.shape[-1]))
    n = ends.shape[1]
    masks = jnp.repeat(jnp.asarray(mask_token_ids[:k - 1], jnp.int32), n)                   # [(k-1) n]
    tokens = jnp.concatenate([inputs, jnp.broadcast_to(masks, (B, (k - 1) * n))], axis=1)   # [B, P]
    positions = jnp.concatenate([jnp.broadcast_to(jnp.arange(T), (B, T))]
                                + [ends + j for j in range(1, k)], axis=1)                   # [B, P]
    mask = jax.vmap(lambda e: pard_stream_mask(e, T, k))(ends)                              # [B, P, P]
    embeds, fparams = None, params
    if head is not None and head.target_embedding:
        embeds = embed_tokens(params["mask_embed"], target_weight(target_params, "embed", head.vocab_size), tokens)
        fparams = head.forward_params(params, target_params)
    # the forward's own logits are unused (XLA drops them): the head runs where a loss reads it
    hidden = causal_forward(fparams, cfg, tokens, depths=positions, mask=mask, input_embeds=embeds).hidden
    return hidden[:, :T], hidden[:, T:].reshape(B, k - 1, n, hidden.shape[-1])


def pard_stream_logits(params: dict, cfg: ModelConfig, inputs: jax.Array, mask_token_ids: Sequence[int], k: int,
                       vocab_size: int, ends: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """An own-vocabulary draft's pard_stream_hidden through its head, cut to the target's vocab_size: (stream 0
    logits [B, T, V], mask logits [B, k - 1, n, V])."""
    head = DraftHead.of(vocab_size)
    real, masks = pard_stream_hidden(params, cfg, inputs, mask_token_ids, k, ends)
    return head.logits(params, None, real), head.logits(params, None, masks)


def _at(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x [B, R, ...] at per-row positions idx [B, ...] -> [B, ..., ...]."""
    B = x.shape[0]
    flat = idx.reshape(B, -1)
    out = jnp.take_along_axis(x, flat.reshape(flat.shape + (1,) * (x.ndim - 2)), axis=1)
    return out.reshape(idx.shape + x.shape[2:])


class Scored(NamedTuple):
    """One draft position at a set of context ends c [B, m]: what the losses and the held-out counts read."""
    logits: jax.Array          # [B, m, N | V] the draft's
    teacher: jax.Array         # [B, m, N | V] the target's for the same token (at the draft vocabulary's ids)
    pred: jax.Array            # [B, m] the draft's top token as a target id
    top: jax.Array             # [B, m] the target's top token
    labels: jax.Array          # [B, m] the row's token there
    valid: jax.Array           # [B, m] whether that token is a label inside the row


def _score(params, head: DraftHead, rows, tf, target_params, hidden: jax.Array, ends: jax.Array, j: int) -> Scored:
    """Draft j + 1 (token c + j + 1) from final-normed hidden [B, m, H] at context ends ends [B, m]."""
    R = rows.tokens.shape[1]
    logits = head.logits(params, target_params, hidden)
    at = jnp.minimum(ends + j, R - 1)                                    # z_{c+j} predicts token c + j + 1
    teacher = tf.teacher_logits(target_weight(target_params, "lm_head", head.vocab_size), at=at, ids=head.draft_ids)
    label_at = ends + j + 1
    valid = label_mask(rows, label_at) & (label_at < R)
    labels = jnp.take_along_axis(rows.tokens, jnp.minimum(label_at, R - 1), axis=1)
    top = jnp.take_along_axis(tf.top_tokens(), at, axis=1)
    return Scored(logits, teacher, head.target_ids(jnp.argmax(logits, -1)), top, labels, valid)


def _streams(params, cfg, head: DraftHead, mask_token_ids, k, rows, tf, ends, target_params,
             real_at: jax.Array | None = None) -> list[Scored]:
    """Every draft position: [draft 1 at context ends real_at (default ends), drafts 2..k at ends], ends [B, n]."""
    real, masks = pard_stream_hidden(params, cfg, rows.tokens[:, :-1], mask_token_ids, k, ends, head, target_params)
    real_at = ends if real_at is None else real_at
    first = jnp.take_along_axis(real, real_at[..., None], axis=1)                            # [B, m, H]
    return ([_score(params, head, rows, tf, target_params, first, real_at, 0)]
            + [_score(params, head, rows, tf, target_params, masks[:, j - 1], ends, j) for j in range(1, k)])


def pard_loss_fn(draft_cfg: ModelConfig, target_cfg: ModelConfig, mask_token_ids: Sequence[int], k: int,
                 ce_weight: float, first_label: int = 1, num_ends: int | None = None, *,
                 target_embedding: bool = False, d2t=None) -> Callable:
    """Per draft position j (stream 0 = draft 1, mask stream j: at num_ends context ends drawn per row and step,
    every position when None), mean over label positions of (1 - ce_weight) * KL(p_target || p_draft) +
    ce_weight * CE (the default draft's distillation loss), the teacher the frozen target's next-token distribution
    for the same token; positions weighted equally. target_embedding: a TargetEmbeddingPard (d2t: its draft
    vocabulary, trained toward the target's distribution over those tokens where the target's top token is one of
    them, EAGLE-3's rule; its CE where the label is). batch: [B, R] token rows (labels from first_label) or chat
    rows, optionally with cached features. Metrics per position: loss and top-1 agreement with the target's
    argmax."""
    head = DraftHead.of(target_cfg.vocab_size, target_embedding, d2t)
    V = target_cfg.vocab_size
    in_vocab = None if d2t is None else jnp.asarray(t2d_from_d2t(d2t, V))
    to_draft = None if d2t is None else jnp.maximum(jnp.asarray(target_to_draft(d2t, V)), 0)   # outside: masked

    def loss_fn(params, batch, rng, target_params):
        rows, tf = target_features(batch, first_label, target_params, target_cfg)
        B, R = rows.tokens.shape
        every = jnp.broadcast_to(jnp.arange(R - 1), (B, R - 1))
        ends = every if num_ends is None else sample_anchors(rng, rows, num_ends)                # [B, n]
        metrics, total = {}, 0.0
        # draft 1 (stream 0) is scored at every position, the masks at the drawn ends
        for j, sc in enumerate(_streams(params, draft_cfg, head, mask_token_ids, k, rows, tf, ends, target_params,
                                        real_at=every)):
            d_logp = jax.nn.log_softmax(sc.logits)
            kl = forward_kl(jax.nn.log_softmax(sc.teacher), d_logp)
            kl_on, ce_on, labels = sc.valid, sc.valid, sc.labels
            if in_vocab is not None:
                kl_on, ce_on, labels = sc.valid & in_vocab[sc.top], sc.valid & in_vocab[labels], to_draft[labels]
            ce = -jnp.take_along_axis(d_logp, labels[..., None], -1)[..., 0]
            lj = (1 - ce_weight) * masked_mean(kl, kl_on) + ce_weight * masked_mean(ce, ce_on)
            metrics[f"loss{j}"], metrics[f"acc{j}"] = lj, masked_mean(sc.pred == sc.top, sc.valid)
            total = total + lj
        return total / k, metrics
    return loss_fn


def pard_accuracy(params: dict, target_params: dict, draft_cfg: ModelConfig, target_cfg: ModelConfig, rows,
                  mask_token_ids: Sequence[int], k: int, first_label: int = 1, *, stride: int = 1,
                  target_embedding: bool = False, d2t=None):
    """Held-out counts of a k-token parallel draft at context ends every `stride` positions of each row's label
    span (rows [B, R] token rows from first_label, or chat rows), teacher-forced: the row's tokens are the context.
    Draft j + 1 of context end c agrees when its argmax is the target's argmax for token c + j + 1. Returns (hits
    [k], labels [k]): per-draft-position top-1 agreement counts; (chain_hits [k], chains): over context ends whose k
    labels are all inside the span, chain_hits[i] counts those where drafts 1..i+1 all agree -- on rows the target
    decoded greedily exactly what greedy verification accepts, so sum(chain_hits[:m]) / chains is the expected
    accepted length of an m-token parallel draft."""
    rows = labeled(rows, first_label)
    B, R = rows.tokens.shape
    head = DraftHead.of(target_cfg.vocab_size, target_embedding, d2t)
    tf = frozen_target_features(target_params, target_cfg, rows.tokens)
    n = -(-(R - 1) // stride)
    ends = jnp.minimum(jnp.maximum(rows.first_label - 1, 0)[:, None] + stride * jnp.arange(n)[None, :], R - 2)
    scored = _streams(params, draft_cfg, head, mask_token_ids, k, rows, tf, ends, target_params)
    # an end clipped onto an earlier one's position would count twice
    fresh = jnp.concatenate([jnp.ones((B, 1), bool), ends[:, 1:] > ends[:, :-1]], axis=1)[:, None, :]
    valid = jnp.stack([sc.valid for sc in scored], 1) & fresh                                   # [B, k, n]
    agree = jnp.stack([sc.pred == sc.top for sc in scored], 1)
    chain_valid = valid[:, 0] & valid[:, -1]
    all_ok = jnp.cumprod(agree, axis=1).astype(bool)
    return (jnp.sum(agree & valid, axis=(0, 2)), jnp.sum(valid, axis=(0, 2)),
            jnp.sum(all_ok & chain_valid[:, None], axis=(0, 2)), jnp.sum(chain_valid))
