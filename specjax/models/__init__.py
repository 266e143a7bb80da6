"""Llama-family models: config, pure-function forward, Hugging Face checkpoint I/O."""
from specjax.models.config import ModelConfig
from specjax.models.hf_io import load_pretrained, save_pretrained
from specjax.models.llama import ForwardOut, forward, full_logits, init_params

__all__ = ["ModelConfig", "ForwardOut", "forward", "init_params", "full_logits", "load_pretrained",
           "save_pretrained"]
