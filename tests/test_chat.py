"""Chat requests: message lists rendered with the model's own chat template, then decoded like any prompt."""
import dataclasses

import pytest

import specjax
from specjax import SpecConfig
from specjax.inputs import render_chat

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
STRICT = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('the first message must be a user message') }}{% endif %}x"


@pytest.fixture(scope="module")
def chat_model():
    model = specjax.load_model("stdlib-target")
    return dataclasses.replace(model, chat_template=CHATML)


def test_chat_renders_with_the_generation_prompt(chat_model):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def add(a, b):"}]
    text = render_chat(chat_model, chat)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\ndef add(a, b):<|im_end|>\n" \
                   "<|im_start|>assistant\n"
    spec = SpecConfig(max_new_tokens=8)
    as_chat = specjax.generate(chat_model, [chat, [{"role": "user", "content": "import os"}]], spec)
    as_text = specjax.generate(chat_model, [text, render_chat(chat_model, [{"role": "user", "content": "import os"}])],
                               spec)
    assert as_chat.tokens == as_text.tokens


def test_chat_errors_name_the_problem(chat_model):
    with pytest.raises(ValueError, match="has no chat template"):
        specjax.generate(dataclasses.replace(chat_model, chat_template=None), [[{"role": "user", "content": "x"}]])
    with pytest.raises(ValueError, match="chat message 1 must be a dict with string 'role' and 'content'"):
        render_chat(chat_model, [{"role": "user", "content": "x"}, {"role": "user"}])
    with pytest.raises(ValueError, match="chat template refused the messages: the first message must be a user message"):
        render_chat(dataclasses.replace(chat_model, chat_template=STRICT), [{"role": "system", "content": "x"}])
