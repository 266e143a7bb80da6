"""experiments.revision_worker / compare_revisions: the worker runs the decode loop with exactly the arguments
generate() passes it (so the HLO it hashes is generate()'s program), strips only source metadata from the HLO, and
the harness's rows do the arithmetic the docstring says."""
from __future__ import annotations

import jax
import pytest

import specjax
from specjax import SpecConfig
from specjax.models import Model
from specjax.models.config import ModelConfig
from specjax.models.llama import init_params

from experiments.compare_revisions import part_rows, program_rows
from experiments.revision_worker import LOOP, loop_call, method_config, stripped_hlo


def _model() -> Model:
    cfg = ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=8, eos_token_id=None, max_position_embeddings=512)
    return Model(cfg, init_params(cfg, jax.random.PRNGKey(0), std=0.3), None, "tiny")


@pytest.mark.parametrize("method", ["none", "ngram"])
def test_loop_call_is_generates_call(method):
    model = _model()
    prompts = [[5, 6, 7, 5, 6], [9, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]]
    config = method_config(method, max_new_tokens=6, k=3)
    args, kwargs = loop_call(model, prompts, config)
    assert len(kwargs["prefill_groups"]) > 1                     # the grouped prefill path, as generate() plans it
    tokens, num_new, _ = LOOP(*args, **kwargs)
    got = [tokens[i, len(p):len(p) + int(num_new[i])].tolist() for i, p in enumerate(prompts)]
    result = specjax.generate(model, prompts, config)
    assert got == result.tokens
    # Greedy tokens would agree under another plan too: the plan itself must be generate()'s.
    assert kwargs["spec"] == config.for_batch(3) and kwargs["buffer_len"] == result.stats["buffer_len"]
    assert [list(g) for g in kwargs["prefill_groups"]] == result.stats["prefill_groups"]
    assert list(kwargs["cache_sizes"] or [kwargs["buffer_len"]]) == result.stats["cache_slots"]


def test_stripped_hlo_drops_source_locations_only():
    text = ('HloModule m, entry_computation_layout={()}\n\nFileNames\n1 "/a/b.py"\n\n'
            '%add (x: f32[]) -> f32[] {\n  %x = f32[] parameter(0), metadata={op_name="jit(f)/add" '
            'source_file="/a/b.py" source_line=3}\n  ROOT %y = f32[] add(%x, %x), stack_frame_id=7\n}\n')
    moved = text.replace("/a/b.py", "/c/d.py").replace("source_line=3", "source_line=9").replace("=7", "=2")
    assert stripped_hlo(text) == stripped_hlo(moved)
    assert stripped_hlo(text).startswith("%add") and "add(%x, %x)" in stripped_hlo(text)
    assert stripped_hlo(text) != stripped_hlo(text.replace("add(%x, %x)", "multiply(%x, %x)"))


def test_rows():
    h = {"hlo_instructions": 10, "hlo_sha256": "a", "flops": 1.0, "bytes_accessed": 2.0, "tokens_sha256": "t"}
    ready = {"base": {"none": h}, "new": {"none": {**h, "hlo_sha256": "b"}}}
    timed = {"base": [{"none": 100.0}, {"none": 300.0}, {"none": 200.0}],
             "new": [{"none": 220.0}, {"none": 180.0}, {"none": 400.0}]}
    rows = program_rows(ready, timed, ["none"])
    assert [(r["side"], r["tok_s"], r["same_hlo"], r["same_tokens"]) for r in rows] == [
        ("base", 200.0, True, True), ("new", 220.0, False, True)]
    assert rows[1]["vs_base"] == pytest.approx(1.1)
    parts = {"base": {"2": {"buffer": 64}}}
    rounds = [{"2": {"full": 1.0, "half": 0.6, "forward": 0.002, "attention": 0.001, "cache_write": 0.0005}},
              {"2": {"full": 0.9, "half": 0.5, "forward": 0.003, "attention": 0.001, "cache_write": 0.0004}}]
    (r,) = part_rows(parts, {"base": rounds}, max_new_tokens=100)
    assert r["step_ms"] == pytest.approx((0.9 - 0.5) / 50 * 1e3) and r["forward_ms"] == pytest.approx(2.0)
    assert r["loop_ms"] == pytest.approx(8.0 - 2.0) and r["tokens_per_s"] == pytest.approx(200 / 0.9)
    assert r["cache_write_ms"] == pytest.approx(0.4) and r["batch"] == 2
