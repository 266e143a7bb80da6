"""Multi-token drafter artifacts in and out (specjax.drafters.artifacts, kinds "mtp" and "mtp_heads"), checked
against the target they draft for; a multi-token target's heads live in its directory under `mtp_heads/`."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from specjax.checkpoints import resolve
from specjax.drafters import artifacts
from specjax.drafters.mtp.config import MTPConfig, MTPWeights

HEADS_DIR = "mtp_heads"           # a multi-token target's extra heads, inside the target's directory
_LAYER_KEYS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")


# ------------------------------------------------------------------------------------------- reading / writing

def _expected_shapes(config: MTPConfig) -> dict:
    c = config.layer
    H, I, D = c.hidden_size, c.intermediate_size, c.head_dim
    layer = {"attn_norm": (H,), "wq": (H, c.num_heads * D), "wk": (H, c.num_kv_heads * D),
             "wv": (H, c.num_kv_heads * D), "wo": (c.num_heads * D, H), "mlp_norm": (H,), "w_gate": (H, I),
             "w_up": (H, I), "w_down": (I, H)}
    group = "modules" if config.kind == "mtp" else "heads"
    shapes = {}
    for d in range(config.depth):
        shapes.update({f"{group}.{d}.layer.{k}": s for k, s in layer.items()})
        shapes[f"{group}.{d}.final_norm"] = (H,)
        if config.kind == "mtp":
            shapes.update({f"{group}.{d}.norm_h": (H,), f"{group}.{d}.norm_e": (H,), f"{group}.{d}.proj": (2 * H, H)})
    return shapes


def save(path: str | os.PathLike, weights: MTPWeights, target, manifest: str, dtype: str = "bfloat16") -> None:
    artifacts.save_artifact(path, weights.config.kind, weights.config.to_dict(),
                            artifacts.flatten_params(jax.device_get(weights.params)),
                            target, manifest, dtype)


def load(path_or_name: str | os.PathLike, target, kind: str) -> MTPWeights:
    """A specjax "mtp" / "mtp_heads" artifact (or a multi-token target's directory holding mtp_heads/, or a shipped
    name) -> MTPWeights, checked against this target."""
    path = resolve(path_or_name, "drafter")
    if kind == "mtp_heads" and os.path.isdir(os.path.join(path, HEADS_DIR)):
        path = os.path.join(path, HEADS_DIR)
    cfg, tensors = artifacts.load_artifact(path, target, kind)
    config = MTPConfig.from_dict(cfg)
    tc = target.config
    if config.layer.hidden_size != tc.hidden_size:
        raise ValueError(f"{path}: {kind} layers are {config.layer.hidden_size} wide, the target's hidden state is "
                         f"{tc.hidden_size}")
    if config.trunk_layer is not None and not 0 <= config.trunk_layer < tc.num_layers:
        raise ValueError(f"{path}: the heads read trunk layer {config.trunk_layer}, the target has "
                         f"{tc.num_layers} decoder layers")
    expected = _expected_shapes(config)
    artifacts.check_shapes(tensors, expected, f"{path}: {kind} weights")
    group = "modules" if kind == "mtp" else "heads"
    entries = []
    for d in range(config.depth):
        pre = f"{group}.{d}."
        entry = {"layer": {k: jnp.asarray(tensors[pre + "layer." + k]) for k in _LAYER_KEYS}}
        entry.update({k[len(pre):]: jnp.asarray(v) for k, v in tensors.items()
                      if k.startswith(pre) and ".layer." not in k})
        entries.append(entry)
    return MTPWeights(config, {group: entries}, os.path.basename(os.path.normpath(path)))
