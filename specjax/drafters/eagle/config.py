"""An EAGLE drafter's configuration and fresh params.

Feature layers (EAGLE-3). Ours are decoder-layer indices whose outputs are read (specjax.models.llama.ForwardOut.
layer_hidden). The reference captures the INPUTS of decoder layers 2, L//2 and L-3, i.e. the outputs of layers
(1, L//2 - 1, L - 4); default_target_layers() uses exactly that when those are strictly increasing (L >= 7), else
(0, L//2 - 1, L - 2) (L = 4..6: e.g. (0, 1, 2) on a 4-layer target), else (0, 1, 2) for L = 3.
Published configs: `eagle_aux_hidden_state_layer_ids` (vLLM / speculators) are HF hidden_states indices: id j is
the input of decoder layer j = the output of layer j - 1 (0 would be the embedding output, which is refused), so
target_layers = [j - 1 for j in ids]; export writes [l + 1 for l in target_layers]. A published EAGLE-3 config
without the field gets the reference default (1, L//2 - 1, L - 4), the layers it was trained on.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models.config import ModelConfig, float32_decimal

KINDS = ("eagle", "eagle3")


@dataclasses.dataclass(frozen=True)
class EagleConfig:
    """What an EAGLE drafter is (hashable: part of the static drafter object).

    layer: the decoder layer's shape as a Llama ModelConfig (hidden_size H, heads, head_dim, intermediate_size,
      rope, rms_norm_eps; vocab_size = the TARGET's vocabulary V; num_layers 1).
    target_hidden_size: H_t, the width of the target features (EAGLE-1: must equal H).
    target_layers: EAGLE-3 only: target decoder-layer indices whose outputs are fused, low to high.
    draft_vocab_size: EAGLE-3 only: N, the LM head's width.
    norm_before_residual: EAGLE-3 (speculators option): the residual is hidden_norm(hidden) instead of hidden.
    fc_norm: EAGLE-3.1: an RMSNorm of its own on each fused target feature before fc (params["fc_norm"] [n, H_t]),
      so that layers of very different scale contribute alike.
    norm_output: EAGLE-3.1: the layer's output goes through final_norm once, and that post-norm state is both
      what lm_head reads and the hidden input of the next draft step (EAGLE-3 feeds back the pre-norm state).
    parallel_drafting: P-EAGLE (Hui et al. 2026): drafts 2..k come from ONE forward of k - 1 entries whose inputs
      are a learned mask embedding and a learned shared hidden state (params["mask_embed"], ["mask_hidden"], [H]
      each) instead of the previous draft's token and output; draft 1 is EAGLE-3's. Trained by the same
      training-time test with those inputs at steps > 0.
    """
    kind: str
    layer: ModelConfig
    target_hidden_size: int
    target_layers: tuple = ()
    draft_vocab_size: int | None = None
    norm_before_residual: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    parallel_drafting: bool = False

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"EAGLE kind must be one of {KINDS}, got {self.kind!r}")
        object.__setattr__(self, "target_layers", tuple(int(i) for i in self.target_layers))
        if self.kind == "eagle":
            if (self.target_layers or self.draft_vocab_size is not None or self.norm_before_residual
                    or self.fc_norm or self.norm_output or self.parallel_drafting):
                raise ValueError("EAGLE-1 reads the target's final hidden state: target_layers, draft_vocab_size, "
                                 "norm_before_residual, fc_norm, norm_output and parallel_drafting are EAGLE-3 "
                                 "settings")
            if self.target_hidden_size != self.layer.hidden_size:
                raise ValueError(f"EAGLE-1 regresses the target's feature: hidden_size {self.layer.hidden_size} "
                                 f"must equal the target's {self.target_hidden_size}")
        else:
            if not self.target_layers:
                raise ValueError("an EAGLE-3 drafter needs target_layers (the target layers it fuses)")
            if self.draft_vocab_size is None or not 1 <= self.draft_vocab_size <= self.layer.vocab_size:
                raise ValueError(f"draft_vocab_size must be in [1, vocab_size={self.layer.vocab_size}], got "
                                 f"{self.draft_vocab_size!r}")

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.layer.vocab_size

    @property
    def out_vocab_size(self) -> int:
        """Width of draft_logits: V for EAGLE-1 (the target's head), N for EAGLE-3."""
        return self.vocab_size if self.kind == "eagle" else self.draft_vocab_size

    def to_dict(self) -> dict:
        c = self.layer
        return {"kind": self.kind, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
                "num_heads": c.num_heads, "num_kv_heads": c.num_kv_heads, "head_dim": c.head_dim,
                "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "rope_scaling": c.rope_scaling_dict,
                "attention_bias": c.attention_bias, "vocab_size": c.vocab_size,
                "max_position_embeddings": c.max_position_embeddings,
                "target_hidden_size": self.target_hidden_size, "target_layers": list(self.target_layers),
                "draft_vocab_size": self.draft_vocab_size, "norm_before_residual": self.norm_before_residual,
                "fc_norm": self.fc_norm, "norm_output": self.norm_output,
                "parallel_drafting": self.parallel_drafting}

    @classmethod
    def from_dict(cls, d: dict) -> "EagleConfig":
        rs = d.get("rope_scaling")
        layer = ModelConfig(vocab_size=int(d["vocab_size"]), hidden_size=int(d["hidden_size"]),
                            intermediate_size=int(d["intermediate_size"]), num_layers=1,
                            num_heads=int(d["num_heads"]), num_kv_heads=int(d["num_kv_heads"]),
                            head_dim=int(d["head_dim"]), rope_theta=float(d["rope_theta"]),
                            rope_scaling=tuple(sorted(rs.items())) if rs else None,
                            # a file that stored the f32 image is the same drafter as one that stored 1e-05
                            rms_norm_eps=float32_decimal(d["rms_norm_eps"]),
                            attention_bias=bool(d.get("attention_bias")),
                            max_position_embeddings=int(d.get("max_position_embeddings", 2048)))
        return cls(d["kind"], layer, int(d["target_hidden_size"]), tuple(d.get("target_layers") or ()),
                   d.get("draft_vocab_size"), bool(d.get("norm_before_residual", False)),
                   bool(d.get("fc_norm", False)), bool(d.get("norm_output", False)),
                   bool(d.get("parallel_drafting", False)))


class EagleWeights(NamedTuple):
    """A loaded EAGLE drafter: what generate(..., drafter=) and the training recipes take.

    params (float leaves only): {"layer": {wq [Hin, Hq*D], wk/wv [Hin, Hkv*D], wo [Hq*D, H], mlp_norm [H],
      w_gate/w_up [H, I], w_down [I, H], (bq, bk, bv), EAGLE-3: attn_norm [H] (input_layernorm), hidden_norm [H]},
      "fc_w" [2H, H] + "fc_b" [H] (EAGLE-1) or "fc_w" [n*H_t, H] (EAGLE-3), EAGLE-3: "final_norm" [H],
      "lm_head" [H, N], EAGLE-3.1 fc_norm: "fc_norm" [n, H_t], P-EAGLE: "mask_embed" [H] and "mask_hidden" [H];
      optional "embed" [V, H] (else the target's)};
      Hin = H (EAGLE-1) or 2H (EAGLE-3).
    d2t: EAGLE-3: int64 [N], target id = draft id + d2t[draft id]; None for EAGLE-1.
    """
    config: EagleConfig
    params: dict
    d2t: np.ndarray | None = None
    name: str = ""

    @property
    def kind(self) -> str:
        return self.config.kind


def default_target_layers(num_layers: int) -> tuple[int, int, int]:
    """Three distinct target layers (decoder-layer outputs) for a new EAGLE-3 drafter; see the module docstring."""
    L = int(num_layers)
    for cand in ((1, L // 2 - 1, L - 4), (0, L // 2 - 1, L - 2), (0, 1, 2)):
        if 0 <= cand[0] < cand[1] < cand[2] < L:
            return cand
    raise ValueError(f"EAGLE-3 fuses three distinct target layers but the target has only {L} decoder layer(s); "
                     "pass target_layers explicitly (repeats allowed)")


def reference_target_layers(num_layers: int) -> tuple[int, int, int]:
    """The EAGLE-3 reference's capture (inputs of layers 2, L//2, L-3) as decoder-layer outputs."""
    return (1, num_layers // 2 - 1, num_layers - 4)


def eagle_config(target, kind: str = "eagle", *, target_layers: Sequence[int] | None = None,
                 draft_vocab_size: int | None = None, hidden_size: int | None = None,
                 intermediate_size: int | None = None, num_heads: int | None = None,
                 num_kv_heads: int | None = None, head_dim: int | None = None,
                 norm_before_residual: bool = False, fc_norm: bool = False,
                 norm_output: bool = False, parallel_drafting: bool = False) -> EagleConfig:
    """A drafter config for `target` (a specjax Model or its ModelConfig): the layer copies the target's shape
    (heads, rope, eps) unless overridden; EAGLE-3 defaults: default_target_layers, draft vocab = full vocab;
    fc_norm and norm_output make it an EAGLE-3.1 drafter, parallel_drafting a P-EAGLE one."""
    tc = getattr(target, "config", target)
    H = hidden_size or tc.hidden_size
    heads = num_heads or (tc.num_heads if H == tc.hidden_size else max(1, H // tc.head_dim))
    layer = ModelConfig(vocab_size=tc.vocab_size, hidden_size=H,
                        intermediate_size=intermediate_size or tc.intermediate_size, num_layers=1,
                        num_heads=heads, num_kv_heads=num_kv_heads or min(tc.num_kv_heads, heads),
                        head_dim=head_dim or H // heads, rope_theta=tc.rope_theta, rope_scaling=tc.rope_scaling,
                        rms_norm_eps=tc.rms_norm_eps, max_position_embeddings=tc.max_position_embeddings)
    if kind == "eagle":                  # EagleConfig refuses the EAGLE-3 settings for it
        return EagleConfig("eagle", layer, tc.hidden_size, norm_before_residual=norm_before_residual,
                           fc_norm=fc_norm, norm_output=norm_output, parallel_drafting=parallel_drafting)
    layers = default_target_layers(tc.num_layers) if target_layers is None else tuple(target_layers)
    return EagleConfig("eagle3", layer, tc.hidden_size, layers,
                       tc.vocab_size if draft_vocab_size is None else int(draft_vocab_size),
                       norm_before_residual, fc_norm, norm_output, parallel_drafting)


def init_params(key: jax.Array, config: EagleConfig, std: float = 0.02, dtype=jnp.float32,
                embed: bool = False) -> dict:
    """Random params (normal(0, std) matrices, zero biases, unit norms); embed=True adds an own [V, H] table."""
    c = config.layer
    H, I, D, Hq, Hkv = c.hidden_size, c.intermediate_size, c.head_dim, c.num_heads, c.num_kv_heads
    hin = H if config.kind == "eagle" else 2 * H
    keys = iter(jax.random.split(key, 14))
    normal = lambda shape: (std * jax.random.normal(next(keys), shape)).astype(dtype)
    ones, zeros = (lambda n: jnp.ones((n,), dtype)), (lambda n: jnp.zeros((n,), dtype))
    layer = {"wq": normal((hin, Hq * D)), "wk": normal((hin, Hkv * D)), "wv": normal((hin, Hkv * D)),
             "wo": normal((Hq * D, H)), "mlp_norm": ones(H), "w_gate": normal((H, I)), "w_up": normal((H, I)),
             "w_down": normal((I, H))}
    if c.attention_bias:
        layer.update(bq=zeros(Hq * D), bk=zeros(Hkv * D), bv=zeros(Hkv * D))
    params = {"layer": layer}
    if config.kind == "eagle":
        params.update(fc_w=normal((2 * H, H)), fc_b=zeros(H))
    else:
        layer.update(attn_norm=ones(H), hidden_norm=ones(H))
        params.update(fc_w=normal((len(config.target_layers) * config.target_hidden_size, H)),
                      final_norm=ones(H), lm_head=normal((H, config.draft_vocab_size)))
        if config.fc_norm:
            params["fc_norm"] = jnp.ones((len(config.target_layers), config.target_hidden_size), dtype)
        if config.parallel_drafting:
            params.update(mask_embed=normal((H,)), mask_hidden=normal((H,)))
    if embed:
        params["embed"] = normal((c.vocab_size, H))
    return params
