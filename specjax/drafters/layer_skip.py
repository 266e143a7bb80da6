"""Self-speculation by layer skipping (Draft & Verify, SWIFT, LayerSkip's self-speculation): the target drafts for
itself with a subset of its own decoder layers, and the full model verifies, so the output is exactly the
target's. No second model, no training, no arrays of its own: it reads the target's weights (the target-weights
contract) and drafts over the target's own KV cache.

The skip set is the method's one setting:
  SpecConfig(method="layer_skip", drafter_options={"skip_layers": (1, 3, ...)})   # target layer indices skipped
  generate(..., drafter="smollm2-135m-layerskip")      # a skip-set artifact (kind "layer_skip", no tensors) that
                                                        # train/layer_skip.py chose by measured acceptance
Without either, the default rule: a contiguous fifth of the stack in its middle (default_skip_layers).

Drafting over the target's cache: a draft token at kept layer i attends to the full model's keys and values of
every committed token (the cache entries the verify passes wrote) and to the skip path's own entries of the tokens
drafted before it in this step, which it writes at the slots the verify pass then overwrites
(specjax.drafters.base: shares_target_cache). So the context is the full model's, as in the papers; there is no
draft prefill and no draft cache. Chains and token trees (static, or a dynamic EAGLE-2 tree whose frontier fits
the slots a verify pass reserves); its cost per drafted token is about (kept layers + LM head) / (all layers + LM
head) of a target step.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import tree_search
from specjax.drafters.artifacts import load_artifact
from specjax.drafters.base import Context, Draft, chain_scan, last_tokens, pick_tokens
from specjax.drafters.registry import BuildRequest, DrafterSpec, Option, register
from specjax.models.config import ModelConfig
from specjax.models.llama import forward
from specjax.models.model import Model
from specjax.sampling import SamplingParams
from specjax.trees import TreeSpec

KIND = "layer_skip"


@dataclasses.dataclass(frozen=True)
class SkipSet:
    """A loaded skip-set artifact: the target layers its draft pass skips."""
    skip_layers: tuple[int, ...]
    path: str = ""


def default_skip_layers(num_layers: int) -> tuple[int, ...]:
    """The default rule: a contiguous fifth of the stack in its middle (at least one layer from 3 layers on). The
    search (train/layer_skip.py) on SmolLM2-135M removes the middle layers first; skipping every other layer instead
    left a draft the target accepted 3-6% of the time."""
    if num_layers < 3:
        return ()
    n = max(1, num_layers // 5)
    start = (num_layers - n) // 2
    return tuple(range(start, start + n))


def check_skip_layers(skip: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """A skip set for a target of num_layers decoder layers -> sorted tuple; ValueError naming what is wrong."""
    skip = tuple(skip)
    bad = [i for i in skip if not isinstance(i, (int, np.integer)) or isinstance(i, bool) or not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"skip_layers {list(bad)} out of range: the target has {num_layers} decoder layers "
                         f"(indices 0..{num_layers - 1})")
    if len(set(skip)) != len(skip):
        raise ValueError(f"skip_layers {list(skip)} names a layer twice")
    if len(skip) >= num_layers:
        raise ValueError(f"skip_layers skips all {num_layers} decoder layers: the draft pass needs at least one")
    return tuple(sorted(int(i) for i in skip))


@dataclasses.dataclass(frozen=True)
class LayerSkipDrafter:
    k: int
    config: ModelConfig                # the target's
    kept: tuple[int, ...]              # the decoder layers the draft pass runs, in order
    implementation: str = "xla"
    tree: TreeSpec | None = None       # a static tree of k + 1 nodes
    num_steps: int = 0                 # > 0: a dynamic tree of num_steps depth, topk children per node
    topk: int = 0
    target_layers = ()
    target_weights = ("embed", "output_head", "final_norm", "layers")
    shares_target_cache = True

    @property
    def skip_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.config.num_layers) if i not in self.kept)

    def _forward(self, ctx: Context, tokens, cache, **kw):
        w = ctx.target_weights
        params = {"embed": w["embed"], **w["output_head"], "final_norm": w["final_norm"], "layers": w["layers"]}
        return forward(params, self.config, tokens, cache, layers=self.kept, implementation=self.implementation, **kw)

    def init(self, params, ctx: Context, target_out, sp):
        return ()

    def propose(self, params, state, ctx: Context, keys, sp: SamplingParams):
        # The cache holds every committed token but the last: feed that one first, then each draft in turn.
        cache = ctx.target_cache.replace(lengths=ctx.length - 1)
        if self.tree is not None or self.num_steps > 0:
            draft, cache = self._propose_tree(ctx, cache)
            return draft, state, cache
        step_keys = jax.vmap(lambda key: jax.random.split(key, self.k))(keys)         # [B, k] keys

        def body(carry, key_i):
            cache, tok = carry
            out = self._forward(ctx, tok[:, None], cache)
            nxt, probs, confidence = pick_tokens(out.logits[:, -1], key_i, sp)
            return (out.cache.replace(lengths=cache.lengths + 1), nxt), (nxt, probs, confidence)

        (cache, _), picks = chain_scan(body, (cache, last_tokens(ctx, 1)[:, 0]), jnp.swapaxes(step_keys, 0, 1), ctx)
        tokens, probs, confidence = (None if x is None else jnp.swapaxes(x, 0, 1) for x in picks)   # [B, k, ...]
        return Draft(tokens, probs, confidence=confidence), state, cache

    def _propose_tree(self, ctx: Context, cache):
        root = last_tokens(ctx, 1)                                                     # [B, 1]
        out = self._forward(ctx, root, cache)
        cache = out.cache.replace(lengths=cache.lengths + 1)                           # the root written
        # each depth re-runs the skip path over the whole partial tree (its mask), written after the root
        run = lambda toks, depths, mask: self._forward(ctx, toks, cache, depths=depths, mask=mask).logits
        tree = tree_search.search_by_rerun(self.tree, self.num_steps, self.topk, self.k + 1, root[:, 0],
                                           out.logits[:, -1], run)
        return Draft(tree.tokens[:, 1:], None, tree), cache

    def commit(self, params, state, ctx, num_accepted, target_out, verified):
        return state


def _load(target: Model, path_or_name: str) -> SkipSet:
    config, _ = load_artifact(path_or_name, target, KIND)
    skip = config.get("skip_layers")
    if not isinstance(skip, list):
        raise ValueError(f"layer-skip artifact {path_or_name!r}: config.skip_layers must be a list of layer indices, "
                         f"got {skip!r}")
    return SkipSet(check_skip_layers(skip, target.config.num_layers), str(path_or_name))


def _build(req: BuildRequest):
    config, target = req.config, req.target
    L = target.config.num_layers
    option = config.option("skip_layers")
    if option is not None and req.drafter is not None:
        raise ValueError("layer_skip: give the skip set once, as drafter_options={'skip_layers': ...} or as "
                         "drafter=<a skip-set artifact>, not both")
    if option is not None:
        skip = check_skip_layers(option, L)
    elif req.drafter is not None:
        skip = req.drafter.skip_layers
    else:
        skip = default_skip_layers(L)
    steps, topk = (config.num_steps or 0), (config.topk or 0)
    width = config.tree.topk if config.tree is not None else topk
    if width > target.config.vocab_size:
        raise ValueError(f"the tree asks for the top-{width} draft tokens per node but the vocabulary has only "
                         f"{target.config.vocab_size}")
    # The partial tree is written into the target's cache past the root. The slots a verify pass reserves past the
    # root (k + 1: the buffer's headroom, never committed unless the verify wrote them) must hold it.
    fed = (steps - 1) * topk if steps else 0
    if fed > config.k + 1:
        raise ValueError(f"layer_skip drafts over the target's cache: a dynamic tree of num_steps={steps}, "
                         f"topk={topk} feeds {fed} nodes after the root, more than the {config.k + 1} slots the "
                         f"verify pass reserves (num_draft_tokens={config.k + 1}); raise num_draft_tokens to at "
                         f"least {fed} or lower num_steps / topk")
    kept = tuple(i for i in range(L) if i not in skip)
    return LayerSkipDrafter(config.k, target.config, kept, config.implementation, config.tree, steps, topk), ()


def _is_skip_option(value) -> bool:
    return value is None or (isinstance(value, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool)
                                                                      for i in value))


register(DrafterSpec(
    KIND, _build, accepts="a layer-skip artifact (directory or shipped name) or None", load=_load, artifact=SkipSet,
    options={"skip_layers": Option(None, _is_skip_option,
                                   "target decoder layers the draft pass skips: a list of layer indices (None: the "
                                   "artifact's, or a contiguous fifth of the stack in its middle)")},
    trees=True))
