"""Greedy exactness beyond the conformance suite (tests/test_conformance.py runs greedy == plain greedy, EOS per row,
sampling and meshes for every drafter): the target drafting for itself accepts every draft."""
import re

import jax.numpy as jnp

import specjax
from specjax import SpecConfig, settings
from specjax.ops.attention import FUSED_MAX_ROWS, FUSED_MIN_KV_BYTES
from specjax.decode import decode_loop
from tiny import BASELINE_MAX_NEW, ragged_prompts

MAX_NEW = BASELINE_MAX_NEW


def test_self_draft_accepts_everything(target, baselines):
    prompts = ragged_prompts(3, seed=3)
    res = specjax.generate(target, prompts, SpecConfig(method="draft_model", num_speculative_tokens=4,
                                                       max_new_tokens=MAX_NEW), drafter=target)
    assert res.tokens == baselines[3]
    assert res.stats["alpha"] == 1.0


def attention_rows(prepared: specjax.Prepared) -> tuple[set, set]:
    """-> (query rows per kv head of the attentions over the whole buffer computed with matmuls, of those computed
    with the fused products), read off the decode loop of a prepared call as jax lowers it (the same trace run()
    compiles). The dot formulation's scores are a dot_general giving [B, Hkv, M, S]; the fused one's products
    are 5-d [B, Hkv, M, D, S] / [B, Hkv, M, S, D] multiplies; S = the buffer's slots."""
    p = prepared
    text = decode_loop.trace(
        p.target_params, p.draft_params, p.prompts, p.prompt_lengths, p.request_keys, jnp.int32(p.eos_id),
        cfg=p.model.config, drafter=p.drafter, spec=p.config, buffer_len=p.buffer_len,
        prefill_groups=p.prefill_groups, prefill_order=p.prefill_order, cache_sizes=p.cache_sizes).lower().as_text()
    dots, fused = set(), set()
    for line in text.splitlines():
        types = re.findall(r"tensor<([0-9x]+)xf32>", line)        # the result's type is the line's last
        if not types:
            continue
        dims = [int(d) for d in types[-1].split("x")]
        if p.buffer_len not in dims[3:]:
            continue
        if "stablehlo.dot_general" in line and len(dims) == 4:
            dots.add(dims[2])
        elif "stablehlo.multiply" in line and len(dims) == 5:
            fused.add(dims[2])
    return dots, fused


def test_fused_attention_formulation_keeps_greedy_output(target, near_draft, baselines):
    """XLA's attention (the CPU verify-attention kernel turned off, as where no compiler builds it): a buffer large
    enough (K and V of a layer >= FUSED_MIN_KV_BYTES) that on a CPU it takes its fused loops for decode steps and
    verify passes (asserted on the lowered program: the steps' few query rows attend through the fused products,
    only the prefill's many rows through matmuls): plain and speculative output are still the small-buffer
    baseline, token for token."""
    with settings.use_backends(attention="xla"):
        _fused_attention_keeps_greedy_output(target, near_draft, baselines)


def _fused_attention_keeps_greedy_output(target, near_draft, baselines):
    cfg = target.config
    group = cfg.num_heads // cfg.num_kv_heads                   # query rows per kv head and position
    buffer_len = -(-FUSED_MIN_KV_BYTES // (2 * 8 * cfg.num_kv_heads * cfg.head_dim * 4) // 64) * 64
    prompts = ragged_prompts(8, seed=8)
    plain_config = SpecConfig(max_new_tokens=MAX_NEW, max_cache_len=buffer_len)
    spec_config = SpecConfig(method="draft_model", num_speculative_tokens=4, max_new_tokens=MAX_NEW,
                             max_cache_len=buffer_len)
    for config, drafter, step_rows in ((plain_config, None, group), (spec_config, near_draft, group * 5)):
        prepared = specjax.prepare(target, prompts, config, drafter=drafter)
        assert prepared.buffer_len == buffer_len and prepared.cache_sizes is None      # one buffer of that size
        dots, fused = attention_rows(prepared)
        assert step_rows in fused, (config.method, dots, fused)                 # the steps take the fused path
        assert all(m > FUSED_MAX_ROWS for m in dots), (config.method, dots)     # only prefill takes the dots
    plain = specjax.generate(target, prompts, plain_config)
    spec = specjax.generate(target, prompts, spec_config, drafter=near_draft)
    assert plain.stats["buffer_len"] == buffer_len
    assert plain.tokens == baselines[8]
    assert spec.tokens == baselines[8]
    assert 0 < spec.stats["alpha"] < 1
