"""PARD parallel-draft losses (specjax.drafters.pard): a draft model that predicts k tokens in one forward, the
real tokens followed by k - 1 mask tokens, distilled from the frozen target."""
from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from specjax.models.config import ModelConfig
from train.losses.common import causal_forward, forward_kl, frozen_target_features, masked_mean

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
    out = causal_forward(params, cfg, tokens, depths=positions, mask=pard_stream_mask(ends, T, k))
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
        kl = forward_kl(t_logp, d_logp)
        ce = -jnp.take_along_axis(d_logp, labels[..., None], -1)[..., 0]
        agree = jnp.argmax(d_logits, -1) == jnp.argmax(t_logp, -1)
        return masked_mean((1 - ce_weight) * kl + ce_weight * ce, valid), masked_mean(agree, valid)

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
