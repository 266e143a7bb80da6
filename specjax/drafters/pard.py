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

A draft for a target with a large vocabulary and no small sibling (SmolLM2-135M: its 49152 x 576 embedding is a
fifth of the model) reads the target's token embedding instead of holding its own (TargetEmbeddingPard): it stores
its decoder layers (hidden = the target's), the final norm, one embedding row per mask, and either nothing more
(drafts through the target's LM head) or an own head over a draft vocabulary of N frequent target tokens
(specjax.drafters.draft_vocab; every other token at probability 0, so speculative sampling stays exact).

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
import numpy as np
from jax.sharding import PartitionSpec
from tokenizers import AddedToken, Tokenizer

from specjax.cache import KVCache
from specjax.drafters import artifacts
from specjax.drafters.base import Context, Draft, pick_block, target_weight
from specjax.drafters.draft_model import DraftModelDrafter, check_same_vocabulary, llama_param_specs, \
    prepare_llama_params
from specjax.drafters.draft_vocab import check_vocab_map, draft_to_target, full_vocab_logits
from specjax.drafters.registry import BuildRequest, DrafterSpec, register
from specjax.checkpoints import resolve
from specjax.models.config import ModelConfig
from specjax.models.hf_io import load_pretrained, save_pretrained
from specjax.models.llama import forward, init_params
from specjax.models.model import Model
from specjax.sampling import SamplingParams

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
    """A TargetEmbeddingPard to train: its layers copies of the target's layers from_layers (one index per draft
    layer; default the first num_layers) or random (from_layers=()), the target's final norm, every mask row the
    mean embedding, and with d2t an own head from the target's LM-head columns."""
    cfg = dataclasses.replace(target.config, num_layers=num_layers)      # the target's layer shapes
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    if from_layers is None:
        from_layers = tuple(range(num_layers))
    if from_layers:
        if len(from_layers) != num_layers:
            raise ValueError(f"from_layers {list(from_layers)} names {len(from_layers)} target layers for a draft of "
                             f"{num_layers}")
        bad = [l for l in from_layers if not 0 <= l < target.config.num_layers]
        if bad:
            raise ValueError(f"from_layers {bad} out of range: the target has {target.config.num_layers} decoder "
                             "layers")
        layers = [jax.tree.map(f32, dict(target.params["layers"][l])) for l in from_layers]
    else:
        layers = init_params(cfg, jax.random.PRNGKey(seed))["layers"]
    if any(set(lp) != set(layers[0]) or "wq" not in lp for lp in layers):
        raise ValueError("init_target_embedding copies row-major float32 layers (wq, wk, ...): load the target "
                         "with weight_format='float32'")
    embed = f32(target_weight(target.params, "embed"))
    params = {"layers": layers, "final_norm": f32(target.params["final_norm"]),
              "mask_embed": jnp.broadcast_to(jnp.mean(embed, 0), (num_masks, cfg.hidden_size))}
    if d2t is not None:
        d2t = check_vocab_map(d2t, cfg.vocab_size, len(d2t), "init_target_embedding")
        params["lm_head"] = f32(target_weight(target.params, "lm_head"))[:, draft_to_target(d2t)]
    return TargetEmbeddingPard(cfg, params, "", d2t)


def embed_tokens(mask_embed: jax.Array, embed: jax.Array, tokens: jax.Array) -> jax.Array:
    """Input embeddings [..., H] of tokens [...] of the target's vocabulary (rows of the target's embed [V, H]) or
    masks (ids V + j: row j of mask_embed [m, H])."""
    V = embed.shape[0]
    own = embed[jnp.minimum(tokens, V - 1)]
    masks = mask_embed[jnp.clip(tokens - V, 0, mask_embed.shape[0] - 1)].astype(own.dtype)
    return jnp.where((tokens >= V)[..., None], masks, own)


@dataclasses.dataclass(frozen=True)
class PardDrafter:
    k: int
    config: ModelConfig               # the draft's (vocab_size = the target's + the masks; reading the target's
                                      # embedding: its head's width, the target's V or the draft vocabulary's N)
    vocab_size: int                   # the target's: draft logits are cut to it
    mask_token_ids: tuple[int, ...]   # the k - 1 masks this drafter feeds
    cache_size: int
    implementation: str = "xla"
    reads_target_embedding: bool = False   # a TargetEmbeddingPard
    draft_vocab_size: int | None = None    # its own head's width (params: lm_head, vocab_map), or None
    target_layers = ()                # reads nothing of the target's features, only its tokens

    @property
    def target_weights(self) -> tuple[str, ...]:
        if not self.reads_target_embedding:
            return ()
        return ("embed",) if self.draft_vocab_size else ("embed", "output_head")

    def _forward(self, params, ctx: Context, tokens: jax.Array, cache: KVCache, **kw):
        if not self.reads_target_embedding:
            return DraftModelDrafter._forward(self, params, ctx, tokens, cache, **kw)
        w = ctx.target_weights
        x = embed_tokens(params["mask_embed"], w["embed"], tokens)                       # [B, T, H]
        # the target's head as it stores it (a tied one read in place), or the draft vocabulary's own
        head = {} if self.draft_vocab_size else w["output_head"]
        return forward(dict(params, **head), self.config, tokens, cache, input_embeds=x,
                       implementation=self.implementation, **kw)

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
        out = self._forward(params, ctx, tokens, cache.replace(lengths=start), depths=depths, mask=mask)
        logits = out.logits[..., :self.vocab_size]                                       # [B, 2k, V | N]
        first = jnp.take_along_axis(logits, root[:, None, None], axis=1)                 # [B, 1, V | N]
        logits = jnp.concatenate([first, logits[:, w:]], axis=1)                         # [B, k, V | N]
        if self.draft_vocab_size:
            logits = full_vocab_logits(logits, params["vocab_map"], self.vocab_size)     # [B, k, V]
        return logits, out.cache.replace(lengths=ctx.length)

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


def save_target_embedding(path: str | os.PathLike, draft: TargetEmbeddingPard, target, manifest: str,
                          dtype: str = "bfloat16") -> None:
    """A TargetEmbeddingPard as a specjax drafter artifact (kind "pard": its layer config, mask count and draft
    vocabulary; tensors under flat names, the d2t map exactly; the target's fingerprint)."""
    tensors = dict(artifacts.flatten_params(jax.device_get(draft.params)))
    if draft.d2t is not None:
        tensors["d2t"] = np.asarray(draft.d2t, np.int64)
    config = {"layers": draft.config.to_hf(), "num_masks": len(draft.mask_token_ids),
              "draft_vocab_size": draft.draft_vocab_size}
    artifacts.save_artifact(path, KIND, config, tensors, target, manifest, dtype)


def load_target_embedding(path_or_name: str | os.PathLike, target) -> TargetEmbeddingPard:
    """A TargetEmbeddingPard artifact (save_target_embedding) -> the draft, checked against `target`."""
    config, tensors = artifacts.load_artifact(path_or_name, target, KIND)
    where = f"PARD artifact {path_or_name!r}"
    try:
        cfg, m, N = ModelConfig.from_hf(config["layers"]), int(config["num_masks"]), config["draft_vocab_size"]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: config does not describe a PARD draft reading the target's embedding "
                         f"(needs layers, num_masks, draft_vocab_size: {e!r})") from None
    H, spec = cfg.hidden_size, lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    want = {"layers": jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))["layers"],
            "final_norm": spec(H), "mask_embed": spec(m, H)}
    if N is not None:
        want["lm_head"] = spec(H, int(N))
    shapes = {k: tuple(v.shape) for k, v in artifacts.flatten_params(want).items()}
    artifacts.check_shapes(tensors, shapes, f"{where}: tensors")
    params = jax.tree.map(jnp.asarray, artifacts.unflatten_params({k: tensors[k] for k in shapes}))
    d2t = None
    if N is not None:
        if "d2t" not in tensors:
            raise ValueError(f"{where} has a draft vocabulary of {N} but no d2t map")
        d2t = check_vocab_map(tensors["d2t"], cfg.vocab_size, int(N), where)
    return TargetEmbeddingPard(cfg, params, os.path.basename(os.path.normpath(os.fspath(path_or_name))), d2t)


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


def check_target_embedding(target, draft: TargetEmbeddingPard, k: int) -> None:
    """ValueError naming the problem when a TargetEmbeddingPard cannot draft k tokens for `target`."""
    cfg, tc, name = draft.config, target.config, draft.name
    if (cfg.hidden_size, cfg.vocab_size) != (tc.hidden_size, tc.vocab_size):
        raise ValueError(f"PARD draft {name!r} reads a target embedding of {cfg.vocab_size} x {cfg.hidden_size}; the "
                         f"target's is {tc.vocab_size} x {tc.hidden_size}")
    m = len(draft.mask_token_ids)
    if k - 1 > m:
        raise ValueError(f"PARD draft {name!r} was trained with {m} mask tokens, so it drafts at most {m + 1} "
                         f"tokens per step; num_speculative_tokens={k} needs {k - 1}")
    if draft.d2t is not None:
        check_vocab_map(draft.d2t, tc.vocab_size, len(draft.d2t), f"PARD draft {name!r}")


def _load(target: Model, path_or_name: str) -> PardModel | TargetEmbeddingPard:
    """An HF PARD draft (its own vocabulary + masks), or our artifact of one reading the target's embedding."""
    path = resolve(path_or_name, "drafter")
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    if CONFIG_KEY not in hf and "config" in hf and "target" in hf:
        return load_target_embedding(path, target)
    return load(path)


def _build(req: BuildRequest):
    pard = req.drafter
    if pard is None:
        raise TypeError("method='pard' needs drafter=<a PARD draft directory, a shipped name such as "
                        "'stdlib-draft-pard', or specjax.drafters.pard.load(...)>, got None")
    k, V = req.config.k, req.target.config.vocab_size
    # 2k extra slots: a block that starts at 0 for a short row can reach past the target's buffer.
    size = req.buffer_len + 2 * k
    if isinstance(pard, TargetEmbeddingPard):
        check_target_embedding(req.target, pard, k)
        N = pard.draft_vocab_size
        cfg = dataclasses.replace(pard.config, vocab_size=N or V)     # the width of the head it projects through
        params = pard.params if N is None else dict(pard.params, vocab_map=jnp.asarray(draft_to_target(pard.d2t),
                                                                                          jnp.int32))
        return PardDrafter(k, cfg, V, pard.mask_token_ids[:k - 1], size, req.config.implementation,
                           reads_target_embedding=True, draft_vocab_size=N), params
    check(req.target, pard, k)
    return PardDrafter(k, pard.model.config, V, pard.mask_token_ids[:k - 1], size,
                       req.config.implementation), pard.model.params


def _prepare_params(drafter: PardDrafter, params, mesh):
    """An own-vocabulary draft is laid out like a draft model; one reading the target's embedding (a few layers
    and small tables) stays replicated."""
    return params if drafter.reads_target_embedding else prepare_llama_params(drafter, params, mesh)


def _param_specs(drafter: PardDrafter, params, mesh):
    if drafter.reads_target_embedding:
        return jax.tree.map(lambda _: PartitionSpec(), params)
    return llama_param_specs(drafter, params, mesh)


register(DrafterSpec(KIND, _build, accepts="a PARD draft directory (its own vocabulary, or our artifact of one "
                     "reading the target's embedding), a shipped name, pard.load(...) or a TargetEmbeddingPard",
                     load=_load, artifact=(PardModel, TargetEmbeddingPard), prepare_params=_prepare_params,
                     param_specs=_param_specs))
