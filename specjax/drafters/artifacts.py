"""Drafter artifacts: how trained drafter weights (Medusa heads, EAGLE layers, MTP modules, ...) are stored.

One convention for every kind: a directory holding
  config.json         {"specjax_drafter": KIND, "config": {...the drafter's own settings...},
                       "target": {architecture, hidden_size, num_layers, vocab_size, vocab_sha256}}
  model.safetensors   the drafter's tensors under flat names (float32, bfloat16 or float16)
  MANIFEST.md         how it was made (command, data, seed) and what it reached
The "target" block names the model the drafter was trained for; loading against any other target fails with a
message naming what differs, because heads trained on one model's features mean nothing on another's.
Published layouts (the EAGLE and Medusa repositories') are converted by their drafter modules, not here.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from specjax.checkpoints import resolve
from specjax.models.hf_io import SafetensorsFile

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
MANIFEST_NAME = "MANIFEST.md"


def flatten_params(params: Any, prefix: str = "") -> dict[str, Any]:
    """A params pytree of dicts and lists -> {dotted path: array}, a list entry named by its index
    ("layers.0.wq"): every kind's tensor names. unflatten_params inverts it."""
    items = params.items() if isinstance(params, dict) else enumerate(params) if isinstance(params, (list, tuple)) \
        else None
    if items is None:
        return {prefix[:-1]: params}
    out = {}
    for key, value in items:
        out.update(flatten_params(value, f"{prefix}{key}."))
    return out


def unflatten_params(flat: dict[str, Any]) -> dict:
    """{dotted path: array} -> the nested params: dicts, and lists where every key of a level is an index."""
    tree: dict = {}
    for name, value in flat.items():
        node = tree
        *path, leaf = name.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = value

    def listify(node):
        if not isinstance(node, dict):
            return node
        node = {k: listify(v) for k, v in node.items()}
        if node and all(k.isdigit() for k in node):
            return [node[str(i)] for i in range(len(node))] if set(node) == {str(i) for i in range(len(node))} \
                else node
        return node
    return listify(tree)


def check_shapes(tensors: dict[str, Any], expected: dict[str, tuple[int, ...]], what: str) -> None:
    """ValueError naming the missing tensors and those of the wrong shape, when an artifact's tensors are not the
    ones its config describes (expected: name -> shape)."""
    missing = sorted(set(expected) - set(tensors))
    wrong = [f"{k}: {list(tensors[k].shape)} (expected {list(s)})" for k, s in expected.items()
             if k in tensors and tuple(tensors[k].shape) != tuple(s)]
    if missing or wrong:
        raise ValueError(f"{what} do not match its config.json" + (f"; missing {missing[:6]}" if missing else "")
                         + (f"; wrong shapes {wrong[:4]}" if wrong else ""))


def target_fingerprint(target) -> dict:
    """What a drafter artifact records about its target (a specjax Model)."""
    cfg = target.config
    return {"architecture": cfg.family, "hidden_size": cfg.hidden_size, "num_layers": cfg.num_layers,
            "vocab_size": cfg.vocab_size, "vocab_sha256": vocab_hash(target)}


def vocab_hash(target) -> str | None:
    """sha256 of the tokenizer's token -> id map (None without a tokenizer): equal vocab sizes are not enough,
    the ids must mean the same strings."""
    tok = getattr(target, "tokenizer", None)
    if tok is None:
        return None
    items = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()


def check_target(recorded: dict, target, where: str) -> None:
    """Raise ValueError naming every field where `target` differs from the target the artifact was made for."""
    actual = target_fingerprint(target)
    diffs = []
    for key, want in recorded.items():
        have = actual.get(key)
        if key == "vocab_sha256" and (want is None or have is None):
            continue                                  # one side has no tokenizer: vocab_size still checked
        if want != have:
            diffs.append(f"{key}: trained for {want!r}, this target has {have!r}")
    if diffs:
        raise ValueError(f"drafter {where} was trained for another target ({'; '.join(diffs)}); train one for "
                         f"this target or pass the target it was made for")


def save_artifact(path: str | os.PathLike, kind: str, config: dict, tensors: dict[str, Any], target,
                  manifest: str, dtype: str = "bfloat16") -> None:
    """Write a drafter artifact for `target`. tensors: flat name -> array; floating ones stored in `dtype`, integer
    ones (a vocabulary map) exactly as int64."""
    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, CONFIG_NAME), "w") as f:
        json.dump({"specjax_drafter": kind, "config": config, "target": target_fingerprint(target),
                   "storage_dtype": dtype}, f, indent=1, sort_keys=True)
    store = lambda a: (np.asarray(a, np.int64) if np.issubdtype(np.asarray(a).dtype, np.integer)
                       else np.asarray(a, np.float32).astype(np_dtype))
    arrays = {name: np.ascontiguousarray(store(a)) for name, a in tensors.items()}
    save_file(arrays, os.path.join(path, WEIGHTS_NAME), metadata={"specjax_drafter": kind})
    with open(os.path.join(path, MANIFEST_NAME), "w") as f:
        f.write(manifest)


def load_artifact(path_or_name: str | os.PathLike, target, kind: str,
                  dtype=np.float32) -> tuple[dict, dict[str, np.ndarray]]:
    """-> (the drafter's config dict, flat name -> array: floating tensors in `dtype`, integer ones as stored) after
    checking the kind and the target."""
    path = resolve(path_or_name, "drafter")
    cfg_path = os.path.join(path, CONFIG_NAME)
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"drafter directory {path} has no {CONFIG_NAME}")
    try:
        with open(cfg_path) as f:
            meta = json.load(f)
        found_kind, config, recorded = meta["specjax_drafter"], meta["config"], meta["target"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{cfg_path} is not a specjax drafter config (needs specjax_drafter, config and target: "
                         f"{e!r}); published layouts load through their drafter's own loader") from None
    if found_kind != kind:
        raise ValueError(f"{path} holds a {found_kind!r} drafter, not a {kind!r} one")
    check_target(recorded, target, path)
    if not os.path.isfile(os.path.join(path, MANIFEST_NAME)):
        raise FileNotFoundError(f"drafter directory {path} has no {MANIFEST_NAME} (how it was made is part of "
                                "the artifact)")
    weights = SafetensorsFile(os.path.join(path, WEIGHTS_NAME))
    read = lambda a: a if np.issubdtype(a.dtype, np.integer) else np.asarray(a, dtype)
    return config, {name: read(np.asarray(weights.get(name))) for name in weights.keys()}


def read_manifest_record(path: str) -> dict:
    """The ```json block of an artifact's MANIFEST.md (what its recipe measured), or {} when there is none."""
    text = open(os.path.join(path, MANIFEST_NAME)).read() if os.path.isfile(os.path.join(path, MANIFEST_NAME)) else ""
    start = text.rfind("```json")
    if start < 0:
        return {}
    body = text[start + len("```json"):]
    return json.loads(body[:body.index("```")])


def read_published_tensors(path: str, safetensors_names: tuple[str, ...], torch_name: str) -> dict[str, np.ndarray]:
    """The tensors of a published checkpoint directory: the first of safetensors_names that exists, else the torch
    file torch_name (read with torch when it is installed). Floating tensors come back as float32."""
    for name in safetensors_names:
        f = os.path.join(path, name)
        if os.path.isfile(f):
            st = SafetensorsFile(f)
            return {k: _as_float32(np.asarray(st.get(k))) for k in st.keys()}
    pt = os.path.join(path, torch_name)
    if os.path.isfile(pt):
        try:
            import torch
        except ImportError:
            raise ImportError(f"{pt} is a torch file: install torch to read it, or convert it to "
                              f"{safetensors_names[0]}") from None
        sd = torch.load(pt, map_location="cpu", weights_only=True)
        return {k: (v.float().numpy() if v.is_floating_point() else v.numpy()) for k, v in sd.items()}
    raise FileNotFoundError(f"no weights in {path}: expected {' or '.join(safetensors_names + (torch_name,))}")


def _as_float32(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float32) if np.issubdtype(a.dtype, np.floating) or a.dtype.kind == "V" else a
