"""A DFlash drafter's configuration (DFlashConfig, dflash_config: one shaped like its target, the target layers it
reads by default), its fresh params (init_params) and its loaded weights (DFlashWeights)."""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models.config import float32_decimal


KIND = "dflash"


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int                  # the drafter's (and the target's) hidden size
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    target_layers: tuple[int, ...]    # target decoder layers whose outputs are the context features
    block_size: int                   # trained block: the anchor + block_size - 1 drafts (the largest k it drafts)
    vocab_size: int                   # the target's
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    draft_vocab_size: int | None = None  # None: the target's LM head over its whole vocabulary; N: an own head

    def __post_init__(self):
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, vocab_size={self.vocab_size}], got "
                             f"{self.draft_vocab_size!r}")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["target_layers"] = list(self.target_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "DFlashConfig":
        d = dict(d)
        d["target_layers"] = tuple(d["target_layers"])
        if "rms_norm_eps" in d:        # one stored as its float32 image (9.999999747e-06) is the same setting as 1e-05
            d["rms_norm_eps"] = float32_decimal(d["rms_norm_eps"])
        return cls(**d)


def default_target_layers(num_layers: int, count: int = 5) -> tuple[int, ...]:
    """`count` target layers spread evenly from the second to the fourth-from-last (the paper's Qwen3-8B drafter
    fuses 5 of 36: 1, 9, 17, 25, 33); at least two for a target of 3 or more layers."""
    lo, hi = 1, min(num_layers - 1, max(2, num_layers - 3))
    return tuple(sorted({int(round(lo + i * (hi - lo) / max(count - 1, 1))) for i in range(count)}))


def dflash_config(target, *, num_layers: int = 1, block_size: int = 8, target_layers: Sequence[int] | None = None,
                  intermediate_size: int | None = None, draft_vocab_size: int | None = None) -> DFlashConfig:
    """A drafter shaped like the target's layers (hidden size, heads, head dim); draft_vocab_size N gives it its
    own LM head over N target tokens."""
    tc = target.config
    layers = tuple(target_layers) if target_layers is not None else default_target_layers(tc.num_layers)
    return DFlashConfig(tc.hidden_size, num_layers, tc.num_heads, tc.num_kv_heads, tc.head_dim,
                        intermediate_size or tc.intermediate_size, layers, block_size, tc.vocab_size,
                        tc.rms_norm_eps, tc.rope_theta, draft_vocab_size)


def init_params(key: jax.Array, cfg: DFlashConfig, std: float = 0.02) -> dict:
    H, D, I = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    keys = iter(jax.random.split(key, 8 * cfg.num_layers + 3))
    normal = lambda shape, s=std: s * jax.random.normal(next(keys), shape, jnp.float32)
    layers = [{"attn_norm": jnp.ones((H,)), "wq": normal((H, cfg.num_heads * D)),
               "wk": normal((H, cfg.num_kv_heads * D)), "wv": normal((H, cfg.num_kv_heads * D)),
               "wo": normal((cfg.num_heads * D, H)) / math.sqrt(2 * cfg.num_layers),
               "q_norm": jnp.ones((D,)), "k_norm": jnp.ones((D,)), "mlp_norm": jnp.ones((H,)),
               "w_gate": normal((H, I)), "w_up": normal((H, I)),
               "w_down": normal((I, H)) / math.sqrt(2 * cfg.num_layers)} for _ in range(cfg.num_layers)]
    params = {"fc": normal((len(cfg.target_layers) * H, H)), "hidden_norm": jnp.ones((H,)),
              "mask_embed": normal((H,)), "layers": layers, "final_norm": jnp.ones((H,))}
    if cfg.draft_vocab_size is not None:
        params["lm_head"] = normal((H, cfg.draft_vocab_size))
    return params


@dataclasses.dataclass(frozen=True)
class DFlashWeights:
    config: DFlashConfig
    params: dict
    name: str = ""
    d2t: np.ndarray | None = None     # the draft vocabulary map (int64 [N]; target id = draft id + d2t), or None

    def __post_init__(self):
        if (self.d2t is None) != (self.config.draft_vocab_size is None):
            raise ValueError(f"DFlash drafter {self.name!r}: draft_vocab_size is {self.config.draft_vocab_size} and "
                             f"d2t is {'None' if self.d2t is None else 'given'}: a draft vocabulary needs its d2t map, "
                             "the full vocabulary none")
