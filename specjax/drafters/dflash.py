"""A DFlash-style block drafter (Chen et al. 2026, "DFlash: Block Diffusion for Flash Speculative Decoding"): a few
decoder layers fill a block of k mask positions after the last committed token in ONE forward, reading the target's
own features of every committed position as keys and values ("KV injection").

Per step, for a row whose last committed token x_L sits at position L:
  block   [embed(x_L), m, m, ..., m] at positions L .. L + k (m: the drafter's learned mask embedding; the anchor's
          embedding is the target's);
  context the target's features of positions 0 .. L - 1 (the outputs of config.target_layers, concatenated, through
          fc and a norm), as keys and values of every draft layer (each layer's own projections, cached);
  layers  pre-norm decoder layers whose queries are the block's; each block position attends to the whole context
          and to every block position (bidirectional inside the block); per-head norms on queries and keys;
  output  the final norm, then the target's LM head at block positions 1 .. k: one distribution per draft; or,
          with a draft vocabulary (config.draft_vocab_size = N), the drafter's own head over N frequent target
          tokens (EAGLE-3's reduction: the full head is the drafter's largest matmul), every other token at
          probability 0.
Draft i is drawn from its own position's distribution (greedy: its argmax), which does not depend on the other
drafts; speculative sampling accepts it exactly against the target at any temperature (q_i is what it was drawn
from). Trees (DDTree's idea, through the shared tree search): a static tree (tree_choices) whose depth-d nodes
hold block position d's top tokens by rank, or a dynamic tree (num_steps, topk, num_draft_tokens) searched
best-first over the positions' log-probabilities; deterministic top-k children, exact at any temperature; still
one drafter forward per step.

State: the context keys/values of every draft layer (a KVCache whose lengths = committed tokens - 1: the anchor has
no target feature until it is verified). init writes the prompt's features; commit writes the features the verify
pass computed at the anchor and the accepted drafts (positions L .. L + n), as EAGLE's drafter follows the
accepted path.

Artifacts: specjax drafter directories (kind "dflash"; config + tensors (+ d2t, the draft vocabulary map, int64) +
MANIFEST, the target's fingerprint), or
the public DFlash layout (load_published: its per-head q/k norms, fused-feature fc and norm map one to one; its mask
position embeds a mask token of the target's vocabulary).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.ops import linear
from specjax.cache import KVCache
from specjax.checkpoints import resolve
from specjax.drafters import artifacts
from specjax.drafters.base import Context, block_draft, last_tokens, target_weight
from specjax.drafters.draft_vocab import check_vocab_map, draft_to_target, full_vocab_logits
from specjax.drafters.registry import BuildRequest, DrafterSpec, register
from specjax.models.config import float32_decimal
from specjax.models.llama import apply_rope, rms_norm
from specjax.sampling import SamplingParams
from specjax.trees import TreeSpec, draft_depth

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


def _inv_freq(cfg: DFlashConfig) -> jax.Array:
    return 1.0 / (cfg.rope_theta ** (jnp.arange(0, cfg.head_dim, 2, dtype=jnp.float32) / cfg.head_dim))


def context_features(params: dict, cfg: DFlashConfig, layer_hidden: Sequence[jax.Array]) -> jax.Array:
    """The target's layer outputs (each [B, T, H_t], in cfg.target_layers' order) -> context features [B, T, H]."""
    feats = linear(jnp.concatenate(list(layer_hidden), -1), params["fc"])
    return rms_norm(feats, params["hidden_norm"], cfg.rms_norm_eps)


def context_kv(lp: dict, cfg: DFlashConfig, feats: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One layer's keys / values of context features [B, T, H] at positions [B, T] -> [B, T, Hkv, D] each."""
    B, T = feats.shape[:2]
    k = linear(feats, lp["wk"]).reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
    k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    v = linear(feats, lp["wv"]).reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
    return apply_rope(k, positions, _inv_freq(cfg)), v


def block_forward(params: dict, cfg: DFlashConfig, x: jax.Array, positions: jax.Array, ctx_k: Sequence[jax.Array],
                  ctx_v: Sequence[jax.Array], ctx_visible: jax.Array) -> jax.Array:
    """The draft layers over a block x [B, T, H] at positions [B, T], each layer's queries attending to its context
    keys / values ctx_k[l], ctx_v[l] [B, Hkv, S, D] (a KVCache's layout) where ctx_visible [B, S] (True: a context
    position of this row), and to every block position -> final-normed hidden [B, T, H]. Drafting and training
    share it."""
    B, T, H = x.shape
    Hq, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    group, eps, inv = Hq // Hkv, cfg.rms_norm_eps, _inv_freq(cfg)
    S = ctx_visible.shape[1]
    for lp, k_c, v_c in zip(params["layers"], ctx_k, ctx_v):
        h = rms_norm(x, lp["attn_norm"], eps)
        q = apply_rope(rms_norm(linear(h, lp["wq"]).reshape(B, T, Hq, D), lp["q_norm"], eps), positions, inv)
        k_b = apply_rope(rms_norm(linear(h, lp["wk"]).reshape(B, T, Hkv, D), lp["k_norm"], eps), positions, inv)
        v_b = linear(h, lp["wv"]).reshape(B, T, Hkv, D)
        qg = q.reshape(B, T, Hkv, group, D) / math.sqrt(D)
        s_ctx = jnp.einsum("btkgd,bksd->bkgts", qg, k_c)                   # [B, Hkv, group, T, S]
        s_ctx = jnp.where(ctx_visible[:, None, None, None, :], s_ctx, -jnp.inf)
        s_blk = jnp.einsum("btkgd,bukd->bkgtu", qg, k_b)                    # the block sees itself whole
        p = jax.nn.softmax(jnp.concatenate([s_ctx, s_blk], -1), -1)
        o = jnp.einsum("bkgts,bksd->btkgd", p[..., :S], v_c) + jnp.einsum("bkgtu,bukd->btkgd", p[..., S:], v_b)
        x = x + linear(o.reshape(B, T, Hq * D), lp["wo"])
        h = rms_norm(x, lp["mlp_norm"], eps)
        x = x + linear(jax.nn.silu(linear(h, lp["w_gate"])) * linear(h, lp["w_up"]), lp["w_down"])
    return rms_norm(x, params["final_norm"], eps)


def draft_logits(params: dict, cfg: DFlashConfig, hidden: jax.Array, target_lm_head: jax.Array) -> jax.Array:
    """Final-normed block hidden [..., H] -> float32 logits [..., N] over the draft vocabulary (the drafter's own
    head), or [..., V] through the target's LM head when it has none. Drafting and training share it."""
    if cfg.draft_vocab_size is not None:
        return linear(hidden, params["lm_head"].astype(hidden.dtype)).astype(jnp.float32)
    # the target's head as given (a tied head is embed.T: XLA's dot reads it in place, a kernel call would copy it)
    return (hidden @ target_lm_head.astype(hidden.dtype)).astype(jnp.float32)


def block_inputs(params: dict, embed: jax.Array, anchor: jax.Array, num_masks: int) -> jax.Array:
    """[embed(anchor), mask x num_masks]: anchor [B] -> [B, 1 + num_masks, H]."""
    first = embed[anchor][:, None, :]
    masks = jnp.broadcast_to(params["mask_embed"], (anchor.shape[0], num_masks, embed.shape[-1]))
    return jnp.concatenate([first, masks.astype(first.dtype)], 1)


@dataclasses.dataclass(frozen=True)
class DFlashDrafter:
    k: int
    config: DFlashConfig
    cache_size: int
    tree: TreeSpec | None = None     # a static tree: a node of depth d and rank r holds block position d's r-th token
    num_steps: int = 0               # a dynamic tree (with topk): num_steps block positions searched best-first
    topk: int = 0
    target_weights = ("embed", "lm_head")

    @property
    def target_layers(self) -> tuple[int, ...]:
        return self.config.target_layers

    @property
    def is_tree(self) -> bool:
        return self.tree is not None or self.num_steps > 0

    @property
    def block_drafts(self) -> int:
        """Block positions after the anchor that one propose fills: a chain's k, a tree's depth."""
        return draft_depth(self.tree, self.num_steps, self.k)

    def _write(self, params, cache: KVCache, layer_hidden, starts: jax.Array) -> KVCache:
        """Context keys/values of the features layer_hidden (each [B, T, H_t]) at positions starts + 0..T-1."""
        feats = context_features(params, self.config, layer_hidden)
        B, T = feats.shape[:2]
        positions = starts[:, None] + jnp.arange(T)[None, :]
        for l, lp in enumerate(params["layers"]):
            k, v = context_kv(lp, self.config, feats, positions)
            cache = cache.write(l, k, v, starts)
        return cache

    def init(self, params, ctx: Context, target_out, sp):
        B = ctx.tokens.shape[0]
        cfg = self.config
        cache = KVCache.init(cfg.num_layers, B, self.cache_size, cfg.num_kv_heads, cfg.head_dim,
                             keys_transposed=False)
        cache = self._write(params, cache, target_out.layer_hidden, jnp.zeros((B,), jnp.int32))
        return cache.replace(lengths=ctx.prompt_length)          # the prompt's features; stale ones past it

    def block_logits(self, params, cache: KVCache, ctx: Context) -> jax.Array:
        """The block's draft logits over the target vocabulary [B, block_drafts, V]: one forward over the anchor and
        block_drafts mask positions. A block shorter than the trained one changes every position's output (the
        attention inside it is bidirectional), but only by the masks it no longer sees: on SmolLM2's drafter the
        held-out acceptance of the first 3 positions was the same with 4 positions as with all 8, which cost more."""
        cfg, n = self.config, self.block_drafts
        w = ctx.target_weights
        anchor = last_tokens(ctx, 1)[:, 0]                                       # [B] at position length - 1
        x = block_inputs(params, w["embed"], anchor, n)                          # [B, n + 1, H]
        positions = (ctx.length - 1)[:, None] + jnp.arange(n + 1)[None, :]
        visible = jnp.arange(cache.size)[None, :] < cache.lengths[:, None]      # [B, S]
        hidden = block_forward(params, cfg, x, positions, [cache.keys(l) for l in range(cfg.num_layers)],
                               list(cache.v), visible)
        logits = draft_logits(params, cfg, hidden[:, 1:], w["lm_head"])          # [B, n, N | V]
        if cfg.draft_vocab_size is not None:
            logits = full_vocab_logits(logits, params["vocab_map"], cfg.vocab_size)   # [B, n, V]
        return logits

    def propose(self, params, cache: KVCache, ctx: Context, keys, sp: SamplingParams):
        logits = self.block_logits(params, cache, ctx)
        return block_draft(logits, ctx, keys, sp, self.tree, self.num_steps, self.topk, self.k + 1), cache

    def commit(self, params, cache: KVCache, ctx, num_accepted, target_out, verified):
        # the verify pass's features at the anchor and the drafts (sequence order); n + 1 of them are committed now
        cache = self._write(params, cache, target_out.layer_hidden, cache.lengths)
        return cache.replace(lengths=ctx.length - 1)                 # every committed token but the new last one


# ------------------------------------------------------------------------------------------- artifacts

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


def save(path: str, weights: DFlashWeights, target, manifest: str, dtype: str = "bfloat16") -> None:
    tensors = dict(artifacts.flatten_params(jax.device_get(weights.params)))
    if weights.d2t is not None:
        tensors["d2t"] = np.asarray(weights.d2t, np.int64)
    artifacts.save_artifact(path, KIND, weights.config.to_dict(), tensors, target, manifest, dtype)


def load(path_or_name: str, target) -> DFlashWeights:
    config, tensors = artifacts.load_artifact(path_or_name, target, KIND)
    try:
        cfg = DFlashConfig.from_dict(config)
    except TypeError as e:
        raise ValueError(f"DFlash artifact {path_or_name!r}: config does not describe a DFlash drafter ({e})") from None
    shapes = {k: tuple(v.shape) for k, v in artifacts.flatten_params(
        jax.eval_shape(lambda: init_params(jax.random.PRNGKey(0), cfg))).items()}
    artifacts.check_shapes(tensors, shapes, f"DFlash artifact {path_or_name!r}: tensors")
    params = jax.tree.map(jnp.asarray, artifacts.unflatten_params({k: tensors[k] for k in shapes}))
    d2t = None
    if cfg.draft_vocab_size is not None:
        if "d2t" not in tensors:
            raise ValueError(f"DFlash artifact {path_or_name!r} has a draft vocabulary of {cfg.draft_vocab_size} but "
                             "no d2t map")
        d2t = check_vocab_map(tensors["d2t"], cfg.vocab_size, cfg.draft_vocab_size,
                              f"DFlash artifact {path_or_name!r}")
    return DFlashWeights(cfg, params, str(path_or_name), d2t)


def _published_value(hf: dict, name: str, default=None):
    return hf.get("dflash_config", {}).get(name, hf.get(name, default))


def load_published(path: str, target) -> DFlashWeights:
    """The public DFlash layout (a directory with an HF config.json whose dflash_config, or top level, gives
    target_layer_ids, block_size and mask_token_id, and model.safetensors with fc, hidden_norm, norm and
    layers.{i}.self_attn.{q,k,v,o}_proj / {q,k}_norm, mlp.{gate,up,down}_proj, input_layernorm,
    post_attention_layernorm) -> DFlashWeights. Its mask position embeds the target's token mask_token_id (the
    published drafters add that token to the target's vocabulary), which becomes our mask embedding."""
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    layers, mask_id = _published_value(hf, "target_layer_ids"), _published_value(hf, "mask_token_id")
    if layers is None or mask_id is None:
        raise ValueError(f"{path}/config.json is not a DFlash drafter config: it needs target_layer_ids and "
                         "mask_token_id (in dflash_config or at the top level)")
    tc = target.config
    H = int(hf["hidden_size"])
    if H != tc.hidden_size:
        raise ValueError(f"DFlash drafter {path} has hidden size {H}; the target has {tc.hidden_size}")
    if not 0 <= int(mask_id) < tc.vocab_size:
        raise ValueError(f"DFlash drafter {path} embeds mask token {mask_id}, outside the target's vocabulary of "
                         f"{tc.vocab_size}: it was made for a target with that token added")
    Hq, Hkv = int(hf["num_attention_heads"]), int(hf["num_key_value_heads"])
    cfg = DFlashConfig(H, int(hf["num_hidden_layers"]), Hq, Hkv, int(hf.get("head_dim", H // Hq)),
                       int(hf["intermediate_size"]), tuple(int(l) for l in layers),
                       int(_published_value(hf, "block_size", 16)), tc.vocab_size,
                       float(hf.get("rms_norm_eps", 1e-6)), float(hf.get("rope_theta", 10000.0)))
    t = artifacts.read_published_tensors(path, ("model.safetensors",), "pytorch_model.bin")

    def get(name, shape):
        if name not in t:
            raise ValueError(f"DFlash checkpoint {path} is missing tensor {name!r}")
        if tuple(t[name].shape) != shape:
            raise ValueError(f"DFlash checkpoint {path}: {name} has shape {tuple(t[name].shape)}, expected {shape}")
        return jnp.asarray(t[name], jnp.float32)

    D, I = cfg.head_dim, cfg.intermediate_size
    lin = lambda name, out, inp: get(name, (out, inp)).T          # torch Linear [out, in] -> our [in, out]
    layers_out = []
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        layers_out.append({
            "attn_norm": get(p + "input_layernorm.weight", (H,)),
            "wq": lin(p + "self_attn.q_proj.weight", Hq * D, H), "wk": lin(p + "self_attn.k_proj.weight", Hkv * D, H),
            "wv": lin(p + "self_attn.v_proj.weight", Hkv * D, H), "wo": lin(p + "self_attn.o_proj.weight", H, Hq * D),
            "q_norm": get(p + "self_attn.q_norm.weight", (D,)), "k_norm": get(p + "self_attn.k_norm.weight", (D,)),
            "mlp_norm": get(p + "post_attention_layernorm.weight", (H,)),
            "w_gate": lin(p + "mlp.gate_proj.weight", I, H), "w_up": lin(p + "mlp.up_proj.weight", I, H),
            "w_down": lin(p + "mlp.down_proj.weight", H, I)})
    params = {"fc": lin("fc.weight", H, len(cfg.target_layers) * H), "hidden_norm": get("hidden_norm.weight", (H,)),
              "mask_embed": jnp.asarray(target_weight(target.params, "embed")[int(mask_id)], jnp.float32),
              "layers": layers_out, "final_norm": get("norm.weight", (H,))}
    return DFlashWeights(cfg, params, os.path.basename(os.path.normpath(path)))


def _load(target, path_or_name: str) -> DFlashWeights:
    """Ours (a specjax artifact or shipped name) or the public layout."""
    path = resolve(path_or_name, "drafter")
    with open(os.path.join(path, "config.json")) as f:
        ours = "specjax_drafter" in json.load(f)
    return load(path, target) if ours else load_published(path, target)


def _build(req: BuildRequest):
    weights, config, target = req.drafter, req.config, req.target
    if weights is None:
        raise TypeError("method='dflash' needs drafter=<a DFlash artifact directory, a shipped name or "
                        "dflash.DFlashWeights>, got None")
    cfg = weights.config
    tc = target.config
    if (cfg.hidden_size, cfg.vocab_size) != (tc.hidden_size, tc.vocab_size):
        raise ValueError(f"DFlash drafter {weights.name!r} is for hidden {cfg.hidden_size} / vocab {cfg.vocab_size}; "
                         f"the target has {tc.hidden_size} / {tc.vocab_size}")
    bad = [l for l in cfg.target_layers if not 0 <= l < tc.num_layers]
    if bad or not cfg.target_layers:
        raise ValueError(f"DFlash drafter {weights.name!r} reads target layers {list(cfg.target_layers)}; the target "
                         f"has {tc.num_layers} decoder layers (indices 0..{tc.num_layers - 1})")
    steps, topk = (config.num_steps or 0), (config.topk or 0)
    drafter = DFlashDrafter(config.k, cfg, req.buffer_len, config.tree, steps, topk)
    positions = drafter.block_drafts
    if positions > cfg.block_size - 1:
        what = (f"k={config.k} drafts" if not config.is_tree else
                f"a tree {positions} deep (num_steps)" if config.tree is None else f"a tree {positions} deep")
        raise ValueError(f"{what} more positions than the DFlash drafter {weights.name!r} fills (its block is "
                         f"{cfg.block_size}: the anchor and {cfg.block_size - 1} drafts)")
    width = config.tree.topk if config.tree is not None else topk
    vocab = cfg.draft_vocab_size or cfg.vocab_size
    if width > vocab:
        raise ValueError(f"the tree asks for the top-{width} tokens of a block position but the DFlash drafter "
                         f"{weights.name!r} drafts from {vocab} tokens")
    params = weights.params
    if cfg.draft_vocab_size is not None:
        params = dict(params, vocab_map=jnp.asarray(draft_to_target(weights.d2t), jnp.int32))
    return drafter, params


register(DrafterSpec(KIND, _build, accepts="a DFlash directory (ours or the public layout), a shipped name or "
                                         "dflash.DFlashWeights", load=_load, artifact=DFlashWeights, trees=True))
