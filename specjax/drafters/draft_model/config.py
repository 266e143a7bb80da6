"""A draft reading the target's embedding: its loaded type (TargetEmbeddingDraft) and how one is made from the target
(init_from_target)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters.base import target_weight
from specjax.drafters.draft_vocab import check_vocab_map, draft_to_target
from specjax.models.config import ModelConfig
from specjax.models.llama import init_params
from specjax.models.model import Model


KIND = "draft_model"                  # a TargetEmbeddingDraft artifact's specjax_drafter


@dataclasses.dataclass
class TargetEmbeddingDraft:
    """A loaded draft model that embeds tokens with the target's embedding (the package docstring).

    config: its decoder layers (the target's layer shapes: hidden_size and vocab_size are the target's).
    params: {"layers": [...], "final_norm": [H], "lm_head": [H, N] with a draft vocabulary}; no "embed" (the
      target's, read at decode time) and, without a draft vocabulary, no head (the target's output head).
    d2t: the draft vocabulary map (int64 [N], target id = draft id + d2t), or None.
    """
    config: ModelConfig
    params: dict
    d2t: np.ndarray | None = None
    name: str = ""

    @property
    def draft_vocab_size(self) -> int | None:
        return None if self.d2t is None else len(self.d2t)


def init_from_target(target: Model, num_layers: int, *, from_layers: tuple[int, ...] | None = None, d2t=None,
                     seed: int = 0) -> TargetEmbeddingDraft:
    """A TargetEmbeddingDraft to train: its layers copies of the target's layers from_layers (one index per draft
    layer; default the first num_layers) or random normal(0, 0.02) ones (from_layers=()), the target's final norm,
    and with d2t an own head of the target's LM-head columns for those tokens. With every layer of the target and no
    d2t it computes the target's own logits. The target's layers must be row-major float32 arrays (load it with
    weight_format="float32")."""
    cfg = dataclasses.replace(target.config, num_layers=num_layers)      # the target's layer shapes
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    if from_layers is None:
        from_layers = tuple(range(num_layers))
    if from_layers:
        if len(from_layers) != num_layers:
            raise ValueError(f"from_layers {list(from_layers)} names {len(from_layers)} target layers for a draft of "
                             f"{num_layers}")
        bad = [l for l in from_layers if not 0 <= l < target.config.num_layers]
        if bad:
            raise ValueError(f"from_layers {bad} out of range: the target has {target.config.num_layers} decoder "
                             "layers")
        layers = [jax.tree.map(f32, dict(target.params["layers"][l])) for l in from_layers]
    else:
        layers = init_params(cfg, jax.random.PRNGKey(seed))["layers"]
    if any(set(lp) != set(layers[0]) or "wq" not in lp for lp in layers):
        raise ValueError("a draft copies row-major float32 layers (wq, wk, ...): load the target with "
                         "weight_format='float32'")
    params = {"layers": layers, "final_norm": f32(target.params["final_norm"])}
    if d2t is not None:
        d2t = check_vocab_map(d2t, cfg.vocab_size, len(d2t), "init_from_target")
        params["lm_head"] = f32(target_weight(target.params, "lm_head"))[:, draft_to_target(d2t)]
    return TargetEmbeddingDraft(cfg, params, d2t)
