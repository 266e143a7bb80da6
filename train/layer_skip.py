"""Choose a layer-skip set for a target by measured acceptance, training-free; export it as a drafter artifact.

    python -m train.layer_skip --target=smollm2-135m --out=checkpoints/smollm2-135m-layerskip

Rows: the target's own greedy answers to ShareGPT training-split first turns (train.self_distill.split_prompts;
held-out conversations never enter), or to corpus windows for a target without a chat template. On them, the
greedy acceptance of the first draft position is the rate at which the drafter's argmax equals the full model's
(teacher-forced on the target's own text, every answer position, with the drafter's context: the full model's keys
and values of the earlier tokens, make_forward). The search is greedy: from no skipped layer,
each round tries the --candidates layers whose removal changes the residual stream least (relative norm of the
layer's update, measured once) and skips the one that keeps the agreement highest, until --max_skip layers.

Each skip count s gives alpha_s, a draft cost c_s (the weights a draft step reads over those of a target step:
kept layers plus embedding/LM head, the quantity a memory-bound step scales with) and, with the verify-cost ratio
(--verify_cost, measured by experiments.costs for this target), the analytic best k and speedup
(specjax.analysis). The artifact keeps the skip set of the best predicted speedup; its MANIFEST has the whole
table. The measured end to end numbers come from experiments.speedup with method layer_skip.
"""
from __future__ import annotations

import json
import sys
import time
from typing import NamedTuple

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import specjax
from specjax import SpecConfig
from specjax.analysis import walltime_speedup
from specjax.drafters.artifacts import save_artifact
from specjax.models.llama import apply_rope, lm_head, rms_norm, rope_inv_freq
from train import self_distill

flags.DEFINE_string("target", "smollm2-135m", "target: a name or path load_model takes")
flags.DEFINE_string("out", None, "artifact directory (default: print the table only)")
flags.DEFINE_integer("num_prompts", 16, "training-split chats answered by the target")
flags.DEFINE_integer("new_tokens", 128, "answer tokens per chat (greedy, to the end of turn)")
flags.DEFINE_integer("max_prompt_tokens", 256, "longest rendered prompt kept")
flags.DEFINE_integer("max_skip", 20, "most layers skipped")
flags.DEFINE_integer("candidates", 8, "layers tried per round (the least-changing ones); 0: every kept layer")
flags.DEFINE_list("protect", ["first", "last"], "layers never skipped: indices, 'first', 'last'")
flags.DEFINE_string("verify_cost", "2:1.15,4:1.45,5:1.64,8:1.73", "verify-cost ratio by positions T, 'T:ratio,...'")
flags.DEFINE_integer("k_max", 8, "largest k the prediction considers")
flags.DEFINE_integer("seed", 0, "prompt order")
F = flags.FLAGS


def answer_rows(target, n: int, new_tokens: int, max_prompt_tokens: int, seed: int):
    """-> (tokens [n, R] int32 right-padded, answer mask [n, R]: position t's next token is an answer token)."""
    prompts = self_distill.split_prompts(target, "train", n, max_prompt_tokens, seed)
    res = specjax.generate(target, prompts, SpecConfig(max_new_tokens=new_tokens, stop_at_eos=True))
    width = max(len(p) + len(a) for p, a in zip(prompts, res.tokens))
    tokens = np.zeros((n, width), np.int32)
    mask = np.zeros((n, width), bool)
    for i, (p, a) in enumerate(zip(prompts, res.tokens)):
        tokens[i, :len(p) + len(a)] = p + list(a)
        mask[i, len(p) - 1:len(p) + len(a) - 1] = True
    return tokens, mask


def _attend(q, k_ctx, v_ctx, k_own, v_own, group: int):
    """Position t's queries over the context keys of positions < t and its own key at t. q [B, T, Hq, D];
    k/v [B, T, Hkv, D] -> [B, T, Hq, D]."""
    T, D = q.shape[1], q.shape[-1]
    rep = lambda x: jnp.repeat(x, group, axis=2)                                  # kv heads to query heads
    scores = jnp.einsum("bthd,bshd->bhts", q, rep(k_ctx)) / jnp.sqrt(D)          # [B, Hq, T, S]
    scores = jnp.where(jnp.tril(jnp.ones((T, T), bool), -1), scores, -jnp.inf)
    own = jnp.einsum("bthd,bthd->bht", q, rep(k_own))[..., None] / jnp.sqrt(D)  # [B, Hq, T, 1]
    p = jax.nn.softmax(jnp.concatenate([scores, own], -1), -1)
    out = jnp.einsum("bhts,bshd->bthd", p[..., :T], rep(v_ctx))
    return out + p[..., T:].transpose(0, 2, 1, 3) * rep(v_own)


def make_forward(target):
    """Two compiled passes with the layer-skip drafter's context: at a kept layer, position t attends to the FULL
    model's keys and values of positions < t (what the target's cache holds) and to its own skip-path key and value
    at t, so its argmax at t is the drafter's first draft after the committed tokens 0..t.
    -> (full(tokens [B, T]) -> (the full model's argmax [B, T], context keys and values [L, B, T, Hkv, D] each,
        per-layer relative update norms [L]),
        skipped(keep [L] bool, tokens, keys, values) -> argmax [B, T]: every layer run or skipped at run time, so
        the search's skip sets share one program and a skipped layer costs nothing)."""
    cfg, params = target.config, target.params
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *params["layers"])
    inv_freq = rope_inv_freq(cfg)
    Hq, Hkv, D, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
    group = Hq // Hkv

    def project(lp, x, positions):
        B, T = x.shape[:2]
        h = rms_norm(x, lp["attn_norm"], eps)
        q = apply_rope((h @ lp["wq"]).reshape(B, T, Hq, D), positions, inv_freq)
        k = apply_rope((h @ lp["wk"]).reshape(B, T, Hkv, D), positions, inv_freq)
        return q, k, (h @ lp["wv"]).reshape(B, T, Hkv, D)

    def finish(lp, x, attn):
        B, T = x.shape[:2]
        x = x + attn.reshape(B, T, Hq * D) @ lp["wo"]
        h = rms_norm(x, lp["mlp_norm"], eps)
        return x + (jax.nn.silu(h @ lp["w_gate"]) * (h @ lp["w_up"])) @ lp["w_down"]

    def argmax(x):
        return jnp.argmax(lm_head(params, rms_norm(x, params["final_norm"], eps), cfg.vocab_size), -1)

    def positions_of(tokens):
        return jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)

    @jax.jit
    def full(tokens):
        T = tokens.shape[1]
        positions = positions_of(tokens)
        causal = jnp.tril(jnp.ones((T, T), bool))

        def layer(x, lp):
            q, k, v = project(lp, x, positions)
            s = jnp.einsum("bthd,bshd->bhts", q, jnp.repeat(k, group, 2)) / jnp.sqrt(D)
            p = jax.nn.softmax(jnp.where(causal, s, -jnp.inf), -1)
            y = finish(lp, x, jnp.einsum("bhts,bshd->bthd", p, jnp.repeat(v, group, 2)))
            change = jnp.mean(jnp.linalg.norm(y - x, axis=-1) / jnp.linalg.norm(x, axis=-1))
            return y, (k, v, change)

        x, (keys, values, change) = lax.scan(layer, params["embed"][tokens], stacked)
        return argmax(x), keys, values, change

    @jax.jit
    def skipped(keep, tokens, keys, values):
        positions = positions_of(tokens)

        def layer(x, per_layer):
            lp, run, k_ctx, v_ctx = per_layer

            def run_layer(x):
                q, k, v = project(lp, x, positions)
                return finish(lp, x, _attend(q, k_ctx, v_ctx, k, v, group))
            return lax.cond(run, run_layer, lambda x: x, x), None

        x, _ = lax.scan(layer, params["embed"][tokens], (stacked, keep, keys, values))
        return argmax(x)
    return full, skipped


class Rows(NamedTuple):
    """The search's rows in chunks, with what the full model gives once: argmax and its keys / values."""
    tokens: list
    mask: list
    reference: list
    keys: list
    values: list
    change: np.ndarray            # [L] mean relative update norm of each layer


def prepare_rows(full, tokens: np.ndarray, mask: np.ndarray, rows: int = 4) -> Rows:
    chunks = [slice(s, s + rows) for s in range(0, len(tokens), rows)]
    out = Rows([], [], [], [], [], None)
    changes = []
    for c in chunks:
        ref, k, v, change = full(jnp.asarray(tokens[c]))
        out.tokens.append(jnp.asarray(tokens[c]))
        out.mask.append(mask[c])
        out.reference.append(np.asarray(ref))
        out.keys.append(k)
        out.values.append(v)
        changes.append(np.asarray(change))
    return out._replace(change=np.mean(changes, 0))


def agreement(skipped, keep: np.ndarray, rows: Rows) -> float:
    hits = total = 0
    for tokens, mask, ref, k, v in zip(rows.tokens, rows.mask, rows.reference, rows.keys, rows.values):
        pred = np.asarray(skipped(jnp.asarray(keep), tokens, k, v))
        hits += int(np.sum((pred == ref) & mask))
        total += int(mask.sum())
    return hits / total


def draft_cost(target, skip: set) -> float:
    """Weights a draft step reads over a target step's: kept layers + embedding / LM head + final norm."""
    size = lambda tree: sum(x.size for x in jax.tree_util.tree_leaves(tree))
    layers = [size(lp) for lp in target.params["layers"]]
    rest = size({k: v for k, v in target.params.items() if k != "layers"})
    return (rest + sum(n for i, n in enumerate(layers) if i not in skip)) / (rest + sum(layers))


def parse_cost(spec: str) -> dict[int, float]:
    out = {}
    for item in spec.split(","):
        t, r = item.split(":")
        out[int(t)] = float(r)
    return out


def protected(names, num_layers: int) -> set[int]:
    alias = {"first": 0, "last": num_layers - 1}
    return {alias[n] if n in alias else int(n) for n in names}


def search(target, tokens, mask, max_skip: int, candidates: int, keep_always: set[int], verify_cost: dict,
           k_max: int, log=print) -> list[dict]:
    full, skipped = make_forward(target)
    L = target.config.num_layers
    rows = prepare_rows(full, tokens, mask)
    change = rows.change
    skip: list[int] = []
    table = []
    for s in range(1, max_skip + 1):
        pool = [i for i in np.argsort(change) if i not in skip and i not in keep_always]
        if not pool:
            break
        pool = pool[:candidates] if candidates else pool
        scores = {}
        for i in pool:
            keep = np.ones(L, bool)
            keep[skip + [int(i)]] = False
            scores[int(i)] = agreement(skipped, keep, rows)
        best = max(scores, key=scores.get)
        skip.append(best)
        c = draft_cost(target, set(skip))
        # the best k >= 1 (optimal_k would answer k = 0, plain decoding, where nothing beats it: the table shows
        # by how much each skip set falls short then)
        k = max(range(1, k_max + 1), key=lambda k: walltime_speedup(scores[best], k, c, verify_cost))
        speedup = walltime_speedup(scores[best], k, c, verify_cost)
        table.append(dict(skipped=s, skip_layers=sorted(skip), alpha=scores[best], c=c, best_k=k,
                          predicted_speedup=speedup))
        log(f"[layer_skip] skip {s:2d}: +layer {best:2d}  alpha {scores[best]:.3f}  c {c:.3f}  best k {k}  "
            f"predicted {speedup:.2f}x  (tried {len(pool)})")
    return table


def manifest(table: list[dict], chosen: dict, meta: dict) -> str:
    lines = ["# Layer-skip self-speculation skip set", "",
             f"Command: `{meta['command']}`", "",
             f"Target: {meta['target']}. Rows: the target's greedy answers to {meta['num_prompts']} ShareGPT "
             f"training-split first turns (seed {meta['seed']}, at most {meta['new_tokens']} answer tokens, "
             f"{meta['answer_tokens']} in all). Training-free: nothing is learned; the artifact is the skip set.",
             "", "A predicted speedup below 1.00 means plain decoding is faster on this machine at every k.", "",
             f"Chosen: skip {chosen['skip_layers']} (alpha {chosen['alpha']:.3f}, c {chosen['c']:.3f}, best k "
             f"{chosen['best_k']}, predicted {chosen['predicted_speedup']:.2f}x with verify cost {meta['verify_cost']}).",
             "", "alpha: teacher-forced greedy agreement of the skipped model's argmax with the full model's on "
             "answer positions; c: weights read per draft step over a target step's.", "",
             "| skipped | alpha | c | best k | predicted speedup | skip set |", "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['skipped']} | {r['alpha']:.3f} | {r['c']:.3f} | {r['best_k']} | {r['predicted_speedup']:.2f} | "
              f"{r['skip_layers']} |" for r in table]
    lines += ["", "```json", json.dumps(dict(meta, chosen=chosen), indent=1), "```", ""]
    return "\n".join(lines)


def main(argv) -> None:
    target = specjax.load_model(F.target)
    t0 = time.time()
    tokens, mask = answer_rows(target, F.num_prompts, F.new_tokens, F.max_prompt_tokens, F.seed)
    print(f"[layer_skip] {len(tokens)} rows, {int(mask.sum())} answer tokens ({time.time() - t0:.0f} s)")
    cost = parse_cost(F.verify_cost)
    table = search(target, tokens, mask, F.max_skip, F.candidates, protected(F.protect, target.config.num_layers),
                   cost, F.k_max)
    chosen = max(table, key=lambda r: r["predicted_speedup"])
    print(f"[layer_skip] chosen: skip {chosen['skip_layers']} ({time.time() - t0:.0f} s)")
    if F.out:
        meta = dict(command="python -m train.layer_skip " + " ".join(sys.argv[1:]), target=F.target,
                    num_prompts=F.num_prompts, new_tokens=F.new_tokens, seed=F.seed, answer_tokens=int(mask.sum()),
                    verify_cost=F.verify_cost, candidates=F.candidates, protect=F.protect, table=table)
        save_artifact(F.out, "layer_skip", {"skip_layers": chosen["skip_layers"], "best_k": chosen["best_k"]}, {},
                      target, manifest(table, chosen, meta))
        print(f"[layer_skip] wrote {F.out}")


if __name__ == "__main__":
    app.run(main)
