"""The Medusa drafter: the heads run on the target's final hidden state at the position that produced the bonus
token, and propose a chain or a tree; registered as the method "medusa"."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from specjax.drafters.base import Context, Draft, block_draft, pick_tokens
from specjax.drafters.medusa.checkpoint import load_heads
from specjax.drafters.medusa.config import KIND, MedusaHeads
from specjax.drafters.medusa.model import head_hidden, head_logits
from specjax.drafters.registry import BuildRequest, DrafterSpec, register
from specjax.layout import fit_spec
from specjax.models import llama
from specjax.sampling import SamplingParams
from specjax.trees import TreeSpec, draft_depth


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
