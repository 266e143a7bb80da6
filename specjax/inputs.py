"""Requests in: prompts (strings, token ids or chat message lists) -> checked token ids and right-padded arrays
(specjax.planning plans their widths, buffers and prefill)."""
from __future__ import annotations

import functools
from typing import Any, Sequence

import numpy as np
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from specjax.models.model import Model


@functools.lru_cache(maxsize=16)
def _compiled_template(source: str):
    # transformers renders chat templates the same way: a sandbox, blocks trimmed, raise_exception available.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message):
        raise TemplateError(message)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


def is_chat(item: Any) -> bool:
    """Whether a request is a chat: a list of {"role": ..., "content": ...} messages."""
    return isinstance(item, (list, tuple)) and len(item) > 0 and isinstance(item[0], dict)


def render_chat(model: Model, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
    """A chat (message list) as the model's own chat template renders it, with the prompt that opens the
    assistant's turn; the model then ends its turn with its end-of-turn token (its eos: generation stops there)."""
    if model.chat_template is None:
        raise ValueError(f"model {model.name!r} has no chat template (tokenizer_config.json's chat_template or GGUF "
                         "tokenizer.chat_template): pass prompts as strings or token ids")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"chat message {i} must be a dict with string 'role' and 'content', got {m!r}")
    tok = model.tokenizer
    special = lambda i: tok.id_to_token(i) if (tok is not None and i is not None) else ""
    try:
        return _compiled_template(model.chat_template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt,
            bos_token=special(model.config.bos_token_id), eos_token=special(model.config.eos_token_id))
    except TemplateError as e:
        raise ValueError(f"model {model.name!r}'s chat template refused the messages: {e}") from None


def _token_id(t: Any) -> int | None:
    """An int (Python, NumPy or a 0-d integer array) as a token id; None for anything else (a string, a float, a
    bool...)."""
    if isinstance(t, (bool, np.bool_)):
        return None
    if isinstance(t, (int, np.integer)):
        return int(t)
    dtype = getattr(t, "dtype", None)
    if dtype is not None and getattr(t, "shape", None) == () and np.issubdtype(dtype, np.integer):
        return int(t)
    return None


def _token_ids(p: Any) -> list[int] | None:
    """A sequence of token ids -> ints; None when any entry is not one."""
    ids = [_token_id(t) for t in p]
    return None if any(t is None for t in ids) else ids


def encode_all(model: Model, items, what: str) -> list[list[int]]:
    """Strings, token-id lists or chats (message lists), one per request -> token-id lists, checked against the
    model's vocabulary."""
    if items is None:
        raise TypeError(f"{what}s must be a list (one entry per request), got None")
    if isinstance(items, (str, bytes)) or not hasattr(items, "__len__") \
            or (len(items) and isinstance(items[0], (int, np.integer))):
        raise TypeError(f"{what}s must be a list (one entry per request), got a single {type(items).__name__}")
    if len(items) == 0:
        raise ValueError(f"no {what}s: pass at least one (a string or a list of token ids)")
    out = []
    for i, p in enumerate(items):
        if not isinstance(p, str) and not hasattr(p, "__iter__"):
            raise TypeError(f"{what} {i} must be a string, a list of token ids or a list of chat messages, got "
                            f"{type(p).__name__}")
        if is_chat(p):
            p = render_chat(model, p)
        p = p if isinstance(p, str) else list(p)
        ids = model.tokenize(p) if isinstance(p, str) else _token_ids(p)
        if ids is None:
            bad = next(t for t in p if _token_id(t) is None)
            raise ValueError(f"{what} {i} holds {type(bad).__name__} {bad!r:.40}: a {what} is a string, a list of "
                             "token ids (ints) or a list of chat messages ({'role': ..., 'content': ...} dicts); "
                             "for several strings, pass each as a prompt of its own or join them")
        if not ids:
            raise ValueError(f"{what} {i} is empty (0 tokens); every request needs at least one token")
        bad = [t for t in ids if not 0 <= t < model.config.vocab_size]
        if bad:
            raise ValueError(f"{what} {i} has token ids outside [0, {model.config.vocab_size}): {bad[:5]}")
        out.append(ids)
    return out


def right_pad(rows: list[list[int]], width: int) -> np.ndarray:
    """Token-id lists -> int32 [len(rows), width], zero-padded on the right."""
    out = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out
