"""train/loop.py: an interrupted-and-resumed run is the uninterrupted run (same params, same loss sequence)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models.llama import init_params
from train import data, loop, skeleton
from train.losses.draft_model import distill_loss_fn
from train.losses.lm import next_token_nll

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tiny_setup():
    cfg = skeleton.lm_config(vocab_size=64, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64,
                             max_len=64, eos_id=0)
    rng = np.random.default_rng(0)
    tokens = (np.cumsum(rng.integers(1, 3, 5000)) % 64).astype(np.uint16)    # learnable, not constant
    batches = data.PackedBatches(tokens, seq_len=16, batch_size=4, seed=0)

    def loss_fn(params, batch, rng):
        nll, _ = next_token_nll(params, cfg, batch)
        return nll.mean(), {}
    return cfg, batches, loss_fn


def _train(tmp, steps, stop_at=None, ckpt=True):
    cfg, batches, loss_fn = _tiny_setup()
    tcfg = loop.TrainConfig(steps=steps, lr=1e-2, warmup_steps=2, ckpt_dir=str(tmp) if ckpt else None,
                            save_every=5, log_every=100, stop_at=stop_at, tokens_per_step=64)
    return loop.train(init_params(cfg, jax.random.PRNGKey(0)), loss_fn, batches.batch, tcfg, log=lambda m: None)


def test_resume_in_process_matches_uninterrupted(tmp_path):
    n = 10
    full = _train(tmp_path / "full", n, ckpt=False)
    first = _train(tmp_path / "resumed", n, stop_at=5)           # "killed" after step 5 (checkpointed)
    second = _train(tmp_path / "resumed", n)                     # a fresh call picks up at step 5
    assert (first.step, second.start_step, second.step) == (5, 5, n)
    np.testing.assert_allclose(first.losses + second.losses, full.losses, rtol=0, atol=1e-6)
    assert full.losses[-1] < full.losses[0]
    for a, b in zip(jax.tree.leaves(full.params), jax.tree.leaves(second.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)


def test_time_budget_stops_and_checkpoints(tmp_path):
    cfg, batches, loss_fn = _tiny_setup()
    tcfg = loop.TrainConfig(steps=1000, ckpt_dir=str(tmp_path), save_every=1000, log_every=1000,
                            time_budget_s=0.0)
    res = loop.train(init_params(cfg, jax.random.PRNGKey(0)), loss_fn, batches.batch, tcfg, log=lambda m: None)
    assert res.stopped_by_budget and res.step == 1
    _, step, meta = loop.latest_params(str(tmp_path), res.params)
    assert step == 1 and meta["step"] == 1 and meta["elapsed_s"] > 0


def _target_cmd(tmp, ckpt, steps, stop_at=None):
    cmd = [sys.executable, "-m", "train.target", "--max_files=60", "--vocab_size=300", "--hidden=32",
           "--layers=1", "--heads=2", "--kv_heads=1", "--intermediate=64", "--seq_len=32", "--batch_size=2",
           f"--steps={steps}", "--warmup=2", "--save_every=5", "--log_every=1", "--eval_every=0", "--out=",
           f"--data_dir={tmp}/data", f"--ckpt_dir={ckpt}"]
    return cmd + ([f"--stop_at={stop_at}"] if stop_at else [])


def _losses(ckpt) -> dict[int, float]:
    out = {}
    with open(os.path.join(ckpt, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            out[rec["step"]] = rec["loss"]          # after a resume, repeated steps overwrite the killed run's
    return out


@pytest.mark.slow       # a training subprocess killed and restarted (~30 s); the in-process resume test stays fast
def test_sigkill_then_resume(tmp_path):
    """A real SIGKILL (no cleanup, possibly mid-save) of `python -m train.target`, then the same command resumes
    from the last complete checkpoint and reproduces the uninterrupted run's loss at every step."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    n = 20
    ref = tmp_path / "ref"
    subprocess.run(_target_cmd(tmp_path, ref, n), cwd=REPO, env=env, check=True, capture_output=True)
    killed = tmp_path / "killed"
    proc = subprocess.Popen(_target_cmd(tmp_path, killed, n), cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while time.time() < deadline:
        steps = [int(d) for d in os.listdir(killed) if d.isdigit()] if killed.exists() else []
        if steps and max(steps) >= 5:
            break
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert max(int(d) for d in os.listdir(killed) if d.isdigit()) < n, "finished before the kill"
    res = subprocess.run(_target_cmd(tmp_path, killed, n), cwd=REPO, env=env, check=True, capture_output=True,
                         text=True)
    assert "resumed from" in res.stdout + res.stderr
    ref_losses, got = _losses(ref), _losses(killed)
    assert sorted(got) == sorted(ref_losses) == list(range(1, n + 1))
    np.testing.assert_allclose([got[s] for s in range(1, n + 1)], [ref_losses[s] for s in range(1, n + 1)],
                               rtol=0, atol=1e-6)


def test_distill_loss_is_zero_kl_against_itself():
    cfg, batches, _ = _tiny_setup()
    params = init_params(cfg, jax.random.PRNGKey(0))
    batch = batches.batch(0)
    _, m = distill_loss_fn(cfg, cfg, ce_weight=0.0, temperature=1.0)(params, batch, None, params)
    assert abs(float(m["kl"])) < 1e-5 and float(m["top1_agree"]) == 1.0
    other = init_params(cfg, jax.random.PRNGKey(1))
    loss, m2 = distill_loss_fn(cfg, cfg, ce_weight=0.5, temperature=1.0)(other, batch, None, params)
    assert float(m2["kl"]) > 0
    np.testing.assert_allclose(float(loss), 0.5 * float(m2["kl"]) + 0.5 * float(m2["ce"]), rtol=1e-5)


def test_lr_scales_scale_each_subtree_step():
    """lr_scales multiplies a subtree's step (after Adam, which would normalise a gradient scale away);
    a scale of 0 freezes it, and the other subtree's step is unchanged."""
    import optax
    from train import loop
    params = {"heads": {"w": jnp.ones((3, 2))}, "target": {"w": jnp.ones((3, 2))}}
    grads = {"heads": {"w": jnp.full((3, 2), 0.5)}, "target": {"w": jnp.full((3, 2), 0.5)}}
    steps = {}
    for scales in (None, {"heads": 1.0, "target": 0.25}, {"heads": 1.0, "target": 0.0}):
        opt, _ = loop.make_optimizer(loop.TrainConfig(steps=10, lr=1e-2, warmup_steps=1, weight_decay=0.0,
                                                      lr_scales=scales))
        for _ in range(2):                       # step 0 has lr 0 under the warmup schedule
            updates, state = opt.update(grads, opt.init(params) if _ == 0 else state, params)
        steps[str(scales)] = updates
    base = steps["None"]
    quarter = steps[str({"heads": 1.0, "target": 0.25})]
    frozen = steps[str({"heads": 1.0, "target": 0.0})]
    assert float(jnp.abs(base["target"]["w"]).min()) > 0
    np.testing.assert_allclose(quarter["target"]["w"], 0.25 * base["target"]["w"], rtol=1e-6)
    np.testing.assert_allclose(quarter["heads"]["w"], base["heads"]["w"], rtol=1e-6)
    assert float(jnp.abs(frozen["target"]["w"]).max()) == 0.0


def test_training_curve_reads_evals_and_mean_loss_since_the_last(tmp_path):
    """The MANIFEST's curve: one row per periodic eval, the training loss averaged over the logs since the previous
    eval, the eval scalars; a resumed run's repeated steps count once (the later record wins)."""
    from train import skeleton
    lines = [{"step": 10, "loss": 4.0}, {"step": 20, "loss": 2.0, "acc": 0.5},
             {"step": 30, "loss": 9.0},                      # lost to the interruption: replaced below
             {"step": 30, "loss": 1.0}, {"step": 40, "loss": 3.0, "acc": 0.75, "other": 1.0}]
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in lines)
    batches = type("B", (), {"epochs": staticmethod(lambda s: s / 100)})()
    curve = skeleton.training_curve(str(tmp_path), batches, ("acc",))
    assert curve == [{"step": 20, "epoch": 0.2, "train_loss": 3.0, "acc": 0.5},
                     {"step": 40, "epoch": 0.4, "train_loss": 2.0, "acc": 0.75}]
    assert "20 / 0.20: 3.0, 0.500; 40 / 0.40: 2.0, 0.750" in skeleton.curve_paragraph(curve, ("acc",))
