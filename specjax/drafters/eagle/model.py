"""The EAGLE layer's maths as pure functions over its params: the pieces the drafter runs against its KV cache
(embed_table, layer_inputs, project_qkv, layer_output, project_features, draft_logits) and the cache-free forwards
training uses: forward_sequence (teacher-forced over a whole sequence) and ttt_forward (EAGLE-3's training-time
test: the drafter unrolled over its own outputs, attending as ttt_mask specifies)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.ops import linear
from specjax.ops.attention import MASK_VALUE
from specjax.drafters.eagle.config import EagleConfig
from specjax.models.config import ModelConfig
from specjax.models.llama import apply_rope, rms_norm, rope_inv_freq



def _mlp(lp: dict, x: jax.Array) -> jax.Array:
    return linear(jax.nn.silu(linear(x, lp["w_gate"])) * linear(x, lp["w_up"]), lp["w_down"])


def layer_inputs(params: dict, config: EagleConfig, emb: jax.Array,
                 hid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(embeddings, hidden inputs) [B, T, H] -> (residual [B, T, H], attention input [B, T, Hin])."""
    lp, eps = params["layer"], config.layer.rms_norm_eps
    if config.kind == "eagle":
        x = linear(jnp.concatenate([emb, hid], -1), params["fc_w"]) + params["fc_b"]
        return x, x                                                   # no input norm on the reference's layer 0
    hn = rms_norm(hid, lp["hidden_norm"], eps)
    resid = hn if config.norm_before_residual else hid
    return resid, jnp.concatenate([rms_norm(emb, lp["attn_norm"], eps), hn], -1)


def project_qkv(lp: dict, c: ModelConfig, x: jax.Array,
                positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Attention input x [B, T, Hin] at RoPE positions [B, T] -> q [B, T, Hq, D], k and v [B, T, Hkv, D]."""
    B, T = x.shape[:2]
    q, k, v = linear(x, lp["wq"]), linear(x, lp["wk"]), linear(x, lp["wv"])
    if "bq" in lp:
        q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    inv = rope_inv_freq(c)
    q = apply_rope(q.reshape(B, T, c.num_heads, c.head_dim), positions, inv)
    k = apply_rope(k.reshape(B, T, c.num_kv_heads, c.head_dim), positions, inv)
    return q, k, v.reshape(B, T, c.num_kv_heads, c.head_dim)


def project_q(lp: dict, c: ModelConfig, x: jax.Array, positions: jax.Array) -> jax.Array:
    """project_qkv's queries alone, [B, T, Hq, D] (training computes them at fewer positions than the keys)."""
    B, T = x.shape[:2]
    q = linear(x, lp["wq"])
    if "bq" in lp:
        q = q + lp["bq"]
    return apply_rope(q.reshape(B, T, c.num_heads, c.head_dim), positions, rope_inv_freq(c))


def project_kv(lp: dict, c: ModelConfig, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """project_qkv's keys and values alone: [B, T, Hkv, D] each."""
    B, T = x.shape[:2]
    k, v = linear(x, lp["wk"]), linear(x, lp["wv"])
    if "bk" in lp:
        k, v = k + lp["bk"], v + lp["bv"]
    k = apply_rope(k.reshape(B, T, c.num_kv_heads, c.head_dim), positions, rope_inv_freq(c))
    return k, v.reshape(B, T, c.num_kv_heads, c.head_dim)


def layer_output(params: dict, config: EagleConfig, resid: jax.Array, attn: jax.Array) -> jax.Array:
    """attn [B, T, Hq*D] (before o_proj) -> the layer output [B, T, H]: what draft_logits reads and the next draft
    step's hidden input (pre-norm; EAGLE-3.1 norm_output: after final_norm)."""
    lp = params["layer"]
    x = resid + linear(attn, lp["wo"])
    out = x + _mlp(lp, rms_norm(x, lp["mlp_norm"], config.layer.rms_norm_eps))
    return rms_norm(out, params["final_norm"], config.layer.rms_norm_eps) if config.norm_output else out


def _dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask) -> jax.Array:
    """q [B, T, Hq, D], k/v [B, S, Hkv, D], mask bool [T, S] (query t may read key s) -> [B, T, Hq*D]."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    qg = q.reshape(B, T, Hkv, Hq // Hkv, D)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * D ** -0.5
    s = jnp.where(jnp.asarray(mask), s, MASK_VALUE)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgts,bskd->btkgd", p, v.astype(jnp.float32))
    return o.reshape(B, T, Hq * D).astype(q.dtype)


def embed_table(params: dict, target_weights) -> jax.Array:
    """The drafter's own [V, H] embedding when it has one, else the target's (target_weights["embed"])."""
    if "embed" in params:
        return params["embed"]
    if not target_weights or "embed" not in target_weights:
        raise ValueError("this EAGLE drafter has no embedding of its own: pass target_weights={'embed': ...}")
    return target_weights["embed"]


def mask_inputs(params: dict, batch: int, length: int, dtype) -> tuple[jax.Array, jax.Array]:
    """P-EAGLE's inputs at a parallel depth: (the learned mask embedding, the learned shared hidden state), each
    broadcast to [batch, length, H]: what stands in for a draft's token and its drafter output, not yet known."""
    shape = (batch, length, params["mask_hidden"].shape[-1])
    return (jnp.broadcast_to(params["mask_embed"].astype(dtype), shape),
            jnp.broadcast_to(params["mask_hidden"].astype(dtype), shape))


def project_features(params: dict, config: EagleConfig, features) -> jax.Array:
    """The drafter's step-0 hidden input from target features. EAGLE-1: the target's final normed hidden state
    [B, T, H] itself. EAGLE-3: fc(concat(target layer outputs)): `features` a sequence of [B, T, H_t] (in
    config.target_layers order) or their concatenation [B, T, n*H_t] -> [B, T, H]. EAGLE-3.1 fc_norm: each feature
    through its own RMSNorm first."""
    dtype = params["fc_w"].dtype
    if config.kind == "eagle":
        return jnp.asarray(features).astype(dtype)
    if not isinstance(features, (tuple, list)):
        n = len(config.target_layers)
        features = jnp.split(features, n, axis=-1) if config.fc_norm else (features,)
    features = [f.astype(dtype) for f in features]
    if config.fc_norm:
        features = [rms_norm(f, w, config.layer.rms_norm_eps) for f, w in zip(features, params["fc_norm"])]
    return linear(jnp.concatenate(features, -1), params["fc_w"])


def draft_logits(params: dict, config: EagleConfig, hidden: jax.Array, target_weights=None) -> jax.Array:
    """Layer outputs [..., H] -> float32 logits: EAGLE-1 [..., V] through the target's LM head
    (target_weights["lm_head"] [H, V]); EAGLE-3 [..., N] over the DRAFT vocabulary (norm, own lm_head)."""
    if config.kind == "eagle":
        if not target_weights or "lm_head" not in target_weights:
            raise ValueError("EAGLE-1 drafts through the target's LM head: pass target_weights={'lm_head': ...}")
        return (hidden @ target_weights["lm_head"]).astype(jnp.float32)
    h = hidden if config.norm_output else rms_norm(hidden, params["final_norm"], config.layer.rms_norm_eps)
    return linear(h, params["lm_head"]).astype(jnp.float32)


def forward_sequence(params: dict, config: EagleConfig, tokens: jax.Array, features,
                     target_weights: dict | None = None,
                     positions: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Teacher-forced drafter over whole sequences (training EAGLE-1, and step 0 of EAGLE-3), no cache.

    Entry t pairs tokens[:, t] with features[:, t] at RoPE position t (positions [B, T] to override), causal
    attention. The inference alignment is tokens = ids[:, 1:], features = the target's features of ids[:, :-1]
    (EAGLE-1: ForwardOut.hidden; EAGLE-3: the layer_hidden of config.target_layers): then hidden[:, t] regresses
    the target feature of position t + 1 (EAGLE-1: hidden_target[:, t + 1]) and logits[:, t] predict
    ids[:, t + 2] (the target's distribution at position t + 1).
    Returns (hidden [B, T, H] (layer_output's), logits [B, T, V] (EAGLE-1) or [B, T, N] draft vocab (EAGLE-3)).
    target_weights: {"embed": [V, H]} unless the drafter has its own, and EAGLE-1's {"lm_head": [H, V]}.
    """
    B, T = tokens.shape
    hid = project_features(params, config, features)
    emb = embed_table(params, target_weights)[tokens].astype(hid.dtype)
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    resid, x_in = layer_inputs(params, config, emb, hid)
    q, k, v = project_qkv(params["layer"], config.layer, x_in, positions)
    out = layer_output(params, config, resid, _dense_attention(q, k, v, np.tril(np.ones((T, T), bool))))
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
                target_weights: dict | None = None, pad_id: int = 0,
                at: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """EAGLE-3's training-time test: the drafter unrolled for num_steps steps over a whole sequence.

    Step 0 is forward_sequence (same alignment: tokens = ids[:, 1:], features of ids[:, :-1]). Step i > 0 consumes
    step i-1's output (pre-norm) as its hidden input, with ground-truth token embeddings shifted by i
    (tokens[:, t + i]; pad_id past the end), RoPE positions t + i and the attention of ttt_mask. Output i at index t
    predicts the same target as forward_sequence's output at index t + i (logits: ids[:, t + i + 2]); indices
    t >= T - i are padding. Works for both kinds (EAGLE-1 unrolls through fc the same way).
    P-EAGLE (config.parallel_drafting): step i > 0 reads mask_inputs instead of a token and step i-1's output, so
    step i at index t is exactly depth i + 1 of the one parallel forward that inference runs after entry t.
    at [B, W] (sorted indices): the outputs at those indices only; every index still gives step 0 its keys and
    values, but the layer's attention, MLP and head run, and the later steps unroll, over the W indices alone (a
    loss whose labels lie in a window of the sequence pays for the window). The same values as the full unroll's
    at those indices, up to float32 rounding (the attention's sums are split differently).
    Returns (hidden [n, B, T|W, H], logits [n, B, T|W, V or N]).
    """
    B, T = tokens.shape
    n = int(num_steps)
    hid = project_features(params, config, features)
    table = embed_table(params, target_weights)
    padded = jnp.concatenate([tokens, jnp.full((B, n), pad_id, tokens.dtype)], axis=1)
    idx = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)) if at is None else at.astype(jnp.int32)
    gather = lambda x: x if at is None else jnp.take_along_axis(x, idx.reshape(B, -1, *([1] * (x.ndim - 2))),
                                                                 axis=1)
    # step 0: keys and values at every index, the rest (queries, attention, MLP) at the queried ones
    emb = table[tokens].astype(hid.dtype)
    resid, x_in = layer_inputs(params, config, emb, hid)
    k_ctx, v_ctx = project_kv(params["layer"], config.layer, x_in,
                              jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)))
    q = project_q(params["layer"], config.layer, gather(x_in), idx)
    visible = jnp.arange(T)[None, None, :] <= idx[:, :, None]                       # [B, W, T] causal
    hid = layer_output(params, config, gather(resid), _window_attention(q, k_ctx, v_ctx, visible, [], []))
    outs, ks, vs = [hid], [], []
    for i in range(1, n):
        if config.parallel_drafting:
            emb, hid = mask_inputs(params, B, idx.shape[1], hid.dtype)
        else:
            emb = table[jnp.take_along_axis(padded, idx + i, axis=1)].astype(hid.dtype)
        resid, x_in = layer_inputs(params, config, emb, hid)
        q, k, v = project_qkv(params["layer"], config.layer, x_in, idx + i)
        ks.append(k)
        vs.append(v)
        hid = layer_output(params, config, resid, _window_attention(q, k_ctx, v_ctx, visible, ks, vs))
        outs.append(hid)
    hidden = jnp.stack(outs)
    return hidden, draft_logits(params, config, hidden, target_weights)


def _window_attention(q: jax.Array, k_ctx: jax.Array, v_ctx: jax.Array, visible: jax.Array, ks: list,
                      vs: list) -> jax.Array:
    """ttt_mask's attention for queries q [B, W, Hq, D]: each query over the step-0 keys and values of the context
    (k_ctx / v_ctx [B, T, Hkv, D], visible [B, W, T]) and over its own index's entries of the drafted steps so far
    (ks / vs: [B, W, Hkv, D] each, the diagonal keys of ttt_mask) -> [B, W, Hq * D]."""
    B, W, Hq, D = q.shape
    Hkv = k_ctx.shape[2]
    qg = q.reshape(B, W, Hkv, Hq // Hkv, D)
    s_ctx = jnp.einsum("bwkgd,btkd->bkgwt", qg, k_ctx, preferred_element_type=jnp.float32) * D ** -0.5
    s_ctx = jnp.where(visible[:, None, None], s_ctx, MASK_VALUE)
    if ks:
        s_own = jnp.einsum("bwkgd,bwskd->bkgws", qg, jnp.stack(ks, 2), preferred_element_type=jnp.float32)
        scores = jnp.concatenate([s_ctx, s_own * D ** -0.5], -1)
    else:
        scores = s_ctx
    p = jax.nn.softmax(scores, axis=-1)
    T = k_ctx.shape[1]
    o = jnp.einsum("bkgwt,btkd->bwkgd", p[..., :T], v_ctx.astype(jnp.float32))
    if ks:
        o = o + jnp.einsum("bkgws,bwskd->bwkgd", p[..., T:], jnp.stack(vs, 2).astype(jnp.float32))
    return o.reshape(B, W, Hq * D).astype(q.dtype)
