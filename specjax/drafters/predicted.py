"""Predicted outputs (OpenAI "Predicted Outputs"): the user supplies the text they expect the model to produce;
the drafter proposes the next k tokens of that prediction from a pointer that follows the generated text.

When the output diverges from the prediction the pointer re-synchronises on the earliest place at or after it
where the prediction contains the last n generated tokens (n from max down to min); with no such place it simply
moves on by the number of tokens generated (a substitution). Exactness never depends on the prediction.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.drafters.base import Context, Draft, last_tokens
from specjax.drafters.ngram import continuation, match_ends
from specjax.drafters.registry import BuildRequest, DrafterSpec, register
from specjax.inputs import encode_all, right_pad


@dataclasses.dataclass(frozen=True)
class PredictedDrafter:
    k: int
    min_n: int = 1
    max_n: int = 3
    target_layers = ()                # reads nothing of the target but its tokens
    target_weights = ()

    # params = (prediction [B, Lp] int32, prediction_length [B]); state = pointer [B]

    def _sync(self, params, ctx: Context, expected: jax.Array) -> jax.Array:
        pred, pred_len = params
        generated = ctx.length - ctx.prompt_length
        pointer = expected
        synced = jnp.zeros_like(expected, bool)
        for n in range(self.max_n, self.min_n - 1, -1):
            query = last_tokens(ctx, n)                                              # [B, n]
            hits = jax.vmap(match_ends)(pred, pred_len + 1, query)                    # [B, Lp]: ends e
            ends = jnp.arange(pred.shape[1])[None, :]
            ok = hits & (ends >= expected[:, None]) & (generated[:, None] >= n)
            first = jnp.min(jnp.where(ok, ends, pred.shape[1]), axis=1)
            take = ~synced & (first < pred.shape[1])
            pointer = jnp.where(take, first, pointer)
            synced |= take
        return pointer

    def init(self, params, ctx, target_out, sp):
        pred, _ = params
        first = last_tokens(ctx, 1)[:, 0]
        on_track = pred[:, 0] == first
        return jnp.where(on_track, 1, self._sync(params, ctx, jnp.ones_like(first)))

    def propose(self, params, pointer, ctx, keys, sp):
        pred, pred_len = params
        draft = jax.vmap(lambda p, l, s: continuation(p, l, s, self.k))(pred, pred_len, pointer)
        proposed = jnp.clip(pred_len - pointer, 0, self.k).astype(jnp.int32)     # [B] prediction left
        return Draft(draft.astype(jnp.int32), num_drafted=proposed), pointer

    def commit(self, params, pointer, ctx: Context, num_accepted, target_out, verified):
        pred, pred_len = params
        expected = pointer + num_accepted + 1
        bonus = last_tokens(ctx, 1)[:, 0]
        on_track = jnp.take_along_axis(pred, jnp.clip(expected - 1, 0, pred.shape[1] - 1)[:, None], 1)[:, 0] == bonus
        return jnp.where(on_track, expected, self._sync(params, ctx, expected))


def _build(req: BuildRequest):
    preds = req.drafter
    if preds is None or isinstance(preds, (str, bytes)) or not hasattr(preds, "__len__") \
            or len(preds) != len(req.prompts):
        raise ValueError(f"method='predicted' needs drafter=<one prediction per prompt> ({len(req.prompts)} "
                         "prompts): a list of strings or token-id lists")
    ids = encode_all(req.target, preds, "prediction")
    arr = right_pad(ids, -(-max(map(len, ids)) // 16) * 16)
    lo, hi = (req.config.prompt_lookup_min or 1), (req.config.prompt_lookup_max or 3)
    return PredictedDrafter(req.config.k, lo, max(lo, hi)), (jnp.asarray(arr), jnp.asarray([len(p) for p in ids], jnp.int32))


register(DrafterSpec("predicted", _build, accepts="one prediction (string or token ids) per prompt",
                     reads=("prompt_lookup_min", "prompt_lookup_max"), per_request_params=True))
