"""Drafter weights that are informative by construction (no training): each proposes (nearly) the target's own next
token, so on the tiny target's repetitive greedy outputs some drafts are accepted and others rejected. Used by the
conformance factories, the drafter families' own tests and the reproduce experiment's test."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters import eagle, mtp
from specjax.drafters.base import target_weight
from specjax.models import Model
from train.losses.common import causal_forward

EAGLE3_LAYERS = (0, 1, 1)     # the 2-layer tiny target: the last entry is the output of its last layer
MTP_TRUNK = 0                 # the tiny target has 2 layers: layer 0 is the trunk, layer 1 head 1


def informative_eagle(target: Model, kind: str, seed: int = 0, noise: float = 0.05, tok_noise: float = 0.1,
                      draft_vocab: int = 48, **eagle3_options) -> eagle.EagleWeights:
    """fc(concat(e, f)) = f + noise (EAGLE-1) / fc(aux) = the last layer's output (EAGLE-3), the layer adds small
    noise, EAGLE-3's norm and lm_head are the target's (restricted to a draft vocabulary of the most frequent
    target predictions). The drafter's logits are (nearly) the target's own at the previous position: it mostly
    proposes the last committed token again. eagle3_options: EAGLE-3.1's fc_norm / norm_output, P-EAGLE's
    parallel_drafting (its depths past the first read the random mask inputs: they guess, mostly wrong)."""
    tc = target.config
    H, V = tc.hidden_size, tc.vocab_size
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    if kind == "eagle":
        cfg = eagle.eagle_config(target, "eagle")
        p = eagle.init_params(k1, cfg, std=noise)
        p["fc_w"] = p["fc_w"].at[:H].multiply(tok_noise / noise).at[H:].add(jnp.eye(H))
        return eagle.EagleWeights(cfg, p, None, "informative-eagle")
    cfg = eagle.eagle_config(target, "eagle3", target_layers=EAGLE3_LAYERS, draft_vocab_size=draft_vocab,
                             **eagle3_options)
    ids = jax.random.randint(k2, (8, 16), 0, V)
    counts = np.bincount(np.asarray(jnp.argmax(target.logits(ids), -1)).ravel(), minlength=V) + 1e-3 * np.arange(V)
    d2t = eagle.vocab_map_from_counts(counts, draft_vocab)
    p = eagle.init_params(k1, cfg, std=noise)
    fc = noise * jax.random.normal(k3, p["fc_w"].shape)
    p["fc_w"] = fc.at[2 * H:].add(jnp.eye(H))
    if cfg.fc_norm:         # keep each feature at its own scale, so the pass-through still dominates the noise
        feats = causal_forward(target.params, tc, ids, hidden_layers=tuple(sorted(set(EAGLE3_LAYERS)))).layer_hidden
        by_layer = dict(zip(sorted(set(EAGLE3_LAYERS)), feats))
        rms = jnp.stack([jnp.sqrt(jnp.mean(by_layer[l] ** 2)) for l in EAGLE3_LAYERS])
        p["fc_norm"] = jnp.broadcast_to(rms[:, None], p["fc_norm"].shape)
    p["final_norm"] = target.params["final_norm"]
    p["lm_head"] = target_weight(target.params, "lm_head")[:, eagle.draft_to_target(d2t)]
    return eagle.EagleWeights(cfg, p, d2t, "informative-eagle3" + "".join(f"-{o}" for o in sorted(eagle3_options)))


def informative_mtp(target: Model, kind: str, depth: int, noise: float = 0.05, seed: int = 0) -> mtp.MTPWeights:
    """mtp: modules whose proj passes the feature through (a fresh module: the target's prediction one position
    late). mtp_heads: each head a noisy copy of the target's last layer (head 1), its final norm the target's:
    every head guesses what head 1 says."""
    cfg = mtp.MTPConfig(kind, mtp.layer_config(target.config), depth, MTP_TRUNK if kind == "mtp_heads" else None)
    p = mtp.init_params(jax.random.PRNGKey(seed), cfg, target.params, std=noise)
    if kind == "mtp_heads":
        for hp in p["heads"]:
            hp["layer"] = jax.tree_util.tree_map(lambda a, b: a + b, target.params["layers"][-1], hp["layer"])
    return mtp.MTPWeights(cfg, p, f"informative-{kind}")
