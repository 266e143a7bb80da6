"""Pieces the LM recipes share (target pre-training, draft distillation): next-token losses, held-out
evaluation in bits per byte, and export of a shipped checkpoint with its MANIFEST.md."""
from __future__ import annotations

import json
import os
import shlex
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from specjax.models.config import ModelConfig
from specjax.models.llama import full_logits
from train.data import Corpus, bits_per_byte, eval_windows, token_byte_lengths

def define_run_flags(*, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, steps: int,
                     lr: float, seed: int, seed_help: str, ckpt_dir: str, out: str) -> None:
    """The flags every LM recipe takes (call once, at the top of a recipe's main module); defaults differ."""
    from absl import flags
    from train import data
    flags.DEFINE_integer("hidden", hidden, "hidden size")
    flags.DEFINE_integer("layers", layers, "decoder layers")
    flags.DEFINE_integer("heads", heads, "query heads")
    flags.DEFINE_integer("kv_heads", kv_heads, "key/value heads (GQA)")
    flags.DEFINE_integer("intermediate", intermediate, "MLP size")
    flags.DEFINE_integer("seq_len", 256, "training sequence length")
    flags.DEFINE_integer("batch_size", 16, "sequences per step")
    flags.DEFINE_integer("steps", steps, "optimizer steps (the cosine schedule spans these)")
    flags.DEFINE_float("lr", lr, "peak learning rate")
    flags.DEFINE_integer("warmup", 50, "warmup steps")
    flags.DEFINE_float("weight_decay", 0.1, "AdamW weight decay")
    flags.DEFINE_integer("seed", seed, seed_help)
    flags.DEFINE_float("time_budget", None, "stop cleanly (and checkpoint) after this many seconds")
    flags.DEFINE_integer("stop_at", None, "stop at this step (for tests; the schedule still spans --steps)")
    flags.DEFINE_integer("max_files", None, "use an evenly spaced subset of the stdlib files (tests)")
    flags.DEFINE_string("data_dir", data.DEFAULT_DATA_DIR, "token cache directory (gitignored)")
    flags.DEFINE_string("ckpt_dir", ckpt_dir, "orbax training checkpoints (resumed from)")
    flags.DEFINE_integer("save_every", 50, "checkpoint interval (steps)")
    flags.DEFINE_integer("log_every", 10, "log interval (steps)")
    flags.DEFINE_integer("eval_every", 200, "held-out eval interval (steps, on --eval_tokens tokens)")
    flags.DEFINE_integer("eval_tokens", 16384, "held-out tokens for periodic evals (the final eval uses all)")
    flags.DEFINE_integer("final_eval_tokens", None, "held-out tokens for the export eval (None: all)")
    flags.DEFINE_string("out", out, "export directory ('' to skip export)")
    flags.DEFINE_bool("export_only", False, "skip training; export the newest checkpoint in --ckpt_dir")


def run_info(ckpt_dir: str, params, run_flags: dict, export_only: bool):
    """-> (params, step, info). A run records its first launch's command and flags in ckpt_dir/run_info.json (a resume
    keeps them, so the MANIFEST names the command that produced the weights); --export_only restores the newest
    checkpoint's params and wall time instead of training."""
    from train import loop
    os.makedirs(ckpt_dir, exist_ok=True)
    info_path = os.path.join(ckpt_dir, "run_info.json")
    if export_only:
        params, step, meta = loop.latest_params(ckpt_dir, params)
        with open(info_path) as f:
            info = json.load(f)
        info["elapsed_s"] = meta["elapsed_s"]
        return params, step, info
    if os.path.exists(info_path):
        with open(info_path) as f:
            return params, None, json.load(f)
    info = {"command": command_line(), "steps": run_flags["steps"], "seed": run_flags["seed"], "flags": run_flags}
    save_run_info(ckpt_dir, info)
    return params, None, info


def save_run_info(ckpt_dir: str, info: dict) -> None:
    with open(os.path.join(ckpt_dir, "run_info.json"), "w") as f:
        json.dump(info, f)


def train_from_flags(F, params, loss_fn, batches, evaluate, info: dict):
    """Run train.loop with the recipe flags (define_run_flags), periodic held-out evals, and record the wall
    time in the run info. -> (params, step)."""
    from train import loop
    tcfg = loop.TrainConfig(
        steps=F.steps, lr=F.lr, warmup_steps=F.warmup, weight_decay=F.weight_decay, seed=F.seed,
        ckpt_dir=F.ckpt_dir, save_every=F.save_every, log_every=F.log_every,
        metrics_path=os.path.join(F.ckpt_dir, "metrics.jsonl"), time_budget_s=F.time_budget,
        tokens_per_step=F.batch_size * F.seq_len, stop_at=F.stop_at)
    res = loop.train(params, loss_fn, batches.batch, tcfg,
                     eval_fn=lambda p, s: {k: v for k, v in evaluate(p, F.eval_tokens).items()
                                           if k in ("heldout_loss", "heldout_bpb")},
                     eval_every=F.eval_every)
    info.update(elapsed_s=res.elapsed_s, stopped_by_budget=res.stopped_by_budget)
    save_run_info(F.ckpt_dir, info)
    return res.params, res.step


def run_record(F, info: dict, step: int) -> dict:
    """The MANIFEST fields every recipe records: commands, seed, schedule, data seen, wall time."""
    return {"command": info["command"], "export_command": command_line(), "seed": F.seed, "steps": step,
            "planned_steps": info["steps"], "batch_size": F.batch_size, "seq_len": F.seq_len,
            "tokens_seen": step * F.batch_size * F.seq_len, "train_wall_s": round(info.get("elapsed_s", float("nan")), 1),
            "lr": F.lr, "warmup": F.warmup, "weight_decay": F.weight_decay,
            "stopped_by_budget": info.get("stopped_by_budget")}


def lm_config(vocab_size: int, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int,
              max_len: int, eos_id: int) -> ModelConfig:
    # Tied embeddings: with a 4k vocab the embedding is a large share of these tiny models and of the
    # 30 MB checkpoint budget. head_dim 64 keeps attention shapes ordinary.
    return ModelConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                       num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=hidden // heads,
                       tie_word_embeddings=True, max_position_embeddings=max_len, rope_theta=10000.0,
                       bos_token_id=eos_id, eos_token_id=eos_id)


def token_nll(params: dict, cfg: ModelConfig, windows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """windows [B, L+1] -> (per-token NLL [B, L], logits [B, L, V])."""
    logits = full_logits(params, cfg, windows[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:]), logits


def make_evaluator(cfg: ModelConfig, corpus: Corpus, seq_len: int, batch_size: int = 16
                   ) -> Callable[..., dict]:
    """evaluate(params, max_tokens=None) -> {heldout_loss, heldout_bpb, heldout_tokens, heldout_bytes} over the
    held-out stream (each token scored once). Bits per byte uses each scored token's UTF-8 byte count, so it is
    exact for any prefix of the stream too."""
    byte_len = token_byte_lengths(corpus.tokenizer)

    @jax.jit
    def batch_nll(params, windows, weights):
        nll, _ = token_nll(params, cfg, windows)
        return jnp.sum(nll * weights)

    def evaluate(params, max_tokens: int | None = None) -> dict:
        nats, ntok, nbytes = 0.0, 0, 0
        for win, w in eval_windows(corpus.heldout, seq_len, batch_size, max_tokens):
            nats += float(batch_nll(params, win, w))
            ntok += int(w.sum())
            nbytes += int((byte_len[win[:, 1:]] * w).sum())
        return {"heldout_loss": nats / max(ntok, 1), "heldout_bpb": bits_per_byte(nats, nbytes),
                "heldout_tokens": ntok, "heldout_bytes": nbytes}
    return evaluate


def command_line() -> str:
    """The command that started this process, as it would be typed from the repo root."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    prog = f"python -m {spec.name}" if spec else f"python {sys.argv[0]}"
    return " ".join([prog] + [shlex.quote(a) for a in sys.argv[1:]])


def restore_run_flags(flag_values, info_path: str) -> None:
    """--export_only: take the training run's hyperparameters from its run_info.json (when recorded)."""
    with open(info_path) as f:
        recorded = json.load(f).get("flags", {})
    for name, value in recorded.items():
        if flag_values[name].value != value:
            print(f"[export] using the run's --{name}={value} (command line had {flag_values[name].value})",
                  flush=True)
            flag_values[name].value = value


def export_checkpoint(params: dict, cfg: ModelConfig, corpus: Corpus, out_dir: str, title: str,
                      record: dict, notes: str) -> None:
    """HF-format checkpoint (bf16 storage) + tokenizer.json + MANIFEST.md (prose, then one ```json block that
    train.data.read_manifest_md parses)."""
    from specjax.models.hf_io import save_pretrained
    os.makedirs(out_dir, exist_ok=True)
    save_pretrained(jax.device_get(params), cfg, out_dir, tokenizer=corpus.tokenizer, dtype="bfloat16")
    record = dict(record, corpus=corpus.manifest, corpus_split={
        k: corpus.meta[k] for k in ("train_files", "train_tokens", "train_bytes", "heldout_files",
                                    "heldout_tokens", "heldout_bytes")},
        model_config=cfg.to_hf(), num_params=cfg.num_params(), storage_dtype="bfloat16",
        exported_at=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
    size = sum(os.path.getsize(os.path.join(out_dir, f)) for f in os.listdir(out_dir))
    text = (f"# {title}\n\n{notes.strip()}\n\n"
            f"Reproduce (from the repo root): `{record['command']}`\n\n"
            f"Held-out ({corpus.meta['heldout_files']} stdlib files, split by sha256 of the relative path): "
            f"loss {record['heldout_loss']:.4f} nats/token, **{record['heldout_bpb']:.4f} bits per UTF-8 byte**.\n\n"
            f"Python {corpus.manifest['python_version']}, corpus manifest sha256 "
            f"`{corpus.manifest['files_sha256']}` ({corpus.manifest['file_count']} files, "
            f"{corpus.manifest['total_bytes']} bytes). Check it with "
            f"`train.data.check_checkpoint_corpus(path)` before comparing held-out numbers.\n\n"
            f"Directory size before this file: {size / 1e6:.2f} MB.\n\n"
            f"```json\n{json.dumps(record, indent=1, default=_jsonable)}\n```\n")
    with open(os.path.join(out_dir, "MANIFEST.md"), "w") as f:
        f.write(text)


def _jsonable(x):
    if isinstance(x, (np.generic,)):
        return x.item()
    if isinstance(x, tuple):
        return list(x)
    return str(x)


def distill_loss_fn(draft_cfg: ModelConfig, target_params: dict, target_cfg: ModelConfig, ce_weight: float,
                    temperature: float) -> Callable:
    """loss_fn for train.loop: (1 - ce_weight) * KL(p_target || p_draft) + ce_weight * CE, per token, with the
    frozen target's logits computed on the fly (the corpus is too large to cache [tokens, 4096] logits)."""
    def loss_fn(params, batch, rng):
        del rng
        inputs, labels = batch[:, :-1], batch[:, 1:]
        t_logits = jax.lax.stop_gradient(full_logits(target_params, target_cfg, inputs)) / temperature
        d_logits = full_logits(params, draft_cfg, inputs)
        t_logp = jax.nn.log_softmax(t_logits)
        d_logp_t = jax.nn.log_softmax(d_logits / temperature)
        kl = jnp.sum(jnp.exp(t_logp) * (t_logp - d_logp_t), axis=-1).mean()
        d_logp = jax.nn.log_softmax(d_logits)
        ce = -jnp.take_along_axis(d_logp, labels[..., None], axis=-1).mean()
        agree = jnp.mean(jnp.argmax(d_logits, -1) == jnp.argmax(t_logits, -1))
        return (1 - ce_weight) * kl + ce_weight * ce, {"kl": kl, "ce": ce, "top1_agree": agree}
    return loss_fn


def decode_ms(params: dict, cfg: ModelConfig, context: int = 200, cache_size: int = 512, iters: int = 50,
              repeats: int = 20) -> float:
    """Wall ms of one decode step (batch 1, T=1, jit forward against a KV cache holding `context` entries): the
    cost c that speculative decoding trades against. Minimum over repeats, because the build CPU is shared and
    other people's load only ever adds time."""
    from specjax.cache import KVCache
    from specjax.models.llama import forward
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
