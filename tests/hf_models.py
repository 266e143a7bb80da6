"""Tiny random transformers models (Llama with GQA, Llama-3 RoPE scaling, Qwen2 with qkv bias and tied embeddings,
Mistral with a sliding window) for parity against transformers. Import it only after
pytest.importorskip("torch") and ("transformers"): both are optional."""
from __future__ import annotations

import torch
import transformers

VOCAB, SW = 128, 8            # vocabulary size, Mistral's sliding window
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)
CASES = {
    "llama_gqa": ("LlamaConfig", dict(tie_word_embeddings=False, rope_theta=10000.0)),
    "llama3_rope": ("LlamaConfig", dict(tie_word_embeddings=False, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    "qwen2_tied": ("Qwen2Config", dict(tie_word_embeddings=True, rope_theta=1000000.0)),
    "mistral_swa": ("MistralConfig", dict(tie_word_embeddings=False, sliding_window=SW)),
}


def hf_model(kind: str, seed: int = 0) -> "transformers.PreTrainedModel":
    """A random float32 eager-attention model of CASES[kind], in eval mode."""
    cls_name, extra = CASES[kind]
    cfg = getattr(transformers, cls_name)(**COMMON, **extra)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    # Non-trivial weights everywhere (HF inits norms to 1 and biases to 0, which would hide layout bugs).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
        if cfg.tie_word_embeddings:
            model.tie_weights()
    return model
