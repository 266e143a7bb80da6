"""How every experiment writes what it measured: its rows as CSV and JSON under one path stem (by default
runs/<experiment>/<table>), its plots as PNG beside them, and a line saying where (one convention, so a results
page and the notebooks find any experiment's output, and can cite the command, revision and date behind it)."""
from __future__ import annotations

import csv
import datetime
import json
import os
import shlex
import subprocess
import sys
from typing import Any, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_table(rows: Sequence[dict], stem: str, meta: dict | None = None) -> list[str]:
    """rows (dicts; the union of their keys, in first-seen order, are the CSV columns) -> stem.csv and stem.json
    ({"meta": provenance() and meta, "rows": rows}); returns the paths written and prints them."""
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    columns: list[str] = []
    for r in rows:
        columns += [c for c in r if c not in columns]
    with open(stem + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, columns)
        w.writeheader()
        for r in rows:
            w.writerow({c: _cell(r.get(c)) for c in columns})
    with open(stem + ".json", "w") as f:
        json.dump({"meta": {**provenance(), **(meta or {})}, "rows": list(rows)}, f, indent=1, default=_plain)
    paths = [stem + ".csv", stem + ".json"]
    print("wrote " + ", ".join(paths), flush=True)
    return paths


def provenance() -> dict:
    """Where a table came from: the command line that ran (as `python -m <module> ...` for an experiment run as a
    module), the git revision of this checkout (None outside one; `dirty`: tracked files differed from it) and
    the date (UTC, ISO 8601)."""
    main = sys.modules.get("__main__")
    module = getattr(getattr(main, "__spec__", None), "name", None)
    argv = (["python", "-m", module] if module else ["python", sys.argv[0]]) + sys.argv[1:]
    git = lambda *args: subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True, timeout=30)
    try:
        head = git("rev-parse", "HEAD")
        revision = head.stdout.strip() if head.returncode == 0 else None
        dirty = bool(git("status", "--porcelain", "--untracked-files=no").stdout.strip()) if revision else None
    except (OSError, subprocess.SubprocessError):           # no git on this machine
        revision = dirty = None
    return {"command": " ".join(map(shlex.quote, argv)), "revision": revision, "dirty": dirty,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def read_table(stem: str) -> dict:
    """What write_table wrote under stem: {"meta": ..., "rows": [...]} (stem may end in .json)."""
    with open(stem if stem.endswith(".json") else stem + ".json") as f:
        return json.load(f)


def read_rows(path: str) -> list[dict]:
    """The rows of a CSV the repository keeps as data (the papers' numbers): '#' comment lines (citations) and
    blank lines skipped, each row a dict of strings keyed by the header."""
    with open(path, newline="") as f:
        return list(csv.DictReader(line for line in f if line.strip() and not line.lstrip().startswith("#")))


def text_table(header: Sequence[str], rows: Sequence[Sequence]) -> str:
    """Right-aligned columns, a dashed rule under the header; cells are printed with str()."""
    cells = [[str(h) for h in header]] + [[str(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def save_figure(fig: Any, stem: str) -> str:
    """A matplotlib figure -> stem.png (closed after writing); returns and prints the path."""
    import matplotlib.pyplot as plt
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    fig.tight_layout()
    fig.savefig(stem + ".png", dpi=120)
    plt.close(fig)
    print(f"wrote {stem}.png", flush=True)
    return stem + ".png"


def pyplot():
    """matplotlib.pyplot with a file-only backend (experiments run headless, in CI and over ssh)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _cell(v: Any) -> Any:
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, (list, tuple, dict)):
        return json.dumps(v, default=_plain)
    return "" if v is None else v


def _plain(v: Any) -> Any:
    """numpy scalars and arrays -> Python numbers and lists (json.dump's default=)."""
    return v.tolist() if hasattr(v, "tolist") else str(v)
