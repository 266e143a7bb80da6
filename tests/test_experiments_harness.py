"""The experiments' shared measurement code: the one timer's alternating rounds, the table writer's provenance, the
dynamic policy's flag entries, and one batch of the speedup experiment's --batch_sizes sweep (harness.measure_batch)
on the tiny models: plain, speculative and policy programs timed side by side, exact, and the policy resolved to
the program it runs at that batch size."""
import dataclasses
import json
import math

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from specjax import SpecConfig, api, settings
from specjax.decode import PROGRAM_PARTS
from specjax.models.model import Model
from experiments import costs, forward_profile, harness, prompts, tables
from conformance_factories import FACTORIES, Case
from tiny import ragged_prompts


def test_fastest_alternating_calls_in_turn_and_keeps_first_results():
    order = []

    def call(name):
        order.append(name)
        return f"{name}{len(order)}"

    seconds, results = costs.fastest_alternating({"a": lambda: call("a"), "b": lambda: call("b")}, rounds=2)
    assert order == ["a", "b"] * 3                       # one untimed warm-up call each, then two rounds
    assert results == {"a": "a1", "b": "b2"}
    assert set(seconds) == {"a", "b"} and all(0 <= s < 1 for s in seconds.values())
    order.clear()
    _, results = costs.fastest_alternating({"a": lambda: call("a"), "b": lambda: call("b")}, rounds=1, warmup=False)
    assert order == ["a", "b"] and results == {"a": "a1", "b": "b2"}   # the first timed call's result
    # Fresh inputs: one made before each call and passed to it; a budget ends the rounds after MIN_REPS of them.
    made = []
    fresh = {"a": lambda: made.append("a") or len(made), "b": lambda: made.append("b") or len(made)}
    seconds, results = costs.fastest_alternating({"a": lambda x: ("a", x), "b": lambda x: ("b", x)}, rounds=10,
                                                 fresh_inputs=fresh, budget_s=0.0)
    assert made == ["a", "b"] * (1 + costs.MIN_REPS) and results == {"a": ("a", 1), "b": ("b", 2)}


def test_write_table_records_command_revision_and_date(tmp_path):
    stem = str(tmp_path / "sub" / "t")
    tables.write_table([{"x": 1.5, "y": [1, 2]}, {"x": 2, "z": None}], stem, meta={"k": 4})
    table = tables.read_table(stem)
    assert table["rows"] == [{"x": 1.5, "y": [1, 2]}, {"x": 2, "z": None}]
    meta = table["meta"]
    assert meta["k"] == 4 and meta["command"].startswith("python ") and meta["date"][:2] == "20"
    assert meta["revision"] is None or len(meta["revision"]) == 40
    with open(stem + ".csv") as f:
        assert f.readline().strip() == "x,y,z"
    with open(stem + ".json") as f:
        assert json.load(f) == table


def test_policy_fields_per_method_entries():
    schedule = ["1:k", "ngram@1:k", "ngram@8:2"]
    assert harness.policy_fields(schedule, "ngram", 4) == {"draft_len_schedule": {1: 4, 8: 2}}
    assert harness.policy_fields(schedule, "draft_model", 3) == {"draft_len_schedule": {1: 3}}
    assert harness.policy_fields([], "ngram", 4) == {}
    assert harness.policy_fields([], "ngram", 4, 0.3, 8) == {"acceptance_rate_threshold": 0.3,
                                                             "acceptance_rate_window_size": 8}
    with pytest.raises(ValueError, match="max_batch:k"):
        harness.policy_fields(["eight:k"], "ngram", 4)


def test_prompt_set_from_a_json_file(tmp_path):
    chats = [[{"role": "user", "content": f"question {i}"}] for i in range(3)]
    path = tmp_path / "set.json"
    path.write_text(json.dumps(chats))
    assert prompts.load_prompt_set(str(path), 2, None) == chats[:2]
    (tmp_path / "bad.json").write_text(json.dumps({"prompts": chats}))
    with pytest.raises(ValueError, match="bad.json.*list"):
        prompts.load_prompt_set(str(tmp_path / "bad.json"), 2, None)
    with pytest.raises(ValueError, match="unknown prompt set"):
        prompts.load_prompt_set("shargept", 2, None)


def test_forward_cost_on_the_weights_dtype_and_attention_path(target):
    """A target forward's cost is measured over a cache of the weights' dtype, on the attention path asked for
    (the Pallas kernel interpreted here); an unknown path is refused by name."""
    half = Model(target.config, jax.tree.map(lambda x: x.astype(jnp.bfloat16), target.params), name="tiny-bf16")
    _, _, cache = costs.looped_forward(half, context=8, T=2)
    assert cache.k[0].dtype == jnp.bfloat16 and cache.v[0].dtype == jnp.bfloat16
    assert costs.forward_seconds(target, 8, 2, reps=1, inner=1, implementation="pallas") > 0
    with pytest.raises(ValueError, match="implementation"):
        costs.forward_seconds(target, 8, 2, reps=1, inner=1, implementation="cuda")


def test_forward_cost_programs_follow_the_backend_choices(target):
    """The compiled forward loop is shared by measurements of one shape, but another backend choice (in force when
    a forward is traced: experiments.forward_profile measures both paths in one process) compiles its own."""
    kernel_fn = costs.looped_forward(target, 8, 2)[0]
    with settings.use_backends(linear="xla"):
        xla_fn = costs.looped_forward(target, 8, 2)[0]
        assert costs.looped_forward(target, 8, 2)[0].keywords == xla_fn.keywords
    assert kernel_fn.keywords["switches"] != xla_fn.keywords["switches"]


def test_forward_costs_side_by_side(target, monkeypatch):
    """T = 1 and T = k + 1 timed in alternating rounds: each rep calls both compiled loops in turn."""
    order = []
    real = costs.looped_forward

    def recording(model, context, T, *args):
        fn, params, cache = real(model, context, T, *args)
        return (lambda p, c: (order.append(T), fn(p, c))[1]), params, cache

    monkeypatch.setattr(costs, "looped_forward", recording)
    seconds = costs.forward_seconds_alternating(target, 8, (1, 4), reps=3, inner=2)
    assert order == [1, 4] * 4                              # one warm-up call each, then 3 rounds in turn
    assert set(seconds) == {1, 4} and all(0 < s < 1 for s in seconds.values())


def test_drafter_step_cost_counts_the_commit(target):
    """EAGLE-3's commit (its layer over the k + 1 verified positions) is measured beside its proposal; a drafter
    whose commit returns its state untouched costs ~nothing there; a tree drafter's commit is measured along a path
    as deep as its tree (EAGLE-2's layer over it: as costly as a chain's commit of that depth, not free)."""
    ids = ragged_prompts(1, seed=3)
    timing = dict(reps=3, inner=4)

    def prepared(name, k=3):
        fields, artifact = FACTORIES[name](Case(target, k, ids, []))
        return api.prepare(target, ids, SpecConfig(max_new_tokens=8, **fields), artifact)

    p = prepared("eagle3")
    propose, commit = costs.drafter_step_seconds(p.drafter, p.draft_params, target, 16, p.config.sampling, **timing)
    assert propose > 0 and commit > 0
    p = prepared("ngram")
    # The fastest of more calls for the cheap commit (a call costs microseconds), and a margin that a test worker
    # beside it cannot close: under load a few slow calls once read 1/4 of EAGLE-3's layer.
    ngram_commit = costs.commit_seconds(p.drafter, p.draft_params, target, 16, p.config.sampling, reps=12, inner=4)
    assert ngram_commit < commit / 2, (ngram_commit, commit)
    p = prepared("eagle2-dynamic_tree")
    su = costs.drafter_setup(p.drafter, p.draft_params, target, 16, p.config.sampling, 1, None)
    assert costs.committed_depth(p.drafter, p.draft_params, 16, p.config.sampling, su) == p.drafter.num_steps
    tree_commit = costs.commit_seconds(p.drafter, p.draft_params, target, 16, p.config.sampling, setup=su, **timing)
    assert tree_commit > 0
    p = prepared("eagle3", k=p.drafter.num_steps)
    assert costs.committed_depth(p.drafter, p.draft_params, 16, p.config.sampling,
                                 costs.drafter_setup(p.drafter, p.draft_params, target, 16, p.config.sampling, 1,
                                                     None)) == p.drafter.k


def test_step_in_turn_runs_every_kind_of_drafter_beside_other_calls(target):
    """The drafter's and the target's work of one step, run in turn: a chain drafter with a commit (EAGLE-3), a tree
    drafter (its commit along a path as deep as the tree), one that drafts over the target's cache (layer skip) and
    one whose commit reads the whole verified pass of its token tree (lookahead) each give the three programs' times; a call timed beside them is called once per round after its warm-up and its time returned."""
    ids = ragged_prompts(1, seed=3)
    calls = []
    for name in ("eagle3", "eagle2-dynamic_tree", "layer_skip", "lookahead"):
        fields, artifact = FACTORIES[name](Case(target, 3, ids, []))
        p = api.prepare(target, ids, SpecConfig(max_new_tokens=8, **fields), artifact)
        beside = {"loop": lambda: calls.append(name) or len(calls)} if name == "eagle3" else None
        turn = costs.step_in_turn_seconds(p.drafter, p.draft_params, target, 16, p.config.sampling, reps=3, inner=2,
                                          beside=beside)
        assert min(turn.in_turn, turn.drafter, turn.verify) > 0, name
        assert set(turn.beside) == ({"loop"} if beside else set())
        if beside:
            assert turn.beside["loop"][0] > 0 and turn.beside["loop"][1] == 1      # its time, its first result
    assert calls == ["eagle3"] * 4 and turn.beside == {}         # one warm-up call, then one per round


def test_repeated_engine_fields_keep_the_median_and_the_range():
    """Repeated engine measurements: the row keeps the one whose overhead is the median, with the lowest and the
    highest; a measurement without the decode loop beside it (a drafter that learns across calls) is taken once."""
    class LoopResult:                                   # a decode call's result: 10 iterations, none one position wide
        stats = {"accept_trace": np.zeros((1, 10))}
    loop_seconds = iter([1.2, 1.01, 1.05])     # less the 0.1-s one-token call, over 10: steps of 110, 91 and 95 ms

    def measure():
        return costs.InTurn(0.1, 0.02, 0.08, {"loop": (next(loop_seconds), LoopResult()), "prefill": (0.1, None)})
    fields = harness.repeated_engine_fields(measure, 0.05, 0.08, repeats=3)
    assert fields["loop_ms_per_step"] == pytest.approx(95.0) and fields["engine_overhead"] == pytest.approx(-0.05)
    assert fields["engine_overhead_min"] == pytest.approx(-0.09)
    assert fields["engine_overhead_max"] == pytest.approx(0.10)
    calls = []
    fields = harness.repeated_engine_fields(lambda: calls.append(1) or costs.InTurn(0.1, 0.02, 0.08, {}), 0.05, 0.08,
                                            repeats=3)
    assert calls == [1] and "engine_overhead" not in fields and fields["in_turn_ms"] == pytest.approx(100.0)


@pytest.mark.slow             # two batches' programs and costs: about a minute on 2 cores
def test_measure_batch_times_plain_spec_and_policy(target, near_draft):
    ids = ragged_prompts(3, seed=5)
    plain = SpecConfig(max_new_tokens=10, stop_at_eos=False)
    config = SpecConfig(method="draft_model", num_speculative_tokens=3, max_new_tokens=10, stop_at_eos=False)
    machine = (1e11, 1e10)
    # Speculate up to batch 2: at batch 3 the policy is plain decoding itself, timed a second time.
    policy = dataclasses.replace(config, draft_len_schedule={2: 3})
    row = harness.measure_batch(target, ids, plain, config, near_draft, policy, 1, machine, engine_overhead=True)
    assert row["batch"] == 3 and row["k"] == 3 and row["exact"] == "yes"
    assert row["loop_ms_per_step"] > 0 and row["in_turn_ms"] > 0 and math.isfinite(row["engine_overhead"])
    assert row["policy_program"] == "plain" and row["policy_k"] == 0 and row["policy_plain_share"] == 1.0
    assert row["policy_speedup"] == 1.0 and math.isfinite(row["plain_repeat"])
    assert 0 <= row["alpha"] <= 1 and row["batch_tau"] >= 1 and row["buffer"] >= max(map(len, ids)) + 10
    for key in ("speedup", "predicted", "predicted_steady", "roofline", "c_step", "verify_cost"):
        assert math.isfinite(row[key]) and row[key] > 0, key
    # At batch 1 the schedule's k is the run's: the fixed-k program, not a second sample of it.
    row = harness.measure_batch(target, ids[:1], plain, config, near_draft, policy, 1, machine)
    assert row["policy_program"] == "fixed" and row["policy_k"] == 3 and row["policy_speedup"] == row["speedup"]
    assert math.isnan(row["plain_repeat"]) and row["exact"] == "yes"


def test_loop_profile_counts_loop_iterations_only(target, near_draft):
    """Thunks per loop iteration: the one-token call (prefill, no iteration) is subtracted, so every kind's
    executions per iteration are whole-call counts less the prefill's, never negative; the loop runs max_new - 1
    iterations of plain decoding (the first token comes from the prefill). The tiny model's iteration costs
    microseconds, so the plain loop runs 256 of them over 3 calls: 64 read a negative total (-0.05 ms per
    iteration) beside a feature-cache run and a second test worker."""
    ids = ragged_prompts(1, seed=2)
    plain = harness.loop_profile(target, ids, SpecConfig(max_new_tokens=257, stop_at_eos=False), calls=3, top=50)
    assert plain["iterations"] == 256 and plain["thread_ms"] > 0 and plain["ops"]
    assert all(op["per_iteration"] >= 0 for op in plain["ops"].values())
    assert max(op["per_iteration"] for op in plain["ops"].values()) >= 1
    # the speculative loop: ~40 iterations a call, 3 calls (one call of 2-3 iterations read -0.12 ms beside a
    # training run)
    config = SpecConfig(method="draft_model", num_speculative_tokens=3, max_new_tokens=129, stop_at_eos=False)
    spec = harness.loop_profile(target, ids, config, near_draft, calls=3)
    assert 1 <= spec["iterations"] <= 128 and spec["thread_ms"] > 0 and len(spec["ops"]) <= 8
    assert "thread ms per iteration" in harness.profile_line(spec)


def test_loop_profile_by_signature(target, near_draft):
    """Grouped by signature, every key is a kernel's or opcode's name with a result shape (the same key in the
    full call's and the one-token call's programs, so the prefill subtracts), the kinds' totals are kept, and an
    unknown grouping is refused by name."""
    ids = ragged_prompts(1, seed=2)
    # ~40 iterations over 2 calls: one call of 2-3 iterations read -0.18 ms in CI, its few microseconds of loop
    # under the prefill's noise
    config = SpecConfig(method="draft_model", num_speculative_tokens=3, max_new_tokens=129, stop_at_eos=False)
    spec = harness.loop_profile(target, ids, config, near_draft, calls=2, top=50, by="signature")
    assert spec["thread_ms"] > 0 and spec["ops"]
    assert all(" " in key and "[" in key for key in spec["ops"]), list(spec["ops"])
    assert any(key.startswith("specjax_") for key in spec["ops"])          # the CPU kernels, by their target
    with pytest.raises(ValueError, match="signature"):
        harness.loop_profile(target, ids, config, near_draft, by="shape")


def test_hlo_parts_follow_the_named_scopes_into_called_computations():
    """An instruction's part is the first step part among its op_name's scopes; one without takes its users' part,
    else the part of the instruction calling its computation (a drafter's inner loop and its copies), else the
    loop's control."""
    hlo = """HloModule m
%inner (p: s32[]) -> s32[] {
  %p = s32[] parameter(0)
  %copy.1 = s32[] copy(%p)
  ROOT %add.1 = s32[] add(%copy.1, %copy.1), metadata={op_name="jit(decode_loop)/while/body/propose/while/body/add"}
}
%body (q: s32[]) -> s32[] {
  %q = s32[] parameter(0)
  %while.2 = s32[] while(%q), condition=%cond, body=%inner, metadata={op_name="jit(decode_loop)/while/body/propose/while"}
  %reduce-window.6 = s32[] fusion(%while.2), kind=kLoop, calls=%window
  %fusion.3 = s32[] fusion(%reduce-window.6), kind=kLoop, calls=%fused, metadata={op_name="jit(decode_loop)/while/body/accept/reduce_max"}
  ROOT %copy.4 = s32[] copy(%fusion.3)
}
ENTRY %main (r: s32[]) -> s32[] {
  %r = s32[] parameter(0)
  ROOT %while.5 = s32[] while(%r), condition=%cond, body=%body, metadata={op_name="jit(decode_loop)/while"}
}
"""
    parts = costs.hlo_parts(hlo)
    assert parts["copy.1"] == parts["add.1"] == parts["while.2"] == "propose"     # inherited from the calling while
    assert parts["fusion.3"] == parts["reduce-window.6"] == "accept"        # unnamed: its only user's part
    assert parts["copy.4"] == parts["while.5"] == parts["r"] == costs.LOOP_CONTROL


def test_loop_profile_by_part(target, near_draft):
    """Grouped by part, the keys are the step's parts (and the loop's control), the target's forward and the
    proposal among them."""
    ids = ragged_prompts(1, seed=2)
    config = SpecConfig(method="draft_model", num_speculative_tokens=3, max_new_tokens=9, stop_at_eos=False)
    spec = harness.loop_profile(target, ids, config, near_draft, calls=1, top=50, by="part")
    assert set(spec["ops"]) <= set(PROGRAM_PARTS) | {costs.LOOP_CONTROL}, list(spec["ops"])
    assert {"target_forward", "propose", "accept"} <= set(spec["ops"])


def test_forward_breakdown_by_signature_names_each_kernel_and_shape(target):
    """forward_profile's breakdown by signature: every key a kernel's or opcode's name with its result shape, the
    matrix products among them (what its matmul GB/s is computed from), a product per forward at least once per
    layer; by kind the CPU kernels are one `ffi_call`; an unknown grouping is refused by name."""
    ops = forward_profile.breakdown(target, 3, 1, 8, calls=1)
    assert ops and all(" " in key and "[" in key for key in ops), list(ops)
    matmuls = [key for key in ops if forward_profile.is_matmul(key)]
    assert matmuls and sum(ops[key][1] for key in matmuls) >= target.config.num_layers, ops
    assert not any(forward_profile.is_matmul(key) for key in ops if key.startswith("specjax_verify_attention"))
    kinds = forward_profile.breakdown(target, 3, 1, 8, calls=1, by="kind")
    assert not any("[" in key for key in kinds)
    with pytest.raises(ValueError, match="signature"):
        forward_profile.breakdown(target, 3, 1, 8, by="shape")


def test_experiment_modules_the_tests_import_load_together():
    """pytest imports every experiment module a test names into one process: absl refuses a flag defined twice, so an
    entry point that defines its flags at import (not in define_flags()) must not share a flag name with another.
    Imported here in a fresh interpreter, in one go, whatever order the test files happen to run in."""
    import pathlib
    import re
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    modules = set()
    for path in [*(root / "tests").glob("*.py"), *(root / "notebooks").glob("*")]:
        if path.is_file():
            text = path.read_text(errors="replace")
            modules |= {m for m in re.findall(r"from experiments\.(\w+) import", text)}
            for names in re.findall(r"from experiments import ([\w, ]+)", text):
                modules |= {n.strip() for n in names.split(",") if n.strip()}
    assert {"reproduce", "weight_format_shift", "compare_engines"} <= modules      # the scan found what it is for
    code = "".join(f"import experiments.{m}\n" for m in sorted(modules))
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                          env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr[-2000:]
