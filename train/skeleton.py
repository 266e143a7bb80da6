"""The one training skeleton every recipe runs: flags -> run record -> init -> resume -> train -> final eval ->
export + MANIFEST.md.

A recipe is a short module: its own absl flags, a NOTES template and a build function, then `main(RECIPE)`:

    flags.DEFINE_integer("num_heads", 4, "Medusa heads")
    def build(run: Run) -> Parts:                  # run: parsed flags, corpus, frozen target, mesh
        H, V = run.target.config.hidden_size, run.target.config.vocab_size
        params = {"w": 0.02 * jax.random.normal(jax.random.PRNGKey(run.flags.seed), (run.flags.num_heads, H, V))}
        def export(params, out_dir, record):       # write the artifact; -> (MANIFEST fields, prose)
            ...
        return Parts(params, medusa_loss_fn(...), evaluate=..., export=export)
    RECIPE = Recipe("medusa", build, defaults=dict(steps=2000, lr=1e-3), run_flags=("num_heads",),
                    frozen_target="checkpoints/stdlib-target")
    if __name__ == "__main__":
        main(RECIPE)

The skeleton owns the shared flags (schedule, data, checkpoints, budget, export, --mesh), the run record
(ckpt_dir/run_info.json keeps the first launch's command and run-defining flags; a rerun resumes with the same data
order; --export_only restores those flags and the newest checkpoint), the frozen target (loaded from --target
onto the mesh), the corpus and default batches, train.loop, the final held-out eval and MANIFEST.md (prose, then
one ```json block that train.data.read_manifest_md parses). Numbers measured once (candidate sizes at selection
time, run history) are not source: pass them with --note and they land in run_info.json and the MANIFEST.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import shlex
import sys
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from jax.sharding import Mesh

from specjax.cache import KVCache
from specjax.models import load_model
from specjax.models.model import model_directory
from specjax.models.config import ModelConfig
from specjax.models.hf_io import save_pretrained
from specjax.models.llama import forward
from specjax.sharding import make_mesh
from train import data, features, loop, self_distill
from train.losses.lm import next_token_nll

# name: (absl definer, generic default, help). A recipe overrides defaults with Recipe.defaults.
_SHARED_FLAGS: dict[str, tuple[Callable, Any, str]] = {
    "seq_len": (flags.DEFINE_integer, 256, "training sequence length"),
    "batch_size": (flags.DEFINE_integer, 16, "sequences per step"),
    "steps": (flags.DEFINE_integer, 1000, "optimizer steps (the cosine schedule spans these)"),
    "lr": (flags.DEFINE_float, 1e-3, "peak learning rate"),
    "warmup": (flags.DEFINE_integer, 50, "warmup steps"),
    "weight_decay": (flags.DEFINE_float, 0.1, "AdamW weight decay"),
    "seed": (flags.DEFINE_integer, 0, "init, data order and per-step PRNG keys"),
    "time_budget": (flags.DEFINE_float, None, "stop cleanly (and checkpoint) after this many seconds"),
    "stop_at": (flags.DEFINE_integer, None, "stop at this step (for tests; the schedule still spans --steps)"),
    "max_files": (flags.DEFINE_integer, None, "use an evenly spaced subset of the stdlib files (tests)"),
    "data_dir": (flags.DEFINE_string, data.DEFAULT_DATA_DIR, "token cache directory (gitignored)"),
    "dataset": (flags.DEFINE_string, None, "train on this .npy token array (a 1-D stream, or [N, seq_len + 1] rows "
                                           "such as cached self-distillation samples) instead of the stdlib corpus"),
    "ckpt_dir": (flags.DEFINE_string, None, "orbax training checkpoints (resumed from)"),
    "save_every": (flags.DEFINE_integer, 50, "checkpoint interval (steps)"),
    "log_every": (flags.DEFINE_integer, 10, "log interval (steps)"),
    "eval_every": (flags.DEFINE_integer, 200, "held-out eval interval (steps, on --eval_tokens tokens)"),
    "eval_tokens": (flags.DEFINE_integer, 16384, "held-out tokens for periodic evals (the final eval uses all)"),
    "final_eval_tokens": (flags.DEFINE_integer, None, "held-out tokens for the export eval (None: all)"),
    "out": (flags.DEFINE_string, "", "export directory ('' to skip export)"),
    "export_only": (flags.DEFINE_bool, False, "skip training; export the newest checkpoint in --ckpt_dir"),
    "mesh": (flags.DEFINE_string, None, "DATAxMODEL, e.g. 2x4: train on a (data, model) mesh of that many devices "
                                        "(frozen target and Llama params split over model, batch over data)"),
    "profile_steps": (flags.DEFINE_integer, 0, "measure where a training step's time goes on this many of the run's "
                                              "batches (train.loop.profile_steps: forward, backward, optimizer, "
                                              "XLA's FLOP counts) and exit without training"),
    "compute_dtype": (lambda name, default, help_: flags.DEFINE_enum(name, default, ["float32", "bfloat16"], help_),
                      "float32", "the loss's arithmetic: bfloat16 runs "
                      "it on bfloat16 copies of the params and the frozen target (float32 master weights, optimizer "
                      "state and checkpoints; the held-out evals in float32)"),
    "note": (flags.DEFINE_string, None, "run history or measurements worth keeping (restarts, changed flags, "
                                        "selection-time numbers): stored in run_info.json, written to the MANIFEST"),
}
# Flags that define the training run: recorded in run_info.json, and restored from it by --export_only so the
# MANIFEST describes the run that produced the weights, not the export command line.
SHARED_RUN_FLAGS = ("seq_len", "batch_size", "steps", "lr", "warmup", "weight_decay", "seed", "max_files", "dataset",
                    "compute_dtype")
LLAMA_FLAGS = ("hidden", "layers", "heads", "kv_heads", "intermediate")


@dataclasses.dataclass
class Run:
    """What a recipe's build function gets."""
    flags: Any                            # parsed absl FlagValues (shared + the recipe's own)
    make_corpus: Callable[[], data.Corpus]
    target: Any                           # the frozen target (specjax.Model, on the mesh), or None
    mesh: Mesh | None
    log: Callable[[str], None]
    _corpus: data.Corpus | None = None
    first_label: int = 0                  # where the labels of rows of one layout start (distilled_rows sets it)

    @property
    def corpus(self) -> data.Corpus:
        """The stdlib corpus (tokenizer, train and held-out token streams), prepared on first use: a recipe that
        trains on other data (chat rows: Parts.corpus False) never tokenizes it."""
        if self._corpus is None:
            self._corpus = self.make_corpus()
        return self._corpus


@dataclasses.dataclass
class Parts:
    """What a recipe's build function returns."""
    params: Any                                        # initial trainable params (any pytree)
    loss_fn: loop.LossFn                               # (params, batch, rng[, target params]) -> (loss, metrics)
    evaluate: Callable[[Any, int | None], dict]        # (params, max held-out tokens or None) -> metrics
    export: Callable[[Any, str, dict], tuple[dict, str]]   # (params, out dir, record) -> (MANIFEST fields, prose)
    batches: Any = None                                # .batch(step), .epochs(steps); None: default_batches(run)
    spec_fn: loop.SpecFn = loop.default_specs          # trainable params -> PartitionSpecs under --mesh
    lr_scales: Any = None                              # learning-rate multipliers per subtree (loop.TrainConfig)
    summary: str = ""                                  # logged once at start (size, ...)
    corpus: bool = True                                # the run's data come from the stdlib corpus (its identity
                                                       # goes into the MANIFEST); False: the recipe's own data


@dataclasses.dataclass(frozen=True)
class Recipe:
    name: str                                          # log prefix; default ckpt_dir runs/<name>_ckpt
    build: Callable[[Run], Parts]
    defaults: dict = dataclasses.field(default_factory=dict)      # shared flag name -> this recipe's default
    run_flags: Sequence[str] = ()                      # the recipe's own run-defining flags
    frozen_target: str | None = None   # default --target (an HF checkpoint dir); None: no target, and the
                                       # tokenizer is trained on the corpus with --vocab_size
    curve_metrics: Sequence[str] = ()  # periodic-eval scalars the MANIFEST's training curve shows (first: present
                                       # in every eval)
    feature_cache: bool = False        # the recipe's loss reads the frozen target's features: it gets the
                                       # --feature_cache flag (feature_batches)
    length_pool: bool = False          # the recipe trains on self-distilled rows (self_distill.recipe_data): it
                                       # gets the --length_pool flag (chat rows batched by length)
    init_drafter: str | None = None    # the recipe can continue a saved drafter: it gets the --init_drafter flag,
                                       # and this is what its help adds for the recipe ("" for nothing)

    def all_run_flags(self) -> tuple[str, ...]:
        return (*SHARED_RUN_FLAGS, *(("target",) if self.frozen_target else ("vocab_size", "tokenizer")),
                *(("feature_cache",) if self.feature_cache else ()), *(("length_pool",) if self.length_pool else ()),
                *(("init_drafter",) if self.init_drafter is not None else ()), *self.run_flags)


def define_llama_flags(*, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int) -> None:
    """The architecture flags of a recipe that trains a Llama (LLAMA_FLAGS); read by llama_config."""
    flags.DEFINE_integer("hidden", hidden, "hidden size")
    flags.DEFINE_integer("layers", layers, "decoder layers")
    flags.DEFINE_integer("heads", heads, "query heads")
    flags.DEFINE_integer("kv_heads", kv_heads, "key/value heads (GQA)")
    flags.DEFINE_integer("intermediate", intermediate, "MLP size")


def argv_flag(argv: Sequence[str], name: str, default: str | None = None) -> str | None:
    """The value of --name on a command line before absl parses it (a module whose flags pick its Recipe: its
    defaults differ), or default."""
    for i, a in enumerate(argv):
        if a.startswith(f"--{name}="):
            return a.split("=", 1)[1]
        if a == f"--{name}" and i + 1 < len(argv):
            return argv[i + 1]
    return default


def main(recipe: Recipe) -> None:
    """Define the shared flags with the recipe's defaults, parse the command line, run."""
    unknown = set(recipe.defaults) - set(_SHARED_FLAGS) - {"vocab_size", "tokenizer"}
    if unknown:
        raise ValueError(f"Recipe.defaults names flags the skeleton does not define: {sorted(unknown)}")
    for name, (define, default, help_) in _SHARED_FLAGS.items():
        default = recipe.defaults.get(name, default)
        if name == "ckpt_dir" and default is None:
            default = f"runs/{recipe.name}_ckpt"
        define(name, default, help_)
    if recipe.frozen_target:
        flags.DEFINE_string("target", recipe.frozen_target, "frozen target checkpoint directory (HF format)")
    if recipe.feature_cache:
        flags.DEFINE_bool("feature_cache", False, "compute the frozen target's features over the training rows once "
                          f"(train.features, under {features.DEFAULT_DIR}/; decoder-layer outputs in bfloat16) instead "
                          "of running the target in every step")
    if recipe.length_pool:
        flags.DEFINE_integer("length_pool", 0, "chat rows: batch rows of similar length, sorting each run of this "
                             "many batches of the shuffled rows by length (a batch is cut to its longest row); 0: "
                             "random batches")
        flags.DEFINE_integer("width_bucket", data.WIDTH_BUCKET, "chat rows: a batch is cut to a multiple of this many "
                             "columns; wider buckets compile fewer step programs (one at the rows' width or more: "
                             "an accelerator's compile time against padded positions)")
        flags.DEFINE_string("chat_rows", None, "with --data=chat: train on the rows `python -m train.self_distill --chat` "
                            "made in this directory (its chat-<key> folder, made with any settings) as they are, "
                            "instead of the default settings' rows under data/selfdistill")
    if recipe.init_drafter is not None:
        flags.DEFINE_string("init_drafter", None, "continue from this saved drafter: its config must be what the "
                            "flags ask for; it keeps its draft vocabulary; the optimizer and the schedule start "
                            "afresh" + (f" ({recipe.init_drafter})" if recipe.init_drafter else ""))
    if not recipe.feature_cache:
        flags.DEFINE_integer("vocab_size", recipe.defaults.get("vocab_size", 4096), "BPE vocab size")
        flags.DEFINE_string("tokenizer", recipe.defaults.get("tokenizer"), "reuse this tokenizer.json (e.g. a "
                            "shipped model's, so that models share token ids) instead of training one")
    app.run(lambda argv: run(recipe))


def run(recipe: Recipe) -> None:
    F = flags.FLAGS
    log = lambda msg: print(f"[{recipe.name}] {msg}", flush=True)
    if F.export_only:
        restore_run_flags(F, os.path.join(F.ckpt_dir, "run_info.json"))
    mesh = parse_mesh(F.mesh, F.batch_size)
    ctx = _setup(recipe, F, mesh, log)
    parts = recipe.build(ctx)
    batches = default_batches(ctx) if parts.batches is None else parts.batches
    corpus = ctx.corpus if parts.corpus else None
    log(parts.summary + (f"; corpus {corpus.meta['train_tokens']:,} train / {corpus.meta['heldout_tokens']:,} "
                         "held-out tokens" if corpus else "") + (f"; mesh {F.mesh}" if mesh else ""))
    params = loop.place(parts.params, mesh, parts.spec_fn) if mesh else parts.params
    params, step, info = run_info(F.ckpt_dir, params, {n: F[n].value for n in recipe.all_run_flags()},
                                  F.export_only, F.note)
    tcfg = dataclasses.replace(train_config(F, mesh), lr_scales=parts.lr_scales)
    frozen = ctx.target.params if ctx.target is not None else None
    if F.profile_steps:
        prof = loop.profile_steps(params, parts.loss_fn, batches.batch, tcfg, frozen, F.profile_steps,
                                  functools.partial(data.batch_tokens, first_label=ctx.first_label))
        log("training step profile: " + json.dumps(prof, indent=1))
        return
    if not F.export_only:
        res = loop.train(params, parts.loss_fn, batches.batch, tcfg, frozen=frozen, spec_fn=parts.spec_fn,
                         eval_fn=lambda p, s: _real_scalars(parts.evaluate(p, F.eval_tokens)),
                         eval_every=F.eval_every,
                         tokens_of=functools.partial(data.batch_tokens, first_label=ctx.first_label))
        params, step = res.params, res.step
        info.update(elapsed_s=res.elapsed_s, stopped_by_budget=res.stopped_by_budget, mesh=F.mesh)
        save_run_info(F.ckpt_dir, info)
    if not F.out:
        return
    t0 = time.time()
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        ev = parts.evaluate(params, F.final_eval_tokens)
    log(f"final held-out: {ev} ({time.time() - t0:.0f}s)")
    record = {**run_record(F, info, step, batches, recipe), **ev}
    if recipe.curve_metrics:
        record["training_curve"] = training_curve(F.ckpt_dir, batches, recipe.curve_metrics)
    fields, notes = parts.export(params, F.out, record)
    training = training_paragraph(record, tcfg)
    if recipe.curve_metrics:
        training += "\n\n" + curve_paragraph(record["training_curve"], recipe.curve_metrics)
    write_manifest(F.out, os.path.basename(os.path.normpath(F.out)), notes, {**record, **fields}, corpus,
                   training)
    log(f"exported to {F.out}")


def _real_scalars(metrics: dict) -> dict:
    # Periodic evals log the real-valued scalars (accuracies, losses); counts such as heldout_tokens and
    # per-position vectors go only into the export record.
    return {k: float(v) for k, v in metrics.items()
            if np.ndim(v) == 0 and np.issubdtype(np.asarray(v).dtype, np.floating)}


# ---------------------------------------------------------------------------------------------------- setup

def parse_mesh(spec: str | None, batch_size: int) -> Mesh | None:
    """'2x4' -> specjax.sharding.make_mesh(data=2, model=4); None -> None."""
    if not spec:
        return None
    try:
        d, m = (int(x) for x in spec.lower().split("x"))
    except ValueError:
        raise ValueError(f"--mesh={spec!r}: expected DATAxMODEL, e.g. 2x4") from None
    if batch_size % d:
        raise ValueError(f"--mesh={spec}: the data axis ({d}) must divide --batch_size={batch_size}")
    return make_mesh(d, m)


def _setup(recipe: Recipe, F, mesh: Mesh | None, log) -> Run:
    if not recipe.frozen_target:
        return Run(F, lambda: data.prepare_corpus(F.data_dir, F.vocab_size, F.max_files,
                                                  tokenizer_path=F.tokenizer or None), None, mesh, log)
    # each tensor read straight into its shard under a mesh; row-major under mixed precision, which casts it
    target = load_model(F.target, mesh=mesh, weight_format="auto" if F.compute_dtype == "float32" else "float32")
    target_dir = model_directory(F.target)             # a name (or GGUF file) -> the HF directory it loads from

    def make_corpus():
        try:
            data.check_checkpoint_corpus(target_dir, strict=False)
        except (FileNotFoundError, ValueError) as e:
            log(f"cannot check the target's corpus manifest: {e}")
        return data.prepare_corpus(F.data_dir, target.config.vocab_size, F.max_files,
                                   tokenizer_path=os.path.join(target_dir, "tokenizer.json"))
    return Run(F, make_corpus, target, mesh, log)


def distilled_rows(run: Run) -> tuple[dict, self_distill.RecipeRows, data.RowBatches]:
    """The drafter recipes' shared opening: the self-distilled rows their flags ask for (--target, --data,
    --num_train, --batch_size, --seed, --length_pool), through train.self_distill.recipe_data -> (the build result,
    its RecipeRows, data.RowBatches over the training rows). Rows of one layout (no spans of their own) train from
    their RecipeRows.prompt_len on: the run's label counts start there."""
    F = run.flags
    ds, rr, batches = self_distill.recipe_data(F.target, F.data, F.num_train, F.batch_size, F.seed, run.log,
                                               length_pool=F.length_pool, chat_rows=F.chat_rows,
                                               width_bucket=F.width_bucket)
    run.first_label = rr.prompt_len
    return ds, rr, batches


def feature_batches(run: Run, batches: data.RowBatches, layers: Sequence[int] = ()):
    """A feature recipe's row batches, with the target's features (final hidden state, argmax, decoder `layers`)
    attached from the feature cache under --feature_cache (train.features.cached_batches), else as they are."""
    if not run.flags.feature_cache:
        return batches
    return features.cached_batches(run.target, batches, layers, log=run.log)


def default_batches(run: Run):
    """--dataset when given (train.data.token_array_batches), else packed windows of the corpus' train split."""
    F = run.flags
    if F.dataset:
        return data.token_array_batches(F.dataset, F.seq_len, F.batch_size, F.seed)
    return data.PackedBatches(run.corpus.train, F.seq_len, F.batch_size, F.seed)


def train_config(F, mesh: Mesh | None) -> loop.TrainConfig:
    return loop.TrainConfig(
        steps=F.steps, lr=F.lr, warmup_steps=F.warmup, weight_decay=F.weight_decay, seed=F.seed,
        ckpt_dir=F.ckpt_dir, save_every=F.save_every, log_every=F.log_every,
        metrics_path=os.path.join(F.ckpt_dir, "metrics.jsonl"), time_budget_s=F.time_budget,
        tokens_per_step=F.batch_size * F.seq_len, stop_at=F.stop_at, mesh=mesh,
        compute_dtype=None if F.compute_dtype == "float32" else F.compute_dtype)


# ----------------------------------------------------------------------------------------------- run record

def command_line() -> str:
    """The command that started this process, as it would be typed from the repo root."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    prog = f"python -m {spec.name}" if spec else f"python {sys.argv[0]}"
    return " ".join([prog] + [shlex.quote(a) for a in sys.argv[1:]])


def run_info(ckpt_dir: str, params: Any, run_flags: dict, export_only: bool,
             note: str | None = None) -> tuple[Any, int | None, dict]:
    """-> (params, step, info). A run records its first launch's command and flags in ckpt_dir/run_info.json (a
    resume keeps them, so the MANIFEST names the command that produced the weights); --export_only restores the
    newest checkpoint's params and wall time instead of training. A note replaces the recorded one."""
    os.makedirs(ckpt_dir, exist_ok=True)
    info_path = os.path.join(ckpt_dir, "run_info.json")
    if export_only or os.path.exists(info_path):
        with open(info_path) as f:
            info = json.load(f)
    else:
        info = {"command": command_line(), "steps": run_flags["steps"], "seed": run_flags["seed"],
                "flags": run_flags}
    if note:
        info["note"] = note
    if not export_only or note:
        save_run_info(ckpt_dir, info)
    if not export_only:
        return params, None, info
    params, step, meta = loop.latest_params(ckpt_dir, params)
    return params, step, dict(info, elapsed_s=meta["elapsed_s"])


def save_run_info(ckpt_dir: str, info: dict) -> None:
    with open(os.path.join(ckpt_dir, "run_info.json"), "w") as f:
        json.dump(info, f)


def restore_run_flags(flag_values, info_path: str) -> None:
    """--export_only: take the training run's hyperparameters from its run_info.json (when recorded)."""
    with open(info_path) as f:
        recorded = json.load(f).get("flags", {})
    for name, value in recorded.items():
        if flag_values[name].value != value:
            print(f"[export] using the run's --{name}={value} (command line had {flag_values[name].value})",
                  flush=True)
            flag_values[name].value = value


def run_record(F, info: dict, step: int, batches, recipe: Recipe) -> dict:
    """The MANIFEST fields every recipe records: commands, seed, schedule, data seen, wall time, run note."""
    rec = {"command": info["command"], "export_command": command_line(), "seed": F.seed}
    if recipe.frozen_target:
        rec["target"] = F.target
    rows = getattr(batches, "rows", None)          # whole-row batches (self-distillation rows): rows, not windows
    rec.update({"steps": step, "planned_steps": info["steps"], "batch_size": F.batch_size,
                "seq_len": None if rows is not None else F.seq_len,
                "tokens_seen": None if rows is not None else step * F.batch_size * F.seq_len,
                "training_rows": None if rows is None else len(rows), "epochs": round(batches.epochs(step), 4),
                "train_wall_s": round(info.get("elapsed_s", float("nan")), 1), "lr": F.lr, "warmup": F.warmup,
                "weight_decay": F.weight_decay, "stopped_by_budget": info.get("stopped_by_budget")})
    if info.get("mesh"):
        rec["train_mesh"] = info["mesh"]
    if F.dataset:
        rec["dataset"] = {"path": F.dataset, "sha256": data.file_sha256(F.dataset),
                          "shape": list(np.load(F.dataset, mmap_mode="r").shape)}
    if info.get("note"):                               # run history worth knowing (restarts, changed flags)
        rec["run_note"] = info["note"]
    return rec


def training_curve(ckpt_dir: str, batches, metrics: Sequence[str]) -> list[dict]:
    """One row per periodic eval of the run in ckpt_dir (its metrics.jsonl, resumes included; a resumed step's
    later record wins): step, epoch, the mean training loss logged since the previous eval, and `metrics`."""
    path = os.path.join(ckpt_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    by_step = {}
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            by_step[rec["step"]] = {**by_step.get(rec["step"], {}), **rec}
    curve, losses = [], []
    for step in sorted(by_step):
        rec = by_step[step]
        if "loss" in rec:
            losses.append(rec["loss"])
        if metrics[0] in rec:
            curve.append({"step": step, "epoch": round(batches.epochs(step), 3),
                          "train_loss": round(float(np.mean(losses)), 4) if losses else None,
                          **{m: round(rec[m], 4) for m in metrics if m in rec}})
            losses = []
    return curve


def curve_paragraph(curve: list[dict], metrics: Sequence[str]) -> str:
    if not curve:
        return "Training curve: none (no periodic eval ran)."
    rows = "; ".join(f"{r['step']} / {r['epoch']:.2f}: {r['train_loss']}, " + ", ".join(
        f"{r[m]:.3f}" for m in metrics if m in r) for r in curve)
    return (f"Training curve (step / epoch: mean training loss since the previous eval, held-out "
            f"{', '.join(metrics)}): {rows}.")


def training_paragraph(record: dict, tcfg: loop.TrainConfig) -> str:
    budget = " Stopped by the wall-clock budget before the planned steps." if record["stopped_by_budget"] else ""
    mesh = f" on a {record['train_mesh']} (data x model) mesh" if record.get("train_mesh") else ""
    if record.get("tokens_seen") is None:          # whole rows of their own lengths
        seen = (f"{record['steps']} steps of {record['batch_size']} rows ({record['epochs']:.2f} epochs of the "
                f"{record['training_rows']:,} training rows)")
    else:
        seen = (f"{record['steps']} steps of {record['batch_size']} x {record['seq_len']} tokens "
                f"({record['tokens_seen']:,} tokens, {record['epochs']:.2f} epochs of the training data)")
    return (f"Training: {seen}, AdamW (peak lr "
            f"{record['lr']}, warmup {record['warmup']}, cosine to {tcfg.min_lr_ratio:.0%}, weight decay "
            f"{record['weight_decay']}, clip {tcfg.clip_norm}), seed {record['seed']}, wall time "
            f"{record['train_wall_s']:.0f} s{mesh}.{budget}")


def write_manifest(out_dir: str, title: str, notes: str, record: dict, corpus: data.Corpus | None,
                   training: str) -> None:
    """MANIFEST.md: the recipe's prose, the training paragraph and run note, reproduce command, held-out numbers
    (when the eval reports bits per byte), corpus identity (None: the run's data are the recipe's own, described
    in its prose and record), then the record as one ```json block."""
    os.makedirs(out_dir, exist_ok=True)
    record = dict(record, exported_at=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
    if corpus is not None:
        record.update(corpus=corpus.manifest, corpus_split={
            k: corpus.meta[k] for k in ("train_files", "train_tokens", "train_bytes", "heldout_files",
                                        "heldout_tokens", "heldout_bytes")})
    size = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(out_dir) for f in files
               if not (root == out_dir and f == "MANIFEST.md"))
    paragraphs = [f"# {title}", notes.strip(), training]
    if record.get("run_note"):
        paragraphs.append(record["run_note"])
    paragraphs.append(f"Reproduce (from the repo root): `{record['command']}`")
    if "heldout_bpb" in record and corpus is not None:
        paragraphs.append(
            f"Held-out ({corpus.meta['heldout_files']} stdlib files, split by sha256 of the relative path): loss "
            f"{record['heldout_loss']:.4f} nats/token, **{record['heldout_bpb']:.4f} bits per UTF-8 byte**.")
    if corpus is not None:
        paragraphs.append(
            f"Python {corpus.manifest['python_version']}, corpus manifest sha256 `{corpus.manifest['files_sha256']}` "
            f"({corpus.manifest['file_count']} files, {corpus.manifest['total_bytes']} bytes). Check it with "
            f"`train.data.check_checkpoint_corpus(path)` before comparing held-out numbers.")
    paragraphs += [
        f"Directory size before this file: {size / 1e6:.2f} MB.",
        f"```json\n{json.dumps(record, indent=1, default=_jsonable)}\n```\n"]
    with open(os.path.join(out_dir, "MANIFEST.md"), "w") as f:
        f.write("\n\n".join(paragraphs))


def _jsonable(x):
    if isinstance(x, (np.generic, np.ndarray, jax.Array)):      # e.g. per-head accuracies from an evaluator
        return np.asarray(x).tolist()
    if isinstance(x, tuple):
        return list(x)
    return str(x)


# ------------------------------------------------------------------------- shared pieces of the LM recipes

def lm_config(vocab_size: int, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int,
              max_len: int, eos_id: int) -> ModelConfig:
    # Tied embeddings: with a 4k vocab the embedding is a large share of these tiny models and of the
    # 30 MB checkpoint budget. head_dim 64 keeps attention shapes ordinary.
    return ModelConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                       num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=hidden // heads,
                       tie_word_embeddings=True, max_position_embeddings=max_len, rope_theta=10000.0,
                       bos_token_id=eos_id, eos_token_id=eos_id)


def llama_config(F, corpus: data.Corpus, max_len: int) -> ModelConfig:
    """lm_config from the recipe's define_llama_flags flags and the corpus' tokenizer."""
    return lm_config(corpus.vocab_size, F.hidden, F.layers, F.heads, F.kv_heads, F.intermediate, max_len,
                     corpus.eos_id)


def make_evaluator(cfg: ModelConfig, corpus: data.Corpus, seq_len: int, batch_size: int = 16
                   ) -> Callable[[Any, int | None], dict]:
    """evaluate(params, max_tokens=None) -> {heldout_loss, heldout_bpb, heldout_tokens, heldout_bytes} over the
    held-out stream (each token scored once). Bits per byte uses each scored token's UTF-8 byte count, so it is
    exact for any prefix of the stream too."""
    byte_len = data.token_byte_lengths(corpus.tokenizer)

    @jax.jit
    def batch_nll(params, windows, weights):
        nll, _ = next_token_nll(params, cfg, windows)
        return jnp.sum(nll * weights)

    def evaluate(params, max_tokens: int | None = None) -> dict:
        nats, ntok, nbytes = 0.0, 0, 0
        for win, w in data.eval_windows(corpus.heldout, seq_len, batch_size, max_tokens):
            nats += float(batch_nll(params, win, w))
            ntok += int(w.sum())
            nbytes += int((byte_len[win[:, 1:]] * w).sum())
        return {"heldout_loss": nats / max(ntok, 1), "heldout_bpb": data.bits_per_byte(nats, nbytes),
                "heldout_tokens": ntok, "heldout_bytes": nbytes}
    return evaluate


def save_lm(params: dict, cfg: ModelConfig, out_dir: str, corpus: data.Corpus) -> dict:
    """HF-format checkpoint (bf16 storage) + tokenizer.json -> the MANIFEST fields describing it."""
    os.makedirs(out_dir, exist_ok=True)
    save_pretrained(jax.device_get(params), cfg, out_dir, tokenizer=corpus.tokenizer, dtype="bfloat16")
    return {"model_config": cfg.to_hf(), "num_params": cfg.num_params(), "storage_dtype": "bfloat16"}


def decode_ms(params: dict, cfg: ModelConfig, context: int = 200, cache_size: int = 512, iters: int = 50,
              repeats: int = 20) -> float:
    """Wall ms of one decode step (batch 1, T=1, jit forward against a KV cache holding `context` entries): the
    cost c that speculative decoding trades against. Minimum over repeats, because the build CPU is shared and
    other people's load only ever adds time. Measured on one device (params gathered from a mesh, if any):
    the cost of the model itself, not of collectives."""
    params = jax.device_get(params)
    cache = KVCache.init(cfg.num_layers, 1, cache_size, cfg.num_kv_heads, cfg.head_dim)
    cache = cache.replace(lengths=jnp.full((1,), context, jnp.int32))
    step = jax.jit(lambda p, t, c: forward(p, cfg, t, c).logits)
    tok = jnp.zeros((1, 1), jnp.int32)
    step(params, tok, cache).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = step(params, tok, cache)
        out.block_until_ready()
        times.append((time.perf_counter() - t0) / iters * 1e3)
    return float(np.min(times))
