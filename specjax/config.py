"""SpecConfig: what to run, with vLLM-style names, validated on construction."""
from __future__ import annotations

import dataclasses

from specjax.sampling import SamplingParams, validate_sampling

CHAIN_METHODS = ("none", "draft_model", "ngram", "predicted")
MAX_SPECULATIVE_TOKENS = 64


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    method: str = "none"
    num_speculative_tokens: int | None = None       # k; required for every method but "none"
    prompt_lookup_min: int | None = None           # ngram / predicted: vLLM defaults (5, each copies the other)
    prompt_lookup_max: int | None = None
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 64
    stop_at_eos: bool = True
    max_cache_len: int | None = None               # None: longest prompt + max_new_tokens + k + 1
    implementation: str = "xla"                    # attention path: "xla" | "pallas" | "pallas_gpu" | "pallas_tpu"

    def __post_init__(self):
        if self.method not in CHAIN_METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; choose one of {CHAIN_METHODS}")
        k = self.num_speculative_tokens
        if self.method == "none":
            if k not in (None, 0):
                raise ValueError(f"method='none' takes no num_speculative_tokens (got {k})")
        else:
            if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
                raise ValueError(f"num_speculative_tokens (k) must be an int in [1, {MAX_SPECULATIVE_TOKENS}] "
                                 f"for method={self.method!r}, got {k!r}")
        validate_sampling(self.temperature, self.top_k, self.top_p)
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"prompt_lookup_min={lo} > prompt_lookup_max={hi}")
        if self.implementation not in ("xla", "pallas", "pallas_gpu", "pallas_tpu"):
            raise ValueError(f"unknown attention implementation {self.implementation!r}")

    @property
    def k(self) -> int:
        return self.num_speculative_tokens or 0

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p)

    @property
    def lookup_range(self) -> tuple[int, int]:
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            return 5, 5
        return (lo if lo is not None else hi), (hi if hi is not None else lo)
