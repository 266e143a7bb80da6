"""DFlash artifacts in and out, checked against the target they draft for.

Artifacts: specjax drafter directories (kind "dflash"; config + tensors (+ d2t, the draft vocabulary map, int64) +
MANIFEST, the target's fingerprint), or
the public DFlash layout (load_published: its per-head q/k norms, fused-feature fc and norm map one to one; its mask
position embeds a mask token of the target's vocabulary).
"""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters import artifacts
from specjax.drafters.base import target_weight
from specjax.drafters.dflash.config import KIND, DFlashConfig, DFlashWeights, init_params
from specjax.drafters.draft_vocab import check_vocab_map


def save(path: str, weights: DFlashWeights, target, manifest: str, dtype: str = "bfloat16") -> None:
    tensors = dict(artifacts.flatten_params(jax.device_get(weights.params)))
    if weights.d2t is not None:
        tensors["d2t"] = np.asarray(weights.d2t, np.int64)
    artifacts.save_artifact(path, KIND, weights.config.to_dict(), tensors, target, manifest, dtype)


def load(path_or_name: str, target) -> DFlashWeights:
    config, tensors = artifacts.load_artifact(path_or_name, target, KIND)
    try:
        cfg = DFlashConfig.from_dict(config)
    except TypeError as e:
        raise ValueError(f"DFlash artifact {path_or_name!r}: config does not describe a DFlash drafter ({e})") from None
    shapes = {k: tuple(v.shape) for k, v in artifacts.flatten_params(
        jax.eval_shape(lambda: init_params(jax.random.PRNGKey(0), cfg))).items()}
    artifacts.check_shapes(tensors, shapes, f"DFlash artifact {path_or_name!r}: tensors")
    params = jax.tree.map(jnp.asarray, artifacts.unflatten_params({k: tensors[k] for k in shapes}))
    d2t = None
    if cfg.draft_vocab_size is not None:
        if "d2t" not in tensors:
            raise ValueError(f"DFlash artifact {path_or_name!r} has a draft vocabulary of {cfg.draft_vocab_size} but "
                             "no d2t map")
        d2t = check_vocab_map(tensors["d2t"], cfg.vocab_size, cfg.draft_vocab_size,
                              f"DFlash artifact {path_or_name!r}")
    return DFlashWeights(cfg, params, str(path_or_name), d2t)


def _published_value(hf: dict, name: str, default=None):
    return hf.get("dflash_config", {}).get(name, hf.get(name, default))


def load_published(path: str, target) -> DFlashWeights:
    """The public DFlash layout (a directory with an HF config.json whose dflash_config, or top level, gives
    target_layer_ids, block_size and mask_token_id, and model.safetensors with fc, hidden_norm, norm and
    layers.{i}.self_attn.{q,k,v,o}_proj / {q,k}_norm, mlp.{gate,up,down}_proj, input_layernorm,
    post_attention_layernorm) -> DFlashWeights. Its mask position embeds the target's token mask_token_id (the
    published drafters add that token to the target's vocabulary), which becomes our mask embedding."""
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    layers, mask_id = _published_value(hf, "target_layer_ids"), _published_value(hf, "mask_token_id")
    if layers is None or mask_id is None:
        raise ValueError(f"{path}/config.json is not a DFlash drafter config: it needs target_layer_ids and "
                         "mask_token_id (in dflash_config or at the top level)")
    tc = target.config
    H = int(hf["hidden_size"])
    if H != tc.hidden_size:
        raise ValueError(f"DFlash drafter {path} has hidden size {H}; the target has {tc.hidden_size}")
    if not 0 <= int(mask_id) < tc.vocab_size:
        raise ValueError(f"DFlash drafter {path} embeds mask token {mask_id}, outside the target's vocabulary of "
                         f"{tc.vocab_size}: it was made for a target with that token added")
    Hq, Hkv = int(hf["num_attention_heads"]), int(hf["num_key_value_heads"])
    cfg = DFlashConfig(H, int(hf["num_hidden_layers"]), Hq, Hkv, int(hf.get("head_dim", H // Hq)),
                       int(hf["intermediate_size"]), tuple(int(l) for l in layers),
                       int(_published_value(hf, "block_size", 16)), tc.vocab_size,
                       float(hf.get("rms_norm_eps", 1e-6)), float(hf.get("rope_theta", 10000.0)))
    t = artifacts.read_published_tensors(path, ("model.safetensors",), "pytorch_model.bin")

    def get(name, shape):
        if name not in t:
            raise ValueError(f"DFlash checkpoint {path} is missing tensor {name!r}")
        if tuple(t[name].shape) != shape:
            raise ValueError(f"DFlash checkpoint {path}: {name} has shape {tuple(t[name].shape)}, expected {shape}")
        return jnp.asarray(t[name], jnp.float32)

    D, I = cfg.head_dim, cfg.intermediate_size
    lin = lambda name, out, inp: get(name, (out, inp)).T          # torch Linear [out, in] -> our [in, out]
    layers_out = []
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        layers_out.append({
            "attn_norm": get(p + "input_layernorm.weight", (H,)),
            "wq": lin(p + "self_attn.q_proj.weight", Hq * D, H), "wk": lin(p + "self_attn.k_proj.weight", Hkv * D, H),
            "wv": lin(p + "self_attn.v_proj.weight", Hkv * D, H), "wo": lin(p + "self_attn.o_proj.weight", H, Hq * D),
            "q_norm": get(p + "self_attn.q_norm.weight", (D,)), "k_norm": get(p + "self_attn.k_norm.weight", (D,)),
            "mlp_norm": get(p + "post_attention_layernorm.weight", (H,)),
            "w_gate": lin(p + "mlp.gate_proj.weight", I, H), "w_up": lin(p + "mlp.up_proj.weight", I, H),
            "w_down": lin(p + "mlp.down_proj.weight", H, I)})
    params = {"fc": lin("fc.weight", H, len(cfg.target_layers) * H), "hidden_norm": get("hidden_norm.weight", (H,)),
              "mask_embed": jnp.asarray(target_weight(target.params, "embed")[int(mask_id)], jnp.float32),
              "layers": layers_out, "final_norm": get("norm.weight", (H,))}
    return DFlashWeights(cfg, params, os.path.basename(os.path.normpath(path)))
