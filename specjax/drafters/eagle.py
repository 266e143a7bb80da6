"""EAGLE drafters (Li et al. 2024/2025): one decoder layer that autoregresses over the target's FEATURES.

Two methods, one drafter class:
  "eagle"   EAGLE-1 / EAGLE-2. Input at sequence entry t: fc(concat(embed(x_{t+1}), f_t)) (2H -> H, with bias),
            f_t = the target's final NORMED hidden state at position t (target_out.hidden); one Llama decoder layer
            WITHOUT an input norm (as the reference's layer 0: attention reads the fc output, then
            post_attention_layernorm + SwiGLU MLP); the TARGET's LM head on the layer output, no final norm (the
            drafter regresses the target's normed feature f_{t+1}). Embedding and LM head: the target's
            (target_weights = ("embed", "lm_head"); a published checkpoint's own embed_tokens is used when present).
            Chains, static trees (tree_choices) and EAGLE-2 dynamic trees (num_steps / topk / num_draft_tokens).
  "eagle3"  EAGLE-3. The feature is fused from several target layers (`target_layers`, decoder-layer indices whose
            OUTPUTS are read, usually three: low, middle, high): g_t = fc(concat(l_a, l_b, l_c)) (n*H_t -> H, no
            bias). The decoder layer's attention reads concat(input_layernorm(embed(x_{t+1})), hidden_norm(g_t))
            (q/k/v input width 2H); the residual is g_t (hidden_norm(g_t) with norm_before_residual, a speculators
            option); post_attention_layernorm + MLP; then its own final `norm` and `lm_head` over a reduced draft
            vocabulary of N tokens: draft id i is target id i + d2t[i]. Drafts are mapped to target ids; at
            temperature > 0 the draft distribution q is over the TARGET vocabulary (zero outside the draft vocab:
            the draft logits are scattered into a [V] row of -1e30 before the shared sampling transform), so
            speculative sampling stays exact. At draft step i > 0 the layer consumes its own previous output
            (pre-norm) as the hidden input, exactly as EAGLE-1 does.

Cache / feature alignment (the same for both kinds, and for training: see forward_sequence):
  drafter KV-cache entry t holds the pair (embed(x_{t+1}), feature of position t), at RoPE position t. Its output
  h_t predicts the feature of position t + 1 and its logits predict x_{t+2}.
  init:    the whole padded prompt block: tokens ctx.tokens[:, 1:P+1] with features of positions 0..P-1 (the
           prefill); entry prompt_length - 1 pairs the first generated token with the last prompt feature, so the
           cache holds prompt_length valid entries (later ones are stale, never read) and the output there gives
           the first draft of the next step (kept in the state as `hidden`).
  propose: draft 1 from the stored hidden; draft i + 1 from feeding (embed(d_i), own previous output) at entry
           committed + i - 1, written past the committed length (overwritten at the next commit). Trees: every
           node's input is (embed(node token), its parent's output; the root's = the stored hidden), at position
           committed length + depth - 1, attending to the committed cache and its ancestors (the layer re-runs
           over the partial tree block at each depth; nothing is written to the committed cache).
  commit:  the verify output (a chain's, or a tree's gathered along the accepted path: sequence order either way)
           covers positions L-1 .. L-1+D for the old committed length L; the pairs (x_{L+j}, feature L-1+j),
           j = 0..D, are written at entries L-1+j (fixed width D+1, ragged: each row's cache grows to its new
           committed length - 1 = L + n) and the output at j = n (the bonus token paired with the last accepted
           feature) is the next first-draft state. The tokens are read at old cache length + 1 + j from
           ctx.tokens, so rows clipped by EOS / max_new_tokens stay consistent.

Feature layers (EAGLE-3). Ours are decoder-layer indices whose outputs are read (specjax.models.llama.ForwardOut.
layer_hidden). The reference captures the INPUTS of decoder layers 2, L//2 and L-3, i.e. the outputs of layers
(1, L//2 - 1, L - 4); default_target_layers() uses exactly that when those are strictly increasing (L >= 7), else
(0, L//2 - 1, L - 2) (L = 4..6: e.g. (0, 1, 2) on a 4-layer target), else (0, 1, 2) for L = 3.
Published configs: `eagle_aux_hidden_state_layer_ids` (vLLM / speculators) are HF hidden_states indices: id j is
the input of decoder layer j = the output of layer j - 1 (0 would be the embedding output, which is refused), so
target_layers = [j - 1 for j in ids]; export writes [l + 1 for l in target_layers]. A published EAGLE-3 config
without the field gets the reference default (1, L//2 - 1, L - 4), the layers it was trained on.

Training (pure functions, no cache): forward_sequence (teacher-forced over a whole sequence), ttt_forward and
ttt_mask (EAGLE-3's training-time test: the drafter unrolled over its own outputs), project_features, draft_logits,
init_params, eagle_config, vocab helpers (vocab_map_from_counts, t2d_from_d2t, target_to_draft).

Artifacts: ours (specjax.drafters.artifacts, kinds "eagle" / "eagle3"; the EAGLE-3 vocabulary map is stored
exactly, as int64/bool, in an extra `vocab_map.safetensors` beside model.safetensors), and the published layouts
(load_published / export_published): EAGLE-1 (`fc.*`, `layers.0.*` without input_layernorm, optional
`embed_tokens.weight`; config.json a Llama config; model.safetensors or pytorch_model.bin via torch) and EAGLE-3
(`fc.weight`, `midlayer.*` or speculators' `layers.0.*`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d`, optional
`embed_tokens.weight`; config.json with draft_vocab_size, or the speculators config with transformer_layer_config,
target_hidden_size, eagle_aux_hidden_state_layer_ids, norm_before_residual).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from specjax import tree_search
from specjax.cache import KVCache
from specjax.checkpoints import resolve
from specjax.drafters import artifacts
from specjax.drafters.base import Context, Draft, last_tokens, pick_tokens
from specjax.drafters.registry import BuildRequest, DrafterSpec, register
from specjax.layout import fit_spec, leaf_spec
from specjax.models.hf_io import SafetensorsFile
from specjax.models.config import ModelConfig
from specjax.models.llama import apply_rope, attention, rms_norm, rope_inv_freq
from specjax.sampling import SamplingParams
from specjax.trees import TreeSpec, mask_from_parents

KINDS = ("eagle", "eagle3")
VOCAB_MAP_NAME = "vocab_map.safetensors"
NEG_LOGIT = -1e30                 # logits of target tokens outside an EAGLE-3 draft vocabulary (probability 0)
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


# ------------------------------------------------------------------------------------------------ configuration

@dataclasses.dataclass(frozen=True)
class EagleConfig:
    """What an EAGLE drafter is (hashable: part of the static drafter object).

    layer: the decoder layer's shape as a Llama ModelConfig (hidden_size H, heads, head_dim, intermediate_size,
      rope, rms_norm_eps; vocab_size = the TARGET's vocabulary V; num_layers 1).
    target_hidden_size: H_t, the width of the target features (EAGLE-1: must equal H).
    target_layers: EAGLE-3 only: target decoder-layer indices whose outputs are fused, low to high.
    draft_vocab_size: EAGLE-3 only: N, the LM head's width.
    norm_before_residual: EAGLE-3 (speculators option): the residual is hidden_norm(hidden) instead of hidden.
    """
    kind: str
    layer: ModelConfig
    target_hidden_size: int
    target_layers: tuple = ()
    draft_vocab_size: int | None = None
    norm_before_residual: bool = False

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"EAGLE kind must be one of {KINDS}, got {self.kind!r}")
        object.__setattr__(self, "target_layers", tuple(int(i) for i in self.target_layers))
        if self.kind == "eagle":
            if self.target_layers or self.draft_vocab_size is not None or self.norm_before_residual:
                raise ValueError("EAGLE-1 reads the target's final hidden state: target_layers, draft_vocab_size "
                                 "and norm_before_residual are EAGLE-3 settings")
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
                "draft_vocab_size": self.draft_vocab_size, "norm_before_residual": self.norm_before_residual}

    @classmethod
    def from_dict(cls, d: dict) -> "EagleConfig":
        rs = d.get("rope_scaling")
        layer = ModelConfig(vocab_size=int(d["vocab_size"]), hidden_size=int(d["hidden_size"]),
                            intermediate_size=int(d["intermediate_size"]), num_layers=1,
                            num_heads=int(d["num_heads"]), num_kv_heads=int(d["num_kv_heads"]),
                            head_dim=int(d["head_dim"]), rope_theta=float(d["rope_theta"]),
                            rope_scaling=tuple(sorted(rs.items())) if rs else None,
                            rms_norm_eps=float(d["rms_norm_eps"]), attention_bias=bool(d.get("attention_bias")),
                            max_position_embeddings=int(d.get("max_position_embeddings", 2048)))
        return cls(d["kind"], layer, int(d["target_hidden_size"]), tuple(d.get("target_layers") or ()),
                   d.get("draft_vocab_size"), bool(d.get("norm_before_residual", False)))


class EagleWeights(NamedTuple):
    """A loaded EAGLE drafter: what generate(..., drafter=) and the training recipes take.

    params (float leaves only): {"layer": {wq [Hin, Hq*D], wk/wv [Hin, Hkv*D], wo [Hq*D, H], mlp_norm [H],
      w_gate/w_up [H, I], w_down [I, H], (bq, bk, bv), EAGLE-3: attn_norm [H] (input_layernorm), hidden_norm [H]},
      "fc_w" [2H, H] + "fc_b" [H] (EAGLE-1) or "fc_w" [n*H_t, H] (EAGLE-3), EAGLE-3: "final_norm" [H],
      "lm_head" [H, N]; optional "embed" [V, H] (else the target's)}; Hin = H (EAGLE-1) or 2H (EAGLE-3).
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
                 norm_before_residual: bool = False) -> EagleConfig:
    """A drafter config for `target` (a specjax Model or its ModelConfig): the layer copies the target's shape
    (heads, rope, eps) unless overridden; EAGLE-3 defaults: default_target_layers, draft vocab = full vocab."""
    tc = getattr(target, "config", target)
    H = hidden_size or tc.hidden_size
    heads = num_heads or (tc.num_heads if H == tc.hidden_size else max(1, H // tc.head_dim))
    layer = ModelConfig(vocab_size=tc.vocab_size, hidden_size=H,
                        intermediate_size=intermediate_size or tc.intermediate_size, num_layers=1,
                        num_heads=heads, num_kv_heads=num_kv_heads or min(tc.num_kv_heads, heads),
                        head_dim=head_dim or H // heads, rope_theta=tc.rope_theta, rope_scaling=tc.rope_scaling,
                        rms_norm_eps=tc.rms_norm_eps, max_position_embeddings=tc.max_position_embeddings)
    if kind == "eagle":
        return EagleConfig("eagle", layer, tc.hidden_size)
    layers = default_target_layers(tc.num_layers) if target_layers is None else tuple(target_layers)
    return EagleConfig("eagle3", layer, tc.hidden_size, layers,
                       tc.vocab_size if draft_vocab_size is None else int(draft_vocab_size),
                       norm_before_residual)


def init_params(key: jax.Array, config: EagleConfig, std: float = 0.02, dtype=jnp.float32,
                embed: bool = False) -> dict:
    """Random params (normal(0, std) matrices, zero biases, unit norms); embed=True adds an own [V, H] table."""
    c = config.layer
    H, I, D, Hq, Hkv = c.hidden_size, c.intermediate_size, c.head_dim, c.num_heads, c.num_kv_heads
    hin = H if config.kind == "eagle" else 2 * H
    keys = iter(jax.random.split(key, 12))
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
    if embed:
        params["embed"] = normal((c.vocab_size, H))
    return params


# ------------------------------------------------------------------------------------------------- vocab maps

def vocab_map_from_counts(counts, draft_vocab_size: int) -> np.ndarray:
    """EAGLE-3's reference construction: the draft vocabulary is the N most frequent target tokens (ties: lower
    id), in ascending id order -> d2t int64 [N] (target id = draft id + d2t[draft id])."""
    counts = np.asarray(counts)
    order = np.lexsort((np.arange(len(counts)), -counts))[:draft_vocab_size]
    ids = np.sort(order)
    return (ids - np.arange(len(ids))).astype(np.int64)


def draft_to_target(d2t) -> np.ndarray:
    """d2t [N] offsets -> the target id of every draft id [N]."""
    d2t = np.asarray(d2t, np.int64)
    return np.arange(len(d2t)) + d2t


def t2d_from_d2t(d2t, vocab_size: int) -> np.ndarray:
    """bool [V]: which target tokens the draft vocabulary holds (the published `t2d`)."""
    out = np.zeros(vocab_size, bool)
    out[draft_to_target(d2t)] = True
    return out


def target_to_draft(d2t, vocab_size: int) -> np.ndarray:
    """int32 [V]: the draft id of every target token, -1 outside the draft vocabulary (training labels)."""
    out = np.full(vocab_size, -1, np.int32)
    out[draft_to_target(d2t)] = np.arange(len(d2t))
    return out


def restrict_draft_vocab(weights: EagleWeights, counts, draft_vocab_size: int) -> EagleWeights:
    """An EAGLE-3 drafter cut down to the draft_vocab_size most frequent of its draft tokens (counts [V] over
    TARGET ids, e.g. of target-generated text), without retraining: the kept lm_head columns and d2t entries. A
    smaller draft vocabulary makes the drafter's LM head (its largest matmul) cheaper and misses more tokens."""
    if weights.kind != "eagle3":
        raise ValueError(f"only EAGLE-3 drafters have a draft vocabulary; {weights.name!r} is {weights.kind!r}")
    have = draft_to_target(weights.d2t)
    n = int(draft_vocab_size)
    if not 1 <= n <= len(have):
        raise ValueError(f"draft_vocab_size={n} must be in [1, {len(have)}] (the drafter's draft vocabulary)")
    counts = np.asarray(counts)
    if counts.shape != (weights.config.vocab_size,):
        raise ValueError(f"counts must have one entry per target token ({weights.config.vocab_size}), got shape "
                         f"{list(counts.shape)}")
    keep = np.sort(np.lexsort((have, -counts[have]))[:n])               # draft ids, ascending = target order
    ids = have[keep]
    params = dict(weights.params, lm_head=weights.params["lm_head"][:, keep])
    config = dataclasses.replace(weights.config, draft_vocab_size=n)
    return EagleWeights(config, params, (ids - np.arange(n)).astype(np.int64), f"{weights.name}[{n}]")


def check_vocab_map(d2t, vocab_size: int, draft_vocab_size: int, where: str, t2d=None) -> np.ndarray:
    """Validate an EAGLE-3 d2t map against the target vocabulary; returns it as int64."""
    d2t = np.asarray(d2t)
    if d2t.shape != (draft_vocab_size,):
        raise ValueError(f"{where}: d2t must hold {draft_vocab_size} offsets (one per draft token), got shape "
                         f"{list(d2t.shape)}")
    if not np.issubdtype(d2t.dtype, np.integer):
        if not np.all(np.isfinite(d2t)) or not np.all(d2t == np.round(d2t)):
            raise ValueError(f"{where}: d2t must hold integer offsets, got dtype {d2t.dtype}")
        d2t = np.round(d2t)
    ids = draft_to_target(d2t.astype(np.int64))
    bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if bad.size:
        raise ValueError(f"{where}: the d2t map does not fit the target vocabulary of {vocab_size}: draft id "
                         f"{int(bad[0])} maps to target id {int(ids[bad[0]])} ({bad.size} out of range)")
    if len(np.unique(ids)) != len(ids):
        raise ValueError(f"{where}: the d2t map sends two draft tokens to the same target token")
    if t2d is not None:
        t2d = np.asarray(t2d).astype(bool)
        if t2d.shape != (vocab_size,) or not np.array_equal(t2d, t2d_from_d2t(d2t, vocab_size)):
            raise ValueError(f"{where}: t2d (shape {list(t2d.shape)}) disagrees with d2t over the target "
                             f"vocabulary of {vocab_size}")
    return d2t.astype(np.int64)


# ----------------------------------------------------------------------------------------------- the layer math

def _mlp(lp: dict, x: jax.Array) -> jax.Array:
    return (jax.nn.silu(x @ lp["w_gate"]) * (x @ lp["w_up"])) @ lp["w_down"]


def _pre(params: dict, config: EagleConfig, emb: jax.Array, hid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(embeddings, hidden inputs) [B, T, H] -> (residual, attention input)."""
    lp, eps = params["layer"], config.layer.rms_norm_eps
    if config.kind == "eagle":
        x = jnp.concatenate([emb, hid], -1) @ params["fc_w"] + params["fc_b"]
        return x, x                                                   # no input norm on the reference's layer 0
    hn = rms_norm(hid, lp["hidden_norm"], eps)
    resid = hn if config.norm_before_residual else hid
    return resid, jnp.concatenate([rms_norm(emb, lp["attn_norm"], eps), hn], -1)


def _qkv(lp: dict, c: ModelConfig, x: jax.Array, positions: jax.Array):
    B, T = x.shape[:2]
    q, k, v = x @ lp["wq"], x @ lp["wk"], x @ lp["wv"]
    if "bq" in lp:
        q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    inv = rope_inv_freq(c)
    q = apply_rope(q.reshape(B, T, c.num_heads, c.head_dim), positions, inv)
    k = apply_rope(k.reshape(B, T, c.num_kv_heads, c.head_dim), positions, inv)
    return q, k, v.reshape(B, T, c.num_kv_heads, c.head_dim)


def _post(params: dict, config: EagleConfig, resid: jax.Array, attn: jax.Array) -> jax.Array:
    """attn [B, T, Hq*D] (before o_proj) -> the layer output [B, T, H] (pre-norm)."""
    lp = params["layer"]
    x = resid + attn @ lp["wo"]
    return x + _mlp(lp, rms_norm(x, lp["mlp_norm"], config.layer.rms_norm_eps))


def _dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask) -> jax.Array:
    """q [B, T, Hq, D], k/v [B, S, Hkv, D], mask bool [T, S] (query t may read key s) -> [B, T, Hq*D]."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    qg = q.reshape(B, T, Hkv, Hq // Hkv, D)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * D ** -0.5
    s = jnp.where(jnp.asarray(mask), s, _MASK_VALUE)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgts,bskd->btkgd", p, v.astype(jnp.float32))
    return o.reshape(B, T, Hq * D).astype(q.dtype)


def _embed_table(params: dict, target_weights) -> jax.Array:
    if "embed" in params:
        return params["embed"]
    if not target_weights or "embed" not in target_weights:
        raise ValueError("this EAGLE drafter has no embedding of its own: pass target_weights={'embed': ...}")
    return target_weights["embed"]


def project_features(params: dict, config: EagleConfig, features) -> jax.Array:
    """The drafter's step-0 hidden input from target features. EAGLE-1: the target's final normed hidden state
    [B, T, H] itself. EAGLE-3: fc(concat(target layer outputs)): `features` a sequence of [B, T, H_t] (in
    config.target_layers order) or their concatenation [B, T, n*H_t] -> [B, T, H]."""
    dtype = params["fc_w"].dtype
    if config.kind == "eagle":
        return jnp.asarray(features).astype(dtype)
    if isinstance(features, (tuple, list)):
        features = jnp.concatenate(features, -1)
    return features.astype(dtype) @ params["fc_w"]


def draft_logits(params: dict, config: EagleConfig, hidden: jax.Array, target_weights=None) -> jax.Array:
    """Layer outputs [..., H] -> float32 logits: EAGLE-1 [..., V] through the target's LM head
    (target_weights["lm_head"] [H, V]); EAGLE-3 [..., N] over the DRAFT vocabulary (norm, own lm_head)."""
    if config.kind == "eagle":
        if not target_weights or "lm_head" not in target_weights:
            raise ValueError("EAGLE-1 drafts through the target's LM head: pass target_weights={'lm_head': ...}")
        return (hidden @ target_weights["lm_head"]).astype(jnp.float32)
    h = rms_norm(hidden, params["final_norm"], config.layer.rms_norm_eps)
    return (h @ params["lm_head"]).astype(jnp.float32)


def forward_sequence(params: dict, config: EagleConfig, tokens: jax.Array, features,
                     target_weights: dict | None = None,
                     positions: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Teacher-forced drafter over whole sequences (training EAGLE-1, and step 0 of EAGLE-3), no cache.

    Entry t pairs tokens[:, t] with features[:, t] at RoPE position t (positions [B, T] to override), causal
    attention. The inference alignment is tokens = ids[:, 1:], features = the target's features of ids[:, :-1]
    (EAGLE-1: ForwardOut.hidden; EAGLE-3: the layer_hidden of config.target_layers): then hidden[:, t] regresses
    the target feature of position t + 1 (EAGLE-1: hidden_target[:, t + 1]) and logits[:, t] predict
    ids[:, t + 2] (the target's distribution at position t + 1).
    Returns (hidden [B, T, H] pre-norm, logits [B, T, V] (EAGLE-1) or [B, T, N] draft vocab (EAGLE-3)).
    target_weights: {"embed": [V, H]} unless the drafter has its own, and EAGLE-1's {"lm_head": [H, V]}.
    """
    B, T = tokens.shape
    hid = project_features(params, config, features)
    emb = _embed_table(params, target_weights)[tokens].astype(hid.dtype)
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    resid, x_in = _pre(params, config, emb, hid)
    q, k, v = _qkv(params["layer"], config.layer, x_in, positions)
    out = _post(params, config, resid, _dense_attention(q, k, v, np.tril(np.ones((T, T), bool))))
    return out, draft_logits(params, config, out, target_weights)


def ttt_mask(seq_len: int, num_steps: int) -> np.ndarray:
    """Training-time-test attention mask, bool [n*T, n*T]; row i*T + t is step i's query at index t, column
    s*T + j is step s's key at index j. Visible: every step-0 key j <= t (causal over the real features) and,
    for 1 <= s <= i, step s's key at the same index t (the drafted entries of the chain that index t continues).
    Step i at index t stands for sequence entry t + i drafted i steps past the real entries 0..t, exactly what
    inference attends to (RoPE position t + i)."""
    T, n = int(seq_len), int(num_steps)
    i = np.repeat(np.arange(n), T)[:, None]
    t = np.tile(np.arange(T), n)[:, None]
    s = np.repeat(np.arange(n), T)[None, :]
    j = np.tile(np.arange(T), n)[None, :]
    return ((s == 0) & (j <= t)) | ((s >= 1) & (s <= i) & (j == t))


def ttt_forward(params: dict, config: EagleConfig, tokens: jax.Array, features, num_steps: int,
                target_weights: dict | None = None, pad_id: int = 0) -> tuple[jax.Array, jax.Array]:
    """EAGLE-3's training-time test: the drafter unrolled for num_steps steps over a whole sequence.

    Step 0 is forward_sequence (same alignment: tokens = ids[:, 1:], features of ids[:, :-1]). Step i > 0 consumes
    step i-1's output (pre-norm) as its hidden input, with ground-truth token embeddings shifted by i
    (tokens[:, t + i]; pad_id past the end), RoPE positions t + i and the attention of ttt_mask. Output i at index t
    predicts the same target as forward_sequence's output at index t + i (logits: ids[:, t + i + 2]); indices
    t >= T - i are padding. Works for both kinds (EAGLE-1 unrolls through fc the same way).
    Returns (hidden [n, B, T, H], logits [n, B, T, V or N]).
    """
    B, T = tokens.shape
    n = int(num_steps)
    hid = project_features(params, config, features)
    table = _embed_table(params, target_weights)
    mask = ttt_mask(T, n)
    padded = jnp.concatenate([tokens, jnp.full((B, n), pad_id, tokens.dtype)], axis=1)
    ks, vs, outs = [], [], []
    for i in range(n):
        emb = table[padded[:, i:i + T]].astype(hid.dtype)
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32) + i, (B, T))
        resid, x_in = _pre(params, config, emb, hid)
        q, k, v = _qkv(params["layer"], config.layer, x_in, positions)
        ks.append(k)
        vs.append(v)
        o = _dense_attention(q, jnp.concatenate(ks, 1), jnp.concatenate(vs, 1),
                             mask[i * T:(i + 1) * T, :(i + 1) * T])
        hid = _post(params, config, resid, o)
        outs.append(hid)
    hidden = jnp.stack(outs)
    return hidden, draft_logits(params, config, hidden, target_weights)


# ------------------------------------------------------------------------------------------------- the drafter

class EagleState(NamedTuple):
    cache: KVCache          # one layer; lengths = committed length - 1 (the pairs of every committed token)
    hidden: jax.Array       # [B, H] output at the last committed entry: its logits give the first draft


@dataclasses.dataclass(frozen=True)
class EagleDrafter:
    num_tokens: int
    config: EagleConfig
    cache_size: int
    own_embed: bool = False
    implementation: str = "xla"
    tree: TreeSpec | None = None      # a static tree of num_tokens + 1 nodes
    num_steps: int = 0                # > 0: an EAGLE-2 dynamic tree
    topk: int = 0

    @property
    def target_layers(self) -> tuple:
        return self.config.target_layers if self.config.kind == "eagle3" else ()

    @property
    def target_weights(self) -> tuple:
        return (() if self.own_embed else ("embed",)) + (("lm_head",) if self.config.kind == "eagle" else ())

    @property
    def is_tree(self) -> bool:
        return self.tree is not None or self.num_steps > 0

    # -- pieces
    def _features(self, params, target_out) -> jax.Array:
        feats = target_out.hidden if self.config.kind == "eagle" else target_out.layer_hidden
        return project_features(params, self.config, feats)

    def _run(self, params, ctx: Context, tokens, hid, cache: KVCache, depths=None, mask=None):
        """Feed pairs (tokens [B, T], hidden inputs [B, T, H]) at each row's cache length (positions length +
        depths) -> (outputs [B, T, H], cache with the entries written, lengths not advanced)."""
        c = self.config.layer
        B, T = tokens.shape
        if depths is None:
            depths = jnp.arange(T, dtype=jnp.int32)
        positions = cache.lengths[:, None] + jnp.broadcast_to(jnp.asarray(depths, jnp.int32), (B, T))
        emb = _embed_table(params, ctx.target_weights)[tokens].astype(hid.dtype)
        resid, x_in = _pre(params, self.config, emb, hid)
        q, k, v = _qkv(params["layer"], c, x_in, positions)
        cache = cache.write(0, k, v, cache.lengths)
        o = attention(q, cache, 0, cache.lengths + T, mask, implementation=self.implementation,
                      q_positions=positions, sliding_window=None)
        return _post(params, self.config, resid, o.reshape(B, T, -1)), cache

    def _logits(self, params, ctx: Context, hidden) -> jax.Array:
        """[..., H] -> float32 logits over the TARGET vocabulary [..., V]."""
        if self.config.kind == "eagle":
            return draft_logits(params, self.config, hidden, ctx.target_weights)
        d = draft_logits(params, self.config, hidden)                          # [..., N]
        full = jnp.full(d.shape[:-1] + (self.config.vocab_size,), NEG_LOGIT, jnp.float32)
        return full.at[..., params["vocab_map"]].set(d)

    # -- protocol
    def init(self, params, ctx: Context, target_out, sp):
        c = self.config.layer
        B, P = target_out.hidden.shape[:2]
        idx = np.minimum(np.arange(1, P + 1), ctx.tokens.shape[1] - 1)
        feats = self._features(params, target_out)
        cache = KVCache.init(1, B, self.cache_size, c.num_kv_heads, c.head_dim, params["layer"]["wq"].dtype)
        out, cache = self._run(params, ctx, ctx.tokens[:, idx], feats, cache)
        last = jnp.take_along_axis(out, (ctx.prompt_length - 1)[:, None, None], axis=1)[:, 0]
        return EagleState(cache.replace(lengths=ctx.prompt_length), last)

    def propose(self, params, state: EagleState, ctx: Context, keys, sp: SamplingParams):
        if self.is_tree:
            return self._propose_tree(params, state, ctx)
        k = self.num_tokens
        step_keys = jax.vmap(lambda key: jax.random.split(key, k))(keys)          # [B, k] keys
        tok, p = pick_tokens(self._logits(params, ctx, state.hidden), step_keys[:, 0], sp)
        if k == 1:
            return Draft(tok[:, None], None if p is None else p[:, None]), state

        def body(carry, key_i):
            cache, tok, h = carry
            out, cache = self._run(params, ctx, tok[:, None], h[:, None], cache)
            h = out[:, 0]
            nxt, q = pick_tokens(self._logits(params, ctx, h), key_i, sp)
            return (cache.replace(lengths=cache.lengths + 1), nxt, h), (nxt, q)

        (cache, _, _), (rest, rest_p) = lax.scan(body, (state.cache, tok, state.hidden),
                                                 jnp.swapaxes(step_keys[:, 1:], 0, 1))
        tokens = jnp.concatenate([tok[:, None], jnp.swapaxes(rest, 0, 1)], axis=1)     # [B, k]
        state = EagleState(cache.replace(lengths=state.cache.lengths), state.hidden)    # drafts: stale entries
        if sp.greedy:
            return Draft(tokens), state
        return Draft(tokens, jnp.concatenate([p[:, None], jnp.swapaxes(rest_p, 0, 1)], axis=1)), state

    def _propose_tree(self, params, state: EagleState, ctx: Context):
        root = last_tokens(ctx, 1)[:, 0]
        B, H = state.hidden.shape
        root_h = state.hidden

        # The search's state: every node fed so far (tokens, in-block parents, depths, hidden inputs, outputs);
        # each call re-runs the layer over the whole partial tree with its mask, nothing is written for good.
        def node_logits(block, tokens, parents, depths):
            toks, pars, deps, feats, outs = block
            n = tokens.shape[1]
            if outs.shape[1] == 0:                                          # depth 1: children of the root
                parent_h = jnp.broadcast_to(root_h[:, None], (B, n, H))
            else:
                got = jnp.take_along_axis(outs, jnp.maximum(parents, 0)[..., None], axis=1)
                parent_h = jnp.where(parents[..., None] < 0, root_h[:, None], got)
            toks, pars = jnp.concatenate([toks, tokens], 1), jnp.concatenate([pars, parents], 1)
            deps, feats = np.concatenate([deps, np.asarray(depths)]), jnp.concatenate([feats, parent_h], 1)
            out, _ = self._run(params, ctx, toks, feats, state.cache, depths=deps - 1,
                               mask=mask_from_parents(pars))
            return self._logits(params, ctx, out[:, -n:]), (toks, pars, deps, feats, out)

        empty = jnp.zeros((B, 0, H), root_h.dtype)
        block = (jnp.zeros((B, 0), jnp.int32), jnp.zeros((B, 0), jnp.int32), np.zeros(0, np.int32), empty, empty)
        root_logits = self._logits(params, ctx, root_h)
        tree, _ = tree_search.search(self.tree, self.num_steps, self.topk, self.num_tokens + 1, root, root_logits,
                                     node_logits, block)
        return Draft(tree.tokens[:, 1:], None, tree), state

    def commit(self, params, state: EagleState, ctx, num_accepted, target_out, verified):
        W = target_out.hidden.shape[1]                                     # k + 1 (chain) or depth + 1 (tree)
        old = state.cache.lengths
        idx = jnp.minimum(old[:, None] + 1 + jnp.arange(W), ctx.tokens.shape[1] - 1)
        toks = jnp.take_along_axis(ctx.tokens, idx, axis=1)                # accepted drafts, then the bonus
        out, cache = self._run(params, ctx, toks, self._features(params, target_out), state.cache)
        new_len = ctx.length - 1                                           # = old + n + 1 unless clipped / done
        at = jnp.clip(new_len - old - 1, 0, W - 1)                         # = num_accepted for a running row
        hidden = jnp.take_along_axis(out, at[:, None, None], axis=1)[:, 0]
        return EagleState(cache.replace(lengths=new_len), hidden)


# ------------------------------------------------------------------------------------------- reading / writing

_LAYER_NAMES = {"wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight", "wv": "self_attn.v_proj.weight",
                "wo": "self_attn.o_proj.weight", "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight",
                "w_down": "mlp.down_proj.weight", "mlp_norm": "post_attention_layernorm.weight",
                "attn_norm": "input_layernorm.weight", "hidden_norm": "hidden_norm.weight",
                "bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias", "bv": "self_attn.v_proj.bias"}
_TRANSPOSED = {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"}


def _flatten(params: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in params.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = np.asarray(jax.device_get(v))
    return out


def _unflatten(flat: dict) -> dict:
    out: dict = {}
    for name, v in flat.items():
        node = out
        *path, leaf = name.split(".")
        for p in path:
            node = node.setdefault(p, {})
        node[leaf] = v
    return out


def _expected_shapes(config: EagleConfig, own_embed: bool) -> dict:
    c = config.layer
    H, I, D = c.hidden_size, c.intermediate_size, c.head_dim
    q, kv = c.num_heads * D, c.num_kv_heads * D
    hin = H if config.kind == "eagle" else 2 * H
    shapes = {"layer.wq": (hin, q), "layer.wk": (hin, kv), "layer.wv": (hin, kv), "layer.wo": (q, H),
              "layer.mlp_norm": (H,), "layer.w_gate": (H, I), "layer.w_up": (H, I), "layer.w_down": (I, H)}
    if c.attention_bias:
        shapes.update({"layer.bq": (q,), "layer.bk": (kv,), "layer.bv": (kv,)})
    if config.kind == "eagle":
        shapes.update(fc_w=(2 * H, H), fc_b=(H,))
    else:
        shapes.update({"layer.attn_norm": (H,), "layer.hidden_norm": (H,), "final_norm": (H,),
                       "fc_w": (len(config.target_layers) * config.target_hidden_size, H),
                       "lm_head": (H, config.draft_vocab_size)})
    if own_embed:
        shapes["embed"] = (c.vocab_size, H)
    return shapes


def _check_shapes(flat: dict, config: EagleConfig, where: str, names: dict | None = None) -> None:
    """flat: our flat names -> arrays. names: our name -> the file's name, for messages."""
    for key, shape in _expected_shapes(config, "embed" in flat).items():
        shown = (names or {}).get(key, key)
        if key not in flat:
            raise ValueError(f"EAGLE checkpoint {where} is missing tensor {shown!r} (truncated or another layout?)")
        if tuple(flat[key].shape) != shape:
            have = tuple(flat[key].shape)
            if key in _TRANSPOSED_FLAT or key in ("fc_w", "lm_head"):
                have, shape = have[::-1], shape[::-1]           # report in the file's [out, in] convention
            raise ValueError(f"EAGLE checkpoint {where}: tensor {shown!r} has shape {list(have)}, expected "
                             f"{list(shape)}")


_TRANSPOSED_FLAT = {f"layer.{k}" for k in _TRANSPOSED}


def check_target(weights: EagleWeights, target) -> None:
    """Raise ValueError when `weights` cannot draft for `target` (a specjax Model)."""
    cfg, tc, name = weights.config, target.config, weights.name or "(unnamed)"
    if cfg.vocab_size != tc.vocab_size:
        raise ValueError(f"EAGLE drafter {name!r} was made for vocab_size={cfg.vocab_size}, the target "
                         f"{target.name!r} has {tc.vocab_size}")
    if cfg.target_hidden_size != tc.hidden_size:
        raise ValueError(f"EAGLE drafter {name!r} was made for target hidden_size={cfg.target_hidden_size}, the "
                         f"target {target.name!r} has {tc.hidden_size}")
    if "embed" not in weights.params and cfg.hidden_size != tc.hidden_size:
        raise ValueError(f"EAGLE drafter {name!r} has hidden_size {cfg.hidden_size} and no embedding of its own; "
                         f"the target's embedding is {tc.hidden_size} wide")
    bad = [i for i in cfg.target_layers if not 0 <= i < tc.num_layers]
    if bad:
        raise ValueError(f"EAGLE-3 drafter {name!r} reads target layers {list(cfg.target_layers)} but the target "
                         f"{target.name!r} has {tc.num_layers} decoder layers (valid: 0..{tc.num_layers - 1}); "
                         f"out of range: {bad}")
    if cfg.kind == "eagle3":
        if weights.d2t is None:
            raise ValueError(f"EAGLE-3 drafter {name!r} has no d2t vocabulary map")
        check_vocab_map(weights.d2t, tc.vocab_size, cfg.draft_vocab_size, f"EAGLE-3 drafter {name!r}")


def save(path: str | os.PathLike, weights: EagleWeights, target, manifest: str, dtype: str = "bfloat16") -> None:
    """Our artifact (kind "eagle" / "eagle3") for `target`; the EAGLE-3 vocab map is stored exactly."""
    check_target(weights, target)
    flat = _flatten(weights.params)
    artifacts.save_artifact(path, weights.kind, weights.config.to_dict(), flat, target, manifest, dtype)
    if weights.kind == "eagle3":
        from safetensors.numpy import save_file
        d2t = np.asarray(weights.d2t, np.int64)
        save_file({"d2t": d2t, "t2d": t2d_from_d2t(d2t, weights.config.vocab_size)},
                  os.path.join(os.fspath(path), VOCAB_MAP_NAME))


def _load_ours(path: str, target, kind: str) -> EagleWeights:
    cfg_dict, flat = artifacts.load_artifact(path, target, kind)
    config = EagleConfig.from_dict(cfg_dict)
    _check_shapes(flat, config, path)
    extra = sorted(set(flat) - set(_expected_shapes(config, "embed" in flat)))
    if extra:
        raise ValueError(f"EAGLE artifact {path} has unexpected tensors {extra}")
    d2t = None
    if kind == "eagle3":
        vm = os.path.join(path, VOCAB_MAP_NAME)
        if not os.path.isfile(vm):
            raise FileNotFoundError(f"EAGLE-3 artifact {path} has no {VOCAB_MAP_NAME} (the draft vocabulary map)")
        st = SafetensorsFile(vm)
        if "d2t" not in st.keys():
            raise ValueError(f"{vm} has no 'd2t' tensor")
        d2t = check_vocab_map(np.asarray(st.get("d2t")), config.vocab_size, config.draft_vocab_size, path,
                              np.asarray(st.get("t2d")) if "t2d" in st.keys() else None)
    weights = EagleWeights(config, jax.tree_util.tree_map(jnp.asarray, _unflatten(flat)), d2t,
                           os.path.basename(os.path.normpath(path)))
    check_target(weights, target)
    return weights


def _read_tensors(path: str) -> dict[str, np.ndarray]:
    return artifacts.read_published_tensors(path, ("model.safetensors",), "pytorch_model.bin")


def _hf_layer_config(hf: dict, where: str) -> ModelConfig:
    """The decoder layer's shape from a (possibly nested, speculators-style) Llama config."""
    lc = dict(hf.get("transformer_layer_config") or hf)
    lc.update(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=1)
    try:
        return ModelConfig.from_hf(lc)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where}/config.json is not an EAGLE config (needs a Llama layer config: "
                         f"hidden_size, intermediate_size, num_attention_heads, vocab_size...): {e!r}") from None


def load_published(path: str | os.PathLike, target, kind: str | None = None) -> EagleWeights:
    """The EAGLE / EAGLE-3 repositories' (or speculators') layout -> EagleWeights, checked against the target."""
    path = os.fspath(path)
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    t = _read_tensors(path)
    is3 = (any(k.startswith("midlayer.") for k in t) or "d2t" in t or "draft_vocab_size" in hf
           or hf.get("speculators_model_type") == "eagle3" or "layers.0.hidden_norm.weight" in t)
    found = "eagle3" if is3 else "eagle"
    if kind is not None and kind != found:
        raise ValueError(f"{path} holds a published {found!r} drafter, not an {kind!r} one; use method={found!r}")
    layer = _hf_layer_config(hf, path)
    if layer.vocab_size != target.config.vocab_size:
        raise ValueError(f"EAGLE drafter {path} was trained for vocab_size={layer.vocab_size}, the target has "
                         f"{target.config.vocab_size}")
    pfx = "midlayer." if any(k.startswith("midlayer.") for k in t) else "layers.0."
    more = sorted({k.split(".")[1] for k in t if k.startswith("layers.") and not k.startswith("layers.0.")})
    if more or int((hf.get("transformer_layer_config") or hf).get("num_hidden_layers", 1)) != 1:
        raise ValueError(f"{path}: only single-layer EAGLE drafters are supported (found layers {more or '?'} "
                         f"/ num_hidden_layers={hf.get('num_hidden_layers')})")
    names: dict[str, str] = {}
    flat: dict[str, np.ndarray] = {}

    def take(ours: str, theirs: str, transpose: bool = False, required: bool = True):
        names[ours] = theirs
        if theirs not in t:
            if required:
                raise ValueError(f"EAGLE checkpoint {path} is missing tensor {theirs!r} (truncated or another "
                                 "layout?)")
            return
        a = np.asarray(t[theirs], np.float32)
        flat[ours] = np.ascontiguousarray(a.T) if transpose else a

    if pfx + "self_attn.q_proj.bias" in t:
        layer = dataclasses.replace(layer, attention_bias=True)
    for ours, theirs in _LAYER_NAMES.items():
        if ours in ("attn_norm", "hidden_norm") and not is3:
            continue
        if ours.startswith("b") and not layer.attention_bias:
            continue
        take(f"layer.{ours}", pfx + theirs, ours in _TRANSPOSED)
    take("embed", "embed_tokens.weight", required=False)
    d2t = None
    if not is3:
        if pfx + "input_layernorm.weight" in t:
            raise ValueError(f"{path} has {pfx}input_layernorm.weight: the EAGLE-1 layer has no input norm "
                             "(another layout?)")
        config = EagleConfig("eagle", layer, int(hf.get("target_hidden_size", layer.hidden_size)))
        take("fc_w", "fc.weight", transpose=True)
        if "fc.bias" in t:
            take("fc_b", "fc.bias")
        else:
            flat["fc_b"] = np.zeros(layer.hidden_size, np.float32)       # a checkpoint trained with bias=False
    else:
        ids = hf.get("eagle_aux_hidden_state_layer_ids")
        L = target.config.num_layers
        if ids:
            if any(int(i) < 1 for i in ids):
                raise ValueError(f"{path}: eagle_aux_hidden_state_layer_ids {list(ids)} include 0 (the embedding "
                                 "output), which specjax does not expose; ids are HF hidden_states indices >= 1")
            layers = tuple(int(i) - 1 for i in ids)
        else:
            layers = reference_target_layers(L)
        N = int(hf.get("draft_vocab_size") or layer.vocab_size)
        config = EagleConfig("eagle3", layer, int(hf.get("target_hidden_size") or layer.hidden_size), layers, N,
                             bool(hf.get("norm_before_residual", False)))
        take("fc_w", "fc.weight", transpose=True)
        take("final_norm", "norm.weight")
        take("lm_head", "lm_head.weight", transpose=True)
        if "d2t" in t:
            d2t = check_vocab_map(t["d2t"], layer.vocab_size, N, path, t.get("t2d"))
        elif N == layer.vocab_size:
            d2t = np.zeros(N, np.int64)                                  # full vocabulary: identity map
        else:
            raise ValueError(f"EAGLE-3 checkpoint {path} has draft_vocab_size={N} < vocab_size="
                             f"{layer.vocab_size} but no d2t map")
    _check_shapes(flat, config, path, names)
    weights = EagleWeights(config, jax.tree_util.tree_map(jnp.asarray, _unflatten(flat)), d2t,
                           os.path.basename(os.path.normpath(path)))
    check_target(weights, target)
    return weights


def export_published(path: str | os.PathLike, weights: EagleWeights, dtype: str = "float32",
                     torch_bin: bool = False) -> None:
    """Write the published layout (EAGLE-1: fc/layers.0, EAGLE-3: fc/midlayer/norm/lm_head/d2t/t2d; config.json a
    Llama layer config, for EAGLE-3 with draft_vocab_size, target_hidden_size, norm_before_residual and the
    feature layers as `eagle_aux_hidden_state_layer_ids` = [l + 1 for l in target_layers], the HF hidden_states
    indices vLLM reads). torch_bin: pytorch_model.bin instead of model.safetensors (needs torch)."""
    import ml_dtypes
    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
    cfg, path = weights.config, os.fspath(path)
    os.makedirs(path, exist_ok=True)
    flat = _flatten(weights.params)
    is3 = cfg.kind == "eagle3"
    pfx = "midlayer." if is3 else "layers.0."
    sd = {}
    for key, a in flat.items():
        a = np.asarray(a, np.float32)
        if key.startswith("layer."):
            ours = key[len("layer."):]
            sd[pfx + _LAYER_NAMES[ours]] = a.T if ours in _TRANSPOSED else a
        else:
            theirs = {"fc_w": "fc.weight", "fc_b": "fc.bias", "final_norm": "norm.weight",
                      "lm_head": "lm_head.weight", "embed": "embed_tokens.weight"}[key]
            sd[theirs] = a.T if key in ("fc_w", "lm_head") else a
    sd = {k: np.ascontiguousarray(v.astype(np_dtype)) for k, v in sd.items()}
    hf = ModelConfig.to_hf(dataclasses.replace(cfg.layer, num_layers=1))
    for key in ("eos_token_id", "bos_token_id"):
        hf.pop(key, None)
    if is3:
        d2t = np.asarray(weights.d2t, np.int64)
        sd["d2t"], sd["t2d"] = d2t, t2d_from_d2t(d2t, cfg.vocab_size)
        hf.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=cfg.draft_vocab_size,
                  target_hidden_size=cfg.target_hidden_size, norm_before_residual=cfg.norm_before_residual,
                  eagle_aux_hidden_state_layer_ids=[i + 1 for i in cfg.target_layers])
    else:
        hf.update(bias=True)                                              # the reference's fc bias flag
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=1)
    if torch_bin:
        import torch
        tsd = {k: torch.from_numpy(np.array(v, np.float32) if v.dtype == ml_dtypes.bfloat16 else np.array(v))
               for k, v in sd.items()}
        torch.save(tsd, os.path.join(path, "pytorch_model.bin"))
    else:
        from safetensors.numpy import save_file
        save_file(sd, os.path.join(path, "model.safetensors"))


def load(path_or_name: str | os.PathLike, target, kind: str | None = None) -> EagleWeights:
    """Our artifact, a published layout, or a shipped name -> EagleWeights for this target (kind: refuse others)."""
    path = resolve(path_or_name, "drafter")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"EAGLE drafter directory {path} has no config.json")
    with open(cfg_path) as f:
        meta = json.load(f)
    if "specjax_drafter" not in meta:
        return load_published(path, target, kind)
    found = meta.get("specjax_drafter")
    if found not in KINDS or (kind is not None and found != kind):
        raise ValueError(f"{path} holds a {found!r} drafter, not {kind or 'an EAGLE'!r} one")
    return _load_ours(path, target, found)


# --------------------------------------------------------------------------------------------------- registry

def _build(req: BuildRequest, kind: str):
    w = req.drafter
    if isinstance(w, (str, os.PathLike)):
        w = load(w, req.target, kind)
    if not isinstance(w, EagleWeights):
        raise TypeError(f"method={kind!r} needs drafter=<EAGLE weights: a directory (ours or a published layout), "
                        f"a shipped name or eagle.load(...)>, got {type(w).__name__}")
    if w.kind != kind:
        raise ValueError(f"drafter {w.name!r} is an {w.kind!r} drafter; use method={w.kind!r}")
    check_target(w, req.target)
    cfg = req.config
    steps, topk = (cfg.num_steps or 0), (cfg.topk or 0)
    width = cfg.tree.topk if cfg.tree is not None else topk
    vocab = w.config.out_vocab_size
    if width > vocab:
        raise ValueError(f"the tree asks for the top-{width} draft tokens per node but the drafter's "
                         f"{'draft ' if kind == 'eagle3' else ''}vocabulary has only {vocab}")
    params = dict(w.params)
    if kind == "eagle3":
        params["vocab_map"] = jnp.asarray(draft_to_target(w.d2t), jnp.int32)
    extra = max(0, (steps - 1) * topk - (cfg.k + 1))      # a dynamic tree's frontier block past the verify slots
    return EagleDrafter(cfg.k, w.config, req.buffer_len + extra, "embed" in w.params, cfg.implementation,
                        cfg.tree, steps, topk), params


def _build_eagle(req: BuildRequest):
    return _build(req, "eagle")


def _build_eagle3(req: BuildRequest):
    return _build(req, "eagle3")


def _load_eagle(target, path_or_name):
    return load(path_or_name, target, "eagle")


def _load_eagle3(target, path_or_name):
    return load(path_or_name, target, "eagle3")


def _param_specs(drafter: EagleDrafter, params, mesh):
    own = {"fc_w": P(), "fc_b": P(), "hidden_norm": P(), "vocab_map": P()}

    def spec(path, x):
        key = next((p.key for p in reversed(path) if isinstance(p, jax.tree_util.DictKey)), None)
        s = own[key] if key in own else leaf_spec(key)      # Llama names: the target's layout
        return fit_spec(s, x.shape, mesh) if mesh is not None else s
    return jax.tree_util.tree_map_with_path(spec, params)


_ACCEPTS = "EAGLE weights: a directory (ours or a published layout), a shipped name, or eagle.load(...)"
register(DrafterSpec("eagle", _build_eagle, accepts=_ACCEPTS, load=_load_eagle, trees=True,
                     param_specs=_param_specs))
register(DrafterSpec("eagle3", _build_eagle3, accepts=_ACCEPTS, load=_load_eagle3, trees=True,
                     param_specs=_param_specs))
