"""Greedy exactness beyond the conformance suite (tests/test_conformance.py runs greedy == plain greedy, EOS per row,
sampling and meshes for every drafter): the target drafting for itself accepts every draft."""
import specjax
from specjax import SpecConfig
from conftest import BASELINE_MAX_NEW, ragged_prompts

MAX_NEW = BASELINE_MAX_NEW


def test_self_draft_accepts_everything(target, baselines):
    prompts = ragged_prompts(3, seed=3)
    res = specjax.generate(target, prompts, SpecConfig(method="draft_model", num_speculative_tokens=4,
                                                       max_new_tokens=MAX_NEW), drafter=target)
    assert res.tokens == baselines[3]
    assert res.stats["alpha"] == 1.0


def test_fused_attention_formulation_keeps_greedy_output(target, near_draft, baselines):
    """A buffer large enough (K and V of a layer >= FUSED_MIN_KV_BYTES) that on a CPU the XLA attention takes its
    fused loops for decode steps and verify passes: plain and speculative output are still the small-buffer
    (matmul) baseline, token for token."""
    from pallas_kernels.verify_attention.reference import FUSED_MIN_KV_BYTES
    cfg = target.config
    buffer_len = -(-FUSED_MIN_KV_BYTES // (2 * 8 * cfg.num_kv_heads * cfg.head_dim * 4) // 64) * 64
    prompts = ragged_prompts(8, seed=8)
    plain = specjax.generate(target, prompts, SpecConfig(max_new_tokens=MAX_NEW, max_cache_len=buffer_len))
    spec = specjax.generate(target, prompts, SpecConfig(method="draft_model", num_speculative_tokens=4,
                                                        max_new_tokens=MAX_NEW, max_cache_len=buffer_len),
                            drafter=near_draft)
    assert plain.stats["buffer_len"] == buffer_len
    assert plain.tokens == baselines[8]
    assert spec.tokens == baselines[8]
    assert 0 < spec.stats["alpha"] < 1
