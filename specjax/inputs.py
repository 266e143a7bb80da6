"""Requests in: prompts (strings, token ids or chat message lists) -> checked token ids, right-padded arrays, the
padded prompt width (prompt buckets) and the prefill plan (rows grouped by prompt length)."""
from __future__ import annotations

import functools
from typing import Any, Sequence

import numpy as np
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from specjax.decode import round_up
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
        ids = model.tokenize(p) if isinstance(p, str) else [int(t) for t in p]
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


def prompt_bucket(n: int) -> int:
    """A padded prompt width for an n-token prompt: at least 16, rounded up to a quarter of its octave (at most
    25% padding; a power-of-two bucket wasted up to half, 512 slots for a 319-token prompt), so recompiles stay
    logarithmic in the prompt length."""
    if n <= 16:
        return 16
    return round_up(n, 1 << ((n - 1).bit_length() - 3))


def plan_prefill(lengths: Sequence[int], width: int, max_groups: int) -> tuple[np.ndarray, tuple]:
    """Rows sorted by prompt length and cut into at most max_groups groups of consecutive sorted rows, each
    prefilled at its own padded width (prompt_bucket of its longest; `width` for the last) so as to minimise the
    padded prompt tokens -> (order [B] int32: the rows' indices in sorted order, ((num_rows, width), ...))."""
    order = np.argsort(np.asarray(lengths), kind="stable").astype(np.int32)
    sl = [int(lengths[i]) for i in order]
    B = len(sl)
    # A group can end only where the bucket grows, or at the last row: O(max_groups * ends^2) on a few buckets.
    ends = [j for j in range(B - 1) if prompt_bucket(sl[j]) < prompt_bucket(sl[j + 1])] + [B - 1]
    w_at = lambda j: width if j == B - 1 else min(prompt_bucket(sl[j]), width)
    # best[g][e]: (padded tokens, cuts) of rows 0..ends[e] in g + 1 groups, the last ending at ends[e].
    best = [[((ends[e] + 1) * w_at(ends[e]), (ends[e],)) for e in range(len(ends))]]
    for _ in range(1, max(max_groups, 1)):
        prev, row = best[-1], []
        for e in range(len(ends)):
            options = [prev[e]] + [(prev[d][0] + (ends[e] - ends[d]) * w_at(ends[e]), prev[d][1] + (ends[e],))
                                   for d in range(e)]
            row.append(min(options))
        best.append(row)
    cuts, start, groups = best[-1][-1][1], 0, []
    for end in cuts:
        groups.append((end + 1 - start, w_at(end)))
        start = end + 1
    return order, tuple(groups)
