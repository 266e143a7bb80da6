"""specjax.analysis' trace replay (experiments.simulate): a per-step acceptance trace replayed offline predicts the loop iterations of other k and
of the acceptance switch, checked against real runs of the tiny target (greedy draft-model chains, where the
replay is exact up to the untested bonus positions)."""
import numpy as np
import pytest

import specjax
from specjax import SpecConfig
from tiny import ragged_prompts
from specjax.analysis import expected_replay, positions_from_trace, replay

MAX_NEW = 24


def run(target, drafter, prompts, k, **policy):
    return specjax.generate(target, prompts, SpecConfig(method="draft_model", num_speculative_tokens=k,
                                                        max_new_tokens=MAX_NEW, stop_at_eos=False, **policy),
                            drafter=drafter)


@pytest.fixture(scope="module")
def recorded(target, near_draft):
    prompts = ragged_prompts(8, seed=8)
    res = run(target, near_draft, prompts, 4)
    return prompts, res, positions_from_trace(res.stats["accept_trace"], 4, [len(t) for t in res.tokens])


def test_positions_cover_every_generated_token(recorded):
    _, res, rows = recorded
    assert [len(r) for r in rows] == [len(t) - 1 for t in res.tokens]      # the first token comes from prefill
    assert all(set(np.unique(r)) <= {-1, 0, 1} for r in rows)


def test_replay_at_the_recorded_k_is_the_run(recorded):
    """The untested positions never decide a step at the recorded k: any fill gives the recorded iterations."""
    _, res, rows = recorded
    for fill in (0, 1):
        sim = replay([np.where(r >= 0, r, fill) for r in rows], 4)
        assert sim["iterations"] == res.stats["accept_trace"].shape[1]
        # a row's last step may accept drafts past its budget: the run counts them, the replay cuts them off
        assert 0 <= res.stats["accepted"] - sim["accepted"] <= 4 * len(rows)


@pytest.mark.slow             # three more compiles; make test has a 20-minute budget
@pytest.mark.parametrize("k, policy", [(2, {}), (3, {}), (4, dict(acceptance_rate_threshold=0.7,
                                                                acceptance_rate_window_size=2))])
def test_replay_predicts_other_runs(target, near_draft, recorded, k, policy):
    prompts, res, rows = recorded
    rate = float(np.concatenate([r[r >= 0] for r in rows]).mean())
    sim = expected_replay(rows, k, rate, draws=50, threshold=policy.get("acceptance_rate_threshold"),
                          window=policy.get("acceptance_rate_window_size", 16))
    real = run(target, near_draft, prompts, k, **policy)
    iterations = real.stats["accept_trace"].shape[1]
    print(k, policy, sim, iterations, real.stats["accepted"])
    assert abs(sim["iterations"] / iterations - 1) < 0.1
    if policy:
        assert real.stats["plain_passes"] > 0 and sim["speculative"] < sim["iterations"]
