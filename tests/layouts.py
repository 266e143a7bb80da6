"""Writers of published drafter checkpoint layouts, by hand from our weights (no reference code needed): EAGLE-1,
EAGLE-3 and speculators state dicts, FasterDecoding/Medusa's and vLLM's Medusa heads. Loading what they write must
give our logits back; the reproduce experiment's test loads them as published checkpoints."""
from __future__ import annotations

import json
import os

import jax
import numpy as np
from safetensors.numpy import save_file

from specjax.drafters import eagle, medusa
from specjax.models import Model


def eagle_published_state_dict(w: eagle.EagleWeights, target: Model, layout: str) -> tuple[dict, dict]:
    """Our EAGLE weights in a published layout ("eagle1", "eagle3", "eagle3.1", "speculators"): (state dict in torch's [out, in]
    convention, config.json)."""
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float32), w.params)
    lp, c = p["layer"], w.config.layer
    pfx = {"eagle1": "layers.0.", "eagle3": "midlayer.", "eagle3.1": "midlayer.", "speculators": "layers.0."}[layout]
    sd = {pfx + "self_attn.q_proj.weight": lp["wq"].T, pfx + "self_attn.k_proj.weight": lp["wk"].T,
          pfx + "self_attn.v_proj.weight": lp["wv"].T, pfx + "self_attn.o_proj.weight": lp["wo"].T,
          pfx + "post_attention_layernorm.weight": lp["mlp_norm"], pfx + "mlp.gate_proj.weight": lp["w_gate"].T,
          pfx + "mlp.up_proj.weight": lp["w_up"].T, pfx + "mlp.down_proj.weight": lp["w_down"].T,
          "fc.weight": p["fc_w"].T}
    llama = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": c.hidden_size,
             "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_heads,
             "num_key_value_heads": c.num_kv_heads, "num_hidden_layers": 1, "rms_norm_eps": c.rms_norm_eps,
             "rope_theta": c.rope_theta, "vocab_size": c.vocab_size, "max_position_embeddings": 2048}
    if layout == "eagle1":
        sd["fc.bias"] = p["fc_b"]
        sd["embed_tokens.weight"] = np.asarray(target.params["embed"])
        return {k: np.ascontiguousarray(v) for k, v in sd.items()}, dict(llama, bias=True)
    sd.update({pfx + "input_layernorm.weight": lp["attn_norm"], pfx + "hidden_norm.weight": lp["hidden_norm"],
               "norm.weight": p["final_norm"], "lm_head.weight": p["lm_head"].T, "d2t": np.asarray(w.d2t),
               "t2d": eagle.t2d_from_d2t(w.d2t, c.vocab_size)})
    sd = {k: np.ascontiguousarray(v) for k, v in sd.items()}
    ids = [i + 1 for i in w.config.target_layers]
    if layout in ("eagle3", "eagle3.1"):
        hf = dict(llama, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=w.config.draft_vocab_size,
                  eagle_aux_hidden_state_layer_ids=ids)
        if layout == "eagle3.1":                 # vLLM's EAGLE-3.1 switches and per-feature norms
            sd.update({f"fc_norm.{i}.weight": np.ascontiguousarray(a) for i, a in enumerate(p["fc_norm"])})
            hf.update(fc_norm=True, norm_output=True)
        return sd, hf
    return sd, {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                "transformer_layer_config": llama, "draft_vocab_size": w.config.draft_vocab_size,
                "target_hidden_size": target.config.hidden_size, "norm_before_residual": False,
                "eagle_aux_hidden_state_layer_ids": ids, "speculators_config": {"algorithm": "eagle3"}}


def write_checkpoint(path: str, state_dict: dict, config: dict, torch_bin: bool = False) -> None:
    """config.json and model.safetensors (pytorch_model.bin when torch_bin: torch is imported only then)."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    if torch_bin:
        import torch
        torch.save({k: torch.from_numpy(np.array(v)) for k, v in state_dict.items()},
                   os.path.join(path, "pytorch_model.bin"))
    else:
        save_file(state_dict, os.path.join(path, "model.safetensors"))


def write_medusa_repo_layout(path: str, heads: medusa.MedusaHeads, target: Model, torch_file: bool = False) -> None:
    """FasterDecoding/Medusa: medusa_lm_head with {head}.{layer}.linear.weight/bias and {head}.{L}.weight."""
    os.makedirs(path, exist_ok=True)
    p = jax.tree_util.tree_map(np.asarray, heads.params)
    sd = {}
    for i in range(heads.num_heads):
        for r in range(heads.num_layers):
            sd[f"{i}.{r}.linear.weight"] = np.ascontiguousarray(p["w"][i, r].T)
            sd[f"{i}.{r}.linear.bias"] = p["b"][i, r]
        sd[f"{i}.{heads.num_layers}.weight"] = np.ascontiguousarray(p["proj"][i].T)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"medusa_num_heads": heads.num_heads, "medusa_num_layers": heads.num_layers,
                   "base_model_name_or_path": "stdlib-target", "hidden_size": target.config.hidden_size,
                   "vocab_size": target.config.vocab_size}, f)
    if torch_file:
        import torch
        torch.save({k: torch.from_numpy(np.array(v)) for k, v in sd.items()}, os.path.join(path, "medusa_lm_head.pt"))
    else:
        save_file(sd, os.path.join(path, "medusa_lm_head.safetensors"))


def write_vllm_medusa_layout(path: str, heads: medusa.MedusaHeads, target: Model) -> None:
    """vLLM's MedusaModel: blocks.{head}.layers.{layer}.weight/bias, lm_heads.{head}.weight."""
    os.makedirs(path, exist_ok=True)
    p = jax.tree_util.tree_map(np.asarray, heads.params)
    sd = {}
    for i in range(heads.num_heads):
        for r in range(heads.num_layers):
            sd[f"blocks.{i}.layers.{r}.weight"] = np.ascontiguousarray(p["w"][i, r].T)
            sd[f"blocks.{i}.layers.{r}.bias"] = p["b"][i, r]
        sd[f"lm_heads.{i}.weight"] = np.ascontiguousarray(p["proj"][i].T)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"architectures": ["MedusaModel"], "model_type": "medusa", "num_heads": heads.num_heads,
                   "num_hidden_layers": heads.num_layers, "hidden_size": target.config.hidden_size,
                   "vocab_size": target.config.vocab_size, "truncated_vocab_size": None}, f)
    save_file(sd, os.path.join(path, "model.safetensors"))


def write_dflash_layout(path: str, weights, mask_token_id: int) -> None:
    """The public DFlash drafter layout (its HF config.json with dflash_config, torch-style [out, in] Linear weights
    in model.safetensors) holding `weights` (specjax.drafters.dflash.DFlashWeights)."""
    cfg, p = weights.config, weights.params
    config = {"architectures": ["DFlashDraftModel"], "hidden_size": cfg.hidden_size,
              "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
              "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
              "intermediate_size": cfg.intermediate_size, "rms_norm_eps": cfg.rms_norm_eps,
              "rope_theta": cfg.rope_theta, "vocab_size": cfg.vocab_size,
              "dflash_config": {"target_layer_ids": list(cfg.target_layers), "block_size": cfg.block_size,
                                "mask_token_id": mask_token_id}}
    a = lambda x: np.ascontiguousarray(np.asarray(x, np.float32))
    t = {"fc.weight": a(np.asarray(p["fc"]).T), "hidden_norm.weight": a(p["hidden_norm"]),
         "norm.weight": a(p["final_norm"])}
    names = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
             "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}
    for i, lp in enumerate(p["layers"]):
        pre = f"layers.{i}."
        t.update({pre + names[k] + ".weight": a(np.asarray(lp[k]).T) for k in names})
        t.update({pre + "self_attn.q_norm.weight": a(lp["q_norm"]), pre + "self_attn.k_norm.weight": a(lp["k_norm"]),
                  pre + "input_layernorm.weight": a(lp["attn_norm"]),
                  pre + "post_attention_layernorm.weight": a(lp["mlp_norm"])})
    write_checkpoint(path, t, config)
