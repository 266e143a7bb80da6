"""The papers' headline numbers beside ours and the analytic model's, per method, in one table: what the literature
reports (experiments/paper_numbers.csv, transcribed with citations), what our drafters measure on the shipped models
(the JSON experiments.speedup writes), and what specjax.analysis predicts from the paper's own alpha or tau.

  bash experiments/drafters_table.sh --out=runs/drafters_table           # ours (about 40 minutes on 2 CPU cores)
  python -m experiments.paper_tables --measured=runs/drafters_table.json

Each paper row is shown with the one measured row of the same method that resembles it most (same temperature
class, chain vs tree, dynamic vs static tree, k, code prompts for a code dataset, Medusa-1 vs -2; ties go to the
row the measurement listed first). The model column:
  - the paper gives alpha and k: walltime_speedup(alpha, k, c), with the paper's c, else --default_c;
  - alpha without k: optimal_k(alpha, c)'s speedup;
  - tau: speedup_from_tau(tau, draft passes x c): k passes where the paper gives k, else --default_depth; Medusa
    one (all heads in one pass); ngram, lookahead and a multi-token target's own heads draft for free;
  - neither: no prediction.
Every prediction assumes a verify pass costing --verify_cost plain steps (1 = Leviathan's memory-bound ideal): the
gap between a paper's speedup and the model is that paper's verify cost and engine overhead.
"""
from __future__ import annotations

import os
import re
import statistics
from typing import Sequence

from absl import app, flags

from specjax import analysis
from experiments.tables import pyplot, read_rows, read_table, save_figure, text_table, write_table

FLAGS = flags.FLAGS
flags.DEFINE_string("paper_csv", os.path.join(os.path.dirname(__file__), "paper_numbers.csv"),
                    "the papers' numbers (CSV; '#' lines are comments)")
flags.DEFINE_string("measured", "runs/drafters_table.json", "our measured rows: the JSON experiments.speedup "
                    "writes under its --out stem")
flags.DEFINE_string("paper_out", "runs/paper_tables/paper_tables", "path stem of the table (.csv, .json) and its plot (.png)")
flags.DEFINE_float("default_c", 0.05, "draft step cost / plain step cost where a paper states none")
flags.DEFINE_integer("default_depth", 6, "draft passes per step where a paper gives neither k nor a tree depth "
                     "(EAGLE's repo uses tree depths 5..7)")
flags.DEFINE_float("verify_cost", 1.0, "cost of a verify pass in plain decode steps, for every model prediction")

METHOD_ORDER = ["draft_model", "ngram", "lookahead", "medusa", "eagle", "eagle3", "mtp", "mtp_heads", "none"]
# Drafting costs no draft-model pass: a lookup in the context (ngram), a Jacobi branch riding in the verify pass
# (lookahead), heads computed in the target's own forward (mtp_heads), or no drafting at all (none).
FREE_DRAFTING = {"ngram", "lookahead", "mtp_heads", "none"}
# These papers' headline numbers all come from token trees, even where the row does not name one.
TREE_METHODS = {"medusa", "eagle", "eagle3"}
PRODUCE_MEASURED = "bash experiments/drafters_table.sh --out=runs/drafters_table"


def number(text: str | None) -> float | None:
    """The leading number of a transcribed cell: '2.8' -> 2.8, '0.85-0.90' -> 0.875 (a range's midpoint),
    '1.00 (158.34 tok/s)' -> 1.0, '' or 'nucleus0.8' -> None."""
    m = re.match(r"\s*(\d+(?:\.\d+)?)(?:\s*-\s*(\d+(?:\.\d+)?))?", text or "")
    if not m:
        return None
    return (float(m[1]) + float(m[2])) / 2 if m[2] else float(m[1])


def paper_k(row: dict) -> int | None:
    text = row["k_or_tree"].strip()
    return int(text) if text.isdigit() else None


def is_tree(row: dict) -> bool:
    return row["k_or_tree"].startswith(("tree", "dyn")) or (not row["k_or_tree"] and row["method"] in TREE_METHODS)


def is_dynamic_tree(row: dict) -> bool:
    """EAGLE-2 onward grow their trees per step."""
    return row["k_or_tree"].startswith("dyn") or bool(re.search(r"eagle-?[23]", row["drafter_or_method"], re.I))


def draft_passes(row: dict, default_depth: int) -> int:
    """Draft steps per cycle the model charges c for."""
    if row["method"] in FREE_DRAFTING:
        return 0
    if row["method"] == "medusa":
        return 1
    return paper_k(row) or default_depth


def predict(row: dict, default_c: float, default_depth: int, verify_cost: float) -> tuple[float | None, str]:
    """(the analytic speedup for a paper row, how it was obtained); see the module docstring."""
    alpha, tau, c, k = number(row["alpha"]), number(row["tau"]), number(row["c"]), paper_k(row)
    c_text = f"c={c:g}" if c is not None else f"c={default_c:g}*"
    c = default_c if c is None else c
    if alpha is not None and k:
        return analysis.walltime_speedup(alpha, k, c, verify_cost), f"alpha,k={k},{c_text}"
    if alpha is not None:
        best_k, speedup = analysis.optimal_k(alpha, c, verify_cost)
        return speedup, f"alpha,best k={best_k},{c_text}"
    if tau is not None:
        passes = draft_passes(row, default_depth)
        return (analysis.speedup_from_tau(tau, passes * c, verify_cost),
                f"tau,{passes}x{c_text}" if passes else "tau,free draft")
    return None, "no alpha/tau"


def load_measured(path: str) -> list[dict]:
    """experiments.speedup's rows, each with `base_method` and `tree` from the run entry it came from (rows are
    written in --runs order; a row's `method` is its label, so the entry is what names the drafter)."""
    data = read_table(path)
    runs = data["meta"].get("runs", [])
    rows = []
    for i, record in enumerate(data["rows"]):
        if i < len(runs):
            parts = runs[i].split(":")
            base, tree = parts[1], (parts[3] if len(parts) > 3 and "=" not in parts[3] else "")
        else:                                           # no entry: the unlabelled name is method[/tree][/...]
            base, _, rest = record["method"].partition("/")
            tree = rest.split("/")[0] if rest.startswith(("dyn", "static", "acc", "medusa63")) else ""
        rows.append({**record, "base_method": base, "tree": tree})
    return rows


def match(row: dict, measured: Sequence[dict]) -> dict | None:
    """The measured row of the paper row's method that resembles it most (see the module docstring)."""
    candidates = [m for m in measured if m["base_method"] == row["method"]]
    if not candidates:
        return None
    temperature = row["temperature"].strip()
    tree, code = is_tree(row), bool(re.search(r"humaneval|code", row["dataset"], re.I))
    medusa2 = "medusa-2" in row["drafter_or_method"].lower()

    def score(m: dict) -> int:
        s = 0
        if temperature:
            s += 4 * ((temperature == "0") == (float(m["temperature"]) == 0))
        s += 2 * (tree == bool(m["tree"]))
        if tree:
            s += is_dynamic_tree(row) == m["tree"].startswith("dyn")
        else:
            s += paper_k(row) == m["k"]
        s += code and m["prompts"].startswith("humaneval")
        if row["method"] == "medusa":
            s += medusa2 == ("medusa2" in m["method"] + m["target"])
        return s

    return max(candidates, key=lambda m: (score(m), -candidates.index(m)))


def main(argv):
    del argv
    papers = read_rows(FLAGS.paper_csv)
    measured = load_measured(FLAGS.measured) if os.path.exists(FLAGS.measured) else None
    if measured is None:
        print(f"{FLAGS.measured} not found: the 'ours' columns stay empty. Produce it with\n  {PRODUCE_MEASURED}")
    rank = {m: i for i, m in enumerate(METHOD_ORDER)}
    papers.sort(key=lambda r: rank.get(r["method"], len(rank)))          # stable: file order within a method
    rows = []
    for p in papers:
        model, basis = predict(p, FLAGS.default_c, FLAGS.default_depth, FLAGS.verify_cost)
        ours = match(p, measured) if measured else None
        rows.append({**p, "model": model, "model_basis": basis,
                     **({f"ours_{k}": ours[k] for k in ("method", "prompts", "temperature", "k", "alpha", "tau",
                                                       "speedup", "predicted")} if ours else {})})

    f2 = lambda v: "" if v is None else f"{v:.2f}"
    g = lambda v: "" if v is None else f"{float(v):g}"
    header = ["method", "paper", "target", "drafter", "dataset", "T", "k/tree", "alpha", "tau", "speedup",
              "hardware", "src", "model", "model basis", "ours", "our set", "our T", "our k", "our alpha",
              "our tau", "our speedup", "our model"]
    print(f"\nPapers vs ours vs the analytic model (verify cost {FLAGS.verify_cost:g}; * = --default_c, the paper "
          f"gives no c; {FLAGS.default_depth} draft passes where neither k nor a depth is given). ours: our "
          f"measured row of the method most like the paper's ({FLAGS.measured if measured else 'not measured'}); "
          f"our model: experiments.speedup's prediction from our measured costs.")
    print(text_table(header, [
        [r["method"], r["paper"], r["target"][:22], r["drafter_or_method"][:16], r["dataset"][:17],
         r["temperature"], r["k_or_tree"], r["alpha"], r["tau"], r["speedup"], r["hardware"], r["src"],
         f2(r["model"]), r["model_basis"], r.get("ours_method", ""), r.get("ours_prompts", ""),
         g(r.get("ours_temperature")), r.get("ours_k", ""), f2(r.get("ours_alpha")), f2(r.get("ours_tau")),
         f2(r.get("ours_speedup")), f2(r.get("ours_predicted"))] for r in rows]))
    print("\nsrc:")
    for src, citation in dict((r["src"], r["citation"]) for r in papers).items():
        print(f"  {src:>6}  {citation}")
    if measured:
        unmatched = sorted({m["base_method"] for m in measured} - {r["method"] for r in papers})
        if unmatched:
            print(f"measured methods with no paper row: {', '.join(unmatched)}")
    if measured:
        print_summary(rows, measured)
    write_table(rows, FLAGS.paper_out, meta={"paper_csv": FLAGS.paper_csv,
                                             "measured": FLAGS.measured if measured else None,
                                             "default_c": FLAGS.default_c, "default_depth": FLAGS.default_depth,
                                             "verify_cost": FLAGS.verify_cost})
    plot(rows, FLAGS.paper_out)


def print_summary(rows: Sequence[dict], measured: Sequence[dict]) -> None:
    """The results page's table beside the papers: one line per measured row (ours: alpha, tau, measured and predicted speedup), beside
    the paper row matched to it that reports the most (tau and speedup; a code dataset first) and the analytic
    model's number for that paper row."""
    print("\n| ours | our alpha | our tau | our speedup | our model | paper (target, dataset) | paper tau | "
          "paper speedup | model | src |")
    print("| " + " | ".join(["---"] * 10) + " |")
    f2 = lambda v: "-" if v is None or v == "" else f"{float(v):.2f}"
    for m in measured:
        papers = [r for r in rows if r.get("ours_method") == m["method"] and r.get("ours_prompts") == m["prompts"]
                  and r.get("ours_temperature") == m["temperature"]]
        best = max(papers, key=lambda r: (number(r["tau"]) is not None, number(r["speedup"]) is not None,
                                          bool(re.search(r"humaneval", r["dataset"], re.I))), default=None)
        drafter = best and best["drafter_or_method"]
        label = best and (f"{best['paper']} ({best['target']}, {best['dataset']})"
                          + (f": {drafter}" if drafter and drafter.lower() not in best["paper"].lower() else ""))
        paper = (label, best["tau"] or "-",
                 best["speedup"] or "-", f2(best["model"]), best["src"]) if best else ("-",) * 5
        print(f"| {m['method']} (k={m['k']}) | {f2(m['alpha'])} | {f2(m['tau'])} | {f2(m['speedup'])}x | "
              f"{f2(m['predicted'])}x | " + " | ".join(paper) + " |")


def plot(rows: Sequence[dict], stem: str) -> str:
    """Grouped bars per method: the median over its paper rows of the paper's speedup and of the model's, and of
    our distinct matched rows' speedups; whiskers span min..max."""
    plt = pyplot()
    methods = [m for m in METHOD_ORDER if any(r["method"] == m for r in rows)]
    series = {"paper": lambda r: number(r["speedup"]), "ours": lambda r: r.get("ours_speedup"),
              "model": lambda r: r["model"]}
    fig, ax = plt.subplots(figsize=(1.1 * len(methods) + 2, 4))
    width = 0.8 / len(series)
    for j, (name, value) in enumerate(series.items()):
        mids, lows, highs = [], [], []
        for m in methods:
            mine = [r for r in rows if r["method"] == m]
            if name == "ours":                                   # each measured row once, however often matched
                mine = list({(r.get("ours_method"), r.get("ours_prompts"), r.get("ours_temperature")): r
                             for r in mine}.values())
            values = [v for v in map(value, mine) if v is not None]
            mid = statistics.median(values) if values else float("nan")      # nan: no bar, not a zero one
            mids.append(mid)
            lows.append(mid - min(values) if values else float("nan"))
            highs.append(max(values) - mid if values else float("nan"))
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(methods))]
        ax.bar(xs, mids, width, yerr=[lows, highs], capsize=2, label=name)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(range(len(methods)), methods, rotation=30)
    ax.set(ylabel="speedup over plain decoding (median, min..max)", title="Papers vs ours vs the analytic model")
    ax.legend()
    return save_figure(fig, stem)


if __name__ == "__main__":
    app.run(main)
