"""PARD (parallel drafting): a small LM that fills k draft positions in ONE forward from mask placeholders.

The draft is an ordinary Llama whose vocabulary is the target's V tokens plus m reserved mask tokens appended after
them (ids V .. V + m - 1, special tokens of its tokenizer, listed in config.json as `pard_mask_token_ids`). One
proposal is one draft forward over

    [committed tokens not yet in the draft cache, as a fixed-width block of k + 1] + [mask_1 .. mask_{k-1}]

with the masks at the k - 1 positions after the last committed token, attending causally (the committed context
and earlier masks). The output at the last committed token is draft 1 (ordinary next-token prediction); the output
at mask j is draft j + 1. Logits are cut to the target's V before argmax / sampling, so a mask token is never
proposed; sampled drafts are drawn independently per position through specjax.sampling.probabilities and returned
with their distributions q, which keeps chain speculative sampling exact (draft j + 1 does not depend on draft j,
so its q is its marginal).

KV cache under partial acceptance: only committed tokens are kept. After a proposal the cache holds every
committed token at slot = position (the block re-writes entries that were already there with identical contents);
the mask entries lie past the committed length and are overwritten by the next proposal. A step commits at most
k + 1 new tokens, so a block of width k + 1 always reaches back to the first uncached one: one forward of 2k
positions per step, against k sequential steps for a draft_model drafter. While a row has fewer committed tokens
than the block is wide, the block starts at 0 and runs past the last committed token into stale slots; the masks
are then placed by explicit positions and an explicit attention mask that hides those slots.
"""
from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
from tokenizers import AddedToken, Tokenizer

from specjax.cache import KVCache
from specjax.drafters import artifacts
from specjax.drafters.base import Context, Draft, pick_block
from specjax.drafters.draft_model import DraftModelDrafter, check_same_vocabulary, llama_param_specs, \
    prepare_llama_params
from specjax.drafters.registry import BuildRequest, DrafterSpec, register
from specjax.checkpoints import resolve
from specjax.models.config import ModelConfig
from specjax.models.hf_io import load_pretrained, save_pretrained
from specjax.models.llama import forward
from specjax.models.model import Model
from specjax.sampling import SamplingParams

MASK_TOKEN = "<|pard_mask_{}|>"
CONFIG_KEY = "pard_mask_token_ids"


@dataclasses.dataclass
class PardModel:
    """A loaded PARD draft: the Llama (a specjax Model, vocabulary = the target's + the masks) and its mask ids,
    mask_token_ids[j] standing for the (j + 1)-th position after the context."""
    model: "Model"
    mask_token_ids: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class PardDrafter:
    k: int
    config: ModelConfig               # the draft's (vocab_size = the target's + the masks)
    vocab_size: int                   # the target's: draft logits are cut to it
    mask_token_ids: tuple[int, ...]   # the k - 1 masks this drafter feeds
    cache_size: int
    implementation: str = "xla"
    target_layers = ()                # reads nothing of the target but its tokens
    target_weights = ()

    def init(self, params, ctx: Context, target_out, sp) -> KVCache:
        """The draft's prefill over the prompt, as a draft model's (the masks are only ever fed by propose)."""
        return DraftModelDrafter.init(self, params, ctx, target_out, sp)

    def draft_logits(self, params, cache: KVCache, ctx: Context) -> tuple[jax.Array, KVCache]:
        """The one draft forward -> (logits [B, k, V] of drafts 1..k, cut to the target's vocabulary; the cache
        holding every committed token, lengths = ctx.length)."""
        k, w = self.k, self.k + 1
        B = ctx.tokens.shape[0]
        start = jnp.maximum(ctx.length - w, 0)                                          # [B]
        block = jnp.take_along_axis(ctx.tokens, start[:, None] + jnp.arange(w), axis=1)  # [B, w]
        root = ctx.length - 1 - start                         # [B] the last committed token's index in the block
        masks = jnp.broadcast_to(jnp.asarray(self.mask_token_ids, jnp.int32), (B, k - 1))
        tokens = jnp.concatenate([block, masks], axis=1)                                 # [B, 2k]
        # Mask j sits at position length + j whatever the block held past the root.
        depths = jnp.concatenate([jnp.broadcast_to(jnp.arange(w), (B, w)),
                                  root[:, None] + 1 + jnp.arange(k - 1)], axis=1)         # [B, 2k]
        q = jnp.arange(w + k - 1)[:, None]                                               # query index
        c = jnp.arange(w + k - 1)[None, :]                                               # key index
        # Block rows: causal. Mask rows: the block up to the root (never the stale slots past it), then the
        # masks up to themselves.
        mask = jnp.where(q < w, c <= q, (c <= root[:, None, None]) | ((c >= w) & (c <= q)))  # [B, 2k, 2k]
        out = forward(params, self.config, tokens, cache.replace(lengths=start), depths=depths, mask=mask,
                      implementation=self.implementation)
        logits = out.logits[..., :self.vocab_size]                                       # [B, 2k, V]
        first = jnp.take_along_axis(logits, root[:, None, None], axis=1)                 # [B, 1, V]
        return jnp.concatenate([first, logits[:, w:]], axis=1), out.cache.replace(lengths=ctx.length)

    def propose(self, params, cache: KVCache, ctx: Context, keys, sp: SamplingParams):
        logits, cache = self.draft_logits(params, cache, ctx)                           # [B, k, V]
        tokens, probs, confidence = pick_block(logits, keys, sp)                       # [B, k, ...]
        return Draft(tokens, probs, confidence=confidence), cache

    def commit(self, params, cache, ctx, num_accepted, target_out, verified):
        return cache                      # the next proposal's block feeds whatever was committed


# ---------------------------------------------------------------------------------------------- artifacts

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


def save(path: str | os.PathLike, params: dict, cfg: ModelConfig, mask_token_ids, tokenizer=None,
         manifest: str | None = None, dtype: str = "bfloat16") -> None:
    """Write a PARD draft as an HF Llama directory (tokenizer.json with the masks as special tokens), config.json
    also recording pard_mask_token_ids and specjax_drafter = "pard" (so load_model and available_drafters know
    it is a drafter)."""
    path = os.fspath(path)
    save_pretrained(jax.device_get(params), cfg, path, tokenizer=tokenizer, dtype=dtype)
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        hf = json.load(f)
    hf.update({CONFIG_KEY: [int(i) for i in mask_token_ids], "specjax_drafter": "pard"})
    with open(cfg_path, "w") as f:
        json.dump(hf, f, indent=2, sort_keys=True)
    if manifest is not None:
        with open(os.path.join(path, artifacts.MANIFEST_NAME), "w") as f:
            f.write(manifest)


def load(path_or_name: str | os.PathLike, dtype=jnp.float32) -> PardModel:
    """A PARD draft directory or shipped name -> PardModel; refuses a directory without mask tokens."""
    path = resolve(path_or_name, "drafter")
    with open(os.path.join(path, "config.json")) as f:
        ids = json.load(f).get(CONFIG_KEY)
    if not ids or not isinstance(ids, list):
        raise ValueError(f"{path} is not a PARD draft: its config.json has no {CONFIG_KEY} (a PARD draft's "
                         "vocabulary is the target's plus reserved mask tokens; train one with train.pard)")
    params, cfg, tokenizer = load_pretrained(path, dtype=dtype)
    if tokenizer is not None:
        added = tokenizer.get_added_tokens_decoder()                                   # id -> AddedToken
        missing = [i for i in ids if i not in added or not added[i].special]
        if missing:
            raise ValueError(f"PARD draft {path}: mask token ids {missing} of {CONFIG_KEY} are not special tokens "
                             "of its tokenizer.json (the masks must be added tokens, never produced by encoding "
                             "text)")
    return PardModel(Model(cfg, params, tokenizer, os.path.basename(os.path.normpath(path))),
                     tuple(int(i) for i in ids))


def check(target, pard: PardModel, k: int) -> None:
    """ValueError naming the problem when `pard` cannot draft k tokens for `target`."""
    ids, V, name = pard.mask_token_ids, target.config.vocab_size, pard.model.name
    if not ids:
        raise ValueError(f"PARD draft {name!r} has no mask tokens")
    if len(set(ids)) != len(ids):
        raise ValueError(f"PARD draft {name!r}: repeated mask token ids {list(ids)}")
    check_same_vocabulary(target, pard.model, extra_tokens=len(ids))
    outside = [i for i in ids if not V <= i < pard.model.config.vocab_size]
    if outside:
        raise ValueError(f"PARD draft {name!r}: mask token ids {outside} are not among the ids appended after the "
                         f"target's {V} tokens ({V}..{pard.model.config.vocab_size - 1})")
    if k - 1 > len(ids):
        raise ValueError(f"PARD draft {name!r} was trained with {len(ids)} mask tokens, so it drafts at most "
                         f"{len(ids) + 1} tokens per step; num_speculative_tokens={k} needs {k - 1}")


def _load(target: Model, path_or_name: str) -> PardModel:
    return load(path_or_name)


def _build(req: BuildRequest):
    pard = req.drafter
    if pard is None:
        raise TypeError("method='pard' needs drafter=<a PARD draft directory, a shipped name such as "
                        "'stdlib-draft-pard', or specjax.drafters.pard.load(...)>, got None")
    k = req.config.k
    check(req.target, pard, k)
    # 2k extra slots: a block that starts at 0 for a short row can reach past the target's buffer.
    return PardDrafter(k, pard.model.config, req.target.config.vocab_size, pard.mask_token_ids[:k - 1],
                       req.buffer_len + 2 * k, req.config.implementation), pard.model.params


register(DrafterSpec("pard", _build, accepts="a PARD draft directory, shipped name or pard.load(...)", load=_load,
                     artifact=PardModel, prepare_params=prepare_llama_params, param_specs=llama_param_specs))
