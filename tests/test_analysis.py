"""The analytic speedup model reproduces the seed's numbers and behaves sanely at the edges."""
import numpy as np
import pytest

from specjax import analysis as an


def test_expected_tokens_seed_numbers():
    assert round(an.expected_tokens_per_step(0.8, 4), 2) == 3.36
    assert round(an.expected_tokens_per_step(0.9, 8), 2) == 6.13
    # The cap 1 / (1 - alpha): at alpha = 0.6 no k gives more than 2.5 tokens per step.
    assert an.expected_tokens_per_step(0.6, 200) == pytest.approx(2.5, abs=1e-9)
    assert all(an.expected_tokens_per_step(0.6, k) < 2.5 for k in range(1, 30))


def test_expected_tokens_edges_and_arrays():
    assert an.expected_tokens_per_step(1.0, 5) == 6.0
    assert an.expected_tokens_per_step(0.0, 5) == 1.0
    assert an.expected_tokens_per_step(0.7, 0) == 1.0
    arr = an.expected_tokens_per_step(np.array([0.5, 1.0]), 3)
    np.testing.assert_allclose(arr, [1.875, 4.0])
    with pytest.raises(ValueError):
        an.expected_tokens_per_step(1.5, 3)
    with pytest.raises(ValueError):
        an.expected_tokens_per_step(0.5, -1)


def test_walltime_speedup_leviathan():
    # Leviathan's formula (1 - a^(k+1)) / ((1 - a)(k c + 1)): 3.3616 / 1.6 = 2.101 at k = 4;
    # the 2.08 quoted for alpha 0.8, c 0.15 is the same formula at k = 6 (3.9514 / 1.9).
    assert an.walltime_speedup(0.8, 4, 0.15) == pytest.approx(2.10, abs=0.01)
    assert an.walltime_speedup(0.8, 6, 0.15) == pytest.approx(2.08, abs=0.01)
    a, k, c = 0.73, 5, 0.21
    assert an.walltime_speedup(a, k, c) == pytest.approx((1 - a ** (k + 1)) / ((1 - a) * (k * c + 1)))


def test_speedup_from_tau_with_one_position_steps():
    """A step that drafted nothing costs the proposal and one decode step, not a verify pass."""
    tau, k, c, vcost = 2.2, 4, 0.05, 1.3
    assert an.speedup_from_tau(tau, k * c, vcost) == pytest.approx(tau / (k * c + vcost))
    assert an.speedup_from_tau(tau, k * c, vcost, 0.0) == pytest.approx(
        an.walltime_speedup(an.alpha_from_tau(tau, k), k, c, vcost))
    assert an.speedup_from_tau(1.0, 0.0, vcost, 1.0) == pytest.approx(1.0)      # every step one position: plain
    # 40% of steps one position: (0.4 + 0.6 * 1.3 + 0.2) per step
    assert an.speedup_from_tau(tau, k * c, vcost, 0.4) == pytest.approx(tau / 1.38)
    with pytest.raises(ValueError, match="one_position_share"):
        an.speedup_from_tau(tau, k * c, vcost, 1.5)


def test_verify_cost_forms_agree():
    curve = {1: 1.0, 3: 1.1, 5: 1.3, 9: 2.0}          # T = k + 1 verified positions -> cost ratio
    s_dict = an.walltime_speedup(0.8, 4, 0.1, curve)
    s_call = an.walltime_speedup(0.8, 4, 0.1, lambda k: 1.3)
    s_const = an.walltime_speedup(0.8, 4, 0.1, 1.3)
    assert s_dict == pytest.approx(s_call) == pytest.approx(s_const)
    # Interpolation between measured points: T = 7 lies halfway between 5 and 9.
    assert an.verify_cost_at(curve, 6) == pytest.approx(1.65)
    assert an.verify_cost_at(2.0, 0) == 1.0            # k = 0 is plain decoding by definition


def test_optimal_k():
    k, s = an.optimal_k(0.8, 0.15)
    assert k == 5 and s == pytest.approx(an.walltime_speedup(0.8, 5, 0.15))
    assert all(an.walltime_speedup(0.8, j, 0.15) <= s + 1e-12 for j in range(1, 17))
    # Better drafts -> longer optimal k; a draft as slow as the target never pays off.
    assert an.optimal_k(0.95, 0.05)[0] > an.optimal_k(0.6, 0.05)[0]
    assert an.optimal_k(0.8, 1.0) == (0, 1.0)
    # An expensive verify curve pulls the optimum down.
    assert an.optimal_k(0.8, 0.05, lambda k: 1 + 0.2 * k)[0] < an.optimal_k(0.8, 0.05)[0]
    assert an.optimal_k(0.99, 0.0, k_max=7)[0] == 7


@pytest.mark.parametrize("alpha,k", [(0.0, 3), (0.3, 1), (0.6, 4), (0.8, 4), (0.95, 12), (1.0, 5)])
def test_alpha_from_tau_round_trip(alpha, k):
    tau = an.expected_tokens_per_step(alpha, k)
    assert an.alpha_from_tau(tau, k) == pytest.approx(alpha, abs=1e-6)


def test_alpha_from_tau_rejects_impossible():
    with pytest.raises(ValueError):
        an.alpha_from_tau(5.5, 4)                     # more than k + 1 tokens per step
    with pytest.raises(ValueError):
        an.alpha_from_tau(0.5, 4)                     # tau includes the bonus token, so >= 1


def test_expected_tokens_tree():
    # A chain reduces to the closed form.
    k, a = 5, 0.7
    parents = [-1] + list(range(k))
    assert an.expected_tokens_tree([1.0] + [a] * k, parents) == pytest.approx(an.expected_tokens_per_step(a, k))
    # Root with two children tried in order: depth-1 reach = p1 + (1 - p1) p2.
    assert an.expected_tokens_tree([1, 0.6, 0.5], [-1, 0, 0]) == pytest.approx(1 + 0.6 + 0.4 * 0.5)
    # root -> {1, 2}, 1 -> {3}, 2 -> {4}: reach(3) = .6*.5, reach(4) = .4*.5*.9
    tau = an.expected_tokens_tree([1, 0.6, 0.5, 0.5, 0.9], [-1, 0, 0, 1, 2])
    assert tau == pytest.approx(1 + 0.6 + 0.2 + 0.3 + 0.18)
    with pytest.raises(ValueError):
        an.expected_tokens_tree([1, 0.5], [0, 0])


def test_batch_roofline_falls_with_batch():
    # Llama-3-8B-like target on an H100-like device, bf16: 16 GB of weights, 128 KiB of KV per token.
    bs = np.array([1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024])
    device = dict(param_bytes=16e9, kv_bytes_per_token=131072, flops_per_token=2 * 8e9, peak_flops=989e12,
                  bandwidth=3.35e12, alpha=0.8, k=4, c=0.05)
    s = an.batch_roofline(bs, context_len=256, **device)
    assert s.shape == bs.shape
    # Memory-bound at batch 1: Leviathan's number.
    assert s[0] == pytest.approx(an.walltime_speedup(0.8, 4, 0.05), rel=1e-6)
    assert np.all(np.diff(s) <= 1e-12)                 # monotone non-increasing in batch size
    assert s[-1] < 1.0                                 # compute-bound: speculation costs throughput
    tau = an.expected_tokens_per_step(0.8, 4)
    assert s[-1] == pytest.approx(tau / (4 * 0.05 + 5), rel=0.05)
    # Long context: per-row KV reads keep the verify pass memory-bound to larger batches.
    s_long = an.batch_roofline(bs, context_len=8192, **device)
    assert np.all(s_long >= s - 1e-12) and s_long[-1] > s[-1]


def test_roofline_crossover_batch_matches_the_scan():
    # Llama-3.1-8B bf16 on H100 / H200 datasheet numbers: the closed form must land where batch_roofline first
    # drops below 1, and say inf exactly where no batch ever does.
    model = dict(param_bytes=2 * 8.03e9, kv_bytes_per_token=131072, alpha=0.8, k=4, c=0.05, peak_flops=989e12)
    bs = np.arange(1, 5001)
    finite = 0
    for bandwidth in (3.35e12, 4.8e12):
        for context in (128, 256, 512, 1024, 4096):
            args = dict(model, bandwidth=bandwidth, context_len=context,
                        flops_per_token=2 * 8.03e9 + 4 * 32 * 4096 * context)
            b_star = an.roofline_crossover_batch(**args)
            below = bs[an.batch_roofline(bs, **args) < 1.0]
            if np.isfinite(b_star):
                finite += 1
                assert below[0] == int(np.floor(b_star)) + 1
                assert an.batch_roofline([b_star], **args)[0] == pytest.approx(1.0, rel=1e-9)
            else:
                assert len(below) == 0 and an.batch_roofline([1e9], **args)[0] > 1.0
    assert finite >= 4                                   # short contexts cross, long ones do not
    # Speculation that never wins (k c swamps tau), and alpha = 1 at c = 0 (the verify ratio never exceeds k+1).
    base = dict(param_bytes=16e9, kv_bytes_per_token=131072, context_len=256, flops_per_token=16e9,
                peak_flops=989e12, bandwidth=3.35e12, k=4)
    assert an.roofline_crossover_batch(**base, alpha=0.5, c=0.5) == 0.0
    assert an.batch_roofline([1], **base, alpha=0.5, c=0.5)[0] < 1.0
    assert an.roofline_crossover_batch(**base, alpha=1.0, c=0.0) == np.inf
