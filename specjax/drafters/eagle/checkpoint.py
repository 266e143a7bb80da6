"""EAGLE checkpoints in and out, checked against the target they draft for.

Artifacts: ours (specjax.drafters.artifacts, kinds "eagle" / "eagle3"; the EAGLE-3 vocabulary map is stored
exactly, as int64/bool, in an extra `vocab_map.safetensors` beside model.safetensors), and the published layouts
(load_published / export_published): EAGLE-1 (`fc.*`, `layers.0.*` without input_layernorm, optional
`embed_tokens.weight`; config.json a Llama config; model.safetensors or pytorch_model.bin via torch) and EAGLE-3
(`fc.weight`, `midlayer.*` or speculators' `layers.0.*`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d`, optional
`embed_tokens.weight`; config.json with draft_vocab_size, or the speculators config with transformer_layer_config,
target_hidden_size, eagle_aux_hidden_state_layer_ids, norm_before_residual); EAGLE-3.1 adds the config switches
fc_norm (tensors `fc_norm.<i>.weight`, one per fused feature) and norm_output. The published EAGLE-3 config's
feature layers: see specjax.drafters.eagle.config.
"""
from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from specjax.checkpoints import resolve
from specjax.drafters import artifacts
from specjax.drafters.eagle.config import KINDS, EagleConfig, EagleWeights, reference_target_layers
from specjax.drafters.draft_vocab import check_vocab_map, t2d_from_d2t
from specjax.models.config import ModelConfig
from specjax.models.hf_io import SafetensorsFile

VOCAB_MAP_NAME = "vocab_map.safetensors"

_LAYER_NAMES = {"wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight", "wv": "self_attn.v_proj.weight",
                "wo": "self_attn.o_proj.weight", "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight",
                "w_down": "mlp.down_proj.weight", "mlp_norm": "post_attention_layernorm.weight",
                "attn_norm": "input_layernorm.weight", "hidden_norm": "hidden_norm.weight",
                "bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias", "bv": "self_attn.v_proj.bias"}
_TRANSPOSED = {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"}


def _expected_shapes(config: EagleConfig, own_embed: bool) -> dict:
    c = config.layer
    H, I, D = c.hidden_size, c.intermediate_size, c.head_dim
    q, kv = c.num_heads * D, c.num_kv_heads * D
    hin = H if config.kind == "eagle" else 2 * H
    shapes = {"layer.wq": (hin, q), "layer.wk": (hin, kv), "layer.wv": (hin, kv), "layer.wo": (q, H),
              "layer.mlp_norm": (H,), "layer.w_gate": (H, I), "layer.w_up": (H, I), "layer.w_down": (I, H)}
    if c.attention_bias:
        shapes.update({"layer.bq": (q,), "layer.bk": (kv,), "layer.bv": (kv,)})
    if config.kind == "eagle":
        shapes.update(fc_w=(2 * H, H), fc_b=(H,))
    else:
        shapes.update({"layer.attn_norm": (H,), "layer.hidden_norm": (H,), "final_norm": (H,),
                       "fc_w": (len(config.target_layers) * config.target_hidden_size, H),
                       "lm_head": (H, config.draft_vocab_size)})
        if config.fc_norm:
            shapes["fc_norm"] = (len(config.target_layers), config.target_hidden_size)
        if config.parallel_drafting:
            shapes.update(mask_embed=(H,), mask_hidden=(H,))
    if own_embed:
        shapes["embed"] = (c.vocab_size, H)
    return shapes


def _check_shapes(flat: dict, config: EagleConfig, where: str, names: dict | None = None) -> None:
    """flat: our flat names -> arrays. names: our name -> the file's name, for messages."""
    for key, shape in _expected_shapes(config, "embed" in flat).items():
        shown = (names or {}).get(key, key)
        if key not in flat:
            raise ValueError(f"EAGLE checkpoint {where} is missing tensor {shown!r} (truncated or another layout?)")
        if tuple(flat[key].shape) != shape:
            have = tuple(flat[key].shape)
            if key in _TRANSPOSED_FLAT or key in ("fc_w", "lm_head"):
                have, shape = have[::-1], shape[::-1]           # report in the file's [out, in] convention
            raise ValueError(f"EAGLE checkpoint {where}: tensor {shown!r} has shape {list(have)}, expected "
                             f"{list(shape)}")


_TRANSPOSED_FLAT = {f"layer.{k}" for k in _TRANSPOSED}


def check_target(weights: EagleWeights, target) -> None:
    """Raise ValueError when `weights` cannot draft for `target` (a specjax Model)."""
    cfg, tc, name = weights.config, target.config, weights.name or "(unnamed)"
    if cfg.vocab_size != tc.vocab_size:
        raise ValueError(f"EAGLE drafter {name!r} was made for vocab_size={cfg.vocab_size}, the target "
                         f"{target.name!r} has {tc.vocab_size}")
    if cfg.target_hidden_size != tc.hidden_size:
        raise ValueError(f"EAGLE drafter {name!r} was made for target hidden_size={cfg.target_hidden_size}, the "
                         f"target {target.name!r} has {tc.hidden_size}")
    if "embed" not in weights.params and cfg.hidden_size != tc.hidden_size:
        raise ValueError(f"EAGLE drafter {name!r} has hidden_size {cfg.hidden_size} and no embedding of its own; "
                         f"the target's embedding is {tc.hidden_size} wide")
    bad = [i for i in cfg.target_layers if not 0 <= i < tc.num_layers]
    if bad:
        raise ValueError(f"EAGLE-3 drafter {name!r} reads target layers {list(cfg.target_layers)} but the target "
                         f"{target.name!r} has {tc.num_layers} decoder layers (valid: 0..{tc.num_layers - 1}); "
                         f"out of range: {bad}")
    if cfg.kind == "eagle3":
        if weights.d2t is None:
            raise ValueError(f"EAGLE-3 drafter {name!r} has no d2t vocabulary map")
        check_vocab_map(weights.d2t, tc.vocab_size, cfg.draft_vocab_size, f"EAGLE-3 drafter {name!r}")


def save(path: str | os.PathLike, weights: EagleWeights, target, manifest: str, dtype: str = "bfloat16") -> None:
    """Our artifact (kind "eagle" / "eagle3") for `target`; the EAGLE-3 vocab map is stored exactly."""
    check_target(weights, target)
    flat = artifacts.flatten_params(jax.device_get(weights.params))
    artifacts.save_artifact(path, weights.kind, weights.config.to_dict(), flat, target, manifest, dtype)
    if weights.kind == "eagle3":
        d2t = np.asarray(weights.d2t, np.int64)
        save_file({"d2t": d2t, "t2d": t2d_from_d2t(d2t, weights.config.vocab_size)},
                  os.path.join(os.fspath(path), VOCAB_MAP_NAME))


def _load_ours(path: str, target, kind: str) -> EagleWeights:
    cfg_dict, flat = artifacts.load_artifact(path, target, kind)
    config = EagleConfig.from_dict(cfg_dict)
    _check_shapes(flat, config, path)
    extra = sorted(set(flat) - set(_expected_shapes(config, "embed" in flat)))
    if extra:
        raise ValueError(f"EAGLE artifact {path} has unexpected tensors {extra}")
    d2t = None
    if kind == "eagle3":
        vm = os.path.join(path, VOCAB_MAP_NAME)
        if not os.path.isfile(vm):
            raise FileNotFoundError(f"EAGLE-3 artifact {path} has no {VOCAB_MAP_NAME} (the draft vocabulary map)")
        st = SafetensorsFile(vm)
        if "d2t" not in st.keys():
            raise ValueError(f"{vm} has no 'd2t' tensor")
        d2t = check_vocab_map(np.asarray(st.get("d2t")), config.vocab_size, config.draft_vocab_size, path,
                              np.asarray(st.get("t2d")) if "t2d" in st.keys() else None)
    weights = EagleWeights(config, jax.tree_util.tree_map(jnp.asarray, artifacts.unflatten_params(flat)), d2t,
                           os.path.basename(os.path.normpath(path)))
    check_target(weights, target)
    return weights


def _read_tensors(path: str) -> dict[str, np.ndarray]:
    return artifacts.read_published_tensors(path, ("model.safetensors",), "pytorch_model.bin")


def _hf_layer_config(hf: dict, where: str) -> ModelConfig:
    """The decoder layer's shape from a (possibly nested, speculators-style) Llama config."""
    lc = dict(hf.get("transformer_layer_config") or hf)
    lc.update(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=1)
    try:
        return ModelConfig.from_hf(lc)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where}/config.json is not an EAGLE config (needs a Llama layer config: "
                         f"hidden_size, intermediate_size, num_attention_heads, vocab_size...): {e!r}") from None


def load_published(path: str | os.PathLike, target, kind: str | None = None) -> EagleWeights:
    """The EAGLE / EAGLE-3 repositories' (or speculators') layout -> EagleWeights, checked against the target."""
    path = os.fspath(path)
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    t = _read_tensors(path)
    is3 = (any(k.startswith("midlayer.") for k in t) or "d2t" in t or "draft_vocab_size" in hf
           or hf.get("speculators_model_type") == "eagle3" or "layers.0.hidden_norm.weight" in t)
    found = "eagle3" if is3 else "eagle"
    if kind is not None and kind != found:
        raise ValueError(f"{path} holds a published {found!r} drafter, not an {kind!r} one; use method={found!r}")
    layer = _hf_layer_config(hf, path)
    if layer.vocab_size != target.config.vocab_size:
        raise ValueError(f"EAGLE drafter {path} was trained for vocab_size={layer.vocab_size}, the target has "
                         f"{target.config.vocab_size}")
    pfx = "midlayer." if any(k.startswith("midlayer.") for k in t) else "layers.0."
    more = sorted({k.split(".")[1] for k in t if k.startswith("layers.") and not k.startswith("layers.0.")})
    if more or int((hf.get("transformer_layer_config") or hf).get("num_hidden_layers", 1)) != 1:
        raise ValueError(f"{path}: only single-layer EAGLE drafters are supported (found layers {more or '?'} "
                         f"/ num_hidden_layers={hf.get('num_hidden_layers')})")
    names: dict[str, str] = {}
    flat: dict[str, np.ndarray] = {}

    def take(ours: str, theirs: str, transpose: bool = False, required: bool = True):
        names[ours] = theirs
        if theirs not in t:
            if required:
                raise ValueError(f"EAGLE checkpoint {path} is missing tensor {theirs!r} (truncated or another "
                                 "layout?)")
            return
        a = np.asarray(t[theirs], np.float32)
        flat[ours] = np.ascontiguousarray(a.T) if transpose else a

    if pfx + "self_attn.q_proj.bias" in t:
        layer = dataclasses.replace(layer, attention_bias=True)
    for ours, theirs in _LAYER_NAMES.items():
        if ours in ("attn_norm", "hidden_norm") and not is3:
            continue
        if ours.startswith("b") and not layer.attention_bias:
            continue
        take(f"layer.{ours}", pfx + theirs, ours in _TRANSPOSED)
    take("embed", "embed_tokens.weight", required=False)
    d2t = None
    if not is3:
        if pfx + "input_layernorm.weight" in t:
            raise ValueError(f"{path} has {pfx}input_layernorm.weight: the EAGLE-1 layer has no input norm "
                             "(another layout?)")
        config = EagleConfig("eagle", layer, int(hf.get("target_hidden_size", layer.hidden_size)))
        take("fc_w", "fc.weight", transpose=True)
        if "fc.bias" in t:
            take("fc_b", "fc.bias")
        else:
            flat["fc_b"] = np.zeros(layer.hidden_size, np.float32)       # a checkpoint trained with bias=False
    else:
        ids = hf.get("eagle_aux_hidden_state_layer_ids")
        L = target.config.num_layers
        if ids:
            if any(int(i) < 1 for i in ids):
                raise ValueError(f"{path}: eagle_aux_hidden_state_layer_ids {list(ids)} include 0 (the embedding "
                                 "output), which specjax does not expose; ids are HF hidden_states indices >= 1")
            layers = tuple(int(i) - 1 for i in ids)
        else:
            layers = reference_target_layers(L)
        N = int(hf.get("draft_vocab_size") or layer.vocab_size)
        config = EagleConfig("eagle3", layer, int(hf.get("target_hidden_size") or layer.hidden_size), layers, N,
                             bool(hf.get("norm_before_residual", False)), bool(hf.get("fc_norm", False)),
                             bool(hf.get("norm_output", False)))
        take("fc_w", "fc.weight", transpose=True)
        if config.fc_norm:                         # EAGLE-3.1: one RMSNorm weight per fused feature
            names["fc_norm"] = "fc_norm.<i>.weight"
            norms = [f"fc_norm.{i}.weight" for i in range(len(layers))]
            absent = [n for n in norms if n not in t]
            if absent:
                raise ValueError(f"EAGLE-3.1 checkpoint {path} (fc_norm) is missing tensor(s) {absent}")
            flat["fc_norm"] = np.stack([np.asarray(t[n], np.float32) for n in norms])
        take("final_norm", "norm.weight")
        take("lm_head", "lm_head.weight", transpose=True)
        if "d2t" in t:
            d2t = check_vocab_map(t["d2t"], layer.vocab_size, N, path, t.get("t2d"))
        elif N == layer.vocab_size:
            d2t = np.zeros(N, np.int64)                                  # full vocabulary: identity map
        else:
            raise ValueError(f"EAGLE-3 checkpoint {path} has draft_vocab_size={N} < vocab_size="
                             f"{layer.vocab_size} but no d2t map")
    _check_shapes(flat, config, path, names)
    weights = EagleWeights(config, jax.tree_util.tree_map(jnp.asarray, artifacts.unflatten_params(flat)), d2t,
                           os.path.basename(os.path.normpath(path)))
    check_target(weights, target)
    return weights


def export_published(path: str | os.PathLike, weights: EagleWeights, dtype: str = "float32",
                     torch_bin: bool = False) -> None:
    """Write the published layout (EAGLE-1: fc/layers.0, EAGLE-3: fc/midlayer/norm/lm_head/d2t/t2d; config.json a
    Llama layer config, for EAGLE-3 with draft_vocab_size, target_hidden_size, norm_before_residual and the
    feature layers as `eagle_aux_hidden_state_layer_ids` = [l + 1 for l in target_layers], the HF hidden_states
    indices vLLM reads). torch_bin: pytorch_model.bin instead of model.safetensors (needs torch)."""
    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
    cfg, path = weights.config, os.fspath(path)
    if cfg.parallel_drafting:
        raise ValueError(f"EAGLE drafter {weights.name!r} is a P-EAGLE (parallel_drafting) drafter: its learned "
                         "mask embedding and shared hidden state have no place in the EAGLE-3 layout; keep our "
                         "artifact (eagle.save)")
    os.makedirs(path, exist_ok=True)
    flat = artifacts.flatten_params(jax.device_get(weights.params))
    is3 = cfg.kind == "eagle3"
    pfx = "midlayer." if is3 else "layers.0."
    sd = {}
    for key, a in flat.items():
        a = np.asarray(a, np.float32)
        if key.startswith("layer."):
            ours = key[len("layer."):]
            sd[pfx + _LAYER_NAMES[ours]] = a.T if ours in _TRANSPOSED else a
        elif key == "fc_norm":
            sd.update({f"fc_norm.{i}.weight": w for i, w in enumerate(a)})
        else:
            theirs = {"fc_w": "fc.weight", "fc_b": "fc.bias", "final_norm": "norm.weight",
                      "lm_head": "lm_head.weight", "embed": "embed_tokens.weight"}[key]
            sd[theirs] = a.T if key in ("fc_w", "lm_head") else a
    sd = {k: np.ascontiguousarray(v.astype(np_dtype)) for k, v in sd.items()}
    hf = ModelConfig.to_hf(dataclasses.replace(cfg.layer, num_layers=1))
    for key in ("eos_token_id", "bos_token_id"):
        hf.pop(key, None)
    if is3:
        d2t = np.asarray(weights.d2t, np.int64)
        sd["d2t"], sd["t2d"] = d2t, t2d_from_d2t(d2t, cfg.vocab_size)
        hf.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=cfg.draft_vocab_size,
                  target_hidden_size=cfg.target_hidden_size, norm_before_residual=cfg.norm_before_residual,
                  eagle_aux_hidden_state_layer_ids=[i + 1 for i in cfg.target_layers])
        if cfg.fc_norm or cfg.norm_output:                                # EAGLE-3.1's config switches
            hf.update(fc_norm=cfg.fc_norm, norm_output=cfg.norm_output)
    else:
        hf.update(bias=True)                                              # the reference's fc bias flag
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=1)
    if torch_bin:
        import torch
        tsd = {k: torch.from_numpy(np.array(v, np.float32) if v.dtype == ml_dtypes.bfloat16 else np.array(v))
               for k, v in sd.items()}
        torch.save(tsd, os.path.join(path, "pytorch_model.bin"))
    else:
        save_file(sd, os.path.join(path, "model.safetensors"))


def load(path_or_name: str | os.PathLike, target, kind: str | None = None) -> EagleWeights:
    """Our artifact, a published layout, or a shipped name -> EagleWeights for this target (kind: refuse others)."""
    path = resolve(path_or_name, "drafter")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"EAGLE drafter directory {path} has no config.json")
    with open(cfg_path) as f:
        meta = json.load(f)
    if "specjax_drafter" not in meta:
        return load_published(path, target, kind)
    found = meta.get("specjax_drafter")
    if found not in KINDS or (kind is not None and found != kind):
        raise ValueError(f"{path} holds a {found!r} drafter, not {kind or 'an EAGLE'!r} one")
    return _load_ours(path, target, found)
