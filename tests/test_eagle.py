"""EAGLE-1/2/3 drafters: greedy output equals plain greedy token for token (chains, static and dynamic trees,
ragged batches), acceptance counts equal a teacher-forced simulation of the drafter (so the cache/feature
alignment is the training one), sampled mode, the training-time-test forward, published layouts in both
directions, our artifacts, and clear errors.

The drafters here are "informative by construction": fc passes the target's feature straight through and the
layer only adds noise, so the drafter's logits are (nearly) the target's own logits at the previous position,
i.e. it mostly proposes the last committed token again. The greedy outputs of the tiny target repeat tokens
often, so some drafts are accepted and others rejected.
"""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import SpecConfig
from specjax.drafters.registry import BuildRequest, build as build_drafter
from specjax.cache import KVCache
from specjax.drafters import eagle
from specjax.drafters.base import Context, target_weight
from specjax.models.llama import forward, rms_norm
from specjax.sampling import SamplingParams
from drafter_weights import EAGLE3_LAYERS, informative_eagle
from layouts import eagle_published_state_dict, write_checkpoint
from tiny import ragged_prompts, tiny_model

MAX_NEW = 20
EXTRA = 6                     # the baselines run longer so the acceptance simulation sees what verify saw


def target_weights(target):
    return {n: target_weight(target.params, n) for n in ("embed", "lm_head")}


@pytest.fixture(scope="module")
def drafters(target):
    return {"eagle": informative_eagle(target, "eagle"), "eagle3": informative_eagle(target, "eagle3")}


def prompts_for(batch):
    # batch 1: the first row of the ragged batch of 3 (its greedy output repeats tokens, so drafts get accepted)
    return ragged_prompts(3, seed=3)[:batch]


@pytest.fixture(scope="module")
def long_baselines(target):
    return {b: specjax.generate(target, prompts_for(b), SpecConfig(max_new_tokens=MAX_NEW + EXTRA)).tokens
            for b in (1, 3)}


def target_features(target, seqs, layers):
    """The target's forward over right-padded sequences (causal: padding changes nothing before it)."""
    tc = target.config
    T = max(map(len, seqs))
    ids = jnp.asarray([list(s) + [0] * (T - len(s)) for s in seqs], jnp.int32)
    cache = KVCache.init(tc.num_layers, len(seqs), T, tc.num_kv_heads, tc.head_dim)
    return ids, forward(target.params, tc, ids, cache, hidden_layers=layers)


def simulated_accepted(target, w: eagle.EagleWeights, prompts, outputs, k, shift=0):
    """Accepted drafts of a greedy chain run predicted from the TRAINING path: ttt_forward over the final sequences
    (step i at index L-2 is draft i+1 of the step with L committed tokens, given that drafts 1..i were right)."""
    seqs = [list(p) + list(o) for p, o in zip(prompts, outputs)]
    ids, tout = target_features(target, seqs, w.config.target_layers)
    feats = tout.hidden[:, :-1] if w.kind == "eagle" else tuple(h[:, :-1] for h in tout.layer_hidden)
    _, logits = eagle.ttt_forward(w.params, w.config, ids[:, 1:], feats, k, target_weights(target))
    pred = np.asarray(jnp.argmax(logits, -1))                                      # [k, B, T-1]
    if w.d2t is not None:
        pred = eagle.draft_to_target(w.d2t)[pred]
    total = 0
    for b, (prompt, seq) in enumerate(zip(prompts, seqs)):
        L, num_new = len(prompt) + 1, 1
        while num_new < MAX_NEW:
            n = 0
            while n < k and pred[n, b, L - 2 + shift] == seq[L + n]:
                n += 1
            total += n
            count = min(n + 1, MAX_NEW - num_new)
            L, num_new = L + count, num_new + count
    return total


TREE = ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
CASES = [   # (method, batch, config fields, simulate acceptance)
    ("eagle", 1, dict(num_speculative_tokens=1), True),
    ("eagle", 3, dict(num_speculative_tokens=3), True),
    ("eagle", 3, dict(tree_choices=TREE), False),
    ("eagle", 1, dict(num_steps=3, topk=2, num_draft_tokens=6), False),          # EAGLE-2
    ("eagle3", 3, dict(num_speculative_tokens=3), True),
    ("eagle3", 1, dict(tree_choices=TREE), False),
]


@pytest.mark.parametrize("method,batch,fields,simulate", CASES,
                         ids=[f"{m}-b{b}-{'-'.join(f'{k}{v}' for k, v in f.items() if k != 'tree_choices') or 'tree'}"
                              for m, b, f, _ in CASES])
def test_greedy_equals_plain(target, drafters, long_baselines, method, batch, fields, simulate):
    w = drafters[method]
    prompts = prompts_for(batch)
    res = specjax.generate(target, prompts, SpecConfig(method=method, max_new_tokens=MAX_NEW, **fields), drafter=w)
    assert res.tokens == [b[:MAX_NEW] for b in long_baselines[batch]]
    assert 0 < res.stats["accepted"] < res.stats["drafted"], res.stats
    if simulate:
        k = fields["num_speculative_tokens"]
        assert res.stats["accepted"] == simulated_accepted(target, w, prompts, long_baselines[batch], k)
        # the simulation discriminates: the drafter one entry behind would have accepted other drafts
        assert res.stats["accepted"] != simulated_accepted(target, w, prompts, long_baselines[batch], k, shift=-1)


@pytest.mark.slow       # the conformance suite's chi-square covers EAGLE sampling in make test; this runs in test-slow
def test_sampled_smoke(target, drafters):
    w = drafters["eagle3"]
    vocab = set(eagle.draft_to_target(w.d2t).tolist())
    prompts = ragged_prompts(3, seed=3)
    cfg = SpecConfig(method="eagle3", num_speculative_tokens=2, temperature=0.8, top_k=20, max_new_tokens=12)
    res = specjax.generate(target, prompts, cfg, drafter=w, seed=1)
    assert [len(t) for t in res.tokens] == [12] * 3
    assert all(0 <= t < target.config.vocab_size for row in res.tokens for t in row)
    assert res.stats["drafted"] > 0 and res.stats["accepted"] > 0
    # q is a distribution over the TARGET vocabulary, zero outside the draft vocabulary; drafts lie inside it
    drafter, params = build_drafter(BuildRequest(cfg, target, w, prompts, 64))
    ids = jnp.asarray(np.array([p + [0] * (19 - len(p)) for p in prompts]), jnp.int32)
    plen = jnp.asarray([len(p) for p in prompts], jnp.int32)
    tc = target.config
    out = forward(target.params, tc, ids, KVCache.init(tc.num_layers, 3, 64, tc.num_kv_heads, tc.head_dim),
                  hidden_layers=drafter.target_layers)
    tokens = jnp.zeros((3, 64), jnp.int32).at[:, :19].set(ids).at[jnp.arange(3), plen].set(5)
    ctx = Context(tokens, plen + 1, plen, {"embed": target.params["embed"]})
    sp = SamplingParams(0.8, 20, 1.0)
    state = drafter.init(params, ctx, out, sp)
    draft, _ = drafter.propose(params, state, ctx, jax.random.split(jax.random.PRNGKey(0), 3), sp)
    probs = np.asarray(draft.probs)
    assert probs.shape == (3, 2, tc.vocab_size)
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)
    outside = np.setdiff1d(np.arange(tc.vocab_size), sorted(vocab))
    assert np.all(probs[..., outside] == 0)
    assert set(np.asarray(draft.tokens).ravel().tolist()) <= vocab


# ----------------------------------------------------------------------------------------- training functions

def test_ttt_mask_matches_direct_construction():
    T, n = 5, 3
    direct = np.zeros((n * T, n * T), bool)
    for i in range(n):
        for t in range(T):
            for s in range(n):
                for j in range(T):
                    causal_real = s == 0 and j <= t
                    own_chain = 1 <= s <= i and j == t
                    direct[i * T + t, s * T + j] = causal_real or own_chain
    np.testing.assert_array_equal(eagle.ttt_mask(T, n), direct)
    assert eagle.ttt_mask(T, 1).tolist() == np.tril(np.ones((T, T), bool)).tolist()


def _dense_ttt(params, cfg, tokens, feats, n, tw):
    """The training-time test unrolled with one dense attention over every step's keys under ttt_mask (what
    ttt_forward computes by parts): hidden [n, B, T, H]."""
    from specjax.drafters.eagle.model import (_dense_attention, embed_table, layer_inputs, layer_output,
                                              project_features, project_qkv)
    B, T = tokens.shape
    hid, table, mask = project_features(params, cfg, feats), embed_table(params, tw), eagle.ttt_mask(T, n)
    padded = jnp.concatenate([tokens, jnp.zeros((B, n), tokens.dtype)], axis=1)
    ks, vs, outs = [], [], []
    for i in range(n):
        resid, x_in = layer_inputs(params, cfg, table[padded[:, i:i + T]], hid)
        q, k, v = project_qkv(params["layer"], cfg.layer, x_in, jnp.broadcast_to(jnp.arange(T) + i, (B, T)))
        ks.append(k)
        vs.append(v)
        hid = layer_output(params, cfg, resid, _dense_attention(q, jnp.concatenate(ks, 1), jnp.concatenate(vs, 1),
                                                                mask[i * T:(i + 1) * T, :(i + 1) * T]))
        outs.append(hid)
    return jnp.stack(outs)


@pytest.mark.parametrize("window", [False, True])
def test_ttt_forward_attends_as_ttt_mask_says(window):
    """ttt_forward (the step-0 keys of every index, each later step's own diagonal; at= a window of indices) is the
    dense attention under ttt_mask, to float32 rounding; a planted mask that also shows step s > 0 keys of other
    indices is far off."""
    tiny = tiny_model(0)
    w = informative_eagle(tiny, "eagle3")
    B, T, n = 2, 12, 3
    tokens = jax.random.randint(jax.random.PRNGKey(0), (B, T), 0, tiny.config.vocab_size)
    feats = tuple(jax.random.normal(jax.random.PRNGKey(i), (B, T, tiny.config.hidden_size)) for i in range(3))
    tw = {"embed": tiny.params["embed"]}
    want = _dense_ttt(w.params, w.config, tokens, feats, n, tw)
    at = jnp.stack([jnp.arange(3, 9), jnp.arange(5, 11)]) if window else None
    got, _ = eagle.ttt_forward(w.params, w.config, tokens, feats, n, tw, at=at)
    ref = want if at is None else jnp.take_along_axis(want, at[None, :, :, None], axis=2)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-4, atol=1e-5)
    real_mask = eagle.ttt_mask
    try:                                    # planted: later steps see every drafted key at or before their index
        eagle.ttt_mask = lambda T_, n_: real_mask(T_, n_) | np.tril(np.ones((n_ * T_, n_ * T_), bool))
        leaky = _dense_ttt(w.params, w.config, tokens, feats, n, tw)
    finally:
        eagle.ttt_mask = real_mask
    assert float(jnp.max(jnp.abs(leaky - want))) > 1e-3


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "eagle3.1"])
def test_ttt_step0_is_the_plain_forward(target, kind):
    v31 = kind == "eagle3.1"
    kind = "eagle3" if v31 else kind
    cfg = eagle.eagle_config(target, kind, **({"target_layers": EAGLE3_LAYERS, "draft_vocab_size": 30,
                                               "fc_norm": v31, "norm_output": v31} if kind == "eagle3" else {}))
    p = eagle.init_params(jax.random.PRNGKey(1), cfg, std=0.3)
    B, T, H = 2, 7, target.config.hidden_size
    toks = jax.random.randint(jax.random.PRNGKey(2), (B, T), 0, target.config.vocab_size)
    feats = jax.random.normal(jax.random.PRNGKey(3), (B, T, H if kind == "eagle" else 3 * H))
    h, lg = eagle.forward_sequence(p, cfg, toks, feats, target_weights(target))
    hs, lgs = eagle.ttt_forward(p, cfg, toks, feats, 3, target_weights(target))
    assert hs.shape == (3, B, T, H) and lgs.shape == (3, B, T, cfg.out_vocab_size)
    np.testing.assert_allclose(hs[0], h, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lgs[0], lg, rtol=1e-5, atol=1e-5)
    # step 1 at index t is the drafter fed (token t+1, step-0 output t) at position t+1 after the real entries 0..t
    t = 3
    toks1 = jnp.concatenate([toks[:, :t + 1], toks[:, t + 1:t + 2]], 1)
    if kind == "eagle3":                     # feed already projected hidden inputs through an identity fc
        fe, p = eagle.project_features(p, cfg, feats), dict(p, fc_w=jnp.eye(H))
        cfg = eagle.EagleConfig("eagle3", cfg.layer, H, (0,), 30, norm_output=cfg.norm_output)
    else:
        fe = feats
    h1, _ = eagle.forward_sequence(p, cfg, toks1, jnp.concatenate([fe[:, :t + 1], h[:, t:t + 1]], 1),
                                   target_weights(target))
    np.testing.assert_allclose(hs[1][:, t], h1[:, t + 1], rtol=1e-4, atol=1e-5)


def test_eagle31_feeds_back_the_post_norm_state_and_norms_each_feature(target):
    """EAGLE-3.1's two switches against EAGLE-3 on the same weights: norm_output's hidden (the next step's input)
    is final_norm of EAGLE-3's pre-norm output, with the same logits; fc_norm equals EAGLE-3 fed pre-normed
    features."""
    w3, w31 = random_weights(target, "eagle3"), random_weights(target, "eagle3.1")
    tokens, feats = _sequence_inputs(target, w3)
    eps = w3.config.layer.rms_norm_eps
    out_only = dataclasses.replace(w3.config, norm_output=True)
    h, lg = eagle.forward_sequence(w3.params, w3.config, tokens, feats, target_weights(target))
    h_post, lg_post = eagle.forward_sequence(w3.params, out_only, tokens, feats, target_weights(target))
    np.testing.assert_allclose(h_post, rms_norm(h, w3.params["final_norm"], eps), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lg_post, lg, rtol=1e-5, atol=1e-5)
    assert not np.allclose(h_post, h, atol=1e-2)
    normed = jnp.concatenate([rms_norm(f, w, eps) for f, w in zip(jnp.split(feats, 3, -1), w31.params["fc_norm"])],
                             -1)
    plain = dict(w31.params)
    del plain["fc_norm"]
    want = eagle.forward_sequence(plain, dataclasses.replace(w31.config, fc_norm=False), tokens, normed,
                                  target_weights(target))
    got = eagle.forward_sequence(w31.params, w31.config, tokens, feats, target_weights(target))
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="EAGLE-3 settings"):
        eagle.eagle_config(target, "eagle", fc_norm=True)


def test_p_eagle_unroll_is_the_parallel_proposal(target):
    """P-EAGLE: the training unroll (ttt_forward, mask inputs at steps > 0) at index t is, step i for depth i + 1,
    the drafter's proposal after the real entries 0..t: depth 1 from the committed entry, depths 2..D from its one
    parallel forward over mask entries. EAGLE-3's unroll of the same weights (its own drafts fed back) differs."""
    w = random_weights(target, "p_eagle")
    cfg, tc, D, P = w.config, target.config, 4, 6
    seq = jnp.asarray(np.random.default_rng(7).integers(1, tc.vocab_size, (2, 16)), jnp.int32)
    tw = {"embed": target.params["embed"]}
    params = dict(w.params, vocab_map=jnp.asarray(eagle.draft_to_target(w.d2t), jnp.int32))
    drafter = eagle.EagleDrafter(D, cfg, 32)
    prefill = forward(target.params, tc, seq[:, :P], KVCache.init(tc.num_layers, 2, 32, tc.num_kv_heads, tc.head_dim),
                      hidden_layers=cfg.target_layers)
    ctx = Context(seq, jnp.full((2,), P + 1), jnp.full((2,), P), tw)      # the prompt and its first token
    state = drafter.init(params, ctx, prefill, SamplingParams())
    got = drafter.parallel_logits(params, state, ctx)[..., eagle.draft_to_target(w.d2t)]      # [B, D, N]
    _, unrolled = eagle.ttt_forward(w.params, cfg, seq[:, 1:P + 1], prefill.layer_hidden, D, tw)   # [D, B, P, N]
    np.testing.assert_allclose(got, np.swapaxes(unrolled[:, :, P - 1], 0, 1), rtol=1e-4, atol=1e-4)
    sequential = dataclasses.replace(cfg, parallel_drafting=False)
    _, chain = eagle.ttt_forward(w.params, sequential, seq[:, 1:P + 1], prefill.layer_hidden, D, tw)
    np.testing.assert_allclose(chain[0], unrolled[0], rtol=1e-5, atol=1e-5)
    assert not np.allclose(chain[1:, :, P - 1], unrolled[1:, :, P - 1], atol=1e-2)
    drafts, _ = drafter.propose(params, state, ctx, jax.random.split(jax.random.PRNGKey(0), 2), SamplingParams())
    assert drafts.tokens.tolist() == eagle.draft_to_target(w.d2t)[np.asarray(jnp.argmax(got, -1))].tolist()


def test_defaults_and_vocab_helpers():
    assert eagle.default_target_layers(32) == (1, 15, 28)          # = HF hidden_states ids (2, 16, 29)
    assert eagle.default_target_layers(4) == (0, 1, 2)
    assert eagle.default_target_layers(3) == (0, 1, 2)
    with pytest.raises(ValueError, match="only 2 decoder layer"):
        eagle.default_target_layers(2)
    d2t = eagle.vocab_map_from_counts([5, 0, 9, 1, 7], 3)
    assert eagle.draft_to_target(d2t).tolist() == [0, 2, 4]
    assert eagle.t2d_from_d2t(d2t, 5).tolist() == [True, False, True, False, True]
    assert eagle.target_to_draft(d2t, 5).tolist() == [0, -1, 1, -1, 2]


def test_restrict_draft_vocab_keeps_the_most_frequent_columns(target, drafters):
    w = drafters["eagle3"]
    have = eagle.draft_to_target(w.d2t)
    counts = np.zeros(w.config.vocab_size)
    counts[have] = np.arange(len(have))[::-1] % 7 + 1                 # some ties, broken by lower id
    counts[np.setdiff1d(np.arange(w.config.vocab_size), have)] = 100  # outside the draft vocabulary: ignored
    small = eagle.restrict_draft_vocab(w, counts, 5)
    kept = eagle.draft_to_target(small.d2t)
    order = sorted(have, key=lambda t: (-counts[t], t))[:5]
    assert kept.tolist() == sorted(order)
    eagle.check_target(small, target)
    h = jnp.asarray(np.random.default_rng(0).normal(size=(2, w.config.hidden_size)), jnp.float32)
    full = np.asarray(eagle.draft_logits(w.params, w.config, h))
    part = np.asarray(eagle.draft_logits(small.params, small.config, h))
    cols = [int(np.flatnonzero(have == t)[0]) for t in kept]
    np.testing.assert_allclose(part, full[:, cols], rtol=1e-6)
    with pytest.raises(ValueError, match="draft_vocab_size=0"):
        eagle.restrict_draft_vocab(w, counts, 0)
    with pytest.raises(ValueError, match="only EAGLE-3"):
        eagle.restrict_draft_vocab(drafters["eagle"], counts, 5)


# ----------------------------------------------------------------------------------------- published layouts

def _np_rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def _np_layer_attention(x, sd, pfx, hf):
    """HF LlamaAttention over one causal sequence x [T, Hin], positions 0..T-1, from torch-layout tensors."""
    lc = hf.get("transformer_layer_config", hf)
    Hq, Hkv = lc["num_attention_heads"], lc["num_key_value_heads"]
    D = lc.get("head_dim") or lc["hidden_size"] // Hq
    T = x.shape[0]
    q = (x @ sd[pfx + "self_attn.q_proj.weight"].T).reshape(T, Hq, D)
    k = (x @ sd[pfx + "self_attn.k_proj.weight"].T).reshape(T, Hkv, D)
    v = (x @ sd[pfx + "self_attn.v_proj.weight"].T).reshape(T, Hkv, D)
    inv = 1.0 / lc.get("rope_theta", 10000.0) ** (np.arange(0, D, 2) / D)
    ang = np.arange(T)[:, None] * inv
    cos, sin = np.concatenate([np.cos(ang)] * 2, -1)[:, None], np.concatenate([np.sin(ang)] * 2, -1)[:, None]
    rot = lambda a: np.concatenate([-a[..., D // 2:], a[..., :D // 2]], -1)
    q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
    k, v = np.repeat(k, Hq // Hkv, axis=1), np.repeat(v, Hq // Hkv, axis=1)
    s = np.einsum("thd,shd->hts", q, k) / np.sqrt(D)
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    a = np.exp(s - s.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    return np.einsum("hts,shd->thd", a, v).reshape(T, Hq * D) @ sd[pfx + "self_attn.o_proj.weight"].T


def _np_mlp(x, sd, pfx):
    g, u = x @ sd[pfx + "mlp.gate_proj.weight"].T, x @ sd[pfx + "mlp.up_proj.weight"].T
    return (g / (1 + np.exp(-g)) * u) @ sd[pfx + "mlp.down_proj.weight"].T


def reference_logits(sd, hf, tokens, feats, target):
    """The EAGLE / EAGLE-3 reference drafters written out in numpy from a published state dict (one sequence)."""
    sd = {k: np.asarray(v, np.float64) for k, v in sd.items()}
    lc = hf.get("transformer_layer_config", hf)
    eps = lc.get("rms_norm_eps", 1e-6)
    embed = sd.get("embed_tokens.weight", np.asarray(target.params["embed"], np.float64))
    e = embed[np.asarray(tokens)]
    f = np.asarray(feats, np.float64)
    if "midlayer.hidden_norm.weight" in sd or "layers.0.hidden_norm.weight" in sd:
        pfx = "midlayer." if "midlayer.hidden_norm.weight" in sd else "layers.0."
        if "fc_norm.0.weight" in sd:                         # EAGLE-3.1: each fused feature normed first
            chunks = np.split(f, len([k for k in sd if k.startswith("fc_norm.")]), -1)
            f = np.concatenate([_np_rms(c, sd[f"fc_norm.{i}.weight"], eps) for i, c in enumerate(chunks)], -1)
        g = f @ sd["fc.weight"].T
        x_in = np.concatenate([_np_rms(e, sd[pfx + "input_layernorm.weight"], eps),
                               _np_rms(g, sd[pfx + "hidden_norm.weight"], eps)], -1)
        h = g + _np_layer_attention(x_in, sd, pfx, hf)
        h = h + _np_mlp(_np_rms(h, sd[pfx + "post_attention_layernorm.weight"], eps), sd, pfx)
        return _np_rms(h, sd["norm.weight"], eps) @ sd["lm_head.weight"].T
    x = np.concatenate([e, f], -1) @ sd["fc.weight"].T + sd["fc.bias"]
    h = x + _np_layer_attention(x, sd, "layers.0.", hf)
    h = h + _np_mlp(_np_rms(h, sd["layers.0.post_attention_layernorm.weight"], eps), sd, "layers.0.")
    return h @ np.asarray(target_weight(target.params, "lm_head"), np.float64)


def random_weights(target, kind, seed=4, draft_vocab=40):
    """kind "eagle", "eagle3", "eagle3.1" (EAGLE-3 with fc_norm and norm_output) or "p_eagle" (parallel_drafting)."""
    v31, parallel = kind == "eagle3.1", kind == "p_eagle"
    kind = "eagle3" if v31 or parallel else kind
    cfg = eagle.eagle_config(target, kind, **({"target_layers": EAGLE3_LAYERS, "draft_vocab_size": draft_vocab,
                                               "fc_norm": v31, "norm_output": v31, "parallel_drafting": parallel}
                                              if kind == "eagle3" else {}))
    p = eagle.init_params(jax.random.PRNGKey(seed), cfg, std=0.3)
    if v31:
        p["fc_norm"] = 1 + 0.2 * jax.random.normal(jax.random.PRNGKey(seed + 2), p["fc_norm"].shape)
    p["layer"] = dict(p["layer"], mlp_norm=1 + 0.1 * jax.random.normal(jax.random.PRNGKey(seed + 1), (32,)))
    d2t = None
    if kind == "eagle3":
        ids = np.sort(np.random.default_rng(seed).choice(target.config.vocab_size, draft_vocab, replace=False))
        d2t = ids - np.arange(draft_vocab)
    return eagle.EagleWeights(cfg, p, d2t, f"random-{kind}")


def _sequence_inputs(target, w, T=9, seed=5):
    seq = np.random.default_rng(seed).integers(0, target.config.vocab_size, T + 1).tolist()
    ids, tout = target_features(target, [seq], w.config.target_layers)
    feats = tout.hidden[:, :-1] if w.kind == "eagle" else jnp.concatenate(tout.layer_hidden, -1)[:, :-1]
    return ids[:, 1:], feats


@pytest.mark.parametrize("layout", ["eagle1", "eagle1_bin", "eagle3", "eagle3.1", "speculators"])
def test_published_layouts_give_our_logits(tmp_path, target, layout):
    kind = "eagle" if layout.startswith("eagle1") else "eagle3"
    ours = random_weights(target, "eagle3.1" if layout == "eagle3.1" else kind)
    sd, hf = eagle_published_state_dict(ours, target, layout.replace("_bin", ""))
    write_checkpoint(str(tmp_path / layout), sd, hf, torch_bin=layout.endswith("_bin"))
    loaded = eagle.load(str(tmp_path / layout), target, kind)
    assert loaded.config.target_layers == ours.config.target_layers
    assert ("embed" in loaded.params) == (kind == "eagle")
    tokens, feats = _sequence_inputs(target, ours)
    _, want = eagle.forward_sequence(ours.params, ours.config, tokens, feats, target_weights(target))
    _, got = eagle.forward_sequence(loaded.params, loaded.config, tokens, feats, target_weights(target))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(want[0], reference_logits(sd, hf, tokens[0], feats[0], target), rtol=1e-4, atol=1e-4)
    if kind == "eagle3":
        np.testing.assert_array_equal(loaded.d2t, ours.d2t)


def test_published_eagle3_without_layer_ids_uses_the_reference_default(tmp_path):
    target = tiny_model(0, layers=8)
    w = random_weights(target, "eagle3")
    sd, hf = eagle_published_state_dict(w, target, "eagle3")
    del hf["eagle_aux_hidden_state_layer_ids"]
    del sd["t2d"]                                            # optional: d2t alone defines the map
    write_checkpoint(str(tmp_path / "p"), sd, hf)
    assert eagle.load(str(tmp_path / "p"), target).config.target_layers == (1, 3, 4)    # HF ids (2, 4, 5)


def test_export_import_round_trip(tmp_path, target):
    for name in ("eagle3", "eagle3.1", "eagle"):
        w = random_weights(target, name)
        kind = w.kind
        eagle.export_published(str(tmp_path / name), w)
        with open(tmp_path / name / "config.json") as f:
            hf = json.load(f)
        if kind == "eagle3":
            assert hf["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in EAGLE3_LAYERS]
            assert hf["draft_vocab_size"] == 40
            assert hf.get("fc_norm", False) == hf.get("norm_output", False) == (name == "eagle3.1")
        back = eagle.load(str(tmp_path / name), target, kind)
        assert back.config == w.config
        for a, b in zip(jax.tree_util.tree_leaves(back.params), jax.tree_util.tree_leaves(w.params)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        if kind == "eagle3":
            np.testing.assert_array_equal(back.d2t, w.d2t)
    # our artifact (the training recipes' format), float32 exact and bfloat16
    for name in ("eagle", "eagle3.1", "p_eagle", "eagle3"):
        w = random_weights(target, name)
        eagle.save(str(tmp_path / f"ours-{name}"), w, target, "# test\n", dtype="float32")
        back = eagle.load(str(tmp_path / f"ours-{name}"), target)
        assert back.config == w.config and back.kind == w.kind
        for a, b in zip(jax.tree_util.tree_leaves(back.params), jax.tree_util.tree_leaves(w.params)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    eagle.save(str(tmp_path / "bf16"), w, target, "# test\n")
    back = eagle.load(str(tmp_path / "bf16"), target, "eagle3")
    np.testing.assert_array_equal(back.d2t, w.d2t)                      # the vocab map stays exact
    np.testing.assert_allclose(back.params["lm_head"], w.params["lm_head"], rtol=1e-2, atol=1e-2)


def test_bad_input(tmp_path, target, drafters):
    prompts = [[1, 2, 3]]
    chain = lambda method, **kw: SpecConfig(method=method, num_speculative_tokens=2, **kw)
    with pytest.raises(TypeError, match="method='eagle' needs drafter"):
        specjax.generate(target, prompts, chain("eagle"), drafter=None)
    with pytest.raises(ValueError, match="is an 'eagle' drafter; use method='eagle'"):
        specjax.generate(target, prompts, chain("eagle3"), drafter=drafters["eagle"])
    # a drafter for another target
    wide = tiny_model(0, hidden=48, heads=4, kv_heads=2)
    with pytest.raises(ValueError, match="target hidden_size=32, the target 'tiny' has 48"):
        specjax.generate(wide, prompts, chain("eagle"), drafter=drafters["eagle"])
    other_vocab = tiny_model(0, vocab=67)
    with pytest.raises(ValueError, match="vocab_size=61, the target 'tiny' has 67"):
        specjax.generate(other_vocab, prompts, chain("eagle3"), drafter=drafters["eagle3"])
    eagle.save(str(tmp_path / "ours"), drafters["eagle"], target, "# x\n", dtype="float32")
    with pytest.raises(ValueError, match="trained for another target.*hidden_size"):
        eagle.load(str(tmp_path / "ours"), wide)
    with pytest.raises(ValueError, match="holds a 'eagle' drafter, not 'eagle3'"):
        specjax.generate(target, prompts, chain("eagle3"), drafter=str(tmp_path / "ours"))
    # P-EAGLE's mask inputs have no place in the published EAGLE-3 layout
    with pytest.raises(ValueError, match="P-EAGLE .*no place in the EAGLE-3 layout"):
        eagle.export_published(str(tmp_path / "p"), random_weights(target, "p_eagle"))
    with pytest.raises(ValueError, match="parallel_drafting are EAGLE-3 settings"):
        eagle.eagle_config(target, "eagle", parallel_drafting=True)
    # feature layers out of range
    w3 = drafters["eagle3"]
    far = w3._replace(config=eagle.EagleConfig("eagle3", w3.config.layer, 32, (0, 1, 5), w3.config.draft_vocab_size))
    with pytest.raises(ValueError, match=r"reads target layers \[0, 1, 5\].*2 decoder layers.*out of range: \[5\]"):
        specjax.generate(target, prompts, chain("eagle3"), drafter=far)
    sd, hf = eagle_published_state_dict(w3, target, "speculators")
    write_checkpoint(str(tmp_path / "emb"), sd, dict(hf, eagle_aux_hidden_state_layer_ids=[0, 1, 2]))
    with pytest.raises(ValueError, match="include 0 \\(the embedding output\\)"):
        eagle.load(str(tmp_path / "emb"), target)
    # a d2t map that does not fit the vocabulary, or is not one-to-one
    bad = np.array(w3.d2t)
    bad[-1] += 100
    with pytest.raises(ValueError, match="d2t map does not fit the target vocabulary of 61"):
        specjax.generate(target, prompts, chain("eagle3"), drafter=w3._replace(d2t=bad))
    dup = np.array(w3.d2t)
    dup[1] = dup[0] - 1
    with pytest.raises(ValueError, match="two draft tokens to the same target token"):
        specjax.generate(target, prompts, chain("eagle3"), drafter=w3._replace(d2t=dup))
    sd2 = dict(sd, d2t=bad)
    write_checkpoint(str(tmp_path / "badmap"), sd2, hf)
    with pytest.raises(ValueError, match="does not fit the target vocabulary"):
        eagle.load(str(tmp_path / "badmap"), target)
    # invalid trees
    small = informative_eagle(target, "eagle3", draft_vocab=3)
    with pytest.raises(ValueError, match="top-4 draft tokens per node but the drafter's draft vocabulary has only 3"):
        specjax.generate(target, prompts, SpecConfig(method="eagle3", tree_choices=[(0,), (1,), (2,), (3,)]),
                         drafter=small)
    with pytest.raises(ValueError, match="num_draft_tokens=40"):
        SpecConfig(method="eagle", num_steps=2, topk=2, num_draft_tokens=40)
    # truncated / incomplete published checkpoints
    sd3 = dict(sd)
    del sd3["layers.0.hidden_norm.weight"]
    write_checkpoint(str(tmp_path / "missing"), sd3, hf)
    with pytest.raises(ValueError, match="missing tensor 'layers.0.hidden_norm.weight'"):
        eagle.load(str(tmp_path / "missing"), target)
    st = tmp_path / "emb" / "model.safetensors"
    st.write_bytes(st.read_bytes()[:-100])
    with pytest.raises(ValueError, match="truncated"):
        eagle.load(str(tmp_path / "emb"), target)
