"""Medusa heads (Cai et al. 2024): K extra decoding heads on the target's last hidden state.

Head i (0-based) reads the target's final normed hidden state at the position that produced the bonus token and
predicts the token i + 1 places after the bonus: ResBlocks `x + SiLU(x W + b)`, then a vocabulary projection.
A proposal costs K small matmuls and no target forward, which is the point: the drafts come from features the
verify pass already computed.

Projections ("layout" in the artifact's config):
  per_head  each head has its own [H, V] LM head (the paper's; K separate vocabulary matmuls per step)
  shared    the heads output hidden states that go through ONE [H, V] projection (one K-row matmul that reads
            the weights once; a K-th of the storage)
  target_head  as shared, through the target's own LM head (frozen; read through the target-weights contract, so
            the artifact holds only the ResBlocks: what a target with a large vocabulary ships)

Proposals: a chain (head i's argmax; at temperature > 0 a sample from head i's distribution after the shared
sampling transform, q = that distribution, which speculative sampling verifies exactly), a static tree from
the heads' top candidates per depth (tree_choices: e.g. trees.MEDUSA_63, or trees.choices_from_accuracies
built from measured per-head top-k accuracies), or a dynamic tree whose paths are ranked by the sum of their
heads' log-probabilities (num_steps / topk / num_draft_tokens; tree_search.tree_from_position_logits, as for the
block drafters); tree children are deterministic top-k, exact at any temperature.
Medusa's typical acceptance is the lossy SpecConfig(acceptance_method="typical_lossy").

Artifacts: a specjax drafter directory (specjax.drafters.artifacts, kind "medusa"), or a published layout:
the Medusa repository's (`medusa_lm_head.safetensors` / `.pt`, keys `{head}.{layer}.linear.weight/bias` and
`{head}.{num_layers}.weight`, config `medusa_num_heads`, `medusa_num_layers`) and vLLM's (`blocks.{head}.layers.
{layer}.weight/bias`, `lm_heads.{head}.weight`, config `num_heads`, `num_hidden_layers`).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from specjax.ops import linear
from specjax.checkpoints import resolve
from specjax.drafters import artifacts
from specjax.drafters.base import Context, Draft, block_draft, pick_tokens
from specjax.drafters.registry import BuildRequest, DrafterSpec, register
from specjax.layout import fit_spec
from specjax.models import llama
from specjax.sampling import SamplingParams
from specjax.trees import TreeSpec, choices_from_accuracies, draft_depth

KIND = "medusa"
LAYOUTS = ("per_head", "shared", "target_head")


class MedusaHeads(NamedTuple):
    """Loaded heads: num_heads K, ResBlocks per head, layout, and params
    {"w": [K, R, H, H], "b": [K, R, H], "proj": [K, H, V] (per_head) or [H, V] (shared); none (target_head)}."""
    num_heads: int
    num_layers: int
    layout: str
    params: dict
    name: str = ""
    vocab: int | None = None           # target_head: the target's vocabulary size (no projection of its own)

    @property
    def hidden_size(self) -> int:
        return int(self.params["w"].shape[-1])

    @property
    def vocab_size(self) -> int:
        """None for heads made in code through the target's LM head (target_head, vocab not given)."""
        if "proj" in self.params:
            return int(self.params["proj"].shape[-1])
        return None if self.vocab is None else int(self.vocab)


def init_heads(key: jax.Array, num_heads: int, num_layers: int, lm_head: jax.Array, layout: str) -> dict:
    """Medusa-1 initialisation: ResBlocks start at zero (each head starts as the identity), projections start
    as copies of the target's LM head [H, V] (target_head: it is the target's), so a fresh head predicts what the
    target predicts."""
    del key                                                   # zero/copy init is deterministic
    if layout not in LAYOUTS:
        raise ValueError(f"unknown Medusa layout {layout!r}; expected one of {LAYOUTS}")
    H = lm_head.shape[0]
    params = {"w": jnp.zeros((num_heads, num_layers, H, H), lm_head.dtype),
              "b": jnp.zeros((num_heads, num_layers, H), lm_head.dtype)}
    if layout != "target_head":
        params["proj"] = jnp.array(jnp.broadcast_to(lm_head, (num_heads,) + lm_head.shape) if layout == "per_head"
                                   else lm_head)
    return params


def head_hidden(params: dict, hidden: jax.Array) -> jax.Array:
    """hidden [..., H] -> [..., K, H]: each head's ResBlock stack applied to the same target feature."""
    x = jnp.broadcast_to(hidden[..., None, :], hidden.shape[:-1] + (params["w"].shape[0], hidden.shape[-1]))
    for r in range(params["w"].shape[1]):
        x = x + jax.nn.silu(jnp.einsum("...kh,khg->...kg", x, params["w"][:, r]) + params["b"][:, r])
    return x


def head_logits(params: dict, hidden: jax.Array, lm_head: jax.Array | None = None) -> jax.Array:
    """hidden [..., H] -> logits [..., K, V] float32. lm_head [H, V]: the target's, for heads without a projection
    of their own (layout target_head)."""
    x = head_hidden(params, hidden)
    if "proj" not in params:
        if lm_head is None:
            raise ValueError("these Medusa heads project through the target's LM head: pass lm_head")
        return (x @ lm_head).astype(jnp.float32)
    if params["proj"].ndim == 3:                              # per-head LM heads: K separate projections
        return jnp.einsum("...kh,khv->...kv", x, params["proj"]).astype(jnp.float32)
    return linear(x, params["proj"].astype(x.dtype)).astype(jnp.float32)   # one shared projection, K rows at once


@dataclasses.dataclass(frozen=True)
class MedusaDrafter:
    k: int
    num_heads: int                    # the heads the loop runs: the proposal's depth (first_heads)
    tree: TreeSpec | None = None
    uses_target_head: bool = False    # layout target_head: the heads project through the target's LM head
    num_steps: int = 0                # > 0: a dynamic tree (with topk) over the first num_steps heads
    topk: int = 0
    target_layers = ()                # reads only the target's final hidden state, which every forward returns

    @property
    def target_weights(self) -> tuple[str, ...]:
        return ("output_head",) if self.uses_target_head else ()

    # state: the target's final hidden state [B, H] at the position that produced the last committed token

    def init(self, params, ctx: Context, target_out, sp):
        at = (ctx.prompt_length - 1)[:, None, None]
        return jnp.take_along_axis(target_out.hidden, at, axis=1)[:, 0]

    def propose(self, params, hidden, ctx: Context, keys, sp: SamplingParams):
        if self.uses_target_head:                 # through the target's head as its own forward computes it
            logits = llama.lm_head(ctx.target_weights["output_head"], head_hidden(params, hidden))   # [B, K, V]
        else:
            logits = head_logits(params, hidden)                                # [B, K, V]
        if self.tree is not None or self.num_steps:       # head d's distribution for every depth-(d + 1) node
            depth = draft_depth(self.tree, self.num_steps, self.k)
            return block_draft(logits[:, :depth], ctx, keys, sp, self.tree, self.num_steps, self.topk,
                               self.k + 1), hidden
        tokens, probs, confidence = pick_tokens(logits[:, :self.k], keys, sp)  # [B, k]: one draw per head
        return Draft(tokens, probs, confidence=confidence), hidden

    def commit(self, params, hidden, ctx, num_accepted, target_out, verified):
        return jnp.take_along_axis(target_out.hidden, num_accepted[:, None, None], axis=1)[:, 0]


# ------------------------------------------------------------------------------------------- loading and saving

def save_heads(path: str, heads: MedusaHeads, target, manifest: str, dtype: str = "bfloat16") -> None:
    p = jax.device_get(heads.params)
    artifacts.save_artifact(path, KIND, {"num_heads": heads.num_heads, "num_layers": heads.num_layers,
                                         "layout": heads.layout}, {k: np.asarray(v) for k, v in p.items()},
                            target, manifest, dtype)


def _from_torch_layout(blocks: dict, lm_heads: list, num_heads: int, num_layers: int, shared=None) -> dict:
    """Published layouts store Linear weights as [out, in]; ours multiply x @ w with w [in, out]."""
    w = np.stack([np.stack([blocks[(i, r)][0].T for r in range(num_layers)]) for i in range(num_heads)])
    b = np.stack([np.stack([blocks[(i, r)][1] for r in range(num_layers)]) for i in range(num_heads)])
    proj = np.stack([h.T for h in lm_heads]) if shared is None else shared.T
    return {"w": w.astype(np.float32), "b": b.astype(np.float32), "proj": proj.astype(np.float32)}


def _read_tensors(path: str) -> dict[str, np.ndarray]:
    return artifacts.read_published_tensors(path, ("medusa_lm_head.safetensors", "model.safetensors"),
                                            "medusa_lm_head.pt")


def _need(tensors: dict, key: str, shape: tuple, where: str) -> np.ndarray:
    if key not in tensors:
        raise ValueError(f"Medusa checkpoint {where} is missing tensor {key!r} (truncated or another layout?)")
    if tuple(tensors[key].shape) != shape:
        raise ValueError(f"Medusa checkpoint {where}: tensor {key!r} has shape {list(tensors[key].shape)}, "
                         f"expected {list(shape)}")
    return tensors[key]


def load_published(path: str, target) -> MedusaHeads:
    """The Medusa repository's or vLLM's layout -> MedusaHeads, checked against the target's sizes."""
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    H, V = target.config.hidden_size, target.config.vocab_size
    for key in ("hidden_size", "vocab_size"):
        if key in hf and int(hf[key]) != getattr(target.config, key):
            raise ValueError(f"Medusa heads in {path} were trained for {key}={hf[key]}, the target has "
                             f"{getattr(target.config, key)}")
    if "medusa_num_heads" in hf:                                 # FasterDecoding/Medusa
        K, R = int(hf["medusa_num_heads"]), int(hf.get("medusa_num_layers", 1))
        t = _read_tensors(path)
        blocks = {(i, r): (_need(t, f"{i}.{r}.linear.weight", (H, H), path), _need(t, f"{i}.{r}.linear.bias", (H,), path))
                  for i in range(K) for r in range(R)}
        heads = [_need(t, f"{i}.{R}.weight", (V, H), path) for i in range(K)]
    elif "MedusaModel" in (hf.get("architectures") or []) or hf.get("model_type") == "medusa":   # vLLM
        K, R = int(hf["num_heads"]), int(hf.get("num_hidden_layers", 1))
        if hf.get("truncated_vocab_size") not in (None, hf.get("vocab_size")):
            raise ValueError(f"{path}: truncated_vocab_size Medusa heads are not supported")
        t = _read_tensors(path)
        blocks = {(i, r): (_need(t, f"blocks.{i}.layers.{r}.weight", (H, H), path),
                           _need(t, f"blocks.{i}.layers.{r}.bias", (H,), path)) for i in range(K) for r in range(R)}
        heads = [_need(t, f"lm_heads.{i}.weight", (V, H), path) for i in range(K)]
    else:
        raise ValueError(f"{path}/config.json is neither a specjax Medusa artifact nor a published Medusa layout "
                         "(no specjax_drafter, medusa_num_heads or MedusaModel architecture)")
    params = _from_torch_layout(blocks, heads, K, R)
    return MedusaHeads(K, R, "per_head", jax.tree_util.tree_map(jnp.asarray, params), os.path.basename(path))


def load_heads(path_or_name: str | os.PathLike, target) -> MedusaHeads:
    """A specjax Medusa artifact, a published layout, or a shipped name -> MedusaHeads for this target."""
    path = resolve(path_or_name, "drafter")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"Medusa directory {path} has no config.json")
    with open(cfg_path) as f:
        is_ours = "specjax_drafter" in json.load(f)
    if not is_ours:
        return load_published(path, target)
    cfg, tensors = artifacts.load_artifact(path, target, KIND)
    K, R, layout = int(cfg["num_heads"]), int(cfg["num_layers"]), cfg["layout"]
    if layout not in LAYOUTS:
        raise ValueError(f"{path}: unknown Medusa layout {layout!r}; expected one of {LAYOUTS}")
    H, V = target.config.hidden_size, target.config.vocab_size
    need = {"w": (K, R, H, H), "b": (K, R, H)}
    if layout != "target_head":
        need["proj"] = (K, H, V) if layout == "per_head" else (H, V)
    for key, shape in need.items():
        _need(tensors, key, shape, path)
    return MedusaHeads(K, R, layout, {k: jnp.asarray(tensors[k]) for k in need},
                       os.path.basename(os.path.normpath(path)), V)


def rank_accuracy(topk_accuracy) -> list[list[float]]:
    """Cumulative top-1..top-k accuracy per head [K][k] -> P(the right token is at rank r) per head [K][k]."""
    acc = np.asarray(topk_accuracy, np.float64)
    return np.diff(np.concatenate([np.zeros((acc.shape[0], 1)), acc], axis=1), axis=1).clip(0, 1).round(4).tolist()


def accuracy_tree(path_or_name: str | os.PathLike, num_nodes: int) -> tuple:
    """Tree choices of num_nodes nodes that maximise the expected accepted length under the heads' measured
    per-rank accuracies (recorded in the artifact's MANIFEST by the training recipe): Medusa's construction."""
    path = resolve(path_or_name, "drafter")
    record = artifacts.read_manifest_record(path)
    if "tree_rank_accuracy" not in record:        # Medusa-2 heads ship inside their target's directory
        record = artifacts.read_manifest_record(os.path.dirname(os.path.normpath(path)))
    if "tree_rank_accuracy" not in record:
        raise ValueError(f"{path}/MANIFEST.md records no tree_rank_accuracy (per-head accuracy by rank); "
                         "give tree_choices explicitly")
    return choices_from_accuracies(record["tree_rank_accuracy"], num_nodes)


# --------------------------------------------------------------------------------------------------- registry

_ACCEPTS = "Medusa heads: a directory (ours or a published layout), a shipped name, or medusa.load_heads(...)"


def _build(req: BuildRequest):
    heads = req.drafter                 # registry.build has loaded a path or name and checked the type
    if heads is None:
        raise TypeError(f"method='medusa' needs drafter=<{_ACCEPTS}>, got None")
    cfg = req.config
    vocab = req.target.config.vocab_size if heads.vocab_size is None else heads.vocab_size
    if (heads.hidden_size, vocab) != (req.target.config.hidden_size, req.target.config.vocab_size):
        raise ValueError(f"Medusa heads {heads.name!r} are for hidden {heads.hidden_size} / vocab "
                         f"{heads.vocab_size}, the target has {req.target.config.hidden_size} / "
                         f"{req.target.config.vocab_size}")
    steps, topk = (cfg.num_steps or 0), (cfg.topk or 0)
    depth = cfg.draft_depth
    if depth > heads.num_heads:
        what = (f"the tree is {depth} deep" if cfg.tree is not None else
                f"the dynamic tree searches {depth} depths" if steps else f"k={depth}")
        raise ValueError(f"{what} but the Medusa heads {heads.name!r} have only {heads.num_heads} heads (one per "
                         "depth)")
    width = cfg.tree.topk if cfg.tree is not None else topk
    if width > vocab:
        raise ValueError(f"the tree asks for top-{width} candidates but the vocabulary has {vocab} tokens")
    return (MedusaDrafter(cfg.k, depth, cfg.tree, heads.layout == "target_head", steps, topk),
            first_heads(heads.params, depth))


def first_heads(params: dict, num_heads: int) -> dict:
    """The heads' params cut to the first num_heads heads: a proposal drafts as many depths as it has heads, and the
    heads past its depth would cost a vocabulary product each per step for drafts no one reads. Cut once when the
    drafter is built (a cut inside the decode loop would copy the per-head projections every step)."""
    if num_heads == params["w"].shape[0]:
        return params
    return {key: (value[:num_heads] if key != "proj" or value.ndim == 3 else value) for key, value in params.items()}


def _param_specs(drafter: MedusaDrafter, params, mesh):
    specs = {"w": P(), "b": P()}
    if "proj" in params:
        specs["proj"] = P(None, None, "model") if params["proj"].ndim == 3 else P(None, "model")
    return {k: fit_spec(specs[k], params[k].shape, mesh) for k in params}


register(DrafterSpec(KIND, _build, accepts=_ACCEPTS, load=lambda target, path: load_heads(path, target),
                     artifact=MedusaHeads, trees=True, param_specs=_param_specs))
