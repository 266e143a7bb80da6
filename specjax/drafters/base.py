"""The Drafter protocol every proposer implements, and the null drafter (plain decoding).

A drafter is a hashable, array-free object (it is a static argument of the compiled loop); its arrays travel
separately as `params` (weights, predictions, ...), so one compiled program serves any weights of the same shape.
All methods are pure functions over pytrees and run inside jit / lax.while_loop.

Target exposure: a drafter declares, as static attributes, what it reads of the target:
  target_layers: tuple of decoder-layer indices whose outputs (the residual stream after that layer, before the
    final norm) the loop requests from every target forward (prefill and verify) and hands to init/commit in
    `target_out.layer_hidden`, in the declared order. The final normed hidden state is always there
    (`target_out.hidden`). Default (): nothing extra is computed.
  target_weights: names among TARGET_WEIGHTS the drafter reads (e.g. the embedding and LM head for heads that
    share them); they arrive in `ctx.target_weights`. Default (): an empty dict.
  shares_target_cache (optional, default False): propose gets the target's KV cache as `ctx.target_cache`
    (lengths = committed tokens - 1: everything but the last committed token) and returns (Draft, state, cache):
    that cache, in which it may have written entries at slots ctx.length - 1 .. ctx.length + k (the verify pass
    overwrites every one of them that becomes committed; the buffer reserves them all). Writing in place into the
    loop's cache costs nothing; a copy of it per step would (self-speculation by layer skipping drafts over it).
How a drafter is built from a config and what it is registered under: specjax.drafters.registry.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Protocol

import jax
import jax.numpy as jnp

from specjax.drafters.registry import BuildRequest, DrafterSpec, register
from specjax.models.llama import ForwardOut
from specjax.sampling import SamplingParams, greedy_token, probabilities, sample
from specjax import tree_search
from specjax.trees import Tree, TreeSpec


# Target weights a drafter may declare in `target_weights`: the token embedding [V, H], the LM head [H, V] (the
# transposed embedding when tied), the final norm [H], the decoder layers (the list of layer dicts, as laid out for
# the mesh: llama.forward reads them as the target's forward does), and the output head as the target stores it
# (a dict for specjax.models.llama.lm_head: {"lm_head": [H, V]}, or the tied {"embed": [V, H]} / {"head_panels"} /
# {"embed_blocks"}):
# a drafter projecting through the target's head at decode time reads this one, so the product is the target's own
# (the CPU kernel reads a tied embedding in place; "lm_head" of a tied target is a transpose, which a kernel call
# would copy whole).
TARGET_WEIGHTS = ("embed", "lm_head", "final_norm", "layers", "output_head")


class Context(NamedTuple):
    """The committed sequence as the loop sees it (read-only for drafters)."""
    tokens: jax.Array          # [B, L] prompt + generated tokens; entries at or past `length` are stale
    length: jax.Array          # [B] committed tokens; the last one (length - 1) is not yet in the target cache
    prompt_length: jax.Array   # [B]
    target_weights: Any = None   # {name: array} for the drafter's declared target_weights
    target_cache: Any = None     # the target's KVCache, for a drafter that shares_target_cache (propose only)
    # SpecConfig's confidence gate (None: off): a step in which no row's first Draft.confidence reaches it verifies
    # one position, so a chain drafter need not draft past its first pick then (chain_scan). A python float,
    # static in the compiled loop.
    draft_confidence_threshold: float | None = None


class Verified(NamedTuple):
    """The whole verify pass, for drafters that learn from more than the accepted path (lookahead decoding
    collects n-grams from every verified position). T = k + 1 (a chain: the last committed token, then the
    drafts) or the tree's nodes."""
    tokens: jax.Array             # [B, T] the tokens fed to the target
    parents: jax.Array | None     # [B, T] tree parents (root -1), None for a chain
    out: ForwardOut               # the target's output at every verified position (logits [B, T, V], ...)


class Draft(NamedTuple):
    """A chain (tree None): tokens [B, k], probs [B, k, V] the distributions they were sampled from.
    A tree: tokens = tree.tokens[:, 1:] (the drafted nodes), probs [B, T, V] per node t the distribution
    t's children were sampled from without replacement (verify.tree_sampled case b). None = deterministic.

    num_drafted: how many of the k drafts are proposals (the rest fill the fixed shape and are verified like any
    draft, so they never change the output). A drafter that can find nothing to propose (prompt lookup without a
    match) sets it; when no active row of the batch proposed anything, the loop takes a one-position step (the
    target's next token, as plain decoding does) instead of verifying k + 1 positions of filler, and a row that
    proposed nothing in a step that others made wide gets the same token, drafts nothing and counts the step as
    one position (so a request's output does not depend on its batch mates). The loop proposes for a step as
    soon as the step before committed, so it knows the width before the step; propose and commit still
    alternate, one each per step. Commit is called after one-position steps too, with num_accepted 0 and the
    target output and Verified of that one position (T = 1, parents None).

    confidence: a chain drafter's top probability at each draft position (pick_tokens gives it). With
    SpecConfig.draft_confidence_threshold the loop takes as proposed only the leading drafts whose running product
    of confidences stays at or above the threshold (num_drafted, as above); without it the field is dropped before
    the loop carries the draft, so it costs nothing."""
    tokens: jax.Array                 # [B, k] proposed continuation of the committed sequence
    probs: jax.Array | None = None    # chain [B, k, V] / tree [B, T, V]; None = deterministic drafts
    tree: Tree | None = None          # T = k + 1 nodes; node 0 is the last committed token
    num_drafted: jax.Array | None = None   # [B] int32 proposals among the k (a tree: its first nodes); None: all k
    confidence: jax.Array | None = None    # [B, k] the drafter's top probability per position; None: unknown


class Drafter(Protocol):
    """init's target_out is the prefill over the right-padded prompts [B, P]: hidden and layer_hidden at every
    prompt position, logits only at each row's last prompt position ([B, 1, V])."""
    k: int                            # tokens proposed per step (static)
    target_layers: tuple[int, ...]    # decoder layers whose outputs it reads (module docstring); () for none
    target_weights: tuple[str, ...]   # names among TARGET_WEIGHTS it reads; () for none

    def init(self, params: Any, ctx: Context, target_out: ForwardOut, sp: SamplingParams) -> Any: ...

    def propose(self, params: Any, state: Any, ctx: Context, keys: jax.Array,
                sp: SamplingParams) -> tuple[Draft, Any]: ...

    def commit(self, params: Any, state: Any, ctx: Context, num_accepted: jax.Array,
               target_out: ForwardOut, verified: Verified) -> Any: ...


class NullDrafter:
    """k = 0: the loop degenerates to plain autoregressive decoding (same code path as every drafter)."""
    k = 0
    target_layers = ()
    target_weights = ()

    def __hash__(self):
        return hash(type(self))

    def __eq__(self, other):
        return type(other) is type(self)

    def init(self, params, ctx, target_out, sp):
        return ()

    def propose(self, params, state, ctx, keys, sp):
        B = ctx.tokens.shape[0]
        return Draft(jnp.zeros((B, 0), jnp.int32)), state

    def commit(self, params, state, ctx, num_accepted, target_out, verified):
        return state


def target_weight(target_params: dict, name: str, vocab_size: int | None = None) -> jax.Array | dict:
    """One of TARGET_WEIGHTS from a Llama params pytree; with vocab_size, the vocabulary entries a mesh layout
    padded (specjax.sharding.Layout) are cut off, so the drafter sees the logical [H, V] / [V, H]."""
    if name == "lm_head":
        w = target_params["lm_head"] if "lm_head" in target_params else target_params["embed"].T
        return w if vocab_size is None or w.shape[1] == vocab_size else w[:, :vocab_size]
    if name == "embed":
        w = target_params["embed"]
        return w if vocab_size is None or w.shape[0] == vocab_size else w[:vocab_size]
    if name in ("final_norm", "layers"):
        return target_params[name]
    if name == "output_head":
        if "lm_head" in target_params:
            return {"lm_head": target_weight(target_params, "lm_head", vocab_size)}
        if "head_panels" in target_params:     # a tied head's own panels (load_model's panels format)
            return {"head_panels": target_params["head_panels"]}
        if "embed_blocks" in target_params:
            blocks = target_params["embed_blocks"]
            if vocab_size is not None and blocks.shape[0] != vocab_size:
                raise ValueError(f"the target's quantized output head has {blocks.shape[0]} rows, its vocabulary "
                                 f"{vocab_size}: a padded quantized head is not supported")
            return {"embed_blocks": blocks}
        return {"embed": target_weight(target_params, "embed", vocab_size)}
    raise ValueError(f"unknown target weight {name!r}; a drafter may read {TARGET_WEIGHTS}")


def _build_null(req: BuildRequest):
    if req.drafter is not None:
        raise ValueError("method='none' (plain decoding) takes no drafter")
    return NullDrafter(), ()


register(DrafterSpec("none", _build_null, speculates=False))


def pick_tokens(logits: jax.Array, key: jax.Array,
                sp: SamplingParams) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """A draft token per row from logits [..., V] -> (tokens [...], q, confidence [...]): the argmax when greedy
    (q None), else a sample from the shared sampling transform's distribution, returned as q [..., V] for
    speculative sampling; confidence is draft_confidence's. key: one key per row (the leading axes)."""
    if sp.greedy:
        tokens = greedy_token(logits)
        return tokens, None, draft_confidence(logits)
    probs = probabilities(logits, sp)
    tokens = jax.vmap(sample)(key, probs)
    return tokens, probs, draft_confidence(logits, probs)


def pick_block(logits: jax.Array, keys: jax.Array,
               sp: SamplingParams) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """pick_tokens at every position of a block whose distributions are all known at once (a parallel drafter's
    logits [B, k, V], one key per row [B], split k ways) -> (tokens [B, k], q [B, k, V] or None, confidence [B, k])."""
    k = logits.shape[1]
    step_keys = jax.vmap(lambda key: jax.random.split(key, k))(keys)                # [B, k] keys
    return jax.vmap(lambda lg, kk: pick_tokens(lg, kk, sp), in_axes=(1, 1), out_axes=1)(logits, step_keys)


def block_draft(logits: jax.Array, ctx: Context, keys: jax.Array, sp: SamplingParams, tree: TreeSpec | None,
                num_steps: int, topk: int, num_nodes: int) -> Draft:
    """The Draft of a drafter whose distributions of every depth are known at once (logits [B, D, V], depth d + 1's
    at d; they do not depend on the drafts before them): the configured tree from them
    (tree_search.tree_from_position_logits: deterministic top-k children, exact at any temperature), else a chain
    of one pick per position (pick_block)."""
    if tree is not None or num_steps:
        found = tree_search.tree_from_position_logits(tree, num_steps, topk, num_nodes, last_tokens(ctx, 1)[:, 0],
                                                      logits)
        return Draft(found.tokens[:, 1:], None, found)
    tokens, probs, confidence = pick_block(logits, keys, sp)
    return Draft(tokens, probs, confidence=confidence)


def chain_of_picks(first: tuple, later: tuple) -> tuple:
    """A chain's picks from the first pick_tokens (tokens [B], q [B, V], confidence [B]) and a lax.scan's stacked
    later ones ([k-1, B, ...]) -> each field as [B, k, ...] (q stays None when greedy)."""
    return tuple(None if f is None else jnp.concatenate([f[:, None], jnp.swapaxes(l, 0, 1)], axis=1)
                 for f, l in zip(first, later))


def chain_scan(body: Callable, carry: Any, keys: jax.Array, ctx: Context,
               running: jax.Array | None = None) -> tuple[Any, tuple]:
    """A chain's picks, lax.scan(body, carry, keys) over keys [n, ...]: body(carry, key) -> (carry, picks), picks =
    (tokens [B], q [B, V] or None, confidence [B]) as pick_tokens gives them -> (carry, picks stacked [n, B, ...]).
    Under the confidence gate (ctx.draft_confidence_threshold) the chain is drafted only where some row's
    confidence so far (running [B]: the product over the positions before the scan's; None: the scan's first
    position decides) is at or above the threshold. Otherwise no row proposes anything, the loop verifies one
    position and none of the chain, so it is never computed: filler (tokens 0, q a point mass on token 0,
    confidence 0) stands in for it. Where some row does propose, the whole chain is drafted and verified: drafts
    past a row's confident ones cost no extra verify width and may still be accepted."""
    threshold = ctx.draft_confidence_threshold
    if threshold is None:
        return jax.lax.scan(body, carry, keys)
    if running is None:                     # the first pick decides: drafted unconditionally, then the rest
        carry, first = body(carry, keys[0])
        carry, rest = chain_scan(body, carry, keys[1:], ctx, first[2])
        return carry, tuple(None if f is None else jnp.concatenate([f[None], r]) for f, r in zip(first, rest))
    n = keys.shape[0]
    tok_shape, q_shape, conf_shape = jax.eval_shape(body, carry, keys[0])[1]
    filler = (jnp.zeros((n,) + tok_shape.shape, tok_shape.dtype),
              None if q_shape is None else jnp.zeros((n,) + q_shape.shape, q_shape.dtype).at[..., 0].set(1),
              jnp.zeros((n,) + conf_shape.shape, conf_shape.dtype))
    return jax.lax.cond(jnp.any(running >= threshold), lambda c: jax.lax.scan(body, c, keys),
                        lambda c: (c, filler), carry)


def draft_confidence(logits: jax.Array, probs: jax.Array | None = None) -> jax.Array:
    """logits [..., V] -> [...]: the top probability of the distribution a draft was picked from (probs [..., V]
    when sampled; greedy: the softmax of the logits). A function of the distribution, never of the sampled token:
    verifying a sampled draft or not according to the token drawn would bias the output (a test plants it)."""
    if probs is not None:
        return jnp.max(probs, axis=-1)
    logits = logits.astype(jnp.float32)
    return jnp.exp(jnp.max(logits, axis=-1) - jax.nn.logsumexp(logits, axis=-1))


def last_tokens(ctx: Context, n: int) -> jax.Array:
    """[B, n]: the n most recent committed tokens (positions length-n .. length-1; clipped at 0)."""
    idx = ctx.length[:, None] - n + jnp.arange(n)[None, :]
    return jnp.take_along_axis(ctx.tokens, jnp.maximum(idx, 0), axis=1)
