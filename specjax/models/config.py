"""Llama-family architecture description, read from / written to Hugging Face config.json."""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np


def float32_decimal(x) -> float:
    """The shortest decimal of x's float32 value (1e-05 for its float32 image 9.999999747e-06): what a setting
    stored in float32 means, so that configs read from float32 and from decimal sources compare equal."""
    return float(str(np.float32(x)))

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    family: str = "llama"                  # llama | mistral | qwen2
    rope_theta: float = 10000.0
    rope_scaling: tuple | None = None      # frozen items of the HF rope_scaling dict
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False           # Qwen2: q/k/v projections carry a bias
    sliding_window: int | None = None      # Mistral
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")

    @property
    def rope_scaling_dict(self) -> dict | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    def num_params(self) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.attention_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads)
        per_layer = attn + 3 * h * i + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + h

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        archs = hf.get("architectures") or []
        family = None
        for a in archs:
            family = SUPPORTED_ARCHITECTURES.get(a)
            if family:
                break
        if family is None:
            mt = hf.get("model_type")
            family = mt if mt in ("llama", "mistral", "qwen2") else None
        if family is None:
            raise ValueError(f"unknown architecture in config.json: architectures={archs}, "
                             f"model_type={hf.get('model_type')!r}; specjax supports "
                             f"{sorted(SUPPORTED_ARCHITECTURES)}")
        n_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // n_heads
        # transformers >= 5 writes `rope_parameters` (rope_theta + scaling in one dict) instead of the legacy
        # top-level `rope_theta` / `rope_scaling`; accept both.
        rs = hf.get("rope_scaling")
        rope_theta = hf.get("rope_theta")
        rp = hf.get("rope_parameters")
        if isinstance(rp, dict) and rp:
            if rope_theta is None:
                rope_theta = rp.get("rope_theta")
            if rs is None:
                rs = rp
        if rs is not None:
            rtype = rs.get("rope_type", rs.get("type"))
            if rtype not in ("llama3", "linear", "default"):
                raise ValueError(f"unsupported rope_scaling type {rtype!r} in config.json")
            rs = None if rtype == "default" else tuple(sorted(
                (k, v) for k, v in rs.items() if k != "rope_theta" and not isinstance(v, (list, dict))))
        sliding = hf.get("sliding_window") if family == "mistral" else None
        if family == "qwen2" and hf.get("use_sliding_window"):
            raise ValueError("Qwen2 use_sliding_window=True is not supported")
        eos = hf.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0]
        return cls(
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"], num_heads=n_heads,
            num_kv_heads=hf.get("num_key_value_heads") or n_heads, head_dim=head_dim, family=family,
            rope_theta=float(10000.0 if rope_theta is None else rope_theta), rope_scaling=rs,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6 if family == "qwen2" else 1e-5)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", family == "qwen2")),
            sliding_window=sliding, max_position_embeddings=hf.get("max_position_embeddings", 2048),
            bos_token_id=hf.get("bos_token_id"), eos_token_id=eos,
        )

    def to_hf(self) -> dict[str, Any]:
        arch = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}[self.family]
        out = {
            "architectures": [arch], "model_type": self.family, "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim, "hidden_act": "silu",
            "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling_dict,
            "rms_norm_eps": self.rms_norm_eps, "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings, "torch_dtype": "float32",
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
        }
        if self.family == "llama":
            out.update(attention_bias=self.attention_bias, mlp_bias=False)
        if self.family == "mistral":
            out["sliding_window"] = self.sliding_window
        if self.family == "qwen2":
            out.update(use_sliding_window=False, sliding_window=None, max_window_layers=self.num_layers)
        return out
