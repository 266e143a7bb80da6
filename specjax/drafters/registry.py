"""The drafter registry: each drafter module describes itself once, and everything else reads the description.

A drafter module calls `register(DrafterSpec(...))` at import time. The spec names the method (vLLM's name where
vLLM has one), the SpecConfig fields it reads, its own options (`SpecConfig(drafter_options={...})`), whether it
drafts token trees, how to build it from what the user passed as `drafter=`, and how its params are laid out on
a ("data", "model") mesh. `resolve(config)` checks a SpecConfig against its method and completes it (SpecConfig
itself checks only what holds whatever the method, and imports nothing of the drafters); `generate()` and
`prepare()` resolve every config first. Resolving, `generate()`, the experiments' cost measurement and sharding all
go through `get(method)`; no other code branches on method names.

Modules and packages inside the specjax.drafters package are discovered on the first lookup, so adding a drafter
is adding its module (or package). Code outside the package (a user's own drafter, a test) calls `register` itself.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
import pkgutil
import warnings
from typing import Any, Callable, Mapping, NamedTuple

from specjax.config import MAX_SPECULATIVE_TOKENS, SpecConfig
from specjax.models.model import Model

# Fields every method reads: the loop's own settings.
COMMON_FIELDS = ("method", "num_speculative_tokens", "temperature", "top_k", "top_p", "max_new_tokens",
                 "stop_at_eos", "max_cache_len", "implementation", "drafter_options", "acceptance_method",
                 "posterior_threshold", "posterior_alpha")
TREE_FIELDS = ("num_steps", "topk", "num_draft_tokens", "tree_choices")
# The dynamic speculation policy's fields, the confidence gate and the verify widths (specjax.config), read by
# every method that speculates.
POLICY_FIELDS = ("draft_len_schedule", "acceptance_rate_threshold", "acceptance_rate_window_size",
                 "draft_confidence_threshold", "verify_widths")
# What the loop reads of every drafter object besides its methods (specjax.drafters.base.Drafter).
DRAFTER_ATTRIBUTES = ("k", "target_layers", "target_weights")


class Option(NamedTuple):
    """A drafter-specific setting, passed as SpecConfig(drafter_options={name: value})."""
    default: Any
    check: Callable[[Any], bool]      # True when the value is acceptable
    help: str                         # what it means and which values are allowed (shown in errors)


class BuildRequest(NamedTuple):
    """What a builder gets: the resolved config (resolve()), the target, the user's `drafter=` argument (for a
    method with an artifact, already loaded by build(): a directory or shipped name arrives as the loaded
    artifact; predictions, ... or None otherwise), the prompts as token ids, and the length of the loop's
    token/KV buffers."""
    config: SpecConfig
    target: Model
    drafter: Any
    prompts: list[list[int]]
    buffer_len: int


@dataclasses.dataclass(frozen=True)
class DrafterSpec:
    method: str
    # BuildRequest -> (drafter object: hashable and array-free, a static argument of the compiled loop; its
    # arrays, passed to every drafter call as `params`). Raise ValueError/TypeError with a clear message on
    # bad input.
    build: Callable[[BuildRequest], tuple[Any, Any]]
    accepts: str = "nothing"             # what drafter= takes, for error messages and docs
    # (target, a directory or shipped name) -> the loaded artifact, an instance of `artifact`; build() runs it on
    # a path or name, so a builder only ever sees the loaded artifact. A caller that runs many generate() calls
    # loads once with it and passes the artifact. None: the method has no artifact to load.
    load: Callable[[Model, str], Any] | None = None
    artifact: type | tuple[type, ...] | None = None   # the type of a loaded artifact (checked by build())
    reads: tuple[str, ...] = ()          # SpecConfig fields read besides COMMON_FIELDS (and TREE_FIELDS if trees)
    options: Mapping[str, Option] = dataclasses.field(default_factory=dict)
    trees: bool = False                  # can propose token trees (static tree_choices or a dynamic tree)
    speculates: bool = True              # False only for plain decoding (k = 0)
    # (drafter object, params, mesh) -> params rearranged for the mesh before param_specs lays them out (a draft
    # model: vocabulary padded and kv heads replicated like the target, specjax.sharding.apply_layout; the
    # drafter's own code must then size its buffers from the params, e.g. llama.kv_heads). None: as they are.
    prepare_params: Callable[[Any, Any, Any], Any] | None = None
    # (drafter object, params, mesh) -> a PartitionSpec pytree for params. None: every leaf replicated.
    param_specs: Callable[[Any, Any, Any], Any] | None = None
    # True: every params leaf has a leading per-request dim (padded with the batch, split over "data").
    per_request_params: bool = False
    # extra checks on a SpecConfig for this method, run by resolve() on the config with every option filled in
    # (config.option works; config.k does too unless derive_k has yet to fix it)
    validate: Callable[[SpecConfig], None] | None = None
    # (SpecConfig, every option filled in) -> k, for a method whose drafter_options fix the tokens drafted per
    # step (lookahead: (W + G)(N - 1)). resolve() then fills num_speculative_tokens in when unset and refuses one
    # that disagrees. None: k is num_speculative_tokens (or the tree's nodes).
    derive_k: Callable[[SpecConfig], int] | None = None
    # (BuildRequest, outputs: one token-id list per request) -> None, called by generate() after decoding: how a
    # drafter learns across calls (suffix decoding's global cache of earlier outputs). None: nothing to learn.
    finish: Callable[[BuildRequest, list], None] | None = None
    # k -> the narrower verify passes resolve() sets an unset SpecConfig.verify_widths to, for a drafter whose
    # proposals' length varies from step to step (suffix decoding's: with the matched suffix); each width is one
    # more compiled copy of the step, so an all-or-nothing proposer (prompt lookup) leaves it None: every pass
    # verifies k.
    verify_widths: Callable[[int], tuple[int, ...]] | None = None

    @property
    def fields(self) -> tuple[str, ...]:
        return (COMMON_FIELDS + self.reads + (TREE_FIELDS if self.trees else ())
                + (POLICY_FIELDS if self.speculates else ()))


_REGISTRY: dict[str, DrafterSpec] = {}
_BROKEN: dict[str, str] = {}          # drafter modules that failed to import -> the error (shown by get())
_discovered = False


def register(spec: DrafterSpec, replace: bool = False) -> DrafterSpec:
    """Add a method. Registering an existing name is an error unless replace=True (e.g. a test re-running)."""
    if not isinstance(spec, DrafterSpec):
        raise TypeError(f"register() takes a DrafterSpec, got {type(spec).__name__}")
    if spec.method in _REGISTRY and not replace and _REGISTRY[spec.method] != spec:
        raise ValueError(f"speculative method {spec.method!r} is already registered")
    unknown = [f for f in spec.reads if f in COMMON_FIELDS or f in TREE_FIELDS or f in POLICY_FIELDS]
    if unknown:
        raise ValueError(f"{spec.method!r}: reads lists fields every method reads already: {unknown}")
    _REGISTRY[spec.method] = spec
    return spec


def unregister(method: str) -> None:
    _REGISTRY.pop(method, None)


def _discover() -> None:
    global _discovered
    if _discovered:
        return
    _discovered = True
    package = __name__.rsplit(".", 1)[0]              # specjax.drafters; its modules register themselves
    for mod in pkgutil.iter_modules([os.path.dirname(__file__)]):
        if mod.name != "registry":
            try:
                importlib.import_module(f"{package}.{mod.name}")
            except Exception as e:       # one broken drafter must not take every other method down with it
                _BROKEN[mod.name] = f"{type(e).__name__}: {e}"
                warnings.warn(f"specjax drafter module {mod.name!r} failed to import ({_BROKEN[mod.name]}); its "
                              "methods are unavailable", RuntimeWarning, stacklevel=2)


def methods() -> tuple[str, ...]:
    _discover()
    return tuple(sorted(_REGISTRY))


def tree_methods() -> tuple[str, ...]:
    _discover()
    return tuple(sorted(m for m, s in _REGISTRY.items() if s.trees))


def get(method: str) -> DrafterSpec:
    _discover()
    if not isinstance(method, str) or method not in _REGISTRY:
        broken = "".join(f"; drafter module {m!r} failed to import: {e}" for m, e in _BROKEN.items())
        raise ValueError(f"unknown speculative method {method!r}; choose one of {methods()}{broken}")
    return _REGISTRY[method]


def resolve(config: SpecConfig) -> SpecConfig:
    """Check a SpecConfig against its method and complete it: the method registered; every field it sets read by
    the method (one it does not read would be silently ignored); drafter_options declared by the method and
    valid; a tree only for a method that drafts trees; k given where the method needs it; the method's own
    checks (DrafterSpec.validate); and each config a draft_len_schedule runs. -> the config completed (equal for
    equal input: it is the compiled loop's static argument): drafter_options holding every declared option
    (defaults filled in) as sorted items, num_speculative_tokens set where the options fix k (derive_k),
    verify_widths the method's default where unset. Resolving a resolved config returns it unchanged.
    generate() and prepare() resolve their config first; code that builds a drafter from a config does too."""
    if not isinstance(config, SpecConfig):
        raise TypeError(f"resolve() takes a SpecConfig, got {type(config).__name__}")
    spec = get(config.method)
    _check_fields(config, spec)
    options = _resolve_options(config, spec)
    if config.is_tree and not spec.trees:
        raise ValueError(f"method={config.method!r} cannot draft token trees; methods that can: {tree_methods()}")
    k = config.num_speculative_tokens           # SpecConfig checked a given k's type and range
    if not config.is_tree and not spec.speculates and k not in (None, 0):
        raise ValueError(f"method={config.method!r} takes no num_speculative_tokens (got {k})")
    if not config.is_tree and spec.speculates and k is None and spec.derive_k is None:
        raise ValueError(f"num_speculative_tokens (k) must be an int in [1, {MAX_SPECULATIVE_TOKENS}] "
                         f"for method={config.method!r}, got None")
    if config.acceptance_method == "typical_lossy" and not spec.speculates:
        raise ValueError("acceptance_method='typical_lossy' needs a speculative method (it accepts drafts)")
    out = dataclasses.replace(config, drafter_options=options)
    if spec.validate is not None:
        spec.validate(out)
    if spec.derive_k is not None:
        derived = spec.derive_k(out)
        if not 1 <= derived <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"method={config.method!r}: its drafter_options fix k = {derived} tokens per step, "
                             f"outside [1, {MAX_SPECULATIVE_TOKENS}]")
        if k is not None and k != derived:
            raise ValueError(f"num_speculative_tokens={k} disagrees with k = {derived}, fixed by the "
                             f"drafter_options of method={config.method!r}; leave num_speculative_tokens unset (it "
                             f"is derived) or set it to {derived}")
        if not out.is_tree and k is None:       # the k-dependent checks of SpecConfig run again, with k known
            out = dataclasses.replace(out, num_speculative_tokens=derived)
    if out.verify_widths is None and spec.verify_widths is not None and not out.is_tree and out.k:
        out = dataclasses.replace(out, verify_widths=spec.verify_widths(out.k))     # the method's default
    for b, _ in out.draft_len_schedule or ():   # every scheduled k must make a valid config for this method
        try:
            resolve(out.for_batch(b))
        except ValueError as e:
            raise ValueError(f"draft_len_schedule: the config for batches up to {b}: {e}") from None
    return out


def _check_fields(config: SpecConfig, spec: DrafterSpec) -> None:
    """A field the method does not read would be silently ignored: refuse it."""
    for f in dataclasses.fields(config):
        if f.name in spec.fields or f.name in TREE_FIELDS:     # trees get their own message
            continue
        if getattr(config, f.name) != f.default:
            own = spec.reads + (TREE_FIELDS if spec.trees else ())
            raise ValueError(f"{f.name} is not used by method={config.method!r} (it reads "
                             f"{', '.join(own) or 'only the common fields'}); "
                             f"remove it or pick a method that reads it")


def _resolve_options(config: SpecConfig, spec: DrafterSpec) -> tuple | None:
    """The config's drafter_options checked against the method's declaration, with every declared option's
    default filled in -> sorted (name, value) items (None: the method declares none)."""
    given = dict(config.drafter_options or ())      # SpecConfig stores them as sorted items
    for name, value in given.items():
        if name not in spec.options:
            raise ValueError(f"method={config.method!r} has no option {name!r}; its options are "
                             f"{sorted(spec.options) or 'none'}")
        opt = spec.options[name]
        try:
            ok = opt.check(value)
        except Exception:                               # a malformed value fails the check, not the caller
            ok = False
        if not ok:
            raise ValueError(f"drafter option {name}={value!r} for method={config.method!r}: {opt.help}")
    full = {name: given.get(name, opt.default) for name, opt in spec.options.items()}
    full = {name: tuple(v) if isinstance(v, list) else v for name, v in full.items()}   # hashable: a static arg
    return tuple(sorted(full.items())) or None


def build(req: BuildRequest) -> tuple[Any, Any]:
    """-> (static drafter object, its array params) from the method's builder. A directory or shipped name given
    as drafter= to a method with an artifact is loaded here (the spec's load), and whatever arrives is checked
    against the spec's artifact type, so every builder receives a loaded artifact (or None)."""
    spec = get(req.config.method)
    drafter = req.drafter
    if spec.load is not None and isinstance(drafter, (str, os.PathLike)):
        drafter = spec.load(req.target, os.fspath(drafter))
    if spec.artifact is not None and drafter is not None and not isinstance(drafter, spec.artifact):
        raise TypeError(f"method={spec.method!r} takes drafter= {spec.accepts}; got {type(drafter).__name__}")
    built, params = spec.build(req._replace(drafter=drafter))
    missing = [name for name in DRAFTER_ATTRIBUTES if not hasattr(built, name)]
    if missing:
        raise TypeError(f"the {type(built).__name__} that method={spec.method!r} builds does not declare "
                        f"{missing}; every drafter declares k, target_layers and target_weights (() when it reads "
                        "nothing of the target): the Drafter protocol in specjax.drafters.base")
    return built, params


def finish(req: BuildRequest, outputs: list[list[int]]) -> None:
    """Hand a call's outputs to the method's `finish` hook, if it has one (a drafter that learns across calls)."""
    hook = get(req.config.method).finish
    if hook is not None:
        hook(req, outputs)
