"""SpecConfig: what to run, with vLLM-style names, validated on construction."""
from __future__ import annotations

import dataclasses

from specjax.sampling import SamplingParams, validate_sampling
from specjax.trees import TreeSpec

CHAIN_METHODS = ("none", "draft_model", "ngram", "predicted")
TREE_METHODS = ("draft_model",)                    # drafters that can propose token trees
MAX_SPECULATIVE_TOKENS = 64                        # drafted tokens per step (tree nodes besides the root)


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
    # Token trees (SGLang names). Dynamic EAGLE-2 tree: all three of num_steps (depth), topk (children per node
    # and frontier width) and num_draft_tokens (verified tokens per step, the root included, so a tree drafts
    # num_draft_tokens - 1 tokens). Static tree: tree_choices (Medusa/EAGLE choices, e.g. trees.MEDUSA_63).
    num_steps: int | None = None
    topk: int | None = None
    num_draft_tokens: int | None = None
    tree_choices: tuple | None = None              # normalised to sorted tuples of ints on construction

    def __post_init__(self):
        if self.method not in CHAIN_METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; choose one of {CHAIN_METHODS}")
        self._validate_tree()
        k = self.num_speculative_tokens
        if self.is_tree:
            if k is not None and k != self.k:
                raise ValueError(f"num_speculative_tokens={k} disagrees with the tree, which drafts {self.k} "
                                 "tokens per step; leave num_speculative_tokens unset for trees")
        elif self.method == "none":
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

    def _validate_tree(self) -> None:
        dynamic = {"num_steps": self.num_steps, "topk": self.topk, "num_draft_tokens": self.num_draft_tokens}
        if self.tree_choices is None and all(v is None for v in dynamic.values()):
            return
        if self.method not in TREE_METHODS:
            raise ValueError(f"token trees are supported for method in {TREE_METHODS}, not {self.method!r}")
        if self.tree_choices is not None:
            if any(v is not None for v in dynamic.values()):
                raise ValueError("give either tree_choices (a static tree) or num_steps/topk/num_draft_tokens "
                                 "(a dynamic tree), not both")
            try:
                choices = TreeSpec.from_choices(self.tree_choices, max_nodes=MAX_SPECULATIVE_TOKENS + 1).choices
            except (ValueError, TypeError) as e:
                raise ValueError(f"malformed tree_choices: {e}") from None
            object.__setattr__(self, "tree_choices", choices)     # hashable: the config is a static jit arg
            return
        missing = [n for n, v in dynamic.items() if v is None]
        if missing:
            raise ValueError(f"a dynamic tree needs num_steps, topk and num_draft_tokens; missing {missing}")
        for n, v in dynamic.items():
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{n} must be an int >= 1, got {v!r}")
        steps, topk = self.num_steps, self.topk
        most = 1 + topk + (steps - 1) * topk * topk      # root + root's top-k + top-k children of each frontier
        if not 2 <= self.num_draft_tokens <= min(most, MAX_SPECULATIVE_TOKENS + 1):
            raise ValueError(f"num_draft_tokens={self.num_draft_tokens} (root included) must be in "
                             f"[2, {min(most, MAX_SPECULATIVE_TOKENS + 1)}] for num_steps={steps}, topk={topk}")

    @property
    def is_tree(self) -> bool:
        return self.tree_choices is not None or self.num_draft_tokens is not None

    @property
    def tree(self) -> TreeSpec | None:
        """The static tree, or None (chain or dynamic tree)."""
        return TreeSpec.from_choices(self.tree_choices) if self.tree_choices is not None else None

    @property
    def k(self) -> int:
        """Drafted tokens per step: the chain length, or the tree's nodes besides the root."""
        if self.tree_choices is not None:
            return len(self.tree_choices)
        if self.num_draft_tokens is not None:
            return self.num_draft_tokens - 1
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
