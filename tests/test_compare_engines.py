"""experiments.compare_hf on a tiny random Llama checkpoint: specjax and transformers emit the same greedy tokens in
plain decoding, assisted generation with a draft model, and prompt lookup, and both really speculated."""
from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_hf_parity import _hf_model  # noqa: E402

from experiments.compare_hf import MODES, compare, load_engines  # noqa: E402


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    # One torch thread: a test checks tokens, not speed, and OpenMP threads spin-waiting on a machine busy with
    # other processes make transformers' step loop many times slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp("compare_hf")
    target = _hf_model("llama_gqa")
    target.save_pretrained(d / "target")
    # The target plus noise: agrees with it often but not always, so steps both accept and reject drafts.
    draft = copy.deepcopy(target)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
    draft.save_pretrained(d / "draft")
    yield load_engines(str(d / "target"), str(d / "draft"))
    torch.set_num_threads(threads)


@pytest.mark.slow           # three specjax compiles and three transformers generate loops: CI runs it in test-slow
def test_engines_emit_identical_tokens(engines):
    # A repeated span, so prompt lookup finds matches from the first step.
    prompt = [5, 17, 99, 42, 7, 5, 17, 99, 42, 7, 5, 17]
    rows, outputs = compare(engines, [prompt], k=4, max_new_tokens=8, rounds=1)
    assert [r["mode"] for r in rows] == list(MODES)
    for r in rows:
        sj, hf = outputs[r["mode"], "specjax"][0], outputs[r["mode"], "hf"][0]
        assert len(sj) == len(hf) == 8
        assert sj == hf, (r["mode"], sj, hf, r.get("divergence"))
        assert r["identical_rows"] == 1 and r["first_difference"] is None
        assert r["specjax_tok_s"] > 0 and r["hf_tok_s"] > 0
    by_mode = {r["mode"]: r for r in rows}
    for mode in ("draft_model", "ngram"):
        r = by_mode[mode]
        assert r["specjax_same_as_plain"] == r["hf_same_as_plain"] == 1
        for engine in ("specjax", "hf"):
            assert r[f"{engine}_drafted"] > 0, (mode, engine)            # the speculative path really ran
            assert 0.0 <= r[f"{engine}_alpha"] <= 1.0
            assert 1.0 <= r[f"{engine}_tau"] <= 5.0
    # Some drafts accepted and some rejected: both branches of verification ran in both engines.
    assert all(0.0 < by_mode["draft_model"][f"{e}_alpha"] < 1.0 for e in ("specjax", "hf"))
    assert by_mode["plain"]["specjax_alpha"] is None and by_mode["plain"]["hf_alpha"] is None
