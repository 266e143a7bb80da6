"""The notebooks in notebooks/: each one executes top to bottom with CI-sized parameters (slow: minutes each on a
CPU), and the committed .ipynb files are what notebooks/build_notebooks.py generates (fast).

Execution: nbclient runs every notebook in a child process (tests/_notebook_worker.py), in a kernel on THIS
interpreter (a kernelspec written to a temporary directory whose argv is sys.executable, so the kernel sees the
same venv as the test), with the repository root as its working directory, JAX_PLATFORMS=cpu, and the test's
parameters in a cell injected after the notebook's "parameters" cell (papermill's convention). Each notebook's
execution time is printed.
"""
import ast
import json
import os
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
NOTEBOOK_DIR = os.path.join(REPO, "notebooks")
CELL_TIMEOUT_S = 900


def _load_builder():
    import importlib.util
    spec = importlib.util.spec_from_file_location("build_notebooks", os.path.join(NOTEBOOK_DIR, "build_notebooks.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_notebooks_are_built_from_their_source():
    """Every committed notebook equals what build_notebooks.py writes: outputs cleared, the parameters cell tagged."""
    pytest.importorskip("nbformat")
    builder = _load_builder()
    for name, cells in builder.NOTEBOOKS.items():
        path = os.path.join(NOTEBOOK_DIR, name + ".ipynb")
        with open(path, encoding="utf-8") as f:
            committed = f.read()
        assert committed == builder.render(builder.build(name, cells)), \
            f"{path} is out of date: run python notebooks/build_notebooks.py"
        nb = json.loads(committed)
        code_cells = [c for c in nb["cells"] if c["cell_type"] == "code"]
        assert all(c["outputs"] == [] and c["execution_count"] is None for c in code_cells), path
        assert "parameters" in code_cells[0]["metadata"].get("tags", []), f"{path}: first code cell is not tagged"


# ----------------------------------------------------------------------------------------------------- execution

def _parameter_names(source: str) -> set[str]:
    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign):
            for t in node.targets:
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def _inject(nb, params: dict) -> None:
    """Insert `params` as a cell after the one tagged "parameters"; every name must be one of its parameters."""
    import nbformat
    idx = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    unknown = set(params) - _parameter_names(nb.cells[idx].source)
    assert not unknown, f"not parameters of this notebook: {sorted(unknown)}"
    cell = nbformat.v4.new_code_cell("# Injected by tests/test_notebooks.py\n"
                                     + "\n".join(f"{k} = {v!r}" for k, v in params.items()))
    cell.metadata["tags"] = ["injected-parameters"]
    nb.cells.insert(idx + 1, cell)


def _kernel_dir(tmp_path) -> str:
    """A kernelspec "specjax-test" for an ipykernel on sys.executable (no kernelspec is installed anywhere)."""
    kernels = tmp_path / "kernels"
    (kernels / "specjax-test").mkdir(parents=True)
    (kernels / "specjax-test" / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "specjax test kernel", "language": "python"}))
    return str(kernels)


def _execute(name: str, params: dict, tmp_path, monkeypatch, capsys) -> None:
    """Runs the notebook in a child process (tests/_notebook_worker.py): nbclient's kernel client leaves threads
    and zmq sockets behind in the process that hosts it."""
    nbformat = pytest.importorskip("nbformat")
    pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("PYTHONPATH", REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    nb = nbformat.read(os.path.join(NOTEBOOK_DIR, name + ".ipynb"), as_version=4)
    _inject(nb, params)
    src, dst = tmp_path / f"{name}.ipynb", tmp_path / f"{name}.executed.ipynb"   # dst: for a failure's post-mortem
    nbformat.write(nb, str(src))
    t0 = time.time()
    proc = subprocess.run([sys.executable, os.path.join(HERE, "_notebook_worker.py"), str(src), str(dst),
                           _kernel_dir(tmp_path), REPO, str(CELL_TIMEOUT_S)],
                          capture_output=True, text=True, timeout=4 * CELL_TIMEOUT_S)
    elapsed = time.time() - t0
    with capsys.disabled():
        print(f"\n[notebook] {name}.ipynb: {elapsed:.1f} s")
    assert proc.returncode == 0, f"{name}.ipynb failed (executed copy: {dst}):\n{proc.stderr[-4000:]}"


@pytest.mark.slow
def test_quickstart(tmp_path, monkeypatch, capsys):
    _execute("quickstart", dict(BACKEND="cpu", NUM_PROMPTS=2, MAX_NEW_TOKENS=32, K=4), tmp_path, monkeypatch, capsys)


@pytest.mark.slow
def test_train_drafter(tmp_path, monkeypatch, capsys):
    """The Medusa recipe on 64 self-distilled rows for 16 steps (the self-distillation rows are generated and cached
    under data/selfdistill/ on the first run, as the recipe does from a shell)."""
    _execute("train_drafter", dict(BACKEND="cpu", RECIPE="medusa", NUM_TRAIN=64, STEPS=16, BATCH_SIZE=4,
                                   RUN_DIR=str(tmp_path / "run"), NUM_PROMPTS=2, MAX_NEW_TOKENS=32),
             tmp_path, monkeypatch, capsys)


def _published_eagle3(path) -> str:
    """The shipped EAGLE-3 drafter written in the published EAGLE-3 layout (as yuhuili/EAGLE3-* on the hub:
    config.json with draft_vocab_size, fc/midlayer/norm/lm_head/d2t/t2d; pytorch_model.bin when torch is
    installed), the stand-in for the download."""
    import specjax
    from specjax.drafters import eagle
    target = specjax.load_model("stdlib-target")
    try:
        import torch  # noqa: F401
        torch_bin = True
    except ImportError:
        torch_bin = False
    eagle.export_published(path, eagle.load("stdlib-target-eagle3", target, "eagle3"), dtype="bfloat16",
                           torch_bin=torch_bin)
    return str(path)


@pytest.mark.slow
def test_reproduce_paper_row(tmp_path, monkeypatch, capsys):
    local = {"target": os.path.join(REPO, "checkpoints", "stdlib-target"),
             "drafter": _published_eagle3(tmp_path / "EAGLE3-stdlib-target")}
    _execute("reproduce_paper_row", dict(BACKEND="cpu", LOCAL_CHECKPOINTS=local, NUM_PROMPTS=2, MAX_NEW_TOKENS=32,
                                         NUM_STEPS=4, TOPK=4, NUM_DRAFT_TOKENS=16, PREDICT=False,
                                         OUT=str(tmp_path / "row")),
             tmp_path, monkeypatch, capsys)
    with open(tmp_path / "row.json") as f:
        row = json.load(f)["rows"][0]
    assert row["exact"] and row["method"] == "eagle3" and row["paper_target"] == "LLaMA3.1-8B-Instruct"
