"""specjax vs Hugging Face transformers on the SAME weights and token ids, greedy, batch 1, one run: plain decoding,
assisted generation with the draft model, and prompt lookup.

  pip install -e .[compare]        # torch + transformers (an optional extra, never needed by `make test`)
  python -m experiments.compare_hf --num_prompts=10 --max_new_tokens=128 --k=4 --rounds=2

Modes, each engine configured to do the same thing:
  plain        specjax method="none"              | transformers generate()
  draft_model  specjax method="draft_model", k    | assistant_model=draft, num_assistant_tokens=k, schedule
                                                    "constant", assistant_confidence_threshold=0 (else the
                                                    assistant stops early on a low-confidence token)
  ngram        specjax method="ngram", k,         | prompt_lookup_num_tokens=k,
               prompt_lookup 1..--prompt_lookup_max  max_matching_ngram_size=--prompt_lookup_max
The two prompt-lookup drafters differ by design: specjax takes the MOST RECENT earlier occurrence of the n-gram and,
without one, still drafts k tokens (the last token repeated); transformers takes the FIRST (leftmost) occurrence,
drafts nothing without one, and stops a draft at the end of the text. Their alpha/tau differ accordingly.

Both engines generate exactly --max_new_tokens per prompt (EOS off: SpecConfig(stop_at_eos=False); transformers'
eos_token_id unset on both models' generation configs -- min_new_tokens would instead mask EOS out of the argmax,
which changes the output). Both run float32 on the CPU with the same thread count. tokens/s = generated tokens /
the summed wall time of the per-prompt calls (prefill included), each call the fastest of --rounds, after one
untimed call per engine and mode (specjax compiles there: every prompt is padded to one width, so one compile
serves all). Calls alternate between engines and modes prompt by prompt, so drift in the machine's speed hits all
alike. alpha = accepted / drafted tokens; tau = tokens emitted per verifying target pass (bonus included). specjax
reports both in generate()'s stats (its prefill pass emits the first token and is not counted); transformers does
not report them, so they are counted by wrapping its candidate generator's update_candidate_strategy (it receives
each step's verified logits and number of matches; transformers' first pass is prefill and verify at once and is
counted). The greedy outputs are compared token for token between the engines; at the first difference the
target's top-2 logit gap is printed from each engine's own forward pass (float32 with different kernels: a
near-tie may flip).

On a machine shared with other busy processes, run with OMP_WAIT_POLICY=PASSIVE: torch's OpenMP threads spin-wait
between parallel regions, and with the cores oversubscribed every region waits for descheduled spinners (measured
here, 2 cores shared with other jobs: transformers 3-10x slower with the default policy at 2 threads, the more the
busier the machine; 1 thread or PASSIVE does not suffer it, nor does specjax's XLA runtime). The policy in force is
printed and kept in the table's meta.
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import dataclasses
import sys
import time
from typing import Any, Callable

MODES = ("plain", "draft_model", "ngram")
ENGINES = ("specjax", "hf")


@dataclasses.dataclass
class Engines:
    """Both engines' copies of the target and the draft model, loaded from the same directories."""
    target: Any                 # specjax Model
    draft: Any                  # specjax Model
    hf_target: Any              # transformers LlamaForCausalLM (float32, eval)
    hf_draft: Any

from specjax.checkpoints import resolve


def model_dir(name: str) -> str:
    """A directory, or the name of a shipped model in checkpoints/."""
    return resolve(name, "model")


def load_engines(target_dir: str, draft_dir: str) -> Engines:
    import specjax
    import torch
    from transformers import LlamaForCausalLM

    def hf(path: str):
        m = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        # Unset rather than min_new_tokens: masking EOS would change the greedy argmax wherever EOS wins.
        m.generation_config.eos_token_id = None
        m.generation_config.pad_token_id = None
        return m

    return Engines(specjax.load_model(target_dir), specjax.load_model(draft_dir), hf(target_dir), hf(draft_dir))


def _spec_config(mode: str, k: int, max_new_tokens: int, prompt_lookup_max: int):
    from specjax import SpecConfig
    if mode == "plain":
        return SpecConfig(max_new_tokens=max_new_tokens, stop_at_eos=False)
    extra = dict(prompt_lookup_min=1, prompt_lookup_max=prompt_lookup_max) if mode == "ngram" else {}
    return SpecConfig(method=mode, num_speculative_tokens=k, max_new_tokens=max_new_tokens, stop_at_eos=False,
                      **extra)


def specjax_runner(engines: Engines, mode: str, k: int, max_new_tokens: int, prompt_lookup_max: int,
                   pad_to: int) -> Callable[[list[int]], tuple[list[int], dict]]:
    """prompt ids -> (new tokens, {"accepted", "drafted", "passes", "counted_tokens"}) decoded by specjax."""
    import specjax
    config = _spec_config(mode, k, max_new_tokens, prompt_lookup_max)
    drafter = engines.draft if mode == "draft_model" else None

    def run(ids: list[int]) -> tuple[list[int], dict]:
        r = specjax.generate(engines.target, [ids], config, drafter=drafter, pad_to=pad_to)
        s = r.stats
        # tau's passes: verify passes after prefill, whose first token is not counted (as in stats["tau"])
        return r.tokens[0], {"accepted": s["accepted"], "drafted": s["drafted"], "passes": s["target_passes"],
                             "counted_tokens": s["generated_tokens"] - 1}
    return run


class _StepCounter:
    """Records (drafted, accepted) per assisted-generation step of a transformers model, by wrapping the candidate
    generator it builds for each generate() call (the step's verified logits cover drafted + 1 positions)."""

    def __init__(self, model):
        self.steps: list[tuple[int, int]] = []
        self.available = hasattr(model, "_get_candidate_generator")      # a private method: may move
        if not self.available:
            return
        build = model._get_candidate_generator

        def counted_build(*args, **kwargs):
            gen = build(*args, **kwargs)
            update = gen.update_candidate_strategy

            def counted_update(input_ids, scores, num_matches):
                self.steps.append((scores.shape[1] - 1, int(num_matches)))
                return update(input_ids, scores, num_matches)
            gen.update_candidate_strategy = counted_update
            return gen
        model._get_candidate_generator = counted_build


def hf_runner(engines: Engines, mode: str, k: int, max_new_tokens: int,
              prompt_lookup_max: int) -> Callable[[list[int]], tuple[list[int], dict]]:
    """prompt ids -> (new tokens, counts or {} where they cannot be had) decoded by transformers."""
    import torch
    model = engines.hf_target
    kwargs: dict = dict(max_new_tokens=max_new_tokens, do_sample=False)
    if mode == "draft_model":
        gc = engines.hf_draft.generation_config
        gc.num_assistant_tokens, gc.num_assistant_tokens_schedule = k, "constant"
        gc.assistant_confidence_threshold = 0.0     # 0 = off (None would be replaced by its default, 0.4)
        kwargs["assistant_model"] = engines.hf_draft
    elif mode == "ngram":
        kwargs.update(prompt_lookup_num_tokens=k, max_matching_ngram_size=prompt_lookup_max)
    counter = getattr(model, "_specjax_step_counter", None)
    if counter is None:
        counter = model._specjax_step_counter = _StepCounter(model)

    def run(ids: list[int]) -> tuple[list[int], dict]:
        x = torch.tensor([ids], dtype=torch.long)
        counter.steps = []
        with torch.inference_mode():
            out = model.generate(x, attention_mask=torch.ones_like(x), **kwargs)
        new = out[0, len(ids):].tolist()
        if len(new) != max_new_tokens:
            raise RuntimeError(f"transformers generated {len(new)} tokens, not {max_new_tokens}: EOS not disabled?")
        if mode == "plain" or not counter.available:
            return new, {}
        return new, {"accepted": sum(a for _, a in counter.steps), "drafted": sum(d for d, _ in counter.steps),
                     "passes": len(counter.steps), "counted_tokens": len(new)}
    return run


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (u, v) in enumerate(zip(a, b)) if u != v), None if len(a) == len(b) else min(len(a), len(b)))


def top2_gaps(engines: Engines, context: list[int]) -> dict:
    """The target's next-token logits after `context` from each engine's own full forward -> per engine its
    argmax, runner-up and their logit gap."""
    import numpy as np
    import torch
    with torch.inference_mode():
        hf = engines.hf_target(torch.tensor([context])).logits[0, -1].float().numpy()
    out = {}
    for name, logits in (("specjax", np.asarray(engines.target.logits([context]))[0, -1]), ("hf", hf)):
        top = np.argsort(logits)[::-1][:2]
        out[name] = {"top1": int(top[0]), "top2": int(top[1]), "gap": float(logits[top[0]] - logits[top[1]])}
    return out


def compare(engines: Engines, prompts: list[list[int]], k: int, max_new_tokens: int, rounds: int,
            prompt_lookup_max: int = 2, modes: tuple = MODES) -> tuple[list[dict], dict]:
    """Every mode on both engines, the calls interleaved prompt by prompt -> (one row per mode, the outputs
    {(mode, engine): [tokens per prompt]})."""
    pad_to = max(map(len, prompts))
    runners = {}
    for mode in modes:
        runners[mode, "specjax"] = specjax_runner(engines, mode, k, max_new_tokens, prompt_lookup_max, pad_to)
        runners[mode, "hf"] = hf_runner(engines, mode, k, max_new_tokens, prompt_lookup_max)
    for run in runners.values():
        run(prompts[0])                                                       # compile / warm up
    best = {key: [float("inf")] * len(prompts) for key in runners}
    outputs = {key: [None] * len(prompts) for key in runners}
    counts = {key: [None] * len(prompts) for key in runners}
    for rnd in range(rounds):
        for i, ids in enumerate(prompts):
            for key, run in runners.items():
                t0 = time.perf_counter()
                tokens, c = run(ids)
                best[key][i] = min(best[key][i], time.perf_counter() - t0)
                if rnd == 0:
                    outputs[key][i], counts[key][i] = list(map(int, tokens)), c
    n = len(prompts) * max_new_tokens
    tok_s = {key: n / sum(t) for key, t in best.items()}
    rows = []
    for mode in modes:
        row: dict = {"mode": mode, "k": 0 if mode == "plain" else k}
        for engine in ENGINES:
            row[f"{engine}_tok_s"] = tok_s[mode, engine]
        row["specjax/hf"] = tok_s[mode, "specjax"] / tok_s[mode, "hf"]
        for engine in ENGINES:
            row[f"{engine}_vs_plain"] = tok_s[mode, engine] / tok_s["plain", engine] if "plain" in modes else None
        for engine in ENGINES:
            c = counts[mode, engine]
            total = {f: sum(x[f] for x in c) for f in c[0]} if c[0] else {}
            drafted = total.get("drafted")
            row[f"{engine}_alpha"] = total["accepted"] / drafted if drafted else None
            row[f"{engine}_tau"] = total["counted_tokens"] / total["passes"] if total.get("passes") else None
            row[f"{engine}_drafted"] = total.get("drafted")
        a, b = outputs[mode, "specjax"], outputs[mode, "hf"]
        diffs = [(first_difference(x, y), i) for i, (x, y) in enumerate(zip(a, b)) if x != y]
        row["identical_rows"] = len(prompts) - len(diffs)
        row["prompts"] = len(prompts)
        row["first_difference"] = min(diffs)[0] if diffs else None
        if diffs:
            pos, i = min(diffs)
            row["divergence"] = {"prompt": i, "position": pos, "specjax_token": a[i][pos], "hf_token": b[i][pos],
                                 **top2_gaps(engines, prompts[i] + a[i][:pos])}
        # Each engine against its own plain output: a speculative engine that broke exactness shows here.
        if mode != "plain" and "plain" in modes:
            for engine in ENGINES:
                row[f"{engine}_same_as_plain"] = sum(x == y for x, y in zip(outputs[mode, engine],
                                                                            outputs["plain", engine]))
        rows.append(row)
    return rows, outputs


def _fmt(v: float | None, spec: str) -> str:
    """A number in `spec`, or "-" right-aligned to its width where the engine/mode has none."""
    return format("-", ">" + spec.split(".")[0]) if v is None else format(v, spec)


def print_table(rows: list[dict]) -> None:
    print(f"{'mode':>11} {'specjax tok/s':>13} {'HF tok/s':>9} {'specjax/HF':>10} {'spec/plain sj':>13} "
          f"{'spec/plain HF':>13} {'alpha sj':>8} {'alpha HF':>8} {'tau sj':>6} {'tau HF':>6} "
          f"{'identical':>9} {'first diff':>10}")
    for r in rows:
        print(f"{r['mode']:>11} {r['specjax_tok_s']:13.1f} {r['hf_tok_s']:9.1f} {r['specjax/hf']:9.2f}x "
              f"{_fmt(r['specjax_vs_plain'], '12.2f')}x {_fmt(r['hf_vs_plain'], '12.2f')}x "
              f"{_fmt(r['specjax_alpha'], '8.3f')} {_fmt(r['hf_alpha'], '8.3f')} {_fmt(r['specjax_tau'], '6.2f')} "
              f"{_fmt(r['hf_tau'], '6.2f')} {r['identical_rows']:>4}/{r['prompts']:<4} "
              f"{str(r['first_difference']):>10}")
    for r in rows:
        if "specjax_same_as_plain" in r:
            print(f"{r['mode']}: same as its own plain output: specjax {r['specjax_same_as_plain']}/{r['prompts']}, "
                  f"transformers {r['hf_same_as_plain']}/{r['prompts']}")
        d = r.get("divergence")
        if d:
            print(f"{r['mode']}: first divergence at prompt {d['prompt']}, new token {d['position']}: specjax "
                  f"emitted {d['specjax_token']}, transformers {d['hf_token']}; the target's logits after the "
                  f"common prefix:")
            for engine in ENGINES:
                g = d[engine]
                print(f"  {engine:>7} forward: argmax {g['top1']}, runner-up {g['top2']}, logit gap {g['gap']:.3g}")


def main(argv):
    del argv
    try:
        import torch
        import transformers
    except ImportError as e:
        sys.exit(f"compare_hf needs torch and transformers ({e}): pip install -e .[compare]")
    import jax
    from absl import flags
    from experiments.prompts import humaneval_prompts
    from experiments.tables import write_table
    FLAGS = flags.FLAGS
    # XLA's CPU client uses every core it may run on; torch gets the same count unless told otherwise.
    threads = FLAGS.torch_threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                      else os.cpu_count())
    torch.set_num_threads(threads)
    omp_policy = os.environ.get("OMP_WAIT_POLICY", "unset")
    engines = load_engines(model_dir(FLAGS.target), model_dir(FLAGS.draft))
    prompts = [engines.target.tokenize(t) for t in humaneval_prompts(FLAGS.num_prompts)]
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, torch {torch.__version__}, transformers "
          f"{transformers.__version__}, {threads} torch threads (OMP_WAIT_POLICY={omp_policy}); {len(prompts)} "
          f"HumanEval prompts ({min(map(len, prompts))}-{max(map(len, prompts))} tokens), {FLAGS.max_new_tokens} "
          f"new tokens, k={FLAGS.k}, {FLAGS.rounds} rounds", flush=True)
    t0 = time.perf_counter()
    rows, _ = compare(engines, prompts, FLAGS.k, FLAGS.max_new_tokens, FLAGS.rounds, FLAGS.prompt_lookup_max)
    wall = time.perf_counter() - t0
    print(f"\ngreedy, batch 1, {FLAGS.target} (draft {FLAGS.draft}), float32, CPU, EOS ignored; {wall:.0f} s")
    print_table(rows)
    write_table(rows, FLAGS.out, meta={
        "target": FLAGS.target, "draft": FLAGS.draft, "num_prompts": len(prompts),
        "max_new_tokens": FLAGS.max_new_tokens, "k": FLAGS.k, "rounds": FLAGS.rounds,
        "prompt_lookup_max": FLAGS.prompt_lookup_max, "torch_threads": threads, "omp_wait_policy": omp_policy,
        "jax": jax.__version__, "torch": torch.__version__, "transformers": transformers.__version__, "wall_s": wall})


def _define_flags() -> None:
    """Defined only when run as a program, so tests can import this module beside other experiments."""
    from absl import flags
    flags.DEFINE_integer("num_prompts", 10, "HumanEval prompts (batch 1, one after another)")
    flags.DEFINE_integer("max_new_tokens", 128, "new tokens per prompt (EOS ignored)")
    flags.DEFINE_integer("k", 4, "drafted tokens per step (both speculative modes, both engines)")
    flags.DEFINE_integer("rounds", 2, "timed calls per prompt, engine and mode (the fastest is kept)")
    flags.DEFINE_integer("prompt_lookup_max", 2, "longest n-gram prompt lookup matches (transformers' "
                         "max_matching_ngram_size, default 2; specjax tries it down to 1, as transformers does)")
    flags.DEFINE_integer("torch_threads", 0, "torch's intra-op threads (0 = the cores this process may use, as "
                         "XLA's CPU client does)")
    flags.DEFINE_string("target", "stdlib-target", "target: shipped name or HF Llama directory")
    flags.DEFINE_string("draft", "stdlib-draft", "draft model: shipped name or HF Llama directory")
    flags.DEFINE_string("out", "runs/compare_hf", "path stem of the table (.csv and .json)")


if __name__ == "__main__":
    from absl import app
    _define_flags()
    app.run(main)
