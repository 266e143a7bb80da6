"""Llama-family models: config, pure-function forward, checkpoint I/O, and the loaded Model."""
from specjax.models.config import ModelConfig
from specjax.models.hf_io import SafetensorsFile, load_pretrained, save_pretrained
from specjax.models.llama import ForwardOut, forward, full_logits, init_params
from specjax.models.model import Model, load_model, model_directory

__all__ = ["ModelConfig", "ForwardOut", "Model", "SafetensorsFile", "forward", "init_params", "full_logits",
           "load_model", "load_pretrained", "model_directory", "save_pretrained"]
