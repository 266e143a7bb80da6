"""The results pages (experiments/results_page.py): from one directory of result tables, a curated page showing the
newest table of each headline kind in the headlines' order, and an archive of every table in number order, each
with its command and provenance; the committed docs/results.md and docs/results_archive.md are what docs/results/
generates."""
import json
import os
import re
import subprocess
import sys

import pytest

from experiments import results_page
from experiments.results_page import Headline

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

HEADLINES = (
    Headline("batches", "Throughput as the batch grows", "Why batches matter.", "python -m experiments.speedup --b",
             columns=("batch", "speedup", "no such column")),
    Headline("drafters", "Every drafter", "What tau means.", "bash experiments/drafters_table.sh"),
)


def _write(results, stem, meta, rows):
    (results / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}))


def _tables(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    _write(results, "02_batches", {
        "title": "Batches", "kind": "batches", "command": "python -m experiments.speedup --batch_sizes=1,64",
        "revision": "0123456789abcdef0123456789abcdef01234567", "dirty": True, "date": "2026-12-02",
        "notes": "Plain decoding as the batch grows.", "figures": ["docs/figures/batch_scaling.png"],
        "columns": ["batch", "speedup", "note"]},
        [{"batch": 1, "tok/s": 1071.4, "speedup": 1.23456, "note": "a|b"}, {"batch": 64, "tok/s": 12345.6,
                                                                           "speedup": 0.5}])
    # A hand-made one without provenance: the pages must say so rather than leave it out.
    _write(results, "01_drafters", {
        "title": "Drafters", "kind": "drafters", "command_then": "python -m experiments.old --x=1",
        "command_now": "python -m experiments.new --x=1"},
        [{"drafter": "ngram", "tau": 2.58, "per-position acceptance": [0.77, 0.74]}])
    _write(results, "03_drafters_again", {"title": "Drafters, newer", "kind": "drafters", "notes": "Newer rows."},
           [{"drafter": "suffix", "tau": 3.5}])
    _write(results, "10_prefill", {"title": "The prefill in groups"}, [{"groups": 4, "ms": 12.0}])   # no kind
    return results


def _section(text, heading):
    """From a section's heading (its text after the anchor) to the next section."""
    start = text.index("</a>" + heading)
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def test_archive_lists_every_table_in_number_order_with_its_command_and_provenance(tmp_path):
    results = _tables(tmp_path)
    out, archive = tmp_path / "docs" / "results.md", tmp_path / "docs" / "results_archive.md"
    pages = results_page.write_pages(str(results), str(out), str(archive), HEADLINES)
    assert archive.read_text() == pages[str(archive)] and out.read_text() == pages[str(out)]
    text = archive.read_text()
    assert text.splitlines()[0] == "# Measured results: the archive"
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert headings == ['## <a id="table-1"></a>1. Drafters', '## <a id="table-2"></a>2. Batches',
                        '## <a id="table-3"></a>3. Drafters, newer',
                        '## <a id="table-10"></a>10. The prefill in groups']
    first = _section(text, "1. Drafters")
    assert ("- command: `python -m experiments.new --x=1` (measured as `python -m experiments.old --x=1`)"
            in first)
    assert "- revision: `unknown`, date: unknown" in first
    assert "| drafter | tau | per-position acceptance |" in first
    assert "| ngram | 2.58 | 0.77 0.74 |" in first
    assert "- data: [`01_drafters.json`](../results/01_drafters.json)" in first
    assert "current headline" not in first                                   # table 3 is the newer drafters table
    second = _section(text, "2. Batches")
    assert "Plain decoding as the batch grows." in second
    assert "The current headline of its kind: [Throughput as the batch grows](results.md#batches)." in second
    assert "- revision: `0123456`" in second and "with uncommitted changes, date: 2026-12-02" in second
    assert "- command: `python -m experiments.speedup --batch_sizes=1,64`" in second and "unknown" not in second
    assert "| batch | speedup | note |" in second and "tok/s" not in second   # meta's columns, in its order
    assert "| 1 | 1.235 | a\\|b |" in second                                  # 4 digits; a "|" escaped
    assert "| 64 | 0.5 |  |" in second                                     # a missing cell is blank
    figure = os.path.relpath(os.path.join(REPO, "docs", "figures", "batch_scaling.png"), out.parent)
    assert f"![batch_scaling]({figure})" in second
    assert "| 4 | 12 |" in _section(text, "10. The prefill in groups")        # no kind: still in the archive


def test_page_shows_the_newest_table_of_each_headline_kind_in_the_headlines_order(tmp_path):
    results = _tables(tmp_path)
    out, archive = tmp_path / "docs" / "results.md", tmp_path / "docs" / "results_archive.md"
    text = results_page.write_pages(str(results), str(out), str(archive), HEADLINES)[str(out)]
    assert text.splitlines()[0] == "# Measured results"
    assert "[the archive](results_archive.md)" in text
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert headings == ['## <a id="batches"></a>Throughput as the batch grows',       # HEADLINES' order,
                        '## <a id="drafters"></a>Every drafter']                     # not the files'
    assert "- [Throughput as the batch grows](#batches)" in text and "- [Every drafter](#drafters)" in text
    batches = _section(text, "Throughput as the batch grows")
    assert "Why batches matter." in batches
    assert "Measure it again: `python -m experiments.speedup --b`" in batches
    assert "[Table 2](results_archive.md#table-2): Batches" in batches
    assert "| batch | speedup |" in batches and "note" not in batches.split("Notes on this")[0].split("| batch")[1]
    assert "| 1 | 1.235 |" in batches                                      # the headline's narrower view
    assert "<details><summary>Notes on this measurement</summary>" in batches
    assert "Plain decoding as the batch grows." in batches
    assert "Earlier tables" not in batches
    drafters = _section(text, "Every drafter")
    assert "[Table 3](results_archive.md#table-3): Drafters, newer" in drafters   # the newest of its kind
    assert "| suffix | 3.5 |" in drafters and "ngram" not in drafters
    assert "Earlier tables of this kind, in the archive: [1](results_archive.md#table-1)." in drafters
    assert "prefill" not in text.lower().split("generated by")[1]                 # no kind: archive only


def test_numbers_order_the_tables_past_99(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    for stem in ("100_newest", "99_older", "9_oldest", "notes_without_number"):
        _write(results, stem, {"title": stem, "kind": "drafters"}, [{"x": 1}])
    assert [stem for stem, _ in results_page.load_tables(str(results))] == [
        "9_oldest", "99_older", "100_newest", "notes_without_number"]
    tables = [t for t in results_page.load_tables(str(results)) if t[0] != "notes_without_number"]
    (headline, (stem, _), older), = results_page.select_headlines(tables, HEADLINES[1:])
    assert stem == "100_newest" and older == ["9_oldest", "99_older"]


def test_a_kind_no_headline_names_and_a_headline_without_tables_are_errors(tmp_path):
    results = _tables(tmp_path)
    tables = results_page.load_tables(str(results))
    with pytest.raises(ValueError, match="no headline's"):
        results_page.select_headlines(tables, HEADLINES[:1])                      # "drafters" is nobody's
    with pytest.raises(ValueError, match="no result table has the kind"):
        results_page.select_headlines(tables, HEADLINES + (Headline("gpu", "GPU", "", "x"),))


def test_check_fails_on_either_stale_page_and_passes_after_a_rebuild(tmp_path):
    # The command line runs the real HEADLINES: one small table per headline kind.
    results = tmp_path / "results"
    results.mkdir()
    for i, headline in enumerate(results_page.HEADLINES, 1):
        _write(results, f"{i:02d}_{headline.kind}", {"title": headline.heading, "kind": headline.kind},
               [{"x": i}])
    out, archive = tmp_path / "results.md", tmp_path / "results_archive.md"
    cmd = [sys.executable, "-m", "experiments.results_page", f"--results_dir={results}", f"--out={out}",
           f"--archive_out={archive}"]
    run = lambda *extra: subprocess.run(cmd + list(extra), cwd=REPO, capture_output=True, text=True)
    assert run("--check").returncode == 1                                       # neither page exists
    assert run().returncode == 0
    assert run("--check").returncode == 0
    archive.write_text(archive.read_text() + "edited by hand\n")
    stale = run("--check")
    assert stale.returncode == 1 and "results_archive.md is out of date" in stale.stderr
    assert run().returncode == 0 and run("--check").returncode == 0
    out.write_text("# edited by hand\n")
    assert run("--check").returncode == 1


def test_committed_pages_are_generated_from_the_committed_results():
    results = os.path.join(REPO, "docs", "results")
    out, archive = os.path.join(REPO, "docs", "results.md"), os.path.join(REPO, "docs", "results_archive.md")
    assert not results_page.stale_pages(results, out, archive), \
        "docs/results.md or docs/results_archive.md is out of date: run python -m experiments.results_page"
    tables = results_page.load_tables(results)
    for _, table in tables:
        for fig in table["meta"].get("figures", ()):
            assert os.path.isfile(os.path.join(REPO, fig)), fig
    with open(out) as f:
        page = f.read()
    assert len(page.splitlines()) < 600, "the results page is the headlines only: move a table to the archive"
    assert page.count("\n## ") <= 15


def test_titles_say_what_a_table_shows_not_what_work_produced_it():
    titles = [table["meta"].get("title", stem) for stem, table in
              results_page.load_tables(os.path.join(REPO, "docs", "results"))]
    titles += [h.heading for h in results_page.HEADLINES]
    offenders = [t for t in titles if re.search(r"\b(issues?|sessions?)\b|\ban earlier run\b|\brerun\b", t, re.I)]
    assert not offenders, offenders
