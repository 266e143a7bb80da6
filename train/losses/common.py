"""What the drafter losses share: the frozen target's forward over whole rows, how a draft under training embeds and
projects (DraftHead), and the per-token terms (soft cross-entropy, forward KL, masked means)."""
from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.cache import KVCache
from specjax.drafters import draft_model
from specjax.drafters.base import target_weight
from specjax.drafters.draft_vocab import check_vocab_map, draft_to_target
from specjax.models.config import ModelConfig
from specjax.models.llama import ForwardOut, forward, kv_heads, lm_head
from train.data import FeatureRows, LabeledRows


class TargetFeatures(NamedTuple):
    logits: jax.Array | None           # [B, T, V] float32; None when read from a feature cache (teacher_logits
                                       # then computes what a loss asks for from hidden)
    hidden: jax.Array                  # [B, T, H] last hidden state after the final norm (what lm_head reads)
    layers: tuple[jax.Array, ...]      # the requested decoder layers' outputs [B, T, H], in the order asked
    top: jax.Array | None = None       # [B, T] int32 the target's argmax token (cached); None: argmax of logits

    def teacher_logits(self, lm_head: jax.Array, at: jax.Array | None = None,
                       ids: jax.Array | None = None) -> jax.Array:
        """The target's float32 logits [B, T|n, V|N]: at [B, n] picks positions first, ids (a draft vocabulary's
        target ids [N]) picks columns. From cached features it is the final hidden state through lm_head [H, V]
        (the target's own last step), restricted before the matmul so a loss pays only for what it reads."""
        if self.logits is not None:
            z = self.logits if at is None else jnp.take_along_axis(self.logits, at[..., None], axis=1)
            return z if ids is None else z[..., ids]
        h = self.hidden if at is None else jnp.take_along_axis(self.hidden, at[..., None], axis=1)
        w = lm_head if ids is None else lm_head[:, ids]
        return (h @ w.astype(h.dtype)).astype(jnp.float32)

    def top_tokens(self, lm_head: jax.Array | None = None, at: jax.Array | None = None) -> jax.Array:
        """[B, T] the target's argmax token at each position (at [B, n]: at those positions, [B, n]): cached, from
        the logits, or from the final hidden state through lm_head [H, V] where neither was kept."""
        if self.top is not None or self.logits is not None:
            top = self.top if self.top is not None else jnp.argmax(self.logits, -1)
            return top if at is None else jnp.take_along_axis(top, at, axis=1)
        if lm_head is None:
            raise ValueError("these target features keep no logits: pass the target's lm_head")
        return jnp.argmax(self.teacher_logits(lm_head, at=at), -1)


def causal_forward(params: dict, cfg: ModelConfig, tokens: jax.Array, **kw) -> ForwardOut:
    """llama.forward over whole sequences tokens [B, T] with a cache of exactly T slots (nothing persists past the
    call); keyword arguments go to forward (hidden_layers, depths, mask)."""
    B, T = tokens.shape
    cache = KVCache.init(cfg.num_layers, B, T, kv_heads(params, cfg), cfg.head_dim, params["final_norm"].dtype)
    return forward(params, cfg, tokens, cache, **kw)


def frozen_target_features(params: dict, cfg: ModelConfig, tokens: jax.Array, layers: Sequence[int] = (),
                           logits: bool = True) -> TargetFeatures:
    """The frozen target's full causal forward over tokens [B, T]: logits, final hidden state and the outputs of
    decoder `layers` (negative indices count from the top, like Python's), all under stop_gradient. What Medusa
    heads (final hidden), EAGLE-1 (final hidden + token), EAGLE-3 (low/mid/high layers) and MTP modules train on.
    logits=False: no [B, T, V] logits (a loss that reads the teacher at a few positions or over a draft vocabulary
    computes those from the final hidden state: TargetFeatures.teacher_logits, top_tokens)."""
    idx = [l % cfg.num_layers if -cfg.num_layers <= l < cfg.num_layers else None for l in layers]
    if None in idx:
        raise ValueError(f"layers {tuple(layers)} out of range for a {cfg.num_layers}-layer target")
    unique = tuple(sorted(set(idx)))
    # the head over one position only (what forward's logits_at gives), dropped
    at = None if logits else jnp.zeros((tokens.shape[0],), jnp.int32)
    out = causal_forward(params, cfg, tokens, hidden_layers=unique, logits_at=at)
    by_layer = dict(zip(unique, out.layer_hidden))
    return jax.lax.stop_gradient(TargetFeatures(out.logits if logits else None, out.hidden,
                                                tuple(by_layer[i] for i in idx)))


def target_features(batch, first_label: int, params: dict, cfg: ModelConfig, layers: Sequence[int] = (),
                    logits: bool = True) -> tuple[LabeledRows, TargetFeatures]:
    """A drafter loss's batch -> (its rows as LabeledRows, the frozen target's features over them): read from the
    batch when it carries them (train.data.FeatureRows: train.features computes them once per training set), else
    frozen_target_features over the rows."""
    if isinstance(batch, FeatureRows):
        missing = [l for l in layers if l not in batch.layers]
        if missing:
            raise ValueError(f"the cached batch has target layers {sorted(batch.layers)}, the loss needs {missing}")
        return batch.rows, TargetFeatures(None, batch.hidden, tuple(batch.layers[l] for l in layers), batch.top)
    rows = labeled(batch, first_label)
    return rows, frozen_target_features(params, cfg, rows.tokens, layers, logits)


class DraftHead(NamedTuple):
    """How a draft LM under training (a draft model, a PARD draft) embeds its tokens and projects its outputs
    (static: closed over by the loss): target_embedding, it reads the target's embedding (a TargetEmbeddingDraft or
    TargetEmbeddingPard) else its own; draft_ids, the target id of each entry of its own head over a draft
    vocabulary (int32 [N]) or None; vocab_size, the target's."""
    target_embedding: bool
    draft_ids: jax.Array | None
    vocab_size: int

    @staticmethod
    def of(vocab_size: int, target_embedding: bool = False, d2t=None) -> "DraftHead":
        if d2t is not None and not target_embedding:
            raise ValueError("a draft vocabulary (d2t) is for a draft reading the target's embedding")
        ids = None if d2t is None else jnp.asarray(draft_to_target(check_vocab_map(d2t, vocab_size, len(d2t),
                                                                                  "draft loss")), jnp.int32)
        return DraftHead(target_embedding, ids, vocab_size)

    def forward_params(self, params: dict, target_params: dict) -> dict:
        """The draft's params as llama.forward reads them: a draft reading the target's embedding gets it, and
        without its own head the target's output head, as the drafter does at decode time
        (specjax.drafters.draft_model.forward_params)."""
        if not self.target_embedding:
            return params
        return draft_model.forward_params(params, {n: target_weight(target_params, n, self.vocab_size)
                                                   for n in ("embed", "output_head")})

    def logits(self, params: dict, target_params: dict, hidden: jax.Array) -> jax.Array:
        """Final-normed hidden [..., H] -> float32 logits [..., N | V] (the draft vocabulary's, else the target's
        vocabulary: an own-vocabulary draft's extra columns, PARD's masks, cut off)."""
        return lm_head(self.forward_params(params, target_params), hidden)[..., :self.vocab_size]

    def target_ids(self, draft_tokens: jax.Array) -> jax.Array:
        return draft_tokens if self.draft_ids is None else self.draft_ids[draft_tokens]


def sample_anchors(rng: jax.Array, rows: LabeledRows, num: int) -> jax.Array:
    """[B, num] anchors (context ends) drawn uniformly, with replacement, over the positions a whose next token is
    a label: first_label - 1 <= a <= end - 2 (end = min(label_end, R))."""
    B, R = rows.tokens.shape
    lo = jnp.maximum(rows.first_label - 1, 0)
    hi = jnp.maximum(jnp.minimum(rows.label_end, R) - 2, lo)
    u = jax.random.uniform(rng, (B, num))
    return (lo[:, None] + jnp.floor(u * (hi - lo + 1)[:, None])).astype(jnp.int32)


def soft_ce(logits: jax.Array, probs: jax.Array) -> jax.Array:
    """-sum_v p_v log softmax(logits)_v: [..., V] -> [...]."""
    return -jnp.sum(probs * jax.nn.log_softmax(logits.astype(jnp.float32)), axis=-1)


def forward_kl(target_logp: jax.Array, draft_logp: jax.Array) -> jax.Array:
    """KL(p_target || p_draft) per token from log-probabilities [..., V] -> [...]: the divergence speculative
    sampling rewards (acceptance = 1 - TV(p, q))."""
    return jnp.sum(jnp.exp(target_logp) * (target_logp - draft_logp), axis=-1)


def labeled(batch, first_label: int) -> LabeledRows:
    """A batch as LabeledRows: LabeledRows as they are; plain token rows [B, R] with the recipe's fixed first_label
    and label_end R + 1."""
    if isinstance(batch, LabeledRows):
        return batch
    B, R = batch.shape
    return LabeledRows(batch, jnp.full((B,), first_label, jnp.int32), jnp.full((B,), R + 1, jnp.int32))


def label_mask(rows: LabeledRows, label_index: jax.Array) -> jax.Array:
    """[B, n] bool: whether the token at row index label_index ([n] or [B, n]; past the row allowed) is a label."""
    return (label_index >= rows.first_label[:, None]) & (label_index < rows.label_end[:, None])


def label_window(rows: LabeledRows, length: int, size: int, lead: int) -> tuple[jax.Array, LabeledRows]:
    """The `size` input positions of each row that a loss reading labels from `lead` positions back needs: from
    lead before the row's first label (moved left where the window would pass `length` inputs). A chat row's label
    span (its answer) is a fraction of the batch's width (cut to its longest prompt plus answer), so a loss whose
    cost is per position (a full-vocabulary head) pays only for the window.
    -> (at [B, size]: the window's positions among the inputs, the rows re-indexed to the window: tokens
    [B, size + 1] (the token after the window's last input included, the label it predicts), spans shifted)."""
    if not 0 < size <= length:
        raise ValueError(f"label_window: size {size} must be in 1..{length} (the inputs)")
    start = jnp.clip(rows.first_label - lead, 0, length - size)                    # [B]
    at = start[:, None] + jnp.arange(size)                                         # [B, size]
    tokens = jnp.take_along_axis(rows.tokens, jnp.concatenate([at, at[:, -1:] + 1], axis=1), axis=1)
    return at, LabeledRows(tokens, rows.first_label - start, rows.label_end - start)


def max_label_span(rows, first_label: int = 0) -> int:
    """The longest label span of rows (LabeledRows: label_end - first_label; a plain [N, R] array: labels from
    first_label through the prediction past the row's end)."""
    if isinstance(rows, LabeledRows):
        return int(np.max(np.asarray(rows.label_end) - np.asarray(rows.first_label)))
    return rows.shape[1] + 1 - first_label


def acceptance_probability(draft_logits: jax.Array, target_logits: jax.Array,
                           draft_ids: jax.Array | None = None) -> jax.Array:
    """Speculative sampling's chance of accepting a draft drawn from the drafter's distribution, sum_x min(p_x, q_x)
    = 1 - TV(p, q), per position at temperature 1: draft_logits [..., N|V] (N: over a draft vocabulary whose target
    ids are draft_ids [N]), target_logits [..., V] -> [...]."""
    q = jax.nn.softmax(draft_logits.astype(jnp.float32), -1)
    logp = jax.nn.log_softmax(target_logits.astype(jnp.float32), -1)
    if draft_ids is not None:
        logp = logp[..., draft_ids]
    return jnp.sum(jnp.minimum(jnp.exp(logp), q), -1)


class ChainAgreement(NamedTuple):
    """A chain drafter's teacher-forced drafts at every committed length of rows [B, R], what the training eval
    scores and what a greedy decode loop's step from that length drafts: entry [b, i, L] is draft i + 1 from the
    context tokens[b, :L] (it drafts token L + i)."""
    agree: jax.Array           # [B, n, R + 1] bool: the drafter's top token is the target's top token there
    accept: jax.Array          # [B, n, R + 1] float32: 1 - TV(target, drafter) there (temperature-1 acceptance)
    valid: jax.Array           # [B, n, R + 1] bool: token L + i is a label and the drafter could draft it

    def counts(self) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """(hits [n], labels [n]) per draft position and (chain_hits [n], chains) over the lengths whose n drafts
        are all labels (chain_hits[i]: drafts 1..i + 1 all agree): train.self_distill.chain_metrics reads them."""
        hits = jnp.sum(self.agree & self.valid, (0, 2))
        chain_valid = jnp.all(self.valid, 1)                                          # [B, R + 1]
        chain_ok = jnp.cumprod(self.agree, 1).astype(bool) & chain_valid[:, None]
        return hits, jnp.sum(self.valid, (0, 2)), jnp.sum(chain_ok, (0, 2)), jnp.sum(chain_valid)


def masked_mean(x: jax.Array, w: jax.Array) -> jax.Array:
    """Mean of x over the entries where w is set (0 when none is)."""
    w = w.astype(jnp.float32)
    return jnp.sum(x * w) / jnp.maximum(jnp.sum(w), 1.0)
