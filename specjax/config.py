"""SpecConfig: what to run, with vLLM-style names.

Construction checks everything that holds whatever the method: types and ranges (k, sampling, max_new_tokens, the
prompt lookup range, the attention implementation, the acceptance rule, the policy's fields), the structure of a
token tree, and that the method is a non-empty name. What depends on the method -- is it registered, which fields
and drafter_options it reads, can it draft trees, k derived from its options, its default verify_widths, its own
checks, the per-batch configs of a draft_len_schedule -- is specjax.drafters.registry.resolve(config)'s, which
returns the config completed for its method; generate() and prepare() resolve theirs before anything else, so a
bad config fails there at the latest, with the same message. This module knows no drafter: it sits below them.
"""
from __future__ import annotations

import dataclasses

from typing import Any, Mapping

from specjax.sampling import SamplingParams, validate_sampling
from specjax.tree_search import max_dynamic_nodes
from specjax.trees import TreeSpec, draft_depth

MAX_SPECULATIVE_TOKENS = 64                        # drafted tokens per step (tree nodes besides the root)
ACCEPTANCE_RATE_WINDOW = 16                        # speculative steps the acceptance switch averages by default
PLAIN_METHOD = "none"                              # plain decoding: k = 0, no drafter


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    method: str = PLAIN_METHOD
    num_speculative_tokens: int | None = None       # k; required for every method but "none" and those whose
                                                    # options fix it (derived then by registry.resolve;
                                                    # DrafterSpec.derive_k)
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
    # Acceptance rule at temperature > 0. "exact": speculative sampling, the output is distributed as the target's.
    # "typical_lossy": Medusa's typical acceptance (accept a draft whose target probability exceeds
    # min(posterior_threshold, posterior_alpha * exp(-entropy))) -- LOSSY, the output distribution shifts.
    acceptance_method: str = "exact"
    posterior_threshold: float = 0.09
    posterior_alpha: float = 0.3
    # Settings of one drafter beyond the shared fields, e.g. {"posterior_threshold": 0.09}; each drafter declares
    # the names, defaults and allowed values it takes (specjax.drafters.registry). Stored as sorted items; a
    # resolved config (registry.resolve) holds every option its method declares, defaults filled in.
    drafter_options: Any = None
    # The dynamic speculation policy (TensorRT-LLM's names and rules). draft_len_schedule {max batch size: k}: a
    # batch of B requests drafts the k of the smallest key >= B, and none past the largest key (speculation off:
    # at large batch a verify pass costs more than the tokens it saves); k may not exceed num_speculative_tokens
    # (a tree drafts all its nodes or nothing). acceptance_rate_threshold: speculation is switched off for the
    # rest of a call once the batch's accepted / drafted over its last acceptance_rate_window_size speculative
    # steps falls below it. Greedy output stays plain greedy output and sampled output keeps the target's
    # distribution; a sampled request's draw then depends on its batch (which k, when the switch came).
    draft_len_schedule: Any = None
    acceptance_rate_threshold: float | None = None
    acceptance_rate_window_size: int = ACCEPTANCE_RATE_WINDOW
    # Confidence-gated drafting (a chain): a row proposes only the leading drafts whose running product of the
    # drafter's top probabilities (Draft.confidence) stays >= this, and a step in which no active row proposes
    # anything verifies one position, not k + 1 (a step that costs a decode step, not a verify pass), and a chain
    # drafter (draft model, EAGLE, layer skip) drafts nothing past its first pick then. In a wider step every draft
    # is verified. The drafts are still verified exactly: greedy output stays plain greedy output and sampled
    # output keeps the target's distribution. None: every step verifies k + 1.
    draft_confidence_threshold: float | None = None
    # Narrower verify passes for a drafter that says how much it proposed (prompt lookup, suffix decoding,
    # predicted outputs; a chain under draft_confidence_threshold): each step verifies the fewest of these draft
    # counts (and k) that hold every active row's proposal, so a step whose rows proposed 1 or 2 drafts verifies
    # 2 or 3 positions, not k + 1 (where a wider pass costs more than a decode step, as on a CPU). Drafts past the
    # width are filler and are not verified; the output is unchanged (greedy) or keeps the target's distribution
    # (sampled: the width is fixed before the drafts it cuts are drawn). Each row is verified at its own width
    # inside a pass a batch mate made wider, so a request's output does not depend on its batch. Each width is
    # one more compiled copy of the step. None: the method's default, filled in by registry.resolve (suffix
    # decoding: the powers of two below k; others k only); (): k only.
    verify_widths: tuple | None = None

    def __post_init__(self):
        """The checks that hold whatever the method (the method's own: specjax.drafters.registry.resolve). The
        k-dependent ones (verify_widths, draft_len_schedule) run once k is known: given, a tree's, or derived by
        resolve, whose completed config is built through here again."""
        if not isinstance(self.method, str) or not self.method:
            raise ValueError(f"method must be the name of a speculative method (a non-empty string: "
                             f"specjax.drafters.registry.methods()), got {self.method!r}")
        self._normalise_options()
        self._validate_tree()
        k = self.num_speculative_tokens
        if self.is_tree:
            if k is not None and k != self.k:
                raise ValueError(f"num_speculative_tokens={k} disagrees with the tree, which drafts {self.k} "
                                 "tokens per step; leave num_speculative_tokens unset for trees")
        elif self.method == PLAIN_METHOD:
            if k not in (None, 0):
                raise ValueError(f"method='none' takes no num_speculative_tokens (got {k})")
        elif k is not None:
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
        if self.acceptance_method not in ("exact", "typical_lossy"):
            raise ValueError(f"acceptance_method must be 'exact' or 'typical_lossy' (lossy, opt-in), got "
                             f"{self.acceptance_method!r}")
        if self.acceptance_method == "exact" and (self.posterior_threshold, self.posterior_alpha) != (0.09, 0.3):
            raise ValueError("posterior_threshold / posterior_alpha only apply to acceptance_method='typical_lossy'")
        for name in ("posterior_threshold", "posterior_alpha"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not 0 < v <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {v!r}")
        self._validate_policy()

    def _normalise_options(self) -> None:
        """drafter_options as sorted (name, value) items, lists made tuples: the config is a static argument of
        the compiled loop, so it must hash. Which names and values a method takes: registry.resolve."""
        opts = self.drafter_options
        if opts is None:
            opts = {}
        elif isinstance(opts, tuple):
            try:
                opts = dict(opts)
            except (TypeError, ValueError):
                pass                                        # refused just below
        if not isinstance(opts, Mapping):
            raise TypeError(f"drafter_options must be a dict of option name -> value, got {type(opts).__name__}")
        for name in opts:
            if not isinstance(name, str):
                raise TypeError(f"drafter_options names must be strings, got {name!r}")
        opts = {name: tuple(v) if isinstance(v, list) else v for name, v in opts.items()}
        object.__setattr__(self, "drafter_options", tuple(sorted(opts.items())) or None)

    def _known_k(self) -> int | None:
        """k where the config itself tells it (a tree, num_speculative_tokens, method 'none'); None where only the
        method's options do (registry.resolve derives it)."""
        if self.tree_choices is not None:
            return len(self.tree_choices)
        if self.num_draft_tokens is not None:
            return self.num_draft_tokens - 1
        if self.num_speculative_tokens is not None:
            return self.num_speculative_tokens
        return 0 if self.method == PLAIN_METHOD else None

    def _validate_policy(self) -> None:
        c = self.draft_confidence_threshold
        if c is not None:
            if not isinstance(c, (int, float)) or isinstance(c, bool) or not 0 < c <= 1:
                raise ValueError(f"draft_confidence_threshold must be in (0, 1] (a probability), got {c!r}")
            if self.is_tree:
                raise ValueError("draft_confidence_threshold applies to chains; a tree verifies all its nodes")
        k = self._known_k() or None         # 0 (method 'none'): the method reads neither field (resolve says so)
        widths = self.verify_widths
        if widths is not None:
            if not isinstance(widths, (list, tuple)) or not all(
                    isinstance(w, int) and not isinstance(w, bool) and 1 <= w and (k is None or w < k)
                    for w in widths):
                bound = f"[1, k) = [1, {k})" if k is not None else "[1, k)"
                raise ValueError(f"verify_widths must be draft counts in {bound} (k itself is always one), got "
                                 f"{widths!r}")
            if self.is_tree:
                raise ValueError("verify_widths applies to chains and drafters' own trees; a configured tree verifies "
                                 "all its nodes")
            object.__setattr__(self, "verify_widths", tuple(sorted(set(widths))))   # hashable: a static jit arg
        t, w = self.acceptance_rate_threshold, self.acceptance_rate_window_size
        if t is not None and (not isinstance(t, (int, float)) or isinstance(t, bool) or not 0 <= t <= 1):
            raise ValueError(f"acceptance_rate_threshold must be in [0, 1] (accepted / drafted), got {t!r}")
        if not isinstance(w, int) or isinstance(w, bool) or w < 1:
            raise ValueError(f"acceptance_rate_window_size must be an int >= 1, got {w!r}")
        if t is None and w != ACCEPTANCE_RATE_WINDOW:
            raise ValueError("acceptance_rate_window_size only applies with an acceptance_rate_threshold")
        schedule = self.draft_len_schedule
        if schedule is None:
            return
        pairs = list(schedule.items()) if isinstance(schedule, Mapping) else schedule
        ok = isinstance(pairs, (list, tuple)) and len(pairs) > 0 and all(
            isinstance(p, (list, tuple)) and len(p) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in p) for p in pairs)
        if not ok:
            raise ValueError(f"draft_len_schedule must be a non-empty dict {{max batch size: k}} of ints, "
                             f"got {schedule!r}")
        items = tuple(sorted((b, k) for b, k in pairs))
        for b, bk in items:
            if b < 1:
                raise ValueError(f"draft_len_schedule: batch size {b} must be >= 1")
            if k is None:                   # derived by registry.resolve, which checks the schedule against it
                continue
            allowed = (0, k) if self.is_tree else range(k + 1)
            if bk not in allowed:
                raise ValueError(f"draft_len_schedule: k={bk} for batches up to {b} must be "
                                 + (f"0 or the tree's {k} drafted tokens (a tree cannot be cut)" if self.is_tree
                                    else f"in [0, num_speculative_tokens={k}]"))
        object.__setattr__(self, "draft_len_schedule", items)       # hashable: the config is a static jit arg

    def for_batch(self, batch_size: int) -> "SpecConfig":
        """The config a batch of `batch_size` requests runs: draft_len_schedule resolved to its k (0: plain
        decoding, method 'none'), the schedule itself dropped. Without a schedule, this config. Of a resolved
        config, a resolved config (registry.resolve checks each scheduled one)."""
        if self.draft_len_schedule is None:
            return self
        k = next((k for b, k in self.draft_len_schedule if batch_size <= b), 0)
        if k == 0:
            plain = ("temperature", "top_k", "top_p", "max_new_tokens", "stop_at_eos", "max_cache_len",
                     "implementation")
            return SpecConfig(**{f: getattr(self, f) for f in plain})
        if self.is_tree:
            return dataclasses.replace(self, draft_len_schedule=None)
        narrower = None if self.verify_widths is None else tuple(w for w in self.verify_widths if w < k)
        return dataclasses.replace(self, num_speculative_tokens=k, draft_len_schedule=None, verify_widths=narrower)

    def option(self, name: str) -> Any:
        """The value of one of the method's drafter_options. A resolved config (specjax.drafters.registry.resolve,
        which generate() and prepare() apply) holds every option its method declares, defaults filled in."""
        opts = dict(self.drafter_options or ())
        if name not in opts:
            raise KeyError(f"method={self.method!r}: this config holds no drafter option {name!r}; resolve it "
                           "first (specjax.drafters.registry.resolve(config) fills in every option the method "
                           "declares, with its default, and refuses one it does not declare)")
        return opts[name]

    def _validate_tree(self) -> None:
        """The tree's structure (whether the method drafts trees: registry.resolve)."""
        dynamic = {"num_steps": self.num_steps, "topk": self.topk, "num_draft_tokens": self.num_draft_tokens}
        if self.tree_choices is None and all(v is None for v in dynamic.values()):
            return
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
        most = max_dynamic_nodes(steps, topk)
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
        """Drafted tokens per step: the tree's nodes besides the root, num_speculative_tokens, or 0 for method
        'none'. A method whose options fix k (DrafterSpec.derive_k) has it once resolved (registry.resolve fills
        num_speculative_tokens in); asked before, this is an error."""
        k = self._known_k()
        if k is None:
            raise ValueError(f"method={self.method!r}: num_speculative_tokens is unset, so k is the method's to "
                             "derive from its drafter_options: resolve the config first "
                             "(specjax.drafters.registry.resolve(config); generate() and prepare() do)")
        return k

    @property
    def draft_depth(self) -> int:
        """How many tokens deep one step drafts (trees.draft_depth)."""
        return draft_depth(self.tree, self.num_steps, self.k)

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p)

    @property
    def lookup_range(self) -> tuple[int, int]:
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            return 5, 5
        return (lo if lo is not None else hi), (hi if hi is not None else lo)
