"""Sharded decoding on 8 virtual CPU devices gives the same tokens as one device.

jax fixes its device count when it first starts, and this pytest process already started it with one device, so
the checks run in a subprocess (tests/_sharding_worker.py) with XLA_FLAGS=--xla_force_host_platform_device_count=8
and report JSON; the tests here assert on it. The multi-process test runs tests/_multihost_worker.py; it is
marked slow (`make test` deselects it with -m "not slow", `make test-all` runs it).
"""
from __future__ import annotations

import pytest

from workers import run_worker

MESHES = ["1x8", "2x4", "8x1"]


@pytest.fixture(scope="module")
def result() -> dict:
    return run_worker("_sharding_worker.py")


# The worker (8 virtual devices, every mesh shape, sharded loading) takes over a minute: CI runs its checks in
# test-slow, beside the (2, 4) mesh conformance of every drafter; make test keeps its 20-minute budget.
worker_check = pytest.mark.slow


@worker_check
@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("method", ["none", "draft_model", "ngram"])
def test_same_tokens_as_one_device(result, method, mesh):
    tokens = result["tokens"]
    assert tokens[f"{method}@{mesh}"] == tokens[f"{method}@single"]
    assert tokens[f"{method}@single"] == tokens["none@single"]           # greedy speculative == plain
    if method != "none":
        stats = result["stats"][f"{method}@{mesh}"]
        assert stats["accepted"] > 0 and stats["rejected"] > 0, stats     # acceptance and rollback both ran
@worker_check
def test_small_draft_model_with_undividable_heads(result):
    # 1 kv head cannot be split 4 ways: the draft model's heads stay replicated, the target is still split.
    tokens = result["tokens"]
    assert tokens["draft_model-small@2x4"] == tokens["draft_model-small@single"] == tokens["none@single"]


@worker_check
@pytest.mark.parametrize("mesh", MESHES)
def test_params_bytes_per_device(result, mesh):
    mem = result["memory"]
    data, model = map(int, mesh.split("x"))
    # Everything but the norms is divided by the model axis; the norms are replicated on every device.
    expect = (mem["total"] - mem["norms"]) / model + mem["norms"]
    assert len(mem[mesh]) == 8
    assert all(b == pytest.approx(expect, rel=1e-6) for b in mem[mesh]), (mem[mesh], expect)
    assert all(b <= mem["total"] / model + mem["norms"] for b in mem[mesh])
@worker_check
def test_clear_errors(result):
    err = result["errors"]
    assert err["heads"] and "'model' axis of size 8 does not divide the model's num_heads=6" in err["heads"]
    assert "make_mesh(data=4, model=2)" in err["heads"]                     # names a mesh that works
    assert err["batch"] and "'data' axis of size 2 does not divide the batch of 5" in err["batch"]
@worker_check
def test_load_into_sharded_layout(result):
    load = result["load"]
    assert load["equal"] and load["specs_ok"]
    assert load["wq_shard_shape"] == [64, 16]                 # wq [64, 64] columns split over model=4
    assert load["tokens"] == result["tokens"]["none@single"]


@pytest.mark.slow
def test_multihost_two_processes():
    """2 processes x 4 CPU devices joined by jax.distributed (coordinator on localhost): same tokens."""
    out = run_worker("_multihost_worker.py", "--launch", devices=4, timeout=900)
    assert out["ok"], out
