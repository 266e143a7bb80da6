"""Did a change alter the decode loop? Two revisions side by side in one run: their compiled programs, their speed,
and where a loop step goes.

  python -m experiments.compare_revisions --base=HEAD~1                  # the working tree vs a commit
  python -m experiments.compare_revisions --base=ded6b81 --methods=none,draft_model,ngram --rounds=3
  python -m experiments.compare_revisions --mode=parts --base=31b88a8 --batch_sizes=1,8,32,64 --rounds=7

Each side is a worker process (experiments/revision_worker.py, run with that revision's code first on its path: the
base in a temporary git worktree, the working tree as it is) that compiles everything first; then the workers are
timed in alternation, one round each, --rounds rounds, so drift in the machine's speed hits both alike.
  programs  per method (k = 4): the optimized HLO of generate()'s decode loop on the shipped models (instruction
            count, a hash with source metadata stripped, XLA's flop and byte estimates), whether both sides
            compile the same program and emit the same greedy tokens, and tokens/s (generate()'s own stats), the
            median over rounds.
  parts     plain greedy decoding of the shipped target on HumanEval prompts, per batch size, ms per loop step:
            step (one iteration of the compiled loop: (time of N new tokens - time of N/2) / (N/2), same buffer),
            forward (one cached target forward over T = 1 over the loop's caches), attn and write (its attention
            and its cache writes alone), loop = step - forward (what the loop spends outside the forward: token
            writes, stopping, stats, sampling), slots (cache slots per row the attention passes over), tok/s (the
            whole generation, prefill included); each the fastest of its rounds. Without --base: the working
            tree alone.
"""
from __future__ import annotations

import contextlib
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json
import subprocess
import sys
import tempfile

from absl import app, flags

from experiments.prompts import humaneval_prompts
from experiments.tables import text_table, write_table

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "experiments", "revision_worker.py")
# A few short code prompts for the programs mode (cycled to --batch rows).
CODE_PROMPTS = ["def fibonacci(n):\n    ", "import os\n\ndef walk(path):\n", "class Stack:\n    def push(self, x):"]

FLAGS = flags.FLAGS


@contextlib.contextmanager
def revision_checkout(revision: str):
    """A temporary git worktree of `revision` (its tracked files: code and shipped checkpoints); yields its path."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "base")
        subprocess.run(["git", "worktree", "add", "--detach", path, revision], cwd=REPO, check=True,
                       capture_output=True)
        try:
            yield path
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", path], cwd=REPO, capture_output=True)


class Side:
    """One revision's worker process."""

    def __init__(self, code_dir: str, mode: str, settings: dict):
        env = dict(os.environ, PYTHONPATH=code_dir, JAX_PLATFORMS="cpu")
        self.proc = subprocess.Popen([sys.executable, WORKER, mode, json.dumps(settings)], cwd=code_dir, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def read(self, tag: str) -> dict:
        for line in self.proc.stdout:
            if line.startswith(tag + " "):
                return json.loads(line[len(tag) + 1:])
        raise RuntimeError(f"a worker exited (code {self.proc.wait()}) before printing {tag}")

    def round(self) -> dict:
        self.proc.stdin.write("round\n")
        self.proc.stdin.flush()
        return self.read("ROUND")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def measure(code_dirs: dict[str, str], mode: str, settings: dict, rounds: int) -> tuple[dict, dict]:
    """Start every side, wait until each has compiled, then alternate them round by round -> (each side's READY
    report, each side's list of ROUND reports)."""
    sides = {name: Side(d, mode, settings) for name, d in code_dirs.items()}
    try:
        ready = {name: s.read("READY") for name, s in sides.items()}
        timed = {name: [] for name in sides}
        for r in range(rounds):
            for name, s in sides.items():
                timed[name].append(s.round())
            print(f"round {r + 1}/{rounds} done", flush=True)
    finally:
        for s in sides.values():
            s.close()
    return ready, timed


def program_rows(ready: dict, timed: dict, methods: list[str]) -> list[dict]:
    """One row per method and side: the HLO report, tokens/s (median over rounds) and the ratio to the base."""
    median = lambda xs: sorted(xs)[len(xs) // 2]
    names = list(ready)
    rows = []
    for m in methods:
        tok_s = {n: median([t[m] for t in timed[n]]) for n in names}
        for n in names:
            h = ready[n][m]
            rows.append({"method": m, "side": n, **h, "tok_s": tok_s[n], "tok_s_rounds": [t[m] for t in timed[n]],
                         "vs_base": tok_s[n] / tok_s[names[0]],
                         "same_hlo": h["hlo_sha256"] == ready[names[0]][m]["hlo_sha256"],
                         "same_tokens": h["tokens_sha256"] == ready[names[0]][m]["tokens_sha256"]})
    return rows


def part_rows(ready: dict, timed: dict, max_new_tokens: int) -> list[dict]:
    """One row per side and batch size: each measurement the fastest of its rounds, in ms per loop step."""
    rows = []
    for n, info in ready.items():
        for B, shapes in info.items():
            best = {name: min(t[B][name] for t in timed[n]) for name in timed[n][0][B]}
            step = (best["full"] - best["half"]) / (max_new_tokens - max_new_tokens // 2)
            rows.append({"side": n, "batch": int(B), **shapes, "step_ms": step * 1e3,
                         "forward_ms": best["forward"] * 1e3, "attention_ms": best["attention"] * 1e3,
                         "cache_write_ms": best["cache_write"] * 1e3, "loop_ms": (step - best["forward"]) * 1e3,
                         "loop_share": (step - best["forward"]) / step,
                         "tokens_per_s": int(B) * max_new_tokens / best["full"]})
    return rows


def main(argv):
    del argv
    base = FLAGS.base or ("HEAD" if FLAGS.mode == "programs" else None)
    if FLAGS.mode == "programs":
        settings = {"methods": FLAGS.methods, "max_new_tokens": FLAGS.max_new_tokens, "k": 4, "pad_to": 64,
                    "target": FLAGS.target, "draft": FLAGS.draft, "weight_format": FLAGS.weight_format,
                    "drafters": dict(pair.split("=", 1) for pair in FLAGS.drafters),
                    "prompts": [CODE_PROMPTS[i % len(CODE_PROMPTS)] for i in range(FLAGS.batch)]}
    else:
        settings = {"batch_sizes": [int(b) for b in FLAGS.batch_sizes], "max_new_tokens": FLAGS.max_new_tokens,
                    "target": FLAGS.target, "prompts": humaneval_prompts(164)}
    with revision_checkout(base) if base else contextlib.nullcontext() as base_dir:
        code_dirs = {f"base ({base})": base_dir} if base else {}
        code_dirs["working tree"] = REPO
        ready, timed = measure(code_dirs, FLAGS.mode, settings, FLAGS.rounds)
    if FLAGS.mode == "programs":
        rows = program_rows(ready, timed, FLAGS.methods)
        print(f"\nbatch {FLAGS.batch}, {FLAGS.max_new_tokens} new tokens, k = 4, tok/s the median of {FLAGS.rounds} "
              "alternating rounds")
        print(text_table(["method", "side", "HLO instr", "HLO sha256 (no metadata)", "same HLO", "same tokens",
                          "GFLOP", "MB accessed", "tok/s", "vs base"],
                         [[r["method"], r["side"], r["hlo_instructions"], r["hlo_sha256"], r["same_hlo"],
                           r["same_tokens"], f"{r['flops'] / 1e9:.3f}", f"{r['bytes_accessed'] / 1e6:.1f}",
                           f"{r['tok_s']:.1f}", f"{r['vs_base']:.3f}x"] for r in rows]))
    else:
        rows = part_rows(ready, timed, FLAGS.max_new_tokens)
        print(f"\nplain greedy decoding, {FLAGS.target}, float32, CPU, HumanEval prompts, {FLAGS.max_new_tokens} new "
              f"tokens; ms per loop step, the fastest of {FLAGS.rounds} alternating rounds")
        print(text_table(["side", "batch", "slots", "step", "forward", "(attn", "write)", "loop", "loop %", "tok/s"],
                         [[r["side"], r["batch"], f"{r['slots_per_row']:.0f}", f"{r['step_ms']:.2f}",
                           f"{r['forward_ms']:.2f}", f"{r['attention_ms']:.2f}", f"{r['cache_write_ms']:.2f}",
                           f"{r['loop_ms']:.2f}", f"{100 * r['loop_share']:.0f}%", f"{r['tokens_per_s']:.0f}"]
                          for r in rows]))
    write_table(rows, FLAGS.out or f"runs/compare_revisions_{FLAGS.mode}",
                meta={"mode": FLAGS.mode, "base": base, "rounds": FLAGS.rounds, "max_new_tokens": FLAGS.max_new_tokens,
                      "target": FLAGS.target, **({k: v for k, v in settings.items() if k != "prompts"})})


def define_flags() -> None:
    """Defined only when run as a program, so that tests can import this module beside other entry points."""
    flags.DEFINE_enum("mode", "programs", ["programs", "parts"], "what to compare (see the module docstring)")
    flags.DEFINE_string("base", None, "git revision to compare the working tree against (programs: default HEAD; "
                        "parts: none = the working tree alone)")
    flags.DEFINE_list("methods", ["none", "draft_model", "ngram"], "programs: methods to compile and time (k = 4)")
    flags.DEFINE_integer("batch", 1, "programs: prompts per generate() call")
    flags.DEFINE_list("batch_sizes", ["1", "8", "32", "64"], "parts: batch sizes")
    flags.DEFINE_integer("rounds", 5, "alternating timing rounds")
    flags.DEFINE_integer("max_new_tokens", 128, "new tokens per row (parts: N; the step is taken between N/2 and N)")
    flags.DEFINE_string("target", "stdlib-target", "shipped target name or HF directory")
    flags.DEFINE_string("draft", "stdlib-draft", "programs: draft model of draft_model ('' for none)")
    flags.DEFINE_list("drafters", [], "programs: what other methods draft from, method=drafter pairs (a shipped "
                      "name or a directory), e.g. eagle3=stdlib-target-eagle3")
    flags.DEFINE_string("weight_format", "auto", "programs: the target's load_model weight_format (auto, float32, "
                        "panels, gguf, gguf_int8)")
    flags.DEFINE_string("out", None, "path stem of the table (default runs/compare_revisions_<mode>)")


if __name__ == "__main__":
    define_flags()
    app.run(main)
