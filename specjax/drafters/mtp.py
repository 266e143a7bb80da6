"""Multi-token prediction drafters: decoder layers of their own that read the target's features.

Two methods, one layer (specjax.models.llama.decoder_layer, with a KV cache per module / head):

  "mtp"        DeepSeek-V3-style MTP modules on a frozen (or jointly trained) target. Module d (1..D) keeps the
               causal chain: its input at a position is proj([RMSNorm(h^{d-1}); RMSNorm(embed(next token))])
               (2H -> H, no bias), h^0 = the target's final normed hidden state, h^{d-1} = module d-1's output;
               one Llama decoder layer; its own final RMSNorm and the TARGET's LM head (and embedding:
               target_weights = ("embed", "lm_head")). A proposal is a chain: draft d comes from module d; beyond D
               the last module is reused on its own output (as vLLM runs DeepSeek's one module for k > 1).
  "mtp_heads"  Gloeckle et al. (2024) multi-token heads, used self-speculatively. The target was trained with n
               output heads on a shared trunk: head 1 is the target's own last decoder layer (it verifies), heads
               2..n are one decoder layer each over the trunk's output (`trunk_layer`, a target layer the loop
               exposes), each with its own final norm, through the target's LM head. Head i at position t predicts
               token t + i, so the trunk features that produced the bonus token give n - 1 drafts at the cost of
               n - 1 vocabulary projections (the heads' layers run over the verified positions at commit).

Cache alignment (both; the EAGLE convention): the drafter's KV-cache entry e belongs to target position e, entries
0 .. committed length - 2 are committed (lengths = committed - 1), and `hidden` holds each module's / head's output
at the last committed entry.
  mtp: module 1's entry e pairs (h^0_e, x_{e+1}); module d's entry e pairs (h^{d-1} at entry e - 1, x_{e+1}) -- the
       DeepSeek chain (module d at position s reads h^{d-1}_s and x_{s+d}) with module d's positions shifted by d - 1,
       which RoPE's relative positions make the same computation, and which lets every module commit the same
       entries. Every module's entry e predicts x_{e+2}. Entry 0 of module d > 1 has no h^{d-1} (zeros), in training
       and inference alike. Propose: draft 1 = module 1's stored output; for d = 2..min(k, D) module d runs the
       d - 1 entries L-1 .. L+d-3 past the committed ones (L = committed length), pairing module d-1's outputs at
       L-2 .. L+d-4 (the stored one, then its own speculative block) with drafts 1..d-1, so each draft is exactly
       what the modules computed in training on the drafted prefix; beyond D one entry of module D per draft on its
       previous output. Speculative entries lie past the committed length and are overwritten at the next commit.
       Commit: for d = 1..D the W = k + 1 verified entries from the old length, module d's hidden inputs being
       module d-1's stored output followed by its commit block (module 1: the target's features).
  mtp_heads: head i's entry e = head i's layer over the trunk feature of position e; no tokens.

Training (pure functions, no cache): mtp_forward_sequence, heads_forward_sequence. Artifacts: kinds "mtp" and
"mtp_heads" (specjax.drafters.artifacts); a multi-token target's heads live in its directory under `mtp_heads/`.
"""
from __future__ import annotations

import dataclasses
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specjax.cache import KVCache
from specjax.checkpoints import resolve
from specjax.drafters import artifacts
from specjax.drafters.base import Context, Draft, pick_tokens
from specjax.drafters.registry import BuildRequest, DrafterSpec, Option, register
from specjax.models.config import ModelConfig
from specjax.models.llama import decoder_layer, lm_head, rms_norm
from specjax.sampling import SamplingParams

KINDS = ("mtp", "mtp_heads")
HEADS_DIR = "mtp_heads"           # a multi-token target's extra heads, inside the target's directory
_LAYER_KEYS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")


# ------------------------------------------------------------------------------------------------ configuration

@dataclasses.dataclass(frozen=True)
class MTPConfig:
    """What a multi-token drafter is (hashable: part of the static drafter object).

    kind: "mtp" (DeepSeek modules) or "mtp_heads" (Gloeckle heads).
    layer: the decoder layer's shape as a Llama ModelConfig (hidden_size = the target's; vocab_size = the
      target's; num_layers 1; intermediate_size may differ from the target's).
    depth: D, the number of MTP modules, or of extra heads (n - 1) of a multi-token target.
    trunk_layer: mtp_heads only: the target decoder layer whose output the heads read (the trunk's last).
    """
    kind: str
    layer: ModelConfig
    depth: int
    trunk_layer: int | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"multi-token drafter kind must be one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.depth, int) or self.depth < 1:
            raise ValueError(f"depth (MTP modules / extra heads) must be a positive int, got {self.depth!r}")
        if (self.kind == "mtp_heads") != (self.trunk_layer is not None):
            raise ValueError("trunk_layer is required for mtp_heads and meaningless for mtp")

    def to_dict(self) -> dict:
        c = self.layer
        return {"kind": self.kind, "depth": self.depth, "trunk_layer": self.trunk_layer,
                "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "num_heads": c.num_heads,
                "num_kv_heads": c.num_kv_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
                "rope_theta": c.rope_theta, "vocab_size": c.vocab_size,
                "max_position_embeddings": c.max_position_embeddings}

    @classmethod
    def from_dict(cls, d: dict) -> "MTPConfig":
        layer = ModelConfig(vocab_size=int(d["vocab_size"]), hidden_size=int(d["hidden_size"]),
                            intermediate_size=int(d["intermediate_size"]), num_layers=1,
                            num_heads=int(d["num_heads"]), num_kv_heads=int(d["num_kv_heads"]),
                            head_dim=int(d["head_dim"]), rope_theta=float(d["rope_theta"]),
                            rms_norm_eps=float(d["rms_norm_eps"]),
                            max_position_embeddings=int(d.get("max_position_embeddings", 2048)))
        trunk = d.get("trunk_layer")
        return cls(d["kind"], layer, int(d["depth"]), None if trunk is None else int(trunk))


class MTPWeights(NamedTuple):
    """A loaded multi-token drafter. params: {"modules": [D x {norm_h [H], norm_e [H], proj [2H, H], layer {...},
    final_norm [H]}]} (mtp) or {"heads": [D x {layer {...}, final_norm [H]}]} (mtp_heads); layer = one Llama
    decoder layer's dict (attn_norm, wq, wk, wv, wo, mlp_norm, w_gate, w_up, w_down)."""
    config: MTPConfig
    params: dict
    name: str = ""


def layer_config(target_config: ModelConfig, intermediate_size: int | None = None) -> ModelConfig:
    """The target's layer shape (one layer), optionally with another MLP width."""
    return dataclasses.replace(target_config, num_layers=1,
                               intermediate_size=intermediate_size or target_config.intermediate_size)


def init_params(key: jax.Array, config: MTPConfig, target_params: dict | None = None, std: float = 0.02) -> dict:
    """Random layers (llama.init_params' scheme); final norms from the target's when given. An MTP module's proj
    starts as identity on the hidden half (+ noise): a fresh module passes its input feature through, like a
    fresh EAGLE-1 drafter."""
    from specjax.models.llama import init_params as llama_init
    H = config.layer.hidden_size
    keys = jax.random.split(key, 2 * config.depth)
    norm = (jnp.asarray(target_params["final_norm"], jnp.float32) if target_params is not None
            else jnp.ones((H,), jnp.float32))
    out = []
    for d in range(config.depth):
        layer = llama_init(config.layer, keys[2 * d], std=std)["layers"][0]
        entry = {"layer": layer, "final_norm": norm}
        if config.kind == "mtp":
            proj = std * jax.random.normal(keys[2 * d + 1], (2 * H, H))
            entry.update(norm_h=jnp.ones((H,)), norm_e=jnp.ones((H,)), proj=proj.at[:H].add(jnp.eye(H)))
        out.append(entry)
    return {"modules" if config.kind == "mtp" else "heads": out}


# ----------------------------------------------------------------------------------------------- the layer math

def _module_input(mp: dict, c: ModelConfig, hid: jax.Array, emb: jax.Array) -> jax.Array:
    """MTP module input: proj([RMSNorm(h); RMSNorm(embedding)]) [B, T, H]."""
    x = jnp.concatenate([rms_norm(hid, mp["norm_h"], c.rms_norm_eps), rms_norm(emb, mp["norm_e"], c.rms_norm_eps)],
                        -1)
    return x @ mp["proj"]


def _logits(mp: dict, c: ModelConfig, out: jax.Array, lm_head_w: jax.Array) -> jax.Array:
    """A module's / head's output [..., H] -> float32 logits over the target vocabulary [..., V]."""
    return lm_head({"lm_head": lm_head_w}, rms_norm(out, mp["final_norm"], c.rms_norm_eps))


def _fresh_cache(c: ModelConfig, layers: int, batch: int, size: int, dtype) -> KVCache:
    return KVCache.init(layers, batch, size, c.num_kv_heads, c.head_dim, dtype)


def _positions(start: jax.Array, T: int) -> jax.Array:
    return start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]                  # [B, T]


def _shift_in(first: jax.Array, block: jax.Array) -> jax.Array:
    """[B, H] and [B, T, H] -> [B, T, H]: first, then block[:, :T-1] (the previous module's outputs one entry
    earlier)."""
    return jnp.concatenate([first[:, None].astype(block.dtype), block[:, :-1]], axis=1)


def mtp_forward_sequence(params: dict, config: MTPConfig, tokens: jax.Array, features: jax.Array,
                         target_weights: dict) -> tuple[jax.Array, jax.Array]:
    """Teacher-forced MTP modules over whole sequences (training), no persistent cache.

    Entry e pairs features[:, e] (the target's final normed hidden state of position e) with tokens[:, e] (the
    token at position e + 1), as inference does: tokens = ids[:, 1:], features = the target's hidden of
    ids[:, :-1]. Returns (outputs [D, B, T, H] pre-norm, logits [D, B, T, V]); every module's logits[:, :, e]
    predict ids[:, e + 2]; module d's entries e < d (0-based d) have no causal chain behind them (padding)."""
    c = config.layer
    B, T = tokens.shape
    emb = target_weights["embed"][tokens]
    pos = _positions(jnp.zeros((B,), jnp.int32), T)
    hid, outs = features.astype(emb.dtype), []
    for d, mp in enumerate(params["modules"]):
        cache = _fresh_cache(c, 1, B, T, emb.dtype)
        out, _ = decoder_layer(mp["layer"], c, _module_input(mp, c, hid, emb), pos, cache, 0)
        outs.append(out)
        hid = _shift_in(jnp.zeros((B, c.hidden_size), out.dtype), out)
    outs = jnp.stack(outs)
    logits = jnp.stack([_logits(mp, c, o, target_weights["lm_head"]) for mp, o in zip(params["modules"], outs)])
    return outs, logits


def heads_forward_sequence(params: dict, config: MTPConfig, trunk: jax.Array, lm_head_w: jax.Array
                           ) -> tuple[jax.Array, jax.Array]:
    """Multi-token heads over whole sequences: trunk [B, T, H] (the trunk's output at every position) -> (outputs
    [D, B, T, H], logits [D, B, T, V]); head d (0-based, the model's head d + 2) at t predicts the token at
    t + d + 2."""
    c = config.layer
    B, T = trunk.shape[:2]
    pos = _positions(jnp.zeros((B,), jnp.int32), T)
    outs = [decoder_layer(hp["layer"], c, trunk, pos, _fresh_cache(c, 1, B, T, trunk.dtype), 0)[0]
            for hp in params["heads"]]
    outs = jnp.stack(outs)
    return outs, jnp.stack([_logits(hp, c, o, lm_head_w) for hp, o in zip(params["heads"], outs)])


# ------------------------------------------------------------------------------------------------- the drafters

class MTPState(NamedTuple):
    cache: KVCache          # one layer per module / head; lengths = committed length - 1
    hidden: jax.Array       # [D, B, H] each module's / head's output at the last committed entry


@dataclasses.dataclass(frozen=True)
class MTPDrafter:
    num_tokens: int
    config: MTPConfig
    cache_size: int
    implementation: str = "xla"

    @property
    def target_layers(self) -> tuple:
        return (self.config.trunk_layer,) if self.config.kind == "mtp_heads" else ()

    @property
    def target_weights(self) -> tuple:
        return ("embed", "lm_head") if self.config.kind == "mtp" else ("lm_head",)

    @property
    def _used(self) -> int:
        """Modules / heads that run: the first min(k, D) (module d only reads modules before it)."""
        return min(self.num_tokens, self.config.depth)

    def _entries(self, params) -> list:
        return (params["modules"] if self.config.kind == "mtp" else params["heads"])[:self._used]

    def _features(self, target_out) -> jax.Array:
        return target_out.hidden if self.config.kind == "mtp" else target_out.layer_hidden[0]

    def _run_all(self, params, ctx: Context, feats, tokens, cache: KVCache, first_hidden):
        """Every module / head over the block of entries at cache.lengths: feats [B, T, H] (target features),
        tokens [B, T] (mtp: x_{e+1} of each entry), first_hidden [D, B, H] (mtp: each module's output one entry
        before the block) -> (outputs [D, B, T, H], cache with the entries written, lengths not advanced)."""
        c = self.config.layer
        pos = _positions(cache.lengths, feats.shape[1])
        outs = []
        if self.config.kind == "mtp":
            emb = ctx.target_weights["embed"][tokens].astype(feats.dtype)
            hid = feats
            for d, mp in enumerate(self._entries(params)):
                out, cache = decoder_layer(mp["layer"], c, _module_input(mp, c, hid, emb), pos, cache, d,
                                           implementation=self.implementation)
                outs.append(out)
                hid = _shift_in(first_hidden[d], out)
        else:
            for d, hp in enumerate(self._entries(params)):
                out, cache = decoder_layer(hp["layer"], c, feats, pos, cache, d, implementation=self.implementation)
                outs.append(out)
        return jnp.stack(outs), cache

    def _head_logits(self, params, ctx: Context, d: int, h: jax.Array) -> jax.Array:
        return _logits(self._entries(params)[d], self.config.layer, h, ctx.target_weights["lm_head"])

    def init(self, params, ctx: Context, target_out, sp):
        c = self.config.layer
        feats = self._features(target_out)
        B, P = feats.shape[:2]
        idx = np.minimum(np.arange(1, P + 1), ctx.tokens.shape[1] - 1)
        cache = _fresh_cache(c, self._used, B, self.cache_size, feats.dtype)
        zeros = jnp.zeros((self._used, B, c.hidden_size), feats.dtype)
        outs, cache = self._run_all(params, ctx, feats, ctx.tokens[:, idx], cache, zeros)
        last = jnp.take_along_axis(outs, (ctx.prompt_length - 1)[None, :, None, None], axis=2)[:, :, 0]
        return MTPState(cache.replace(lengths=ctx.prompt_length), last)

    def propose(self, params, state: MTPState, ctx: Context, keys, sp: SamplingParams):
        k = self.num_tokens
        step_keys = jax.vmap(lambda key: jax.random.split(key, k))(keys)          # [B, k] keys
        if self.config.kind == "mtp_heads":
            picks = [pick_tokens(self._head_logits(params, ctx, d, state.hidden[d]), step_keys[:, d], sp)
                     for d in range(k)]
            return self._draft(picks), state
        c, D = self.config.layer, self.config.depth
        base = state.cache.lengths                                                 # L - 1
        cache = state.cache
        picks = [pick_tokens(self._head_logits(params, ctx, 0, state.hidden[0]), step_keys[:, 0], sp)]
        chain = state.hidden[0][:, None]      # the latest module's outputs from entry L-2 on: [B, n, H]
        for j in range(2, k + 1):                                                  # draft j
            drafts = jnp.stack([p[0] for p in picks], 1)                           # [B, j - 1]
            if j <= D:             # module j: the j - 1 entries L-1 .. L+j-3, on module j-1's L-2 .. L+j-4
                d, hid, toks, start = j - 1, chain, drafts, base
            else:                  # beyond D: module D once more, one entry, on its own previous output
                d, hid, toks, start = D - 1, chain[:, -1:], drafts[:, -1:], base + j - 2
            mp = self._entries(params)[d]
            x = _module_input(mp, c, hid, ctx.target_weights["embed"][toks].astype(hid.dtype))
            out, cache = decoder_layer(mp["layer"], c, x, _positions(start, x.shape[1]), cache.replace(lengths=start),
                                       d, implementation=self.implementation)
            chain = (jnp.concatenate([state.hidden[d][:, None], out], 1) if j <= D
                     else jnp.concatenate([chain, out], 1))
            picks.append(pick_tokens(self._head_logits(params, ctx, d, out[:, -1]), step_keys[:, j - 1], sp))
        return self._draft(picks), MTPState(cache.replace(lengths=base), state.hidden)

    @staticmethod
    def _draft(picks) -> Draft:
        tokens = jnp.stack([p[0] for p in picks], 1)                               # [B, k]
        if picks[0][1] is None:
            return Draft(tokens)
        return Draft(tokens, jnp.stack([p[1] for p in picks], 1))                  # [B, k, V]

    def commit(self, params, state: MTPState, ctx, num_accepted, target_out, verified):
        feats = self._features(target_out)
        W = feats.shape[1]                                                         # k + 1
        old = state.cache.lengths
        idx = jnp.minimum(old[:, None] + 1 + jnp.arange(W), ctx.tokens.shape[1] - 1)
        toks = jnp.take_along_axis(ctx.tokens, idx, axis=1)                        # accepted drafts, then the bonus
        outs, cache = self._run_all(params, ctx, feats, toks, state.cache, state.hidden)
        new_len = ctx.length - 1                                                   # old + n + 1 unless clipped
        at = jnp.clip(new_len - old - 1, 0, W - 1)
        hidden = jnp.take_along_axis(outs, at[None, :, None, None], axis=2)[:, :, 0]
        return MTPState(cache.replace(lengths=new_len), hidden)


# ------------------------------------------------------------------------------------------- reading / writing

def _flatten(params: dict) -> dict:
    group = "modules" if "modules" in params else "heads"
    flat = {}
    for d, entry in enumerate(params[group]):
        for name, x in entry.items():
            if name == "layer":
                flat.update({f"{group}.{d}.layer.{k}": v for k, v in x.items()})
            else:
                flat[f"{group}.{d}.{name}"] = x
    return flat


def _expected_shapes(config: MTPConfig) -> dict:
    c = config.layer
    H, I, D = c.hidden_size, c.intermediate_size, c.head_dim
    layer = {"attn_norm": (H,), "wq": (H, c.num_heads * D), "wk": (H, c.num_kv_heads * D),
             "wv": (H, c.num_kv_heads * D), "wo": (c.num_heads * D, H), "mlp_norm": (H,), "w_gate": (H, I),
             "w_up": (H, I), "w_down": (I, H)}
    group = "modules" if config.kind == "mtp" else "heads"
    shapes = {}
    for d in range(config.depth):
        shapes.update({f"{group}.{d}.layer.{k}": s for k, s in layer.items()})
        shapes[f"{group}.{d}.final_norm"] = (H,)
        if config.kind == "mtp":
            shapes.update({f"{group}.{d}.norm_h": (H,), f"{group}.{d}.norm_e": (H,), f"{group}.{d}.proj": (2 * H, H)})
    return shapes


def save(path: str | os.PathLike, weights: MTPWeights, target, manifest: str, dtype: str = "bfloat16") -> None:
    artifacts.save_artifact(path, weights.config.kind, weights.config.to_dict(),
                            {k: np.asarray(v) for k, v in _flatten(jax.device_get(weights.params)).items()},
                            target, manifest, dtype)


def load(path_or_name: str | os.PathLike, target, kind: str) -> MTPWeights:
    """A specjax "mtp" / "mtp_heads" artifact (or a multi-token target's directory holding mtp_heads/, or a shipped
    name) -> MTPWeights, checked against this target."""
    path = resolve(path_or_name, "drafter")
    if kind == "mtp_heads" and os.path.isdir(os.path.join(path, HEADS_DIR)):
        path = os.path.join(path, HEADS_DIR)
    cfg, tensors = artifacts.load_artifact(path, target, kind)
    config = MTPConfig.from_dict(cfg)
    tc = target.config
    if config.layer.hidden_size != tc.hidden_size:
        raise ValueError(f"{path}: {kind} layers are {config.layer.hidden_size} wide, the target's hidden state is "
                         f"{tc.hidden_size}")
    if config.trunk_layer is not None and not 0 <= config.trunk_layer < tc.num_layers:
        raise ValueError(f"{path}: the heads read trunk layer {config.trunk_layer}, the target has "
                         f"{tc.num_layers} decoder layers")
    expected = _expected_shapes(config)
    missing = sorted(set(expected) - set(tensors))
    wrong = [f"{k}: {list(tensors[k].shape)} (expected {list(s)})" for k, s in expected.items()
             if k in tensors and tuple(tensors[k].shape) != s]
    if missing or wrong:
        raise ValueError(f"{path}: {kind} weights do not match its config.json"
                         + (f"; missing {missing[:6]}" if missing else "") + (f"; wrong shapes {wrong[:4]}" if wrong else ""))
    group = "modules" if kind == "mtp" else "heads"
    entries = []
    for d in range(config.depth):
        pre = f"{group}.{d}."
        entry = {"layer": {k: jnp.asarray(tensors[pre + "layer." + k]) for k in _LAYER_KEYS}}
        entry.update({k[len(pre):]: jnp.asarray(v) for k, v in tensors.items()
                      if k.startswith(pre) and ".layer." not in k})
        entries.append(entry)
    return MTPWeights(config, {group: entries}, os.path.basename(os.path.normpath(path)))


# --------------------------------------------------------------------------------------------------- registry

def _build(req: BuildRequest, kind: str):
    w = req.drafter
    if isinstance(w, (str, os.PathLike)):
        w = load(w, req.target, kind)
    if not isinstance(w, MTPWeights):
        raise TypeError(f"method={kind!r} needs drafter=<a {kind} directory, a shipped name or mtp.load(...)>, got "
                        f"{type(w).__name__}")
    if w.config.kind != kind:
        raise ValueError(f"drafter {w.name!r} holds {w.config.kind!r} weights; use method={w.config.kind!r}")
    k = req.config.k
    if kind == "mtp_heads" and k > w.config.depth:
        raise ValueError(f"k={k} but the multi-token target {w.name!r} has {w.config.depth} extra heads (it was "
                         f"trained to predict {w.config.depth + 1} tokens): k <= {w.config.depth}")
    if kind == "mtp" and k > w.config.depth and not req.config.option("reuse_last_module"):
        raise ValueError(f"k={k} drafts but {w.name!r} has {w.config.depth} MTP modules (depths beyond were never "
                         f"trained): use k <= {w.config.depth}, or drafter_options={{'reuse_last_module': True}} to "
                         "run the last module again beyond its depth (vLLM's way)")
    return MTPDrafter(k, w.config, req.buffer_len, req.config.implementation), w.params


register(DrafterSpec(
    "mtp", lambda req: _build(req, "mtp"), accepts="MTP modules: a directory, a shipped name or mtp.load(...)",
    load=lambda target, path: load(path, target, "mtp"),
    options={"reuse_last_module": Option(False, lambda v: isinstance(v, bool),
                                         "True: draft beyond the trained depth D by running module D again on its "
                                         "own output (vLLM's way); False: k > D is an error")}))
register(DrafterSpec(
    "mtp_heads", lambda req: _build(req, "mtp_heads"),
    accepts="a multi-token target's heads: its directory (holding mtp_heads/), the heads' directory, a shipped name "
            "or mtp.load(..., kind='mtp_heads')",
    load=lambda target, path: load(path, target, "mtp_heads")))
