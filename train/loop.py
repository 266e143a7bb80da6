"""The one training loop every recipe uses (target LM, draft distillation, Medusa, EAGLE, MTP).

A recipe supplies initial params, `loss_fn(params, batch, rng) -> (loss, metrics)` and `batch_fn(step) -> batch`
(a pure function of the step, so resuming replays the same data order). The loop owns the optimizer
(AdamW, linear warmup + cosine decay, global-norm clipping), the jitted step, orbax checkpoints of
(params, opt_state, step, elapsed wall time), logging, and a wall-clock budget. A frozen pytree the loss reads
but never trains (a target model's params) goes in `frozen=` and reaches the loss as its 4th argument.

Under a ("data", "model") mesh (TrainConfig.mesh, from specjax.sharding.make_mesh) the same code runs tensor- and
data-parallel: params (trainable and frozen) are placed by a spec function (default_specs: Llama params split over
"model" as for decoding, anything else replicated), the optimizer state follows its params, every batch leaf is
split over "data" along its leading dim, and the step is traced under jax.set_mesh so XLA's sharding propagation
places the rest. Checkpoints save and restore the sharded arrays in place.

Determinism: the per-step PRNG key is fold_in(seed, step) and the batch is batch_fn(step), so a run resumed from
step s computes exactly the updates the uninterrupted run computes from s; tests/test_train_resume.py checks it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from specjax import layout, sharding

# (params, batch, rng) -> (loss, metrics); with train(frozen=...): (params, batch, rng, frozen) -> (loss, metrics)
LossFn = Callable[..., tuple[jax.Array, dict]]


@dataclasses.dataclass
class TrainConfig:
    steps: int
    lr: float = 1e-3
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1            # cosine decays to lr * min_lr_ratio at `steps`
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    clip_norm: float = 1.0
    seed: int = 0
    ckpt_dir: str | None = None          # orbax CheckpointManager directory; None: no checkpoints
    save_every: int = 200
    keep: int = 2
    log_every: int = 10
    metrics_path: str | None = None      # jsonl; appended to, so a resumed run continues the same file
    time_budget_s: float | None = None   # stop cleanly (and checkpoint) once this much wall time is spent
    tokens_per_step: int = 0             # for tokens/s and tokens-seen bookkeeping
    stop_at: int | None = None           # stop early at this step (the schedule still spans `steps`)
    mesh: Mesh | None = None             # ("data", "model") mesh: see the module docstring; None: one device
    lr_scales: Any = None                # a prefix of the params tree with float leaves: that subtree's learning
                                         # rate is lr * scale (Medusa-2 moves the target slower than its heads)
    compute_dtype: str | None = None     # "bfloat16": the loss runs on a copy of the params in that dtype (mixed
                                         # precision); gradients, optimizer state and checkpoints stay float32


@dataclasses.dataclass
class TrainResult:
    params: Any
    step: int                            # steps completed (global, including resumed ones)
    losses: list[float]                  # loss of every step run in THIS call, in order
    start_step: int                      # where this call started (> 0 when resumed)
    elapsed_s: float                     # total training wall time, across resumes
    stopped_by_budget: bool


def cast_floats(tree: Any, dtype: Any) -> Any:
    """Every floating-point leaf of `tree` in `dtype` (integer leaves as they are)."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def with_compute_dtype(loss_fn: LossFn, compute_dtype: str | None) -> LossFn:
    """Mixed precision: loss_fn run on the trainable params cast to compute_dtype (None: loss_fn itself). The cast
    is inside the differentiated function, so gradients arrive in the params' own (float32 master) dtype; the
    losses take their softmaxes in float32 whatever the logits' dtype. A frozen tree is cast once (compute_frozen)."""
    if compute_dtype is None or jnp.dtype(compute_dtype) == jnp.float32:
        return loss_fn
    dtype = jnp.dtype(compute_dtype)
    return lambda params, *args: loss_fn(cast_floats(params, dtype), *args)


def compute_frozen(frozen: Any, compute_dtype: str | None) -> Any:
    """The frozen tree the loss reads under mixed precision: cast once, outside the step."""
    return frozen if compute_dtype is None or frozen is None else cast_floats(frozen, jnp.dtype(compute_dtype))


def make_optimizer(cfg: TrainConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=max(cfg.warmup_steps, 1),
        decay_steps=max(cfg.steps, cfg.warmup_steps + 1), end_value=cfg.lr * cfg.min_lr_ratio)
    # No weight decay on gains/biases (1-D leaves): decaying RMSNorm weights toward 0 only hurts.
    decay_mask = lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)
    parts = [optax.clip_by_global_norm(cfg.clip_norm),
             optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=decay_mask)]
    if cfg.lr_scales is not None:
        # Scaling the updates after Adam (not the gradients, which Adam normalises away) scales the step size.
        scale_tree = lambda updates: jax.tree.map(lambda s, sub: jax.tree.map(lambda u: u * s, sub),
                                                  cfg.lr_scales, updates)
        parts.append(optax.stateless(lambda updates, params=None: scale_tree(updates)))
    return optax.chain(*parts), schedule


SpecFn = Callable[[Any, Mesh], Any]


def default_specs(tree: Any, mesh: Mesh) -> Any:
    """PartitionSpecs for a params pytree: a Llama (target or draft model) gets specjax.layout.param_specs
    (split over "model"; dims the axis does not divide stay replicated), anything else (head weights) is
    replicated. A recipe whose heads are large passes its own spec function."""
    if isinstance(tree, dict) and "layers" in tree and "embed" in tree:
        return layout.param_specs(None, tree, mesh)
    return jax.tree.map(lambda _: P(), tree)


def place(tree: Any, mesh: Mesh, spec_fn: SpecFn = default_specs) -> Any:
    """Every leaf of `tree` on `mesh` with its spec (no copy for leaves already there)."""
    return jax.tree.map(lambda x, s: sharding.put(x, NamedSharding(mesh, s)), tree, spec_fn(tree, mesh))


def shard_batch(batch: Any, mesh: Mesh) -> Any:
    """Every batch leaf split over "data" along its leading (batch) dim."""
    return jax.tree.map(lambda x: sharding.shard_rows(x, mesh), batch)


def _on_mesh(tree: Any, mesh: Mesh) -> Any:
    # opt.init's zeros_like keeps each param's sharding; its step counters land on one device, which a jitted
    # step over the whole mesh refuses, so they are replicated.
    rep = NamedSharding(mesh, P())
    return jax.tree.map(lambda x: x if isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh
                        else sharding.put(x, rep), tree)


def _manager(cfg: TrainConfig) -> ocp.CheckpointManager | None:
    if not cfg.ckpt_dir:
        return None
    opts = ocp.CheckpointManagerOptions(max_to_keep=cfg.keep, create=True)
    return ocp.CheckpointManager(os.path.abspath(cfg.ckpt_dir), options=opts)


def latest_params(ckpt_dir: str, like: Any) -> tuple[Any, int, dict]:
    """(params with the structure of `like`, step, meta {step, elapsed_s}) from the newest checkpoint of a
    training run: for export, or to distill from an intermediate target before its run has finished."""
    mngr = ocp.CheckpointManager(os.path.abspath(ckpt_dir))
    step = mngr.latest_step()
    if step is None:
        raise FileNotFoundError(f"no checkpoint in {ckpt_dir}")
    meta_like = {"step": jnp.int32(0), "elapsed_s": jnp.float32(0)}
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": like, "meta": meta_like})
    restored = mngr.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(abstract["params"]), meta=ocp.args.StandardRestore(abstract["meta"])))
    mngr.close()
    meta = {k: float(v) for k, v in restored["meta"].items()}
    return restored["params"], step, meta


def train(params: Any, loss_fn: LossFn, batch_fn: Callable[[int], Any], cfg: TrainConfig,
          eval_fn: Callable[[Any, int], dict] | None = None, eval_every: int = 0,
          log: Callable[[str], None] = print, frozen: Any = None,
          spec_fn: SpecFn = default_specs, tokens_of: Callable[[Any], tuple[int, int]] | None = None) -> TrainResult:
    """Run (or resume) training to cfg.steps. eval_fn(params, step) -> metrics is called every eval_every
    steps and logged with them. frozen: passed to loss_fn as loss_fn(params, batch, rng, frozen), never
    trained or checkpointed. spec_fn(params, mesh) -> PartitionSpecs for the trainable params under cfg.mesh
    (the frozen tree always gets default_specs). tokens_of(batch) -> (positions, label tokens): logged as rates
    (batches of rows with label spans differ in both)."""
    mesh = cfg.mesh
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        return _train(params, loss_fn, batch_fn, cfg, eval_fn, eval_every, log, frozen, spec_fn, tokens_of)


def _train(params, loss_fn, batch_fn, cfg, eval_fn, eval_every, log, frozen, spec_fn, tokens_of) -> TrainResult:
    t_call = time.time()
    mesh = cfg.mesh
    opt, schedule = make_optimizer(cfg)
    frozen = compute_frozen(frozen, cfg.compute_dtype)
    if mesh is not None:
        params = place(params, mesh, spec_fn)
        frozen = place(frozen, mesh) if frozen is not None else None
    opt_state = opt.init(params)
    if mesh is not None:
        opt_state = _on_mesh(opt_state, mesh)
    step, elapsed_before = 0, 0.0
    mngr = _manager(cfg)
    if mngr is not None and mngr.latest_step() is not None:
        latest = mngr.latest_step()
        state = {"params": params, "opt_state": opt_state,
                 "meta": {"step": jnp.int32(0), "elapsed_s": jnp.float32(0)}}
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        restored = mngr.restore(latest, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(abstract["params"]),
            opt_state=ocp.args.StandardRestore(abstract["opt_state"]),
            meta=ocp.args.StandardRestore(abstract["meta"])))
        params, opt_state = restored["params"], restored["opt_state"]
        step, elapsed_before = int(restored["meta"]["step"]), float(restored["meta"]["elapsed_s"])
        log(f"[loop] resumed from {cfg.ckpt_dir} at step {step} ({elapsed_before:.0f}s trained before)")
    start_step = step

    def save(step: int, elapsed: float) -> None:
        if mngr is None:
            return
        mngr.save(step, args=ocp.args.Composite(
            params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt_state),
            meta=ocp.args.StandardSave({"step": jnp.int32(step), "elapsed_s": jnp.float32(elapsed)})),
            force=True)

    base_key = jax.random.PRNGKey(cfg.seed)

    compute_loss = with_compute_dtype(loss_fn, cfg.compute_dtype)

    def train_step(params, opt_state, batch, step, frozen):
        rng = jax.random.fold_in(base_key, step)
        extra = () if frozen is None else (frozen,)
        (loss, metrics), grads = jax.value_and_grad(compute_loss, has_aux=True)(params, batch, rng, *extra)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        metrics = dict(metrics, grad_norm=optax.tree.norm(grads))
        return params, opt_state, loss, metrics

    if mesh is None:
        train_step = jax.jit(train_step)
    else:   # pin params and optimizer state to their layout, so every step (and checkpoint) sees the same one
        shardings = lambda tree: jax.tree.map(lambda x: x.sharding, tree)
        rep = NamedSharding(mesh, P())
        train_step = jax.jit(train_step, out_shardings=(shardings(params), shardings(opt_state), rep, rep))

    metrics_file = open(cfg.metrics_path, "a") if cfg.metrics_path else None
    losses: list[float] = []
    stop_at = cfg.steps if cfg.stop_at is None else min(cfg.stop_at, cfg.steps)
    t_train0 = time.time()
    t_log, step_log = time.time(), step
    stopped_by_budget = False
    labels_since_log = 0
    try:
        while step < stop_at:
            host_batch = batch_fn(step)
            if tokens_of is not None:
                labels_since_log += tokens_of(host_batch)[1]
            batch = host_batch if mesh is None else shard_batch(host_batch, mesh)
            params, opt_state, loss, metrics = train_step(params, opt_state, batch, jnp.int32(step), frozen)
            loss = float(loss)                       # syncs; also surfaces NaN at the step it appears
            losses.append(loss)
            step += 1
            if not np.isfinite(loss):
                raise FloatingPointError(f"loss is {loss} at step {step}")
            elapsed = elapsed_before + time.time() - t_train0
            budget_spent = cfg.time_budget_s is not None and time.time() - t_call >= cfg.time_budget_s
            if step % cfg.log_every == 0 or step == stop_at or budget_spent:
                now = time.time()
                rec = {"step": step, "loss": loss, "lr": float(schedule(step - 1)),
                       "tokens_per_s": cfg.tokens_per_step * (step - step_log) / max(now - t_log, 1e-9),
                       "tokens_seen": cfg.tokens_per_step * step, "elapsed_s": round(elapsed, 1),
                       "s_per_step": (now - t_log) / max(step - step_log, 1)}
                if tokens_of is not None:
                    rec["label_tokens_per_s"] = labels_since_log / max(now - t_log, 1e-9)
                    labels_since_log = 0
                rec.update({k: float(v) for k, v in metrics.items()})
                if eval_fn is not None and eval_every and step % eval_every == 0:
                    rec.update(eval_fn(params, step))
                log("[loop] " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                         for k, v in rec.items()))
                if metrics_file:
                    metrics_file.write(json.dumps(rec) + "\n")
                    metrics_file.flush()
                t_log, step_log = time.time(), step
            if step % cfg.save_every == 0 or step == stop_at or budget_spent:
                save(step, elapsed)
            if budget_spent and step < stop_at:
                log(f"[loop] time budget of {cfg.time_budget_s:.0f}s spent: stopping at step {step}")
                stopped_by_budget = True
                break
    finally:
        if mngr is not None:
            mngr.wait_until_finished()
            mngr.close()
        if metrics_file:
            metrics_file.close()
    return TrainResult(params, step, losses, start_step, elapsed_before + time.time() - t_train0,
                       stopped_by_budget)


def profile_steps(params: Any, loss_fn: LossFn, batch_fn: Callable[[int], Any], cfg: TrainConfig, frozen: Any = None,
                  steps: int = 4, tokens_of: Callable[[Any], tuple[int, int]] | None = None) -> dict:
    """Where a training step's time goes, on the run's own batches (steps 0..steps-1, each timed once after a
    compile on step 0's shapes; batches of other widths compile their own programs, untimed): the loss alone
    (forward), its value and gradient (forward + backward), and the whole step (+ clipping and AdamW), each
    with XLA's FLOP count of its compiled program, and the rates they give. tokens_of(batch) -> (positions the
    step runs over, label tokens it trains on). One device (no mesh)."""
    opt, _ = make_optimizer(cfg)
    opt_state = opt.init(params)
    rng = jax.random.PRNGKey(cfg.seed)
    frozen = compute_frozen(frozen, cfg.compute_dtype)
    # the frozen params are an argument, as in train's step (closed over, they would be compiled in as constants)
    compute_loss = with_compute_dtype(loss_fn, cfg.compute_dtype)
    loss = lambda p, b, f: compute_loss(p, b, rng, *(() if f is None else (f,)))[0]
    fwd = jax.jit(loss)
    grad = jax.jit(lambda p, b, f: jax.value_and_grad(loss)(p, b, f))

    def full(p, s, b, f):
        value, g = jax.value_and_grad(loss)(p, b, f)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, value
    full = jax.jit(full)
    parts = {"forward": (fwd, lambda b: (params, b, frozen)), "forward_backward": (grad, lambda b: (params, b, frozen)),
             "step": (full, lambda b: (params, opt_state, b, frozen))}
    out = {name: {"seconds": 0.0, "flops": 0.0} for name in parts}
    positions = labels = 0
    programs = {}                                                # (part, batch shapes) -> (compiled, flops)
    for step in range(steps):
        batch = jax.tree.map(jnp.asarray, batch_fn(step))
        if tokens_of is not None:
            p_, l_ = tokens_of(batch)
            positions, labels = positions + p_, labels + l_
        shapes = tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(batch))
        for name, (fn, args) in parts.items():
            a = args(batch)
            if (name, shapes) not in programs:
                compiled = fn.lower(*a).compile()
                cost = compiled.cost_analysis()
                cost = cost[0] if isinstance(cost, (list, tuple)) else cost
                jax.block_until_ready(compiled(*a))              # warm
                programs[name, shapes] = compiled, float(cost.get("flops", 0.0))
            compiled, flops = programs[name, shapes]
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(*a))
            out[name]["seconds"] += time.perf_counter() - t0
            out[name]["flops"] += flops
    for name, r in out.items():
        r["seconds_per_step"] = r["seconds"] / steps
        r["gflop_per_s"] = r["flops"] / max(r["seconds"], 1e-9) / 1e9
        if labels:
            r["label_tokens_per_s"] = labels / max(r["seconds"], 1e-9)
            r["positions_per_s"] = positions / max(r["seconds"], 1e-9)
    out["steps"], out["positions_per_step"], out["labels_per_step"] = steps, positions / steps, labels / steps
    out["backward_share"] = 1 - out["forward"]["seconds"] / max(out["forward_backward"]["seconds"], 1e-9)
    out["optimizer_share"] = 1 - out["forward_backward"]["seconds"] / max(out["step"]["seconds"], 1e-9)
    return out
