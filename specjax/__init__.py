"""specjax: exact speculative decoding in JAX/Pallas, every drafter in one jit-compiled loop."""
from specjax.api import (GenerateResult, Model, Prepared, available_drafters, available_models, generate,
                         load_model, prepare, run)
from specjax.config import SpecConfig
from specjax.sampling import SamplingParams
from specjax import analysis, layout, sharding, trees  # noqa: F401  (public submodules)

__all__ = ["GenerateResult", "Model", "Prepared", "SpecConfig", "SamplingParams", "available_drafters",
           "available_models", "generate", "load_model", "prepare", "run"]
