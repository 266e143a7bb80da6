"""What a PARD draft is and how one is made: a Llama with mask tokens appended to the target's vocabulary
(PardModel; made from a Llama by add_mask_rows and mask_tokenizer), or a draft of decoder layers that reads the
target's embedding (TargetEmbeddingPard; init_target_embedding)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from tokenizers import AddedToken, Tokenizer

from specjax.drafters.base import target_weight
from specjax.drafters.draft_model import init_from_target
from specjax.models.config import ModelConfig
from specjax.models.model import Model


KIND = "pard"
MASK_TOKEN = "<|pard_mask_{}|>"
CONFIG_KEY = "pard_mask_token_ids"


@dataclasses.dataclass
class PardModel:
    """A loaded PARD draft: the Llama (a specjax Model, vocabulary = the target's + the masks) and its mask ids,
    mask_token_ids[j] standing for the (j + 1)-th position after the context."""
    model: "Model"
    mask_token_ids: tuple[int, ...]


@dataclasses.dataclass
class TargetEmbeddingPard:
    """A loaded PARD draft that embeds tokens with the target's embedding: its decoder layers, final norm and mask
    embedding rows (params: layers, final_norm, mask_embed [m, H], and lm_head [H, N] with a draft vocabulary);
    config describes its layers (hidden = the target's, vocab_size = the target's V). Mask j is token id V + j, as
    in a PardModel, so the drafter feeds the same block either way."""
    config: ModelConfig
    params: dict
    name: str = ""
    d2t: np.ndarray | None = None     # the draft vocabulary map (int64 [N]; target id = draft id + d2t), or None

    @property
    def mask_token_ids(self) -> tuple[int, ...]:
        V = self.config.vocab_size
        return tuple(range(V, V + int(self.params["mask_embed"].shape[0])))

    @property
    def draft_vocab_size(self) -> int | None:
        return None if self.d2t is None else len(self.d2t)


def init_target_embedding(target, num_layers: int, num_masks: int, *, from_layers: tuple[int, ...] | None = None,
                          d2t=None, seed: int = 0) -> TargetEmbeddingPard:
    """A TargetEmbeddingPard to train: a draft model reading the target's embedding as
    specjax.drafters.draft_model.init_from_target makes one (its layers copies of the target's layers from_layers,
    default the first num_layers, or random with from_layers=(); the target's final norm; with d2t an own head from
    the target's LM-head columns), and every mask row the mean embedding."""
    draft = init_from_target(target, num_layers, from_layers=from_layers, d2t=d2t, seed=seed)
    embed = jnp.asarray(target_weight(target.params, "embed"), jnp.float32)
    params = dict(draft.params, mask_embed=jnp.broadcast_to(jnp.mean(embed, 0), (num_masks, draft.config.hidden_size)))
    return TargetEmbeddingPard(draft.config, params, "", draft.d2t)


def mask_tokenizer(tokenizer, num_masks: int):
    """A copy of a tokenizers.Tokenizer with num_masks special mask tokens appended -> (tokenizer, their ids).
    The ids must follow the existing vocabulary, or they would not line up with the appended embedding rows."""
    tok = Tokenizer.from_str(tokenizer.to_str())
    n = tok.get_vocab_size(with_added_tokens=True)
    tok.add_special_tokens([AddedToken(MASK_TOKEN.format(j), special=True) for j in range(num_masks)])
    ids = tuple(tok.token_to_id(MASK_TOKEN.format(j)) for j in range(num_masks))
    if ids != tuple(range(n, n + num_masks)):
        raise ValueError(f"mask tokens got ids {ids}, expected {n}..{n + num_masks - 1} (a mask token string "
                         "already in the vocabulary?)")
    return tok, ids


def add_mask_rows(params: dict, cfg: ModelConfig, num_masks: int,
                  rows: jax.Array | None = None) -> tuple[dict, ModelConfig]:
    """Extend a Llama's vocabulary by num_masks entries: embedding rows `rows` [m, H] (default: the mean embedding,
    a neutral start that the masks' positions then tell apart), zero LM-head columns when untied (never read:
    drafts are cut to the old vocabulary) -> (params, config)."""
    embed = params["embed"]
    if rows is None:
        rows = jnp.broadcast_to(jnp.mean(embed.astype(jnp.float32), 0), (num_masks, embed.shape[1]))
    out = dict(params, embed=jnp.concatenate([embed, jnp.asarray(rows, embed.dtype)], 0))
    if "lm_head" in params:
        out["lm_head"] = jnp.pad(params["lm_head"], ((0, 0), (0, num_masks)))
    return out, dataclasses.replace(cfg, vocab_size=cfg.vocab_size + num_masks)
