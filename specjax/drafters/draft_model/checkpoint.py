"""Draft models in and out, and checked against the target they draft for: a TargetEmbeddingDraft is a specjax
drafter artifact (specjax.drafters.artifacts, kind "draft_model": save, load, check_target; its tensors' names and
shapes, target_embedding_shapes / target_embedding_params, are PARD's too); a Model draft is an HF directory
(specjax.models.model.load_model) that must speak the target's vocabulary (check_same_vocabulary)."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters import artifacts
from specjax.drafters.draft_model.config import KIND, TargetEmbeddingDraft
from specjax.drafters.draft_vocab import check_vocab_map
from specjax.models.config import ModelConfig
from specjax.models.llama import init_params
from specjax.models.model import Model


def check_same_vocabulary(target, draft, extra_tokens: int = 0) -> None:
    """A drafter must speak the target's vocabulary, or its tokens mean something else (silent garbage).
    extra_tokens: draft-only tokens appended after the target's (PARD's mask tokens); the draft's first
    target-vocab_size ids must still map to the target's strings."""
    V = target.config.vocab_size
    if draft.config.vocab_size != V + extra_tokens:
        want = f"{V}" if not extra_tokens else \
            f"the target's {V} plus its {extra_tokens} mask tokens = {V + extra_tokens}"
        raise ValueError(f"vocabulary mismatch: draft model {draft.name!r} has vocab_size "
                         f"{draft.config.vocab_size}, target {target.name!r} has {V}; expected {want}")
    if target.tokenizer is not None and draft.tokenizer is not None:
        vocab = draft.tokenizer.get_vocab()
        if extra_tokens:
            vocab = {t: i for t, i in vocab.items() if i < V}
        if target.tokenizer.get_vocab() != vocab:
            raise ValueError(f"vocabulary mismatch: draft model {draft.name!r} and target {target.name!r} have "
                             f"the same {V}-token vocabulary size but different tokenizers (token ids map to "
                             "different strings): the draft was made for another tokenizer")


def target_embedding_shapes(cfg: ModelConfig, draft_vocab_size: int | None) -> dict[str, tuple[int, ...]]:
    """The flat tensor names and shapes of a draft that reads the target's embedding (layers, final norm, and an own
    head over a draft vocabulary of draft_vocab_size tokens): a TargetEmbeddingDraft's, and PARD's beside its mask
    rows."""
    want = {"layers": jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))["layers"],
            "final_norm": jax.ShapeDtypeStruct((cfg.hidden_size,), jnp.float32)}
    if draft_vocab_size is not None:
        want["lm_head"] = jax.ShapeDtypeStruct((cfg.hidden_size, int(draft_vocab_size)), jnp.float32)
    return {k: tuple(v.shape) for k, v in artifacts.flatten_params(want).items()}


def target_embedding_params(tensors: dict, shapes: dict, cfg: ModelConfig, draft_vocab_size: int | None,
                            where: str) -> tuple[dict, np.ndarray | None]:
    """An artifact's flat tensors -> (params, d2t), checked against the names and shapes its config describes
    (shapes: target_embedding_shapes' and any of the kind's own) and its d2t against the target's vocabulary."""
    artifacts.check_shapes(tensors, shapes, f"{where}: tensors")
    params = jax.tree.map(jnp.asarray, artifacts.unflatten_params({k: tensors[k] for k in shapes}))
    if draft_vocab_size is None:
        return params, None
    if "d2t" not in tensors:
        raise ValueError(f"{where} has a draft vocabulary of {draft_vocab_size} but no d2t map")
    return params, check_vocab_map(tensors["d2t"], cfg.vocab_size, int(draft_vocab_size), where)


def save(path: str | os.PathLike, draft: TargetEmbeddingDraft, target: Model, manifest: str,
         dtype: str = "bfloat16") -> None:
    """A TargetEmbeddingDraft as a specjax drafter artifact (kind "draft_model": its layer config and draft
    vocabulary size; its layers, final norm and head under flat names, the d2t map exactly as int64; the target's
    fingerprint). The target's embedding is not stored: the drafter reads it from the target."""
    check_target(target, draft)
    tensors = dict(artifacts.flatten_params(jax.device_get(draft.params)))
    if draft.d2t is not None:
        tensors["d2t"] = np.asarray(draft.d2t, np.int64)
    config = {"layers": draft.config.to_hf(), "draft_vocab_size": draft.draft_vocab_size}
    artifacts.save_artifact(path, KIND, config, tensors, target, manifest, dtype)


def load(path_or_name: str | os.PathLike, target: Model) -> TargetEmbeddingDraft:
    """A TargetEmbeddingDraft artifact (save) -> the draft (float32), checked against `target`: the artifact must
    have been made for it (specjax.drafters.artifacts), since the draft embeds with the target's table."""
    config, tensors = artifacts.load_artifact(path_or_name, target, KIND)
    where = f"draft model artifact {os.fspath(path_or_name)!r}"
    try:
        cfg, N = ModelConfig.from_hf(config["layers"]), config["draft_vocab_size"]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: config does not describe a draft reading the target's embedding (needs layers, "
                         f"draft_vocab_size: {e!r})") from None
    params, d2t = target_embedding_params(tensors, target_embedding_shapes(cfg, N), cfg, N, where)
    extra = sorted(set(tensors) - set(target_embedding_shapes(cfg, N)) - {"d2t"})
    if extra:
        raise ValueError(f"{where} has unexpected tensors {extra}")
    draft = TargetEmbeddingDraft(cfg, params, d2t, os.path.basename(os.path.normpath(os.fspath(path_or_name))))
    check_target(target, draft)
    return draft


def check_target(target: Model, draft: TargetEmbeddingDraft) -> None:
    """ValueError naming the mismatch when `draft` cannot embed with, and draft for, `target`: the target's
    embedding table must be the vocab_size x hidden_size one the draft's layers were made for."""
    cfg, tc, name = draft.config, target.config, draft.name or "(unnamed)"
    if (cfg.vocab_size, cfg.hidden_size) != (tc.vocab_size, tc.hidden_size):
        raise ValueError(f"draft model {name!r} embeds with its target's embedding table of {cfg.vocab_size} "
                         f"tokens x {cfg.hidden_size}; the target {target.name!r} has {tc.vocab_size} x "
                         f"{tc.hidden_size} (it was made for another target)")
    if draft.d2t is not None:
        check_vocab_map(draft.d2t, tc.vocab_size, len(draft.d2t), f"draft model {name!r}")
