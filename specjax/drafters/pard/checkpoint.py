"""PARD drafts in and out, and checked against the target they draft for: a PardModel is an HF Llama directory
whose config.json lists its mask tokens (save, load, check); a TargetEmbeddingPard is a specjax drafter artifact
(specjax.drafters.artifacts, kind "pard": save_target_embedding, load_target_embedding, check_target_embedding)."""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from specjax.checkpoints import resolve
from specjax.drafters import artifacts
from specjax.drafters.draft_model import (check_same_vocabulary, target_embedding_params,
                                         target_embedding_shapes)
from specjax.drafters.draft_vocab import check_vocab_map
from specjax.drafters.pard.config import CONFIG_KEY, KIND, PardModel, TargetEmbeddingPard
from specjax.models.config import ModelConfig
from specjax.models.hf_io import load_pretrained, save_pretrained
from specjax.models.model import Model


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
    shapes = dict(target_embedding_shapes(cfg, N), mask_embed=(m, cfg.hidden_size))
    params, d2t = target_embedding_params(tensors, shapes, cfg, N, where)
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
