"""The results page (experiments/results_page.py): built from a directory of result tables, in file-name order,
each with its command and provenance; the committed docs/results.md is what docs/results/ generates."""
import json
import os
import subprocess
import sys

from experiments import results_page

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _two_tables(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "02_batches.json").write_text(json.dumps({
        "meta": {"title": "Batches", "command": "python -m experiments.speedup --batch_sizes=1,64",
                 "revision": "0123456789abcdef0123456789abcdef01234567", "dirty": True, "date": "2026-12-02",
                 "notes": "Plain decoding as the batch grows.", "figures": ["docs/figures/batch_scaling.png"],
                 "columns": ["batch", "speedup", "note"]},
        "rows": [{"batch": 1, "tok/s": 1071.4, "speedup": 1.23456, "note": "a|b"},
                 {"batch": 64, "tok/s": 12345.6, "speedup": 0.5}]}))
    # A hand-made one without provenance: the page must say so rather than leave it out.
    (results / "01_drafters.json").write_text(json.dumps({
        "meta": {"title": "Drafters", "command_then": "python -m experiments.old --x=1",
                 "command_now": "python -m experiments.new --x=1"},
        "rows": [{"drafter": "ngram", "tau": 2.58, "per-position acceptance": [0.77, 0.74]}]}))
    return results


def test_page_lists_each_table_with_its_command_and_provenance(tmp_path):
    results = _two_tables(tmp_path)
    out = tmp_path / "docs" / "results.md"
    text = results_page.write_page(str(results), str(out))
    assert out.read_text() == text
    lines = text.splitlines()
    assert lines[0] == "# Measured results"
    assert text.index("## Drafters") < text.index("## Batches")            # file-name order, not write order
    first = text[text.index("## Drafters"):text.index("## Batches")]
    assert ("- command: `python -m experiments.new --x=1` (measured as `python -m experiments.old --x=1`)"
            in first)
    assert "- revision: `unknown`, date: unknown" in first
    assert "| drafter | tau | per-position acceptance |" in first
    assert "| ngram | 2.58 | 0.77 0.74 |" in first
    assert "- data: [`01_drafters.json`](../results/01_drafters.json)" in first
    second = text[text.index("## Batches"):]
    assert "Plain decoding as the batch grows." in second
    assert "- revision: `0123456`" in second and "with uncommitted changes, date: 2026-12-02" in second
    assert "- command: `python -m experiments.speedup --batch_sizes=1,64`" in second and "unknown" not in second
    assert "| batch | speedup | note |" in second and "tok/s" not in second   # meta's columns, in its order
    assert "| 1 | 1.235 | a\\|b |" in second                                  # 4 digits; a "|" escaped
    assert "| 64 | 0.5 |  |" in second                                     # a missing cell is blank
    figure = os.path.relpath(os.path.join(REPO, "docs", "figures", "batch_scaling.png"), out.parent)
    assert f"![batch_scaling]({figure})" in second


def test_check_fails_on_a_stale_page_and_passes_after_a_rebuild(tmp_path):
    results = _two_tables(tmp_path)
    out = tmp_path / "results.md"
    out.write_text("# edited by hand\n")
    cmd = [sys.executable, "-m", "experiments.results_page", f"--results_dir={results}", f"--out={out}"]
    assert subprocess.run(cmd + ["--check"], cwd=REPO, capture_output=True).returncode == 1
    assert subprocess.run(cmd, cwd=REPO, capture_output=True).returncode == 0
    assert subprocess.run(cmd + ["--check"], cwd=REPO, capture_output=True).returncode == 0


def test_committed_page_is_generated_from_the_committed_results():
    results, out = os.path.join(REPO, "docs", "results"), os.path.join(REPO, "docs", "results.md")
    with open(out) as f:
        assert f.read() == results_page.render_page(results_page.load_tables(results), results, out), \
            "docs/results.md is out of date: run python -m experiments.results_page"
    for _, table in results_page.load_tables(results):
        for fig in table["meta"].get("figures", ()):
            assert os.path.isfile(os.path.join(REPO, fig)), fig
