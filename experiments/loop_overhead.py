"""Where the decode loop's step time goes, per batch size, before and after a change, in one run.

  python -m experiments.loop_overhead --base=31b88a8 --batch_sizes=1,8,32,64

For each side (the working tree, and --base in a temporary git worktree when given) a worker process running that
side's library measures plain greedy decoding of the shipped target on HumanEval prompts:
  step     one iteration of the compiled loop: (time of N new tokens - time of N/2) / (N/2), same buffer, so
           prefill and compilation cancel out;
  forward  one cached target forward over T = 1 position, each row at its mid-run length, over the loop's cache
           (one buffer, or each prompt-length group's own where the revision gives it one), carried through a
           lax.fori_loop as the loop carries it and donated as the loop's state is (so its writes are in place
           and no call copies it);
  attn     the forward's attention alone (every layer), and `write` its cache writes alone, at the same shapes;
  loop     step - forward: what the loop spends outside the forward (token writes, stopping, stats, sampling);
  slots    the cache slots per row the attention passes over (the buffer, or less in groups of their own);
  tok/s    generated tokens / wall time of the whole generation (prefill included), as an engine is measured.
Both sides compile first, then take turns, one round of every measurement each, so drift in the machine's speed
hits both alike; each number is the fastest of its --reps rounds (the slower ones measure the neighbours on a
shared machine). The table goes to --out as JSON.
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json
import subprocess
import sys

from absl import app, flags

from experiments.revisions import REPO, revision_checkout

FLAGS = flags.FLAGS
flags.DEFINE_string("base", None, "git revision to measure beside the working tree (None: the working tree only)")
flags.DEFINE_list("batch_sizes", ["1", "8", "32", "64"], "batch sizes")
flags.DEFINE_integer("max_new_tokens", 128, "new tokens per row (N); the step time is taken between N/2 and N")
flags.DEFINE_integer("reps", 7, "alternating timing rounds (the fastest of each measurement is kept)")
flags.DEFINE_string("target", "stdlib-target", "shipped target name or HF directory")
flags.DEFINE_string("out", "runs/loop_overhead.json", "where the table is written")

# Runs against whichever library is first on PYTHONPATH: only APIs that every revision since the KV-cache layout
# change and before it share (decode, KVCache, forward, the reference attention), and the prefill groups and
# grouped cache where a revision has them.
WORKER = r'''
import json, sys, time
import jax, jax.numpy as jnp, numpy as np
from jax import lax
import specjax
from specjax import SpecConfig
from specjax.drafters.registry import BuildRequest, build as build_drafter
from specjax.inputs import right_pad
from specjax.cache import KVCache
from specjax.decode import decode_loop
from specjax.models.llama import forward, kv_heads
from pallas_kernels.verify_attention.reference import verify_attention_reference
from experiments.prompts import humaneval_prompts
try:                            # revisions that prefill in length groups (the loop runs them as generate() does)
    from specjax.inputs import plan_prefill
except ImportError:
    plan_prefill = None
try:                            # ... and give each group a KV cache of its own where that pays
    from specjax.cache import GroupedKVCache
    from specjax.decode import group_cache_sizes
except ImportError:
    group_cache_sizes = None

batches, new, target_name = [int(b) for b in sys.argv[1].split(",")], int(sys.argv[2]), sys.argv[3]
model = specjax.load_model(target_name)
cfg = model.config
Hkv = kv_heads(model.params, cfg)

def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0

def looped(body, carry, inner):
    # The carry is donated, as the decode loop's state is: without that XLA copies the whole cache into the loop
    # on every call, and the copy would be counted as forward time. A fresh copy is made before the clock starts.
    run = jax.jit(lambda c: lax.fori_loop(0, inner, body, c), donate_argnums=0)
    def call():
        fresh = jax.block_until_ready(jax.tree.map(jnp.copy, carry))
        t0 = time.perf_counter()
        jax.block_until_ready(run(fresh))
        return time.perf_counter() - t0
    return call

INNER = 16
cases = []                      # per batch size: its info and {name: (callable -> seconds, divisor)}
for B in batches:
    texts = (humaneval_prompts(164) * (B // 164 + 1))[:B]
    ids = [model.tokenize(t) for t in texts]
    P = max(len(r) for r in ids)
    buf = -(-(P + new + 1) // 64) * 64
    prompts = jnp.asarray(right_pad(ids, P))
    plens = jnp.asarray([len(r) for r in ids], jnp.int32)
    keys = jax.random.split(jax.random.PRNGKey(0), B)
    grouping, sizes, parts = {}, None, [(slice(None), buf)]
    if plan_prefill is not None:
        order, groups = plan_prefill([len(r) for r in ids], P, 4)
        grouping = dict(prefill_groups=groups, prefill_order=jnp.asarray(order))
        # Sized for the full run and kept for the half one, so that the two differ in their steps only.
        sizes = group_cache_sizes(groups, buf, new, 0) if group_cache_sizes is not None else None
        if sizes:
            grouping["cache_sizes"] = sizes
            cuts = np.cumsum([0] + [rows for rows, _ in groups])
            parts = [(jnp.asarray(order[a:b]), size) for a, b, size in zip(cuts[:-1], cuts[1:], sizes)]
    def gen(n, B=B, ids=ids, buf=buf, prompts=prompts, plens=plens, keys=keys, grouping=grouping):
        spec = SpecConfig(max_new_tokens=n, stop_at_eos=False)
        drafter, dparams = build_drafter(BuildRequest(spec, model, None, ids, buf))
        run = lambda: jax.block_until_ready(decode_loop(model.params, dparams, prompts, plens, keys, jnp.int32(-1),
                                                   cfg=cfg, drafter=drafter, spec=spec, buffer_len=buf, **grouping))
        return lambda: timed(run)
    # The forward, attention and writes alone over the loop's cache (its groups' caches where it has them), each
    # row at its own mid-run length.
    lengths = plens + new // 2
    new_cache = lambda rows, size: KVCache.init(cfg.num_layers, rows, size, Hkv, cfg.head_dim)
    if sizes:
        cache = GroupedKVCache.of([new_cache(len(r), size) for r, size in parts], [r for r, _ in parts], lengths)
        part_caches = lambda cache: cache.parts
    else:
        cache = new_cache(B, buf).replace(lengths=lengths)
        part_caches = lambda cache: (cache,)

    def fwd_body(i, c, B=B):
        acc, cache = c
        tok = jnp.full((B, 1), i % cfg.vocab_size, jnp.int32)
        out = forward(model.params, cfg, tok, cache)
        return acc + out.logits[0, 0, 0], out.cache.replace(lengths=cache.lengths)

    q0 = jnp.ones((B, 1, cfg.num_heads, cfg.head_dim), jnp.float32)
    layout = {"keys_transposed": True} if getattr(cache, "keys_transposed", False) else {}   # revisions without it
    def attn_body(i, c, q0=q0, parts=parts, part_caches=part_caches):
        acc, cache = c
        for layer in range(cfg.num_layers):
            for (rows, _), part in zip(parts, part_caches(cache)):
                o = verify_attention_reference(q0[rows] * (i + layer), part.k[layer], part.v[layer],
                                               cache.lengths[rows] + 1, **layout)
                acc = acc + o[0, 0, 0, 0]
        return acc, cache

    kv0 = jnp.ones((B, 1, Hkv, cfg.head_dim), jnp.float32)
    def write_body(i, c, kv0=kv0):
        acc, cache = c
        for layer in range(cfg.num_layers):
            cache = cache.write(layer, kv0 * i, kv0 * i, cache.lengths)
        return acc + jax.tree.leaves(cache)[0].ravel()[0], cache

    calls = {"full": (gen(new), 1), "half": (gen(new // 2), 1),
             "forward": (looped(fwd_body, (jnp.float32(0), cache), INNER), INNER),
             "attention": (looped(attn_body, (jnp.float32(0), cache), INNER), INNER),
             "cache_write": (looped(write_body, (jnp.float32(0), cache), INNER), INNER)}
    for fn, _ in calls.values():
        fn()                                                              # compile
    cases.append(({"batch": B, "prompt_pad": P, "buffer": buf, "cache_slots": [size for _, size in parts],
                   "slots_per_row": sum((B if isinstance(r, slice) else len(r)) * size for r, size in parts) / B},
                  calls))
print("READY", flush=True)

best = [dict.fromkeys(calls, float("inf")) for _, calls in cases]
for _ in sys.stdin:             # one round per line: every measurement once (rounds alternate with the other side)
    for (info, calls), b in zip(cases, best):
        for name, (fn, div) in calls.items():
            b[name] = min(b[name], fn() / div)            # each callable returns its own timed seconds
    print("ROUND", flush=True)

rows = []
for (info, _), b in zip(cases, best):
    step = (b["full"] - b["half"]) / (new - new // 2)
    rows.append({**info, "step_ms": step * 1e3, "forward_ms": b["forward"] * 1e3,
                 "attention_ms": b["attention"] * 1e3, "cache_write_ms": b["cache_write"] * 1e3,
                 "loop_ms": (step - b["forward"]) * 1e3, "loop_share": (step - b["forward"]) / step,
                 "tokens_per_s": info["batch"] * new / b["full"]})
print("DONE " + json.dumps(rows), flush=True)
'''


def start(code_dir: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=code_dir, JAX_PLATFORMS="cpu")
    return subprocess.Popen([sys.executable, "-c", WORKER, ",".join(FLAGS.batch_sizes), str(FLAGS.max_new_tokens),
                             FLAGS.target], cwd=code_dir, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)


def read(proc: subprocess.Popen, tag: str) -> str:
    for line in proc.stdout:
        if line.startswith(tag):
            return line[len(tag):].strip()
    raise RuntimeError(f"a worker exited (code {proc.wait()}) before printing {tag}")


def measure(code_dirs: dict[str, str]) -> dict[str, list[dict]]:
    """Each side's worker compiles everything, then they take turns, one round each, --reps rounds."""
    procs = {name: start(d) for name, d in code_dirs.items()}
    for p in procs.values():
        read(p, "READY")
    for r in range(FLAGS.reps):
        for p in procs.values():
            p.stdin.write("round\n")
            p.stdin.flush()
            read(p, "ROUND")
        print(f"round {r + 1}/{FLAGS.reps} done", flush=True)
    out = {}
    for name, p in procs.items():
        p.stdin.close()
        out[name] = json.loads(read(p, "DONE "))
        p.wait()
    return out


def main(argv):
    del argv
    if FLAGS.base:
        with revision_checkout(FLAGS.base) as base_dir:
            sides = measure({f"before ({FLAGS.base})": base_dir, "after (working tree)": REPO})
    else:
        sides = measure({"working tree": REPO})
    print(f"\nplain greedy decoding, {FLAGS.target}, float32, CPU, HumanEval prompts, {FLAGS.max_new_tokens} new "
          f"tokens; ms per loop step, the fastest of {FLAGS.reps} alternating rounds")
    print(f"{'side':>22} {'batch':>5} {'slots':>6} {'step':>7} {'forward':>7} {'(attn':>7} {'write)':>7} "
          f"{'loop':>7} {'loop %':>6} {'tok/s':>7}")
    for name, rows in sides.items():
        for r in rows:
            print(f"{name:>22} {r['batch']:>5} {r.get('slots_per_row', r['buffer']):6.0f} {r['step_ms']:7.2f} {r['forward_ms']:7.2f} "
                  f"{r['attention_ms']:7.2f} {r['cache_write_ms']:7.2f} {r['loop_ms']:7.2f} "
                  f"{100 * r['loop_share']:5.0f}% {r['tokens_per_s']:7.0f}")
    os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
    with open(FLAGS.out, "w") as f:
        json.dump({"flags": {"base": FLAGS.base, "batch_sizes": FLAGS.batch_sizes,
                             "max_new_tokens": FLAGS.max_new_tokens, "reps": FLAGS.reps, "target": FLAGS.target},
                   "sides": sides}, f, indent=1)
    print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
    app.run(main)
