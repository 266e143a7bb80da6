"""specjax: exact speculative decoding in JAX/Pallas, every drafter in one jit-compiled loop."""
from specjax.api import GenerateResult, Model, available_drafters, available_models, generate, load_model
from specjax.config import SpecConfig
from specjax.sampling import SamplingParams
from specjax import analysis, sharding, trees  # noqa: F401  (public submodules)

__all__ = ["GenerateResult", "Model", "SpecConfig", "SamplingParams", "available_drafters", "available_models", "generate", "load_model"]
