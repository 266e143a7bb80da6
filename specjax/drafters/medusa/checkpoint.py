"""Medusa heads in and out, checked against the target they draft for, and the tree their measured accuracies give.

Artifacts: a specjax drafter directory (specjax.drafters.artifacts, kind "medusa"), or a published layout:
the Medusa repository's (`medusa_lm_head.safetensors` / `.pt`, keys `{head}.{layer}.linear.weight/bias` and
`{head}.{num_layers}.weight`, config `medusa_num_heads`, `medusa_num_layers`) and vLLM's (`blocks.{head}.layers.
{layer}.weight/bias`, `lm_heads.{head}.weight`, config `num_heads`, `num_hidden_layers`). A recipe records the heads'
per-rank accuracies in the artifact's MANIFEST (rank_accuracy); accuracy_tree builds tree choices from them.
"""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from specjax.checkpoints import resolve
from specjax.drafters import artifacts
from specjax.drafters.medusa.config import KIND, LAYOUTS, MedusaHeads
from specjax.trees import choices_from_accuracies


def save_heads(path: str, heads: MedusaHeads, target, manifest: str, dtype: str = "bfloat16") -> None:
    p = jax.device_get(heads.params)
    artifacts.save_artifact(path, KIND, {"num_heads": heads.num_heads, "num_layers": heads.num_layers,
                                         "layout": heads.layout}, {k: np.asarray(v) for k, v in p.items()},
                            target, manifest, dtype)


def _from_torch_layout(blocks: dict, lm_heads: list, num_heads: int, num_layers: int, shared=None) -> dict:
    """Published layouts store Linear weights as [out, in]; ours multiply x @ w with w [in, out]."""
    w = np.stack([np.stack([blocks[(i, r)][0].T for r in range(num_layers)]) for i in range(num_heads)])
    b = np.stack([np.stack([blocks[(i, r)][1] for r in range(num_layers)]) for i in range(num_heads)])
    proj = np.stack([h.T for h in lm_heads]) if shared is None else shared.T
    return {"w": w.astype(np.float32), "b": b.astype(np.float32), "proj": proj.astype(np.float32)}


def _read_tensors(path: str) -> dict[str, np.ndarray]:
    return artifacts.read_published_tensors(path, ("medusa_lm_head.safetensors", "model.safetensors"),
                                            "medusa_lm_head.pt")


def _need(tensors: dict, key: str, shape: tuple, where: str) -> np.ndarray:
    if key not in tensors:
        raise ValueError(f"Medusa checkpoint {where} is missing tensor {key!r} (truncated or another layout?)")
    if tuple(tensors[key].shape) != shape:
        raise ValueError(f"Medusa checkpoint {where}: tensor {key!r} has shape {list(tensors[key].shape)}, "
                         f"expected {list(shape)}")
    return tensors[key]


def load_published(path: str, target) -> MedusaHeads:
    """The Medusa repository's or vLLM's layout -> MedusaHeads, checked against the target's sizes."""
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    H, V = target.config.hidden_size, target.config.vocab_size
    for key in ("hidden_size", "vocab_size"):
        if key in hf and int(hf[key]) != getattr(target.config, key):
            raise ValueError(f"Medusa heads in {path} were trained for {key}={hf[key]}, the target has "
                             f"{getattr(target.config, key)}")
    if "medusa_num_heads" in hf:                                 # FasterDecoding/Medusa
        K, R = int(hf["medusa_num_heads"]), int(hf.get("medusa_num_layers", 1))
        t = _read_tensors(path)
        blocks = {(i, r): (_need(t, f"{i}.{r}.linear.weight", (H, H), path), _need(t, f"{i}.{r}.linear.bias", (H,), path))
                  for i in range(K) for r in range(R)}
        heads = [_need(t, f"{i}.{R}.weight", (V, H), path) for i in range(K)]
    elif "MedusaModel" in (hf.get("architectures") or []) or hf.get("model_type") == "medusa":   # vLLM
        K, R = int(hf["num_heads"]), int(hf.get("num_hidden_layers", 1))
        if hf.get("truncated_vocab_size") not in (None, hf.get("vocab_size")):
            raise ValueError(f"{path}: truncated_vocab_size Medusa heads are not supported")
        t = _read_tensors(path)
        blocks = {(i, r): (_need(t, f"blocks.{i}.layers.{r}.weight", (H, H), path),
                           _need(t, f"blocks.{i}.layers.{r}.bias", (H,), path)) for i in range(K) for r in range(R)}
        heads = [_need(t, f"lm_heads.{i}.weight", (V, H), path) for i in range(K)]
    else:
        raise ValueError(f"{path}/config.json is neither a specjax Medusa artifact nor a published Medusa layout "
                         "(no specjax_drafter, medusa_num_heads or MedusaModel architecture)")
    params = _from_torch_layout(blocks, heads, K, R)
    return MedusaHeads(K, R, "per_head", jax.tree_util.tree_map(jnp.asarray, params), os.path.basename(path))


def load_heads(path_or_name: str | os.PathLike, target) -> MedusaHeads:
    """A specjax Medusa artifact, a published layout, or a shipped name -> MedusaHeads for this target."""
    path = resolve(path_or_name, "drafter")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"Medusa directory {path} has no config.json")
    with open(cfg_path) as f:
        is_ours = "specjax_drafter" in json.load(f)
    if not is_ours:
        return load_published(path, target)
    cfg, tensors = artifacts.load_artifact(path, target, KIND)
    K, R, layout = int(cfg["num_heads"]), int(cfg["num_layers"]), cfg["layout"]
    if layout not in LAYOUTS:
        raise ValueError(f"{path}: unknown Medusa layout {layout!r}; expected one of {LAYOUTS}")
    H, V = target.config.hidden_size, target.config.vocab_size
    need = {"w": (K, R, H, H), "b": (K, R, H)}
    if layout != "target_head":
        need["proj"] = (K, H, V) if layout == "per_head" else (H, V)
    for key, shape in need.items():
        _need(tensors, key, shape, path)
    return MedusaHeads(K, R, layout, {k: jnp.asarray(tensors[k]) for k in need},
                       os.path.basename(os.path.normpath(path)), V)


def rank_accuracy(topk_accuracy) -> list[list[float]]:
    """Cumulative top-1..top-k accuracy per head [K][k] -> P(the right token is at rank r) per head [K][k]."""
    acc = np.asarray(topk_accuracy, np.float64)
    return np.diff(np.concatenate([np.zeros((acc.shape[0], 1)), acc], axis=1), axis=1).clip(0, 1).round(4).tolist()


def accuracy_tree(path_or_name: str | os.PathLike, num_nodes: int) -> tuple:
    """Tree choices of num_nodes nodes that maximise the expected accepted length under the heads' measured
    per-rank accuracies (recorded in the artifact's MANIFEST by the training recipe): Medusa's construction."""
    path = resolve(path_or_name, "drafter")
    record = artifacts.read_manifest_record(path)
    if "tree_rank_accuracy" not in record:        # Medusa-2 heads ship inside their target's directory
        record = artifacts.read_manifest_record(os.path.dirname(os.path.normpath(path)))
    if "tree_rank_accuracy" not in record:
        raise ValueError(f"{path}/MANIFEST.md records no tree_rank_accuracy (per-head accuracy by rank); "
                         "give tree_choices explicitly")
    return choices_from_accuracies(record["tree_rank_accuracy"], num_nodes)
